"""pretrain.plan's memory estimate against measured peaks.

    python bench/memory_plan.py cpu                          # measure CPU_CONFIGS here (peak RSS increase)
    python bench/memory_plan.py compare RESULT.json...       # estimate each measured row, write the table

`cpu` runs each config of CPU_CONFIGS through tests/memory_probe.py (the real Trainer's
`train_step`, peak resident memory over the pre-model baseline, glibc mapping every large block
on its own) and writes memory-measured-cpu.json.

`compare` reads measured rows: this script's files (`rows` of name, overrides, world_size,
device, allocated_gib) or bench/throughput.py's results on GPUs (`overrides`, `world_size`,
`steady.mem_allocated_gb` = torch.cuda.max_memory_allocated), estimates each with the current
pretrain/plan.py on the device it was measured on, and writes memory-plan-vs-measured.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
sys.path.insert(0, str(REPO))

from pretrain import flops
from pretrain.launcher import plan  # noqa: E402
from pretrain.compose import compose  # noqa: E402
from tests import memory_probe  # noqa: E402

GIB = 2**30
# About 52M parameters with a 32k vocabulary: the recorded CPU rows (tests/test_plan.py measures a 7M one).
PROBE_MODEL = ["data=synthetic", "model.name=probe", "model.dim=512", "model.n_layers=6", "model.n_heads=8",
               "model.n_kv_heads=4", "model.ffn_hidden=1536", "model.vocab_size=32000", "train.seq_len=512",
               "train.steps=2", "train.log_every=1"]
CPU_CONFIGS: dict[str, tuple[int, list[str]]] = {
    "fp32-none": (1, ["precision=fp32", "train.micro_batch=2", "train.global_batch=2"]),
    "fp32-none-accumulate2": (1, ["precision=fp32", "train.micro_batch=2", "train.global_batch=4"]),
    "fp32-selective": (1, ["precision=fp32", "fsdp.activation_checkpointing=selective", "train.micro_batch=2",
                           "train.global_batch=2"]),
    "fp32-full": (1, ["precision=fp32", "fsdp.activation_checkpointing=full", "train.micro_batch=2",
                      "train.global_batch=2"]),
    "bf16-none": (1, ["precision=bf16", "train.micro_batch=2", "train.global_batch=2"]),
    "fp32-none-2ranks": (2, ["precision=fp32", "train.micro_batch=2", "train.global_batch=4"]),
    "fp32-none-2ranks-shard_grad_op": (2, ["precision=fp32", "fsdp=shard_grad_op", "train.micro_batch=2",
                                           "train.global_batch=4"]),
    "bf16-selective-2ranks": (2, ["precision=bf16", "fsdp.activation_checkpointing=selective",
                                  "train.micro_batch=4", "train.global_batch=8"]),
}


def stamp() -> dict[str, Any]:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit or "unknown"}


def measure_cpu(out: Path) -> Path:
    rows = []
    for name, (world, settings) in CPU_CONFIGS.items():
        overrides = [*PROBE_MODEL, *settings, f"local.nproc={world}"]
        with tempfile.TemporaryDirectory() as scratch:
            peaks = [peak / GIB for peak in memory_probe.measure(world, overrides, Path(scratch))]
        rows.append({"name": name, "overrides": overrides, "world_size": world, "device": "cpu",
                     "allocated_gib": max(peaks)})
        print(name, [f"{p:.3f}" for p in peaks], flush=True)
    result = {**stamp(), "machine": {"gpu": "CPU", "cpus": os.cpu_count(), "host": platform.node(),
                                     "torch": __import__("torch").__version__},
              "measured": "peak resident memory increase over the pre-model baseline (tests/memory_probe.py)",
              "rows": rows}
    out.write_text(json.dumps(result, indent=2) + "\n")
    return out


def measured_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of name, overrides, world size, device, GPU and measured GiB from either kind of file."""
    data = json.loads(path.read_text())
    gpu = data["machine"].get("gpu", "CPU")
    where = {"gpu": gpu, "source": path.name, "date": data["date"], "commit": data["commit"]}
    if "rows" in data:
        return [{"device": "cuda", **row, **where} for row in data["rows"]]
    steady = data["steady"]
    return [{"name": data["name"], "overrides": data["overrides"], "world_size": data["world_size"], "device": "cuda",
             "allocated_gib": steady["mem_allocated_gb"], "reserved_gib": steady["mem_reserved_gb"], **where}]


def estimated(row: dict[str, Any]) -> plan.Estimate:
    """The plan's estimate for the row's settings on the device it was measured on."""
    world = row["world_size"]
    overrides = [o for o in row["overrides"] if not o.startswith("local.nproc=")]
    cfg = compose([*overrides, f"local.nproc={world}"])
    cuda = row["device"] == "cuda"
    target = plan.Target(world, world, row["device"], plan.resolved_precision(cfg.precision.name, cuda), None,
                         flops.peak_flops_for(row["gpu"]) if cuda else None, row["gpu"])
    return plan.estimate(cfg, target)


def compare(paths: list[Path], out_dir: Path) -> Path:
    rows = []
    for path in paths:
        for row in measured_rows(path):
            estimate = estimated(row)
            rows.append({**row, "estimated_allocated_gib": estimate.allocated / GIB,
                         "estimated_with_allowance_gib": estimate.total / GIB,
                         "ratio": estimate.allocated / GIB / row["allocated_gib"],
                         "parts_gib": {p.name: p.bytes / GIB for p in estimate.held + estimate.peak_phase}})
    result = {**stamp(), "tolerance": 0.15, "allowance": {"context_gib": plan.CONTEXT_GIB,
                                                          "fragmentation": plan.FRAGMENTATION}, "rows": rows}
    (out_dir / "memory-plan-vs-measured.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["| config | where | measured | estimated | estimated / measured | measured reserved | "
             "estimated + allowance | source |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        reserved = f"{r['reserved_gib']:.2f}" if r.get("reserved_gib") else "-"
        lines.append(f"| {r['name']} | {r['world_size']} x {r['gpu']} | {r['allocated_gib']:.2f} | "
                     f"{r['estimated_allocated_gib']:.2f} | {r['ratio']:.2f} | {reserved} | "
                     f"{r['estimated_with_allowance_gib']:.2f} | {r['source']} "
                     f"({r['commit'][:10]}, {r['date'][:10]}) |")
    path = out_dir / "memory-plan-vs-measured.md"
    path.write_text(f"# pretrain.plan: estimated vs measured peak memory (GiB)\n\ncompared: {result['date']}, "
                    f"plan at commit {result['commit']}\n\n" + "\n".join(lines) + "\n\n" + NOTES)
    return path


NOTES = """\
- where: GPU rows were measured on the device tool's nvidia-h200 and nvidia-h200-x2 machines (H200 141 GB,
  torch 2.11.0+cu130) by the perf branch (its bench/results/*.json and logs, code at the commit shown:
  compiled loss, real-arithmetic RoPE, own FSDP units for embedding and output); CPU rows on a 2-core
  machine with torch 2.13.0+cpu, the same 52M-parameter probe model (dim 512, 6 layers, vocabulary
  32,000, micro-batch 2-4 x 512 tokens), 2 steps.
- reproduce (once the perf branch's results are merged): python bench/memory_plan.py compare
  bench/results/{1b-1gpu,1b-1gpu-mb16,1b-2gpu,8b-2gpu,8b-2gpu-noac}.json bench/results/memory-measured-perf-logs.json
  bench/results/memory-measured-cpu.json; the CPU rows: python bench/memory_plan.py cpu (about 10 minutes).
- measured, GPUs: torch.cuda.max_memory_allocated of the package's own runs (bench/throughput.py's steady
  state, or the `mem` of the training log); reserved: max_memory_reserved. Estimated: `allocated` of
  pretrain.plan.estimate for the same overrides and number of GPUs; + allowance adds the CUDA context and
  fragmentation allowance the launcher's check counts against the GPU's memory.
- measured, CPU: the peak resident-memory increase of each rank over its baseline just before the model
  is built (tests/memory_probe.py, glibc mapping each large block on its own so freed tensors leave the
  resident set). Since 2026-12-02 the probe first trains a tiny model of the same settings and drops it,
  so that the baseline holds the runtime's start-up memory (libraries loaded and caches filled during
  the first steps, tens of MiB) that the estimate does not count; rows measured earlier include it.
- The eager and checkpointed terms come from what the code keeps for backward; the compiled blocks' term
  has one fitted coefficient (COMPILED_NORM_FP32) from the compiled GPU rows here, so those rows are not
  an independent check.
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    cpu = sub.add_parser("cpu")
    cpu.add_argument("--out", type=Path, default=RESULTS / "memory-measured-cpu.json")
    c = sub.add_parser("compare")
    c.add_argument("results", nargs="+", type=Path)
    c.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    print(measure_cpu(args.out) if args.command == "cpu" else compare(args.results, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
