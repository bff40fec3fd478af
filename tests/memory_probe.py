"""Peak memory of one rank of a real training run on CPU, for checking pretrain.plan's estimate.

    python -m tests.memory_probe OUT.json RUN_DIR [overrides...]     # with RANK/WORLD_SIZE/... set

Builds the real Trainer and runs its `train_step` train.steps times (no evaluation or checkpoint,
whose memory the estimate leaves out), then writes to OUT.json the resident set's peak
increase over the baseline taken just before the model is built (the process group, imports
and data are up by then). The high-water mark is reset at the baseline (/proc/self/clear_refs),
and glibc is told (by the caller, MALLOC_MMAP_THRESHOLD_) to map every large block on its own, so
freed tensors leave the resident set at once and the peak follows the live tensors, not the
allocator's caching.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from pretrain.compose import compose
from pretrain.launcher import preparation
from pretrain.launcher.world import World
from pretrain.trainer import distributed, logs, loop


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def main(argv: list[str]) -> int:
    out, run_dir, overrides = Path(argv[0]), Path(argv[1]), argv[2:]
    cfg = compose([f"hydra.run.dir={run_dir}", *overrides])
    env = distributed.detect()
    device = distributed.device_for(env)
    preparation.check_config(cfg, World(env.world_size, env.local_world_size, device.type == "cuda"))
    if env.is_main:
        preparation.write_run(cfg)
    distributed.init_process_group(env, device)
    dist.barrier()
    logs.setup(run_dir, env.rank)
    reset_peak()
    baseline = status_kib("VmRSS")
    try:
        trainer = loop.Trainer(cfg, env, device)
        for _ in range(cfg.train.steps):
            trainer.train_step()
    finally:
        dist.destroy_process_group()
    peak = status_kib("VmHWM")
    out.write_text(json.dumps({"rank": env.rank, "baseline_bytes": baseline * 1024,
                               "peak_increase_bytes": (peak - baseline) * 1024}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
