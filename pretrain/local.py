"""Training on this machine: one process per visible GPU, or local.nproc CPU processes (gloo).

With one process the training runs inside the launcher's own process. With more, each rank is
a `python -m pretrain.train RUN_DIR` child with the standard RANK/WORLD_SIZE/... variables:
rank 0 prints to this terminal, the others write RUN_DIR/logs/rank<N>.log. If any rank fails,
the others are stopped and the failing rank's log is named.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pretrain.config import Config, ConfigError
from pretrain.distributed import free_port
from pretrain.preemption import EXIT_ABORTED, EXIT_STOPPED
from pretrain.runs import LOCK_HELD_ENV


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def nproc(cfg: Config) -> int:
    if cfg.local.nproc is not None:
        return cfg.local.nproc
    import torch

    return max(torch.cuda.device_count(), 1)


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    return {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        # Two ranks sharing a few cores fight over threads; torchrun sets the same.
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max((os.cpu_count() or 1) // world_size, 1))),
    }


def check(cfg: Config) -> None:
    """What only this machine can tell before a local run starts: whether FP8 matmuls run here."""
    if cfg.precision.float8 == "none":
        return
    import torch

    from pretrain import float8

    try:
        float8.check_available(cfg.precision.float8, torch.device("cuda", 0) if has_cuda() else torch.device("cpu"))
    except float8.Float8Unavailable as error:
        raise ConfigError(str(error)) from None


def dry_run(cfgs: list[Config]) -> int:
    """What a local launch would start, after the same checks; nothing is written or run."""
    for cfg in cfgs:
        ranks = f"{nproc(cfg)} x {'GPU' if has_cuda() else 'CPU process'}"
        batch = (f"{cfg.train.global_batch_tokens} tokens" if cfg.train.global_batch_tokens
                 else f"{cfg.train.global_batch} sequences")
        print(f"would train {cfg.model.name} here on {ranks}: {cfg.train.steps} steps, global batch {batch}, "
              f"activation checkpointing {cfg.fsdp.activation_checkpointing}, run directory {cfg.run_dir}")
    print("checked: config, memory estimate, data, checkpoints, run directory; dry run: nothing was written or run")
    return 0


def run(cfg: Config) -> int:
    world = nproc(cfg)
    if world == 1:
        return run_in_process(cfg)
    return run_processes(cfg, world)


def launched_env(rank: int, world_size: int, port: int, run_dir: str) -> dict[str, str]:
    """A rank's environment: its identity, and that this launcher holds the run directory's lock."""
    return {**rank_env(rank, world_size, port), LOCK_HELD_ENV: run_dir}


def run_in_process(cfg: Config) -> int:
    from pretrain import train

    variables = launched_env(0, 1, free_port(), cfg.run_dir)
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        result = train.run(cfg)
    except train.TrainingError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:  # the caller's environment (e.g. a later sbatch's) must not inherit this rank's identity
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return EXIT_STOPPED if result["stopped_early"] else 0


def run_processes(cfg: Config, world: int) -> int:
    run_dir = Path(cfg.run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, **launched_env(rank, world, port, cfg.run_dir)}
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
    this keeps waiting for them; at a second they abort at once (pretrain.preemption), and so does this.
    """
    interrupted = False
    while True:
        try:
            return _watch(procs, run_dir)
        except KeyboardInterrupt:
            if interrupted:
                stop(procs, grace_s=5.0)
                return EXIT_ABORTED
            interrupted = True


def _watch(procs: list[subprocess.Popen], run_dir: Path) -> int:
    while True:
        codes = [p.poll() for p in procs]
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0, EXIT_STOPPED)]
        if failed:
            rank, code = failed[0]
            stop(procs)
            where = "the output above" if rank == 0 else str(run_dir / "logs" / f"rank{rank}.log")
            print(f"error: rank {rank} exited with code {code}; see {where}", file=sys.stderr)
            return code if code > 0 else 1
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
