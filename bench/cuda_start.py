"""What a one-GPU job's start pays for CUDA, each way timed in fresh processes, the ways alternated.

    python bench/cuda_start.py [--repeats 5] [--out bench/results] [--name cuda-start]

Each process imports what the job imports (`pretrain.trainer.loop`, torch and all), then makes the GPU
ready as the job does (`distributed.device_for` and a first allocation), then the one-rank NCCL process
group as the job makes it (`device_id`, so NCCL builds its communicator at once) and a barrier:
- serial: the context made after the imports, by torch, as before pretrain.trainer.cuda_context;
- threaded: cuda_context's thread started first, so the driver makes the context during the imports;
- lazy_nccl: serial, but the process group without `device_id` (NCCL's communicator made at the barrier).
The figures are each phase's median over --repeats processes: the imports, the device (context and first
allocation), the process group and the barrier, and their sum; for threaded also the thread's own time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

WAYS = ("serial", "threaded", "lazy_nccl")
PHASES = ("imports", "device", "process_group", "barrier")

CHILD = r"""
import json, sys, time
started = time.perf_counter()
way = sys.argv[1]
if way == "threaded":
    from pretrain.trainer import cuda_context
    thread, context = cuda_context.start_in_background()
import torch, torch.distributed as dist
from pretrain.trainer import loop, distributed, identity
imported = time.perf_counter()
env = identity.detect()
device = distributed.device_for(env)
torch.empty(1, device=device)
ready = time.perf_counter()
if way == "lazy_nccl":
    backend = "nccl" if device.type == "cuda" else "gloo"  # gloo: the script's own check on a CPU machine
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{env.master_port}", rank=0, world_size=1)
else:
    distributed.init_process_group(env, device)
grouped = time.perf_counter()
dist.barrier()
if device.type == "cuda":
    torch.cuda.synchronize()
done = time.perf_counter()
dist.destroy_process_group()
times = {"imports": imported - started, "device": ready - imported, "process_group": grouped - ready,
         "barrier": done - grouped}
if way == "threaded":
    times["thread"] = context.seconds if context.seconds is not None else context.problem
print("TIMES " + json.dumps(times))
"""


def run_once(way: str) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, "-c", CHILD, way], cwd=common.REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    for line in out.stdout.splitlines():
        if line.startswith("TIMES "):
            return json.loads(line[6:])
    raise RuntimeError(f"{way} printed no times (exit {out.returncode}): {out.stderr[-2000:]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=common.RESULTS)
    parser.add_argument("--name", default="cuda-start")
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
    run_once("serial")  # one unmeasured start: the files the imports read are then in the page cache
    for repeat in range(args.repeats):
        for way in (WAYS if repeat % 2 == 0 else WAYS[::-1]):
            runs[way].append(run_once(way))
    medians = {way: {phase: statistics.median(r[phase] for r in rs) for phase in PHASES} for way, rs in runs.items()}
    for way, m in medians.items():
        m["total"] = sum(m[phase] for phase in PHASES)
    thread = [r["thread"] for r in runs["threaded"] if isinstance(r.get("thread"), float)]
    result = {**common.stamp(), "repeats": args.repeats, "runs": runs, "medians": medians,
              "thread_median_s": statistics.median(thread) if thread else None}
    rows = ["| way | imports | device | process group | barrier | total |", "|---|---|---|---|---|---|"]
    rows += [f"| {way} | " + " | ".join(f"{m[p]:.3f}" for p in (*PHASES, "total")) + " |" for way, m in medians.items()]
    note = (f"\nSeconds, medians of {args.repeats} fresh processes each, the ways alternated. threaded: the "
            f"context thread's own time {result['thread_median_s']} s (median).\n")
    print(common.write_result(args.out, args.name, result, "\n".join(rows) + note).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
