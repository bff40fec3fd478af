"""Run directories on disk: a run, or the runs of a sweep, how far each one has got, and who trains in it.

A run directory is one that `pretrain.launch` made: it holds the MARKER file beside its
config.yaml; a sweep directory holds one per point, named `INDEX_OVERRIDES`. A folder without the
marker is never used as a run directory unless it is empty, so a user's own files are never renamed
or appended to. While a run trains, its rank 0 (or the local launcher) holds an exclusive lock on
LOCK_FILE (`fcntl.lockf`, which NFS and Lustre honour across nodes), so two launches can never train
in one run directory at once.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import time
from pathlib import Path
from typing import Any

MARKER = ".pretrain-run"
LOCK_FILE = ".lock"
# Set by the local launcher for its ranks to the run directory whose lock it holds for them.
LOCK_HELD_ENV = "PRETRAIN_RUN_LOCK_HELD"
# Left by a rank that stopped on an error a rerun would repeat (its one-line message): the batch
# script does not requeue then, whatever exit codes srun reports for the ranks it had to kill.
FAILED_MARKER = ".failed"


def record_failure(run_dir: Path, message: str) -> None:
    """Note an error that a requeue would repeat, for the batch script (every failing rank appends)."""
    if Path(run_dir).is_dir():
        with (Path(run_dir) / FAILED_MARKER).open("a") as f:
            f.write(message.replace("\n", " ") + "\n")


def is_run_dir(path: Path) -> bool:
    return (Path(path) / MARKER).is_file() and (Path(path) / "config.yaml").is_file()


def foreign_files(path: Path) -> list[str]:
    """Names in an existing folder that make it unusable as a run directory: any, unless it is one of ours."""
    path = Path(path)
    if not path.is_dir() or (path / MARKER).is_file():
        return []
    return sorted(p.name for p in path.iterdir())


def mark(path: Path) -> None:
    """Claim a (new or empty) folder as a run directory."""
    marker = Path(path) / MARKER
    if not marker.exists():
        marker.write_text(json.dumps({"created": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n")


class RunLocked(RuntimeError):
    """Another process trains in this run directory; the message names it."""


class RunLock:
    """An exclusive, non-blocking lock on a run directory, held while its run trains.

    The lock is the kernel's (released when the holder exits, however it exits); the file only
    tells who holds it: host, process id and since when.
    """

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        self._fd = self._lock(os.O_RDWR | os.O_CREAT)
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"pid {os.getpid()} on {socket.gethostname()} since "
                  f"{time.strftime('%Y-%m-%d %H:%M:%S')}".encode(), 0)

    def _lock(self, flags: int) -> int:
        fd = os.open(self.path, flags, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise RunLocked(f"another training is running in {self.path.parent} ({holder}); wait for it to end or "
                            "stop it, or use another hydra.run.dir") from None
        return fd

    def check_free(self) -> None:
        """Raise RunLocked if the lock is held now; leaves the file as it is."""
        if self.path.is_file():
            os.close(self._lock(os.O_RDWR))

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the lock
            self._fd = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def check_unlocked(run_dir: Path) -> None:
    """Raise RunLocked if a run trains in run_dir now (the lock is tried and given back at once)."""
    RunLock(run_dir).check_free()


def run_dirs(path: Path) -> list[Path]:
    """[path] for a run directory, a sweep's run directories in point order, or [] for neither."""
    path = Path(path)
    if is_run_dir(path):
        return [path]
    if not path.is_dir():
        return []
    return sorted((child for child in path.iterdir() if is_run_dir(child)), key=_point_order)


def not_found(path: Path) -> str:
    """The one-line error of the commands that take a run or sweep directory and got neither."""
    return f"error: {path} is neither a run directory nor a sweep directory (none with a config.yaml)"


def _point_order(run_dir: Path) -> tuple[int, str]:
    index = re.match(r"\d+", run_dir.name)
    return (int(index.group()) if index else -1, run_dir.name)


def planned_steps(run_dir: Path) -> int:
    from omegaconf import OmegaConf

    return int(OmegaConf.load(Path(run_dir) / "config.yaml").train.steps)


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The records of the run's metrics.jsonl; a line being written (or cut short by a crash) is left out."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def last_step(run_dir: Path) -> int:
    """The last step in the run's metrics.jsonl, 0 before the first."""
    return max((record.get("step", 0) for record in metrics(run_dir)), default=0)


def is_finished(run_dir: Path) -> bool:
    return last_step(run_dir) >= planned_steps(run_dir)
