"""Training throughput of the package on one setup, measured through `python -m pretrain.launch`.

    python bench/throughput.py 1b-1gpu                      # the 1B reference shape on 1 GPU
    python bench/throughput.py 1b-2gpu train.micro_batch=16 # any extra launcher overrides
    python bench/throughput.py 8b-2gpu --name 8b-2gpu-noac fsdp.activation_checkpointing=none

Trains the setup's model on synthetic tokens (no eval, no checkpoints) and reads the run's own
metrics.jsonl: steady state is the mean over the logged windows after --measure-from steps
(torchtitan's reference figures are means over steps 30-60), which leaves compilation out.
Writes NAME.json and NAME.md under --out (bench/results by default): tokens/s per GPU, MFU in
both accountings, step time, peak memory, the exact command, machine, date, torch and commit.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

# Per setup: processes, model, sequence length, micro-batch, activation checkpointing, and the
# torchtitan reference (tokens/s per GPU, ../shared/notes/performance-reference.md) x 1.10.
SETUPS: dict[str, dict[str, Any]] = {
    "1b-1gpu": {"nproc": 1, "model": "llama-1b", "seq_len": 4096, "micro_batch": 8, "ac": "none",
                "reference": 64_424},
    "1b-2gpu": {"nproc": 2, "model": "llama-1b", "seq_len": 4096, "micro_batch": 8, "ac": "none",
                "reference": 61_256},
    "8b-2gpu": {"nproc": 2, "model": "llama-8b", "seq_len": 8192, "micro_batch": 1, "ac": "selective",
                "reference": 8_894},
}
TARGET_FACTOR = 1.10


def overrides_for(setup: dict[str, Any], steps: int, extra: list[str]) -> list[str]:
    """The launcher overrides of a setup; later (extra) overrides win."""
    base = [
        f"model={setup['model']}", "data=synthetic", "precision=bf16", "fsdp=full_shard", "fsdp.compile=true",
        f"fsdp.activation_checkpointing={setup['ac']}", f"train.seq_len={setup['seq_len']}",
        f"train.micro_batch={setup['micro_batch']}", f"train.global_batch={setup['micro_batch'] * setup['nproc']}",
        f"train.steps={steps}", "train.log_every=10", "train.eval_every=0", "train.ckpt_every=0",
        "optim.warmup_steps=10", f"local.nproc={setup['nproc']}",
    ]
    keys = {o.split("=", 1)[0] for o in extra}
    global_batch_given = "train.global_batch" in keys
    micro = next((o.split("=", 1)[1] for o in extra if o.startswith("train.micro_batch=")), None)
    if micro is not None and not global_batch_given:
        extra = extra + [f"train.global_batch={int(micro) * setup['nproc']}"]
    keys = {o.split("=", 1)[0] for o in extra}
    return [o for o in base if o.split("=", 1)[0] not in keys] + extra


def steady_state(records: list[dict[str, Any]], measure_from: int) -> dict[str, Any]:
    """Means over the logged windows that start at or after step measure_from."""
    windows = [r for r in records if "tokens_per_s_per_device" in r and r["step"] > measure_from]
    if not windows:
        return {}
    step_time = statistics.fmean(r["step_time_s"] for r in windows)
    per_gpu = statistics.fmean(r["tokens_per_s_per_device"] * r["step_time_s"] for r in windows) / step_time
    result = {
        "tokens_per_s_per_gpu": per_gpu,
        "step_time_s": step_time,
        "windows": [{k: r.get(k) for k in ("step", "tokens_per_s_per_device", "step_time_s", "loss")} for r in windows],
    }
    for key in ("mfu", "mfu_reference"):
        if key in windows[-1]:
            result[key] = windows[-1][key] / windows[-1]["tokens_per_s_per_device"] * per_gpu
    logged = [r for r in records if "mem_gb" in r]
    result["mem_allocated_gb"] = max(r["mem_gb"] for r in logged)
    if any("mem_reserved_gb" in r for r in logged):
        result["mem_reserved_gb"] = max(r.get("mem_reserved_gb", 0.0) for r in logged)
    return result


def table(result: dict[str, Any]) -> str:
    s = result.get("steady", {})
    rows = [
        ("setup", result["setup"]),
        ("tokens/s per GPU", f"{s['tokens_per_s_per_gpu']:,.0f}" if s else "failed"),
        ("reference (torchtitan) / target", f"{result['reference']:,} / {result['target']:,.0f}"),
        ("meets target", result["meets_target"]),
        ("MFU (ours, causal) / reference accounting",
         f"{s.get('mfu', 0):.1%} / {s.get('mfu_reference', 0):.1%}" if s else "-"),
        ("step time", f"{s['step_time_s'] * 1000:.0f} ms" if s else "-"),
        ("peak memory allocated / reserved",
         f"{s.get('mem_allocated_gb', 0):.1f} / {s.get('mem_reserved_gb', 0):.1f} GiB" if s else "-"),
        ("measured", f"steps {result['measure_from']}-{result['steps']} of {result['steps']}"),
        ("command", f"`{result['command']}`"),
    ]
    return "| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("setup", choices=sorted(SETUPS))
    parser.add_argument("overrides", nargs="*", help="extra launcher overrides, e.g. train.micro_batch=16")
    parser.add_argument("--name", help="result file name (default: the setup)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--measure-from", type=int, default=30)
    parser.add_argument("--out", type=Path, default=common.RESULTS)
    parser.add_argument("--runs", type=Path, default=Path("/tmp/bench-runs"), help="where run directories go")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--repo", type=Path, default=common.REPO,
                        help="package tree to run (another checkout, for a before/after comparison)")
    args = parser.parse_intermixed_args(argv)

    setup = SETUPS[args.setup]
    name = args.name or args.setup
    overrides = overrides_for(setup, args.steps, args.overrides)
    run_dir = args.runs / name
    ran = common.launch(overrides, run_dir, args.timeout, args.out / f"{name}.log", args.repo.resolve())
    steady = steady_state(common.metrics(run_dir), args.measure_from)
    target = setup["reference"] * TARGET_FACTOR
    result = {
        "name": name, "setup": args.setup, **common.stamp(), **ran, "overrides": overrides, "repo": str(args.repo),
        "world_size": setup["nproc"], "steps": args.steps, "measure_from": args.measure_from,
        "reference": setup["reference"], "target": target, "steady": steady,
        "meets_target": bool(steady) and steady["tokens_per_s_per_gpu"] >= target,
    }
    if not steady:
        result["log_tail"] = common.log_tail(args.out / f"{name}.log")
        print(result["log_tail"])
    common.write_result(args.out, name, result, table(result))
    s = steady
    print(f"{name}: exit {ran['exit_code']}, " + (
        f"{s['tokens_per_s_per_gpu']:,.0f} tok/s/GPU (target {target:,.0f}), mfu {s.get('mfu', 0):.1%} "
        f"(ref {s.get('mfu_reference', 0):.1%}), step {s['step_time_s'] * 1000:.0f} ms, "
        f"mem {s['mem_allocated_gb']:.1f}/{s.get('mem_reserved_gb', 0):.1f} GiB" if s else "no steady-state figures"))
    return 0 if steady else 1


if __name__ == "__main__":
    sys.exit(main())
