"""Peak memory of one rank of a real training run on CPU, for checking pretrain.plan's estimate.

    python -m tests.memory_probe OUT.json RUN_DIR [overrides...]     # with RANK/WORLD_SIZE/... set

or, from a test or benchmark, `measure(world, overrides, scratch)`, which starts the ranks so.

Builds the real Trainer and runs its `train_step` train.steps times (no evaluation or checkpoint,
whose memory the estimate leaves out), then writes to OUT.json the resident set's peak
increase over the baseline taken just before the model is built. Before the baseline, a tiny model
of the same settings trains the same steps and is dropped: the process group, the imports done on
first use, the kernels' and threads' one-time buffers and the data are up by then, so the increase
is the tensors the estimate counts (without the warm-up, some 40 MiB of start-up rode on every
peak, which needed a model of 52M parameters, and minutes of bf16 matmuls on a CPU without bf16
instructions, to stay inside the tolerance). The high-water mark is reset at the baseline
(/proc/self/clear_refs), and glibc is told (by `measure`, MALLOC_MMAP_THRESHOLD_) to map every large
block on its own, so freed tensors leave the resident set at once and the peak follows the live
tensors, not the allocator's caching.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from pretrain.compose import compose
from pretrain.config import Config
from pretrain.hosts import free_port
from pretrain.launcher import preparation
from pretrain.launcher.local import rank_env
from pretrain.launcher.world import World
from pretrain.trainer import distributed, identity, logs, loop


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def warm_up(cfg: Config, env: identity.DistEnv, device: torch.device) -> None:
    """Train a tiny model with cfg's settings for its steps, and drop it."""
    tiny = replace(cfg, model=replace(cfg.model, dim=64, n_layers=1, ffn_hidden=128, vocab_size=512),
                   train=replace(cfg.train, seq_len=32))
    trainer = loop.Trainer(tiny, env, device)
    for _ in range(tiny.train.steps):
        trainer.train_step()
    del trainer
    gc.collect()


def main(argv: list[str]) -> int:
    out, run_dir, overrides = Path(argv[0]), Path(argv[1]), argv[2:]
    cfg = compose([f"hydra.run.dir={run_dir}", *overrides])
    env = identity.detect()
    device = distributed.device_for(env)
    preparation.check_config(cfg, World(env.world_size, env.local_world_size, device.type == "cuda"))
    if env.is_main:
        preparation.write_run(cfg)
    distributed.init_process_group(env, device)
    dist.barrier()
    logs.setup(run_dir, env.rank)
    try:
        warm_up(cfg, env, device)
        reset_peak()
        baseline = status_kib("VmRSS")
        trainer = loop.Trainer(cfg, env, device)
        for _ in range(cfg.train.steps):
            trainer.train_step()
    finally:
        dist.destroy_process_group()
    peak = status_kib("VmHWM")
    out.write_text(json.dumps({"rank": env.rank, "baseline_bytes": baseline * 1024,
                               "peak_increase_bytes": (peak - baseline) * 1024}))
    return 0


def measure(world: int, overrides: list[str], scratch: Path, timeout: float | None = None) -> list[int]:
    """Each rank's peak resident-memory increase (bytes) over its pre-model baseline, from `world` probe
    processes of `overrides` (their files go under scratch). A rank that fails raises its stderr's end;
    none is left running, even on a timeout (it would hold the machine's cores through what comes next)."""
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(repo)}
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "tests.memory_probe", str(scratch / f"peak{rank}.json"),
                               str(scratch / "run"), *overrides], cwd=repo, env={**env, **rank_env(rank, world, port)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for rank in range(world)]
    try:
        for rank, proc in enumerate(procs):
            _, err = proc.communicate(timeout=timeout)
            if proc.returncode:
                raise RuntimeError(f"memory probe rank {rank} exited with {proc.returncode}:\n{err[-3000:]}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [json.loads((scratch / f"peak{rank}.json").read_text())["peak_increase_bytes"] for rank in range(world)]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
