"""Training on this machine: one process per visible GPU, or local.nproc CPU processes (gloo).

Every rank is a `python -m pretrain.train RUN_DIR` process with torchrun's variables (RANK,
WORLD_SIZE, ...): rank 0 prints to this terminal, the others write RUN_DIR/logs/rank<N>.log. If
any rank fails, the others are stopped and the failing rank's log is named.

What this machine has (GPUs, their memory, FP8 support, what gloo can do with this torch) is asked
of the trainer's torch in a process of its own (`python -m pretrain.trainer.devices`), once per
launcher process: the launcher itself imports no torch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from pretrain.config import Config, ConfigError
from pretrain.hosts import free_port
from pretrain.rundir import LOCK_HELD_ENV, ExitCode


# Signals to this launcher that its ranks get as SIGTERM (checkpoint and stop).
FORWARDED = (signal.SIGTERM, signal.SIGHUP)
# Present wherever the NVIDIA driver is loaded: without it there is no CUDA GPU to ask torch about.
NVIDIA_DRIVER = "/proc/driver/nvidia/gpus"


@dataclass(frozen=True)
class Devices:
    """What the trainer's torch finds on this machine (pretrain.trainer.devices); None: not asked."""

    gpus: int
    torch: str | None
    cpu_all_reduce: bool | None
    gpu_name: str | None
    gpu_memory_gib: float | None
    bf16: bool
    float8_problem: str | None


def devices(cfg: Config) -> Devices:
    """This machine's devices: asked of torch where there may be a GPU (an NVIDIA driver is loaded) or
    FP8 is wanted; on other machines plainly none, without the seconds a torch import takes."""
    if cfg.precision.float8 == "none" and not Path(NVIDIA_DRIVER).is_dir():
        return Devices(gpus=0, torch=None, cpu_all_reduce=None, gpu_name=None, gpu_memory_gib=None, bf16=False,
                       float8_problem=None)
    return probe(cfg.precision.float8, os.environ.get("CUDA_VISIBLE_DEVICES"))


def cpu_all_reduce() -> bool:
    """Whether the trainer's torch can all-reduce FSDP2 gradients over gloo (2-D meshes on CPUs)."""
    return probe("none", os.environ.get("CUDA_VISIBLE_DEVICES")).cpu_all_reduce


@lru_cache(maxsize=8)
def probe(float8_recipe: str, visible_devices: str | None) -> Devices:
    """Ask the trainer's torch, in a process of its own, what it finds (cached per launcher process)."""
    result = subprocess.run([sys.executable, "-m", "pretrain.trainer.devices", float8_recipe], capture_output=True,
                            text=True, timeout=300)
    if result.returncode:
        tail = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ConfigError(f"the trainer's torch does not start here ({tail}); check the installation "
                          f"({sys.executable} -m pretrain.trainer.devices)")
    return Devices(**json.loads(result.stdout))


def nproc(cfg: Config, found: Devices) -> int:
    return cfg.local.nproc if cfg.local.nproc is not None else max(found.gpus, 1)


def check(cfg: Config, found: Devices) -> None:
    """What only this machine can tell before a local run starts: whether FP8 matmuls run here."""
    if cfg.precision.float8 != "none" and found.float8_problem:
        raise ConfigError(found.float8_problem)


def dry_run(cfgs: list[Config], found: Devices) -> int:
    """What a local launch would start, after the same checks; nothing is written or run."""
    for cfg in cfgs:
        ranks = f"{nproc(cfg, found)} x {'GPU' if found.gpus else 'CPU process'}"
        batch = (f"{cfg.train.global_batch_tokens} tokens" if cfg.train.global_batch_tokens
                 else f"{cfg.train.global_batch} sequences")
        print(f"would train {cfg.model.name} here on {ranks}: {cfg.train.steps} steps, global batch {batch}, "
              f"activation checkpointing {cfg.fsdp.activation_checkpointing}, run directory {cfg.run_dir}")
    print("checked: config, memory estimate, data, checkpoints, run directory; dry run: nothing was written or run")
    return 0


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    return {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads_per_rank(world_size))),
    }


def threads_per_rank(world_size: int) -> int:
    """The CPUs this launch may run on, shared out between its ranks: ranks sharing cores fight over their
    threads (torchrun sets the same). The affinity, not the machine's count: inside an salloc allocation,
    a cgroup or taskset, the machine's 128 cores may be 8 for us, and 128 threads on 8 cores crawl."""
    return max(len(os.sched_getaffinity(0)) // world_size, 1)


def run(cfg: Config, world: int) -> int:
    """Start the ranks of a run directory the launcher has written (it holds the run's lock for them)."""
    run_dir = Path(cfg.run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, **rank_env(rank, world, port), LOCK_HELD_ENV: cfg.run_dir}
        cmd = [sys.executable, "-m", "pretrain.train", str(run_dir)]
        if rank == 0:
            procs.append(subprocess.Popen(cmd, env=env))
        else:
            with (run_dir / "logs" / f"rank{rank}.log").open("ab") as log:
                procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    return wait_all(procs, run_dir)


def wait_all(procs: list[subprocess.Popen], run_dir: Path) -> int:
    """Wait for every rank; on the first failure stop the rest and say which rank failed and where.

    Ctrl-C reaches every rank too (one process group): at the first they checkpoint and stop, and
    this keeps waiting for them; at a second they abort at once (pretrain.trainer.resilience), and so does this.
    SIGTERM or SIGHUP to this process (kill, a closed terminal) is passed on to the ranks as SIGTERM:
    they checkpoint and stop.
    """
    def forward(signum: int, frame: object) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    interrupted = False
    try:
        while True:
            try:
                return _watch(procs, run_dir)
            except KeyboardInterrupt:
                if interrupted:
                    stop(procs, grace_s=5.0)
                    return ExitCode.ABORTED
                interrupted = True
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _watch(procs: list[subprocess.Popen], run_dir: Path) -> int:
    while True:
        codes = [p.poll() for p in procs]
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, ExitCode.OK, ExitCode.STOPPED)]
        if failed:
            # A rank killed by a signal is the cause: the others fail after it, in a collective with it,
            # and may exit first (rank 0's checkpoint write failing on a killed rank 1 was seen to).
            rank, code = min(failed, key=lambda failure: (failure[1] >= 0, failure[0]))
            stop(procs)
            if rank or code != ExitCode.ERROR:  # rank 0's own error line is on this terminal already
                where = "the output above" if rank == 0 else str(run_dir / "logs" / f"rank{rank}.log")
                print(f"error: rank {rank} exited with code {code}; see {where}", file=sys.stderr)
            return code if code > 0 else ExitCode.ERROR
        if all(code is not None for code in codes):
            return max(codes)
        time.sleep(0.2)


def stop(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.time() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.time(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
