"""Where one training step's GPU time goes, through the package's own Trainer.train_step.

    python bench/profile_step.py [launcher overrides...] [--warmup 8] [--steps 3] [--name NAME]
                                 [--inductor triton.prefer_nd_tiling=True ...]

Builds the Trainer as `python -m pretrain.launch` would for one process (same config
composition, model, parallelization, optimizer and data), runs --warmup steps (compilation),
then profiles --steps steps with torch.profiler. Reports wall time per step, GPU kernel time
per step by category (matmul, attention, fused elementwise, optimizer, copies, NCCL, ...),
the GPU's idle time (where no kernel or copy runs: how much in gaps of each size, and the largest
gaps with the kernels around them), and the 40 most expensive kernels. --inductor sets one of
Inductor's options (`torch._inductor.config`, a Python literal) for this process's compilation, to
measure a setting before the package adopts it. Writes NAME.json and NAME.md.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402
from pretrain.trainer import allocator  # noqa: E402

allocator.configure(os.environ)  # before torch starts, as in a job (pretrain/train.py)

# First match wins: kernel-name patterns to a category.
CATEGORIES = [
    ("attention", r"cudnn|fmha|flash|attention|sdpa"),
    ("matmul", r"gemm|nvjet|xmma|cutlass|sm90_|sm80_|matmul|wgmma"),
    ("optimizer", r"adam|fused_adamw|multi_tensor|foreach"),
    ("nccl", r"nccl"),
    ("triton (fused elementwise, norms, loss)", r"triton"),
    ("copy / cast", r"memcpy|memset|copy|cast|cat|chunk|split|fill|to_copy"),
]


def category(name: str) -> str:
    lowered = name.lower()
    for label, pattern in CATEGORIES:
        if re.search(pattern, lowered):
            return label
    return "other"


def build_trainer(overrides: list[str], run_dir: Path):
    from pretrain.compose import compose
    from pretrain.data import source
    from pretrain import rundir
    from pretrain.hosts import free_port
    from pretrain.launcher import local, preparation
    from pretrain.launcher.world import world_of
    from pretrain.parallel.parallelize import persist_compile_cache
    from pretrain.trainer import distributed, identity, logs, loop

    cfg = compose(overrides + [f"hydra.run.dir={run_dir}"])
    preparation.check_config(cfg, world_of(cfg))
    preparation.write_run(cfg)
    os.environ.update(local.rank_env(0, 1, free_port()))
    env = identity.detect()
    device = distributed.device_for(env)
    distributed.init_process_group(env, device)
    logs.setup(run_dir, env.rank)
    source.ensure(cfg)
    if cfg.fsdp.compile:  # as a job keeps them: Inductor's generated code stays in the run directory to be read
        persist_compile_cache(run_dir / rundir.COMPILE_CACHE)
    return loop.Trainer(cfg, env, device), cfg


def profile(trainer, warmup: int, steps: int):
    import torch
    from torch.profiler import ProfilerActivity

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(warmup):
        trainer.train_step()
    trainer.skips.settle()
    sync()
    # Kernels only: recording every CPU op would slow the host enough to starve the GPU.
    with torch.profiler.profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        for _ in range(steps):
            trainer.train_step()
        trainer.skips.settle()
        sync()
        wall = time.perf_counter() - started
    return prof, wall


def set_inductor_options(options: list[str]) -> dict[str, object]:
    """Apply KEY=VALUE settings to Inductor's config before anything compiles; an unknown key fails here."""
    import torch._inductor.config as inductor_config

    chosen = {}
    for option in options:
        key, value = option.split("=", 1)
        parsed = ast.literal_eval(value)
        holder = inductor_config
        *parents, leaf = key.split(".")
        for part in parents:
            holder = getattr(holder, part)
        if not hasattr(holder, leaf):
            raise SystemExit(f"--inductor {option}: torch._inductor.config has no {key}")
        setattr(holder, leaf, parsed)
        chosen[key] = parsed
    return chosen


# Gap sizes (microseconds) for the idle table: launch latency, host stalls, waits for the host.
GAP_BUCKETS = [(0, 5), (5, 50), (50, 1000), (1000, float("inf"))]


def device_spans(prof) -> list[tuple[float, float, str]]:
    """(start, end, name) in microseconds of every kernel, copy and memset the profiler saw on the device."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    return [(e["ts"], e["ts"] + e.get("dur", 0), e.get("name", "")) for e in events
            if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "ts" in e]


def idle_gaps(spans: list[tuple[float, float, str]], steps: int, largest: int = 10) -> dict[str, object]:
    """Where the device ran nothing between its first and last activity, over all streams: the gaps
    bucketed by size, and the largest ones with the names of the kernels that end and start them."""
    if not spans:
        return {}
    spans = sorted(spans)
    gaps = []
    end, last_name = spans[0][1], spans[0][2]
    for start, stop, name in spans[1:]:
        if start > end:
            gaps.append((start - end, last_name, name))
        if stop > end:
            end, last_name = stop, name
    buckets = []
    for low, high in GAP_BUCKETS:
        inside = [g for g, _, _ in gaps if low <= g < high]
        label = f"{low}-{high} us" if high != float("inf") else f">= {low} us"
        buckets.append({"gap": label, "count_per_step": len(inside) / steps,
                        "ms_per_step": sum(inside) / 1000 / steps})
    top = sorted(gaps, key=lambda g: -g[0])[:largest]
    return {"span_ms_per_step": (end - spans[0][0]) / 1000 / steps,
            "idle_ms_per_step": sum(g for g, _, _ in gaps) / 1000 / steps, "buckets": buckets,
            "largest": [{"us": round(g, 1), "after": before[:80], "before": after[:80]} for g, before, after in top]}


def idle_rows(idle: dict[str, object]) -> list[str]:
    if not idle:
        return []
    rows = ["", f"GPU idle between its first and last kernel: {idle['idle_ms_per_step']:.2f} ms/step "
                f"(span {idle['span_ms_per_step']:.1f} ms/step)", "", "| gap | gaps/step | ms/step |", "|---|---|---|"]
    rows += [f"| {b['gap']} | {b['count_per_step']:.1f} | {b['ms_per_step']:.2f} |" for b in idle["buckets"]]
    rows += ["", "| largest gaps (us) | after | before |", "|---|---|---|"]
    rows += [f"| {g['us']} | {g['after']} | {g['before']} |" for g in idle["largest"]]
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--name", default="profile")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=common.RESULTS)
    parser.add_argument("--runs", type=Path, default=Path("/tmp/bench-runs"))
    parser.add_argument("--inductor", action="append", default=[], metavar="KEY=VALUE",
                        help="one of torch._inductor.config's settings for this run (repeatable)")
    args = parser.parse_intermixed_args()
    inductor_options = set_inductor_options(args.inductor)
    base = ["model=llama-1b", "data=synthetic", "precision=bf16", "fsdp.compile=true", "train.seq_len=4096",
            "train.micro_batch=8", "train.global_batch=8", "train.eval_every=0", "train.ckpt_every=0",
            "train.steps=1000", "local.nproc=1"]
    keys = {o.split("=", 1)[0] for o in args.overrides}
    overrides = [o for o in base if o.split("=", 1)[0] not in keys] + args.overrides
    trainer, _ = build_trainer(overrides, args.runs / args.name)
    prof, wall = profile(trainer, args.warmup, args.steps)
    kernels = common.kernel_times(prof)
    idle = idle_gaps(device_spans(prof), args.steps)
    by_category: dict[str, float] = defaultdict(float)
    for name, ms in kernels.items():
        by_category[category(name)] += ms / args.steps
    step_ms = wall * 1000 / args.steps
    busy = sum(by_category.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:40]
    result = {**common.stamp(), "overrides": overrides, "inductor_options": inductor_options,
              "steps": args.steps, "wall_ms_per_step": step_ms, "idle": idle,
              "gpu_kernel_ms_per_step": busy, "by_category_ms_per_step": dict(by_category),
              "top_kernels_ms_per_step": [(n, ms / args.steps) for n, ms in top]}
    rows = [f"Inductor options: {inductor_options}", ""] if inductor_options else []
    rows += [f"wall {step_ms:.1f} ms/step; kernels {busy:.1f} ms/step (sum over streams; idle >= "
            f"{max(step_ms - busy, 0):.1f} ms)", "", "| category | ms/step | share of wall |", "|---|---|---|"]
    rows += [f"| {c} | {ms:.1f} | {ms / step_ms:.1%} |" for c, ms in sorted(by_category.items(), key=lambda kv: -kv[1])]
    rows += idle_rows(idle)
    kernel_rows = ["", "| kernel | ms/step |", "|---|---|"]
    kernel_rows += [f"| {n[:110]} | {ms / args.steps:.2f} |" for n, ms in top]
    common.write_result(args.out, args.name, result, "\n".join(rows + kernel_rows))
    print("\n".join(rows + kernel_rows[:14]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
