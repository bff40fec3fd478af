"""The run directory: what a run keeps on disk, and the one place that knows its layout.

    RUN/
      .pretrain-run          the mark of a run directory (MARKER); a folder without it is never
                             written into unless it is empty, so a user's own files are left alone
      .lock                  held (fcntl.lockf, which NFS and Lustre honour across nodes) while the
                             run trains: two launches never train in one run directory
      config.yaml            the resolved config the run uses; config.N.yaml: earlier ones
      metrics.jsonl          one JSON record per logged step (MetricsFile); metrics.discarded.jsonl
      train.log, logs/       rank 0's log; the other ranks' output (local runs)
      checkpoints/step_N/    complete checkpoints (a MANIFEST each); step_N.partial/ being written,
                             step_N.removing/ being deleted, step_N.damaged/ set aside
      jobs.json, slurm/      the Slurm jobs of the run and their logs
      cache/compile/         torch.compile's caches (Inductor, Triton): a requeued job reuses them
      .requeue               a rank stopped on a time-limit signal: the batch script requeues
      .stopped               the ranks stopped on SIGTERM or SIGINT: the batch script requeues
                             unless it was signalled too (scancel, preemption)
      .exclude_nodes         nodes that failed the preflight: requeued without them
      .failed                an error a requeue would repeat: the batch script does not requeue

The exit codes of the job's processes (ExitCode) are defined here too: the batch script's requeue
rule is generated from them (pretrain.launcher.slurm). No torch here: the launcher, status and
report read run directories on login nodes.
"""

from __future__ import annotations

import enum
import fcntl
import json
import os
import re
import socket
import time
from pathlib import Path
from typing import Any

from pretrain.config import Config, ModelConfig

MARKER = ".pretrain-run"
LOCK_FILE = ".lock"
CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
JOBS_FILE = "jobs.json"
REQUEUE_REQUEST = ".requeue"
STOPPED_NOTICE = ".stopped"
EXCLUDE_NODES = ".exclude_nodes"
FAILED_MARKER = ".failed"
# Set by the local launcher for its ranks to the run directory whose lock it holds for them.
LOCK_HELD_ENV = "PRETRAIN_RUN_LOCK_HELD"

CHECKPOINTS = "checkpoints"
COMPILE_CACHE = "cache/compile"
# Python's bytecode for the job's imports, where the interpreter keeps none (pretrain.trainer.bytecode).
BYTECODE_CACHE = "cache/python"
MANIFEST = "manifest.json"
PARTIAL = ".partial"
DAMAGED = ".damaged"
REMOVING = ".removing"
# The model fields that decide the shapes of the saved tensors.
SHAPE_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size", "tie_embeddings")


class ExitCode(enum.IntEnum):
    """How a training process ends."""

    OK = 0
    ERROR = 1  # stopped on an error a rerun would repeat (a diverged loss, an unwritable checkpoint)
    REFUSED = 2  # the config or the run directory was refused before training
    STOPPED = 3  # stopped on a signal with a checkpoint, to be requeued or rerun
    HUNG = 124  # a step or a collective stalled (a rank died): a requeue may help
    ABORTED = 130  # a second Ctrl-C: stopped at once, without a checkpoint

    @classmethod
    def final(cls) -> tuple[ExitCode, ...]:
        """The codes after which requeueing would only repeat the same end."""
        return cls.OK, cls.ERROR, cls.REFUSED


# ---- what a run directory is ------------------------------------------------------------------
def is_run_dir(path: Path) -> bool:
    return (Path(path) / MARKER).is_file() and (Path(path) / CONFIG_FILE).is_file()


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
        marker.write_text(marker_text())


def marker_text() -> str:
    return json.dumps({"created": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n"


def load_config(run_dir: Path) -> Config:
    """The run's resolved config (config.yaml), with run_dir set to where the folder is now."""
    from omegaconf import OmegaConf

    from pretrain import config

    cfg = config.from_container(OmegaConf.load(Path(run_dir) / CONFIG_FILE))
    cfg.run_dir = str(run_dir)
    return cfg


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
    return f"error: {path} is neither a run directory nor a sweep directory (none with a {CONFIG_FILE})"


def _point_order(run_dir: Path) -> tuple[int, str]:
    index = re.match(r"\d+", run_dir.name)
    return (int(index.group()) if index else -1, run_dir.name)


def record_failure(run_dir: Path, message: str) -> None:
    """Note an error that a requeue would repeat, for the batch script (every failing rank appends)."""
    if Path(run_dir).is_dir():
        with (Path(run_dir) / FAILED_MARKER).open("a") as f:
            f.write(message.replace("\n", " ") + "\n")


# ---- metrics ----------------------------------------------------------------------------------
class MetricsFile:
    """metrics.jsonl: one JSON object per record, appended and flushed at once; read tolerantly
    (a line being written, or cut short by a crash, is left out)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def records(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        records = []
        for line in self.path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return records

    def truncate_after(self, step: int) -> None:
        """On resume: keep records up to `step`; move later ones (from the lost attempt) aside, never delete."""
        if not self.path.is_file():
            return
        kept, dropped = [], []
        for line in self.path.read_text().splitlines():
            try:
                (kept if json.loads(line).get("step", 0) <= step else dropped).append(line)
            except json.JSONDecodeError:
                dropped.append(line)  # a line cut short by a crash
        if not dropped:
            return
        with self.path.with_name("metrics.discarded.jsonl").open("a") as f:
            f.write("\n".join(dropped) + "\n")
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.path)


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    return MetricsFile(Path(run_dir) / METRICS_FILE).records()


def planned_steps(run_dir: Path) -> int:
    from omegaconf import OmegaConf

    return int(OmegaConf.load(Path(run_dir) / CONFIG_FILE).train.steps)


def last_step(run_dir: Path) -> int:
    """The last step in the run's metrics.jsonl, 0 before the first."""
    return max((record.get("step", 0) for record in metrics(run_dir)), default=0)


def is_finished(run_dir: Path) -> bool:
    return last_step(run_dir) >= planned_steps(run_dir)


# ---- the lock ---------------------------------------------------------------------------------
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


# ---- checkpoint folders -----------------------------------------------------------------------
class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message says which and why."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of(path: Path) -> int:
    """The step a checkpoint folder holds, from its name (step_00000100, step_00000100.partial, ...)."""
    return int(Path(path).name.split(".")[0].removeprefix("step_"))


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under root, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and "." not in p.name]
    return sorted((p for p in found if (p / MANIFEST).is_file()), key=lambda p: p.name)


def latest_checkpoint(root: Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1] if found else None


def checkpoint_of(run_dir: Path, step: int | None = None) -> Path:
    """The newest complete checkpoint of a run, or that of `step`; CheckpointError naming what there is."""
    found = complete_checkpoints(Path(run_dir) / CHECKPOINTS)
    if not found:
        raise CheckpointError(f"{run_dir} has no complete checkpoint yet (checkpoints are written every "
                              "train.ckpt_every steps and at the end of training); train it further first")
    if step is None:
        return found[-1]
    by_step = {step_of(path): path for path in found}
    if step not in by_step:
        raise CheckpointError(f"{run_dir} has no complete checkpoint of step {step}; its complete checkpoints are of "
                              f"step {', '.join(str(s) for s in sorted(by_step))} (train.ckpt_keep keeps the newest)")
    return by_step[step]


def damaged_checkpoints(root: Path) -> list[Path]:
    """Checkpoints set aside as damaged, oldest first."""
    return sorted(root.glob(f"step_*{DAMAGED}*")) if root.is_dir() else []


def all_damaged_message(damaged: list[Path]) -> str:
    """Why a run with checkpoints, every one of them damaged, does not start again from step 0."""
    return (f"every checkpoint of this run is damaged (set aside as {', '.join(str(p) for p in damaged)}); "
            "nothing was trained. To start this run directory again from step 0, rerun with "
            "train.start_from_scratch=true (the damaged checkpoints stay where they are)")


def read_manifest(path: Path) -> dict[str, Any]:
    return json.loads((path / MANIFEST).read_text())


def model_shape(cfg: ModelConfig) -> dict[str, Any]:
    shape = {name: getattr(cfg, name) for name in SHAPE_FIELDS}
    shape["n_kv_heads"] = cfg.kv_heads
    return shape


# The checksums a manifest may record for a file beside its size (pretrain.trainer.checkpoint computes them):
# what saves record now, then what saves recorded before. A kind not listed was written by a newer pretrain.
CHECKSUM_KINDS = ("crc32c", "crc32")


def check_checksums_known(path: Path) -> None:
    """Raise CheckpointError where a newer pretrain wrote `path` with checksums of a kind this version
    cannot compute: its check would take every file for damaged and set a sound checkpoint aside.

    A manifest that cannot be read is left to the check, which reports it as damage.
    """
    try:
        manifest = read_manifest(path)
    except (OSError, ValueError):
        return
    _refuse_unknown_checksums(path, manifest)


def _refuse_unknown_checksums(path: Path, manifest: dict[str, Any]) -> None:
    try:
        unknown = sorted({key for entry in manifest["files"].values() if not entry.keys() & set(CHECKSUM_KINDS)
                          for key in entry.keys() - {"size"}})
    except (KeyError, TypeError, AttributeError):  # no or malformed file entries: the check reports them
        return
    if unknown:
        raise CheckpointError(
            f"checkpoint {path} records checksums of a kind this version of pretrain cannot check "
            f"({', '.join(unknown)}; it checks {', '.join(CHECKSUM_KINDS)}): a newer pretrain wrote it. Resume the "
            "run with that version (the container or environment it was launched with); the checkpoint is "
            "left as it is"
        )


def check_compatible(path: Path, cfg: ModelConfig) -> None:
    """Raise CheckpointError if `path` holds another model's weights (naming the differing fields) or
    was written by a newer pretrain (check_checksums_known)."""
    manifest = read_manifest(path)
    _refuse_unknown_checksums(path, manifest)
    saved = manifest.get("model_shape", {})
    wanted = model_shape(cfg)
    differing = [f"{k}={saved.get(k)!r} (this run: {v!r})" for k, v in wanted.items() if saved.get(k) != v]
    if differing:
        raise CheckpointError(
            f"checkpoint {path} was written for another model shape: {', '.join(differing)}; "
            "use a new run directory or the model config it was trained with"
        )
