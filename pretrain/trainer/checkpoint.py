"""Sharded checkpoints with torch.distributed.checkpoint, published atomically.

Layout of a run's checkpoints:
  checkpoints/step_00000100/          a complete checkpoint (DCP shards, rng/, manifest.json)
  checkpoints/step_00000200.partial/  one being written: never loaded, removed at the next start

Every rank writes its shards into the `.partial` folder; after a barrier, rank 0 writes
manifest.json (the training state and the model shape) and renames the folder. A crash at any
moment therefore leaves either the previous complete checkpoint or the new one, never a
half-written folder that looks complete. Deletion runs the other way round: a folder is first
renamed out of the complete ones (`.removing`), then its files are deleted, so a crash while
old checkpoints are pruned leaves no folder that looks complete with files missing. DCP
reshards on load, so a checkpoint written by N processes loads into any other number.

Asynchronous saves (train.async_checkpoint) keep that order: the state is copied into host
buffers kept for the whole run (`staging.HostStaging`: on GPUs a side-stream copy into pinned
memory that the next optimizer step waits for on the GPU), a background thread writes the
shards with `dcp.save` over a gloo group of its own, and the folder is published, by the same
barrier, manifest and rename, once every rank has finished writing (`poll`, `wait`).

Each rank writes its shards as several files with as many threads (`writer_threads`). The
manifest lists every file of the checkpoint with its size and checksum (`checksums`); each rank digests the files
it wrote, in parallel and, for asynchronous saves, in the writer thread, so training never waits
for the digests. `verify` checks them before a load, several files at a time; the training start
falls back to the previous checkpoint when the newest is damaged, and renames the damaged one aside
(`.damaged`), never deleting it. A load reads the rank's files in parallel too, with up to 16 threads,
several to a file, each tensor's bytes straight into its target (`shard_reader.ParallelReader`): a
requeued job waits for its checkpoint before its first step. So that it waits less, the job checks
its newest checkpoint from its first moments (`VerifyAhead`), while the process group, the preflight
and the model are set up; that read also leaves the rank's files in the node's page cache for the load.
On a GPU each file that passes is then registered with CUDA (`shard_reader.RegisteredFiles`), so that
the load's copies come from the page cache by DMA and run on while the job traces its first step.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from pretrain.config import ModelConfig
from pretrain.parallel.float8 import plain_tensors
from pretrain.rundir import (DAMAGED, MANIFEST, PARTIAL, REMOVING, CheckpointError,
                             complete_checkpoints, model_shape, read_manifest, step_dir_name, step_of)
from pretrain.trainer import checksums, resilience, shard_reader
from pretrain.trainer.distributed import all_agree, collective_failed
from pretrain.trainer.shard_reader import ParallelReader, RegisteredFiles, Registration
from pretrain.trainer.staging import HostStaging

log = logging.getLogger(__name__)

# The model's part of a checkpoint's state: DCP stores its tensors as MODEL_STATE.NAME (pretrain.hf reads them).
MODEL_STATE = "model"


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (raised on every rank alike); the message says why."""


def _on_rank_0(action, what: str) -> None:
    """Run `action` on rank 0 only and share its outcome: if it fails, every rank raises
    CheckpointWriteError (no rank is left waiting for rank 0 in a collective)."""
    failure = [None]
    if dist.get_rank() == 0:
        try:
            action()
        except OSError as error:
            failure[0] = f"{what}: {error.strerror or error}"
    dist.broadcast_object_list(failure, src=0)
    if failure[0]:
        raise CheckpointWriteError(failure[0])


def tidy(root: Path) -> None:
    """Settle what a crash left behind (rank 0 only, before training starts).

    A `.partial` folder whose manifest was written is a finished save that the crash kept from
    being renamed: it is published. Any other `.partial` folder is an unfinished save and is
    removed, as are folders whose deletion was under way (`.removing`).
    """
    if not root.is_dir():
        return
    for path in sorted(root.glob(f"step_*{PARTIAL}")):
        final = path.with_name(path.name[: -len(PARTIAL)])
        if (path / MANIFEST).is_file() and not final.exists():
            log.warning("publishing checkpoint %s, finished before the crash", final)
            os.replace(path, final)
        else:
            log.warning("removing unfinished checkpoint %s", path)
            remove(path)
    for path in root.glob(f"step_*{REMOVING}"):
        shutil.rmtree(path, ignore_errors=True)


def remove(path: Path) -> None:
    """Delete a checkpoint folder: renamed out of the complete ones first, then its files."""
    doomed = path.with_name(path.name + REMOVING)
    shutil.rmtree(doomed, ignore_errors=True)  # left by an earlier crash
    os.replace(path, doomed)
    killed_midway = resilience.fault_active("kill_in_remove", step_of(path))
    for file in sorted(p for p in doomed.rglob("*") if p.is_file()):
        file.unlink()
        if killed_midway:
            resilience.kill_self()
    shutil.rmtree(doomed, ignore_errors=True)


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def digest(folder: Path, names: list[str]) -> dict[str, dict[str, int]]:
    """Size and checksum of each file, several files at a time (both checksums release the GIL)."""
    kind = checksums.saved_kind()
    with ThreadPoolExecutor(max_workers=writer_threads()) as pool:
        sums = list(pool.map(lambda path: checksums.checksum_of(path, kind), [folder / name for name in names]))
    return {name: {"size": (folder / name).stat().st_size, kind: value} for name, value in zip(names, sums)}


def _within_cpus(threads: int) -> int:
    """`threads`, or fewer: as many as the CPUs this rank may use (under Slurm, its task's), at least one."""
    return max(1, min(threads, len(os.sched_getaffinity(0))))


def writer_threads() -> int:
    """Threads (and files) per rank for writing and digesting shards: up to 8, within the CPUs the
    rank may use."""
    return _within_cpus(8)


def reader_threads() -> int:
    """Threads per rank for reading shards: up to 16, within the CPUs the rank may use. Each thread's copy from
    the page cache into pinned memory is one core's work: on a GPU host of 16 cores, 16 threads read the 1B
    shape's 17 GiB in 0.92-1.04 s, 8 in 1.02-1.19 s (bench/NOTES.md, attempt 47)."""
    return _within_cpus(16)


def save_shards(state: dict[str, Any], partial: Path, group: dist.ProcessGroup | None = None) -> dict[str, dict[str, int]]:
    """Write this rank's shards with several threads; returns the digests of the files it wrote."""
    writer = dcp.FileSystemWriter(str(partial), thread_count=writer_threads())
    dcp.save(state, storage_writer=writer, process_group=group)
    return digest(partial, written_by(partial, dist.get_rank()))


def written_by(folder: Path, rank: int) -> list[str]:
    """The files of a checkpoint folder that `rank` wrote: its DCP shards and its RNG state
    (rank 0 also wrote DCP's .metadata)."""
    names = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    return [name for name in names if writer_of(name) == rank]


def writer_of(name: str) -> int | None:
    """The rank that wrote a checkpoint file (`__R_I.distcp`, `rng/rankR.pt`; rank 0 `.metadata`)."""
    if name == ".metadata":
        return 0
    match = _WRITER.fullmatch(name)
    return int(match.group(1) or match.group(2)) if match else None


_WRITER = re.compile(r"__(\d+)_\d+\.distcp|rng/rank(\d+)\.pt")


def share_of(manifest: dict[str, Any], rank: int, world_size: int) -> list[str]:
    """The files of a checkpoint that rank of world_size checks: those it wrote, where as many ranks wrote
    it, and rank 0 those no rank of this job wrote; otherwise every world_size-th file from rank."""
    files = manifest["files"]
    if manifest.get("world_size") != world_size:
        return sorted(files)[rank::world_size]
    writers = {name: writer_of(name) for name in files}
    return sorted(name for name, writer in writers.items()
                  if writer == rank or (rank == 0 and (writer is None or writer >= world_size)))


def problems(path: Path, rank: int = 0, world_size: int = 1,
             passed: Callable[[Path], None] | None = None, manifest: dict[str, Any] | None = None) -> list[str]:
    """What is wrong with a checkpoint folder's files: with world_size ranks checking, rank's share.

    Written by as many ranks as check it, each rank checks the files it wrote, which are those it will
    load (on a node of its own, the read leaves them in that node's page cache); otherwise every
    world_size-th file from rank. `passed` is called with each shard file that passes, in the checking thread.
    `manifest` is the folder's manifest where the caller has read it already.
    """
    try:
        manifest = manifest if manifest is not None else read_manifest(path)
        files = manifest["files"]
    except (OSError, ValueError, KeyError) as err:
        return [f"unreadable manifest ({err})"]
    share = share_of(manifest, rank, world_size)

    def problem(name: str) -> str | None:
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != files[name]["size"]:
            return f"{name} has {file.stat().st_size} bytes, not {files[name]['size']}"
        kind = next((kind for kind in checksums.EXTEND if kind in files[name]), None)
        if kind is None:
            return f"{name} has no checksum in the manifest"
        if checksums.checksum_of(file, kind) != files[name][kind]:
            return f"{name} fails its checksum"
        if passed is not None and name.endswith(".distcp"):
            passed(file)
        return None

    # Several files at a time, as they were written: one after the other, a resume of the 1B shape
    # spent 12 s on its 17 GiB of checksums.
    with ThreadPoolExecutor(max_workers=writer_threads()) as pool:
        return [p for p in pool.map(problem, share) if p]


class VerifyAhead:
    """This rank's share of the newest complete checkpoint's check (`problems`), in a background thread
    started before the process group exists: a requeued job's start-up then overlaps it.

    `verify` takes its result for that folder; any other folder (an older one after a damaged newest,
    or one `tidy` published meanwhile) is checked when asked. With `registered`, each shard file that
    passes is registered with CUDA for the load (`shard_reader.RegisteredFiles`).
    """

    def __init__(self, root: Path, rank: int, world_size: int, registered: RegisteredFiles | None = None) -> None:
        found = complete_checkpoints(root)
        self.path: Path | None = found[-1] if found else None
        self._result: Future | None = None
        self._manifest: dict[str, Any] | None = None
        self._registered, self._rank, self._world_size = registered, rank, world_size
        self._span = (0.0, 0.0)  # when the check began and ended (perf_counter)
        if self.path is not None:
            try:  # read once, here, for `registers_all` and the check; an unreadable one the check reports
                self._manifest = read_manifest(self.path)
            except (OSError, ValueError):
                pass
            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-verify")
            self._result = pool.submit(self._check)
            pool.shutdown(wait=False)

    def _check(self) -> list[str]:
        began = time.perf_counter()
        found = problems(self.path, self._rank, self._world_size,
                         self._registered.add if self._registered is not None else None, self._manifest)
        self._span = (began, time.perf_counter())
        return found

    def registers_all(self) -> bool:
        """Whether this rank's load can take every shard file it reads registered: the checkpoint was written
        by as many ranks (each then loads the files it wrote and checks) and they fit the registration
        budget. Where not, the load reads through pinned buffers, which are best reserved ahead."""
        manifest = self._manifest
        if manifest is None or self._registered is None:
            return False
        if manifest.get("world_size") != self._world_size:  # resharded: pieces of files no rank registered
            return False
        try:
            share = share_of(manifest, self._rank, self._world_size)
            size = sum(manifest["files"][name]["size"] for name in share if name.endswith(".distcp"))
        except KeyError:
            return False
        return size <= self._registered.budget

    def problems_of(self, path: Path) -> list[str] | None:
        """This rank's problems with `path` if it was checked ahead (waiting for the check), else None."""
        if self._result is None or path != self.path:
            return None
        asked = time.perf_counter()
        found = self._result.result()
        log.info("checkpoint %s checked ahead: %s", path.name, check_summary(self._share_bytes(), *self._span, asked))
        return found

    def _share_bytes(self) -> tuple[int, int]:
        """The files this rank checks and their bytes, by the manifest ((0, 0) where it is unreadable)."""
        try:
            share = share_of(self._manifest, self._rank, self._world_size)
            return len(share), sum(self._manifest["files"][name]["size"] for name in share)
        except (TypeError, KeyError):
            return 0, 0

    def registrations(self, path: Path | None) -> dict[str, Registration]:
        """The registered files of `path` for its load (which releases them); for another folder, or None when
        nothing is loaded, none (and those registered are released)."""
        if self._registered is None:
            return {}
        files = self._registered.take()  # taken either way: nothing more is registered once a load starts
        taken = time.perf_counter()
        if self._registered.failure:
            log.info("checkpoint files are read through pinned buffers: %s", self._registered.failure)
        if path == self.path:
            log.info("checkpoint files registered with CUDA ahead: %s", self._registered.timing(taken))
            return files
        shard_reader.release_now(files)
        return {}


def check_summary(share: tuple[int, int], began: float, ended: float, asked: float) -> str:
    """For the log: a check ahead's files and bytes (`share`), its seconds, and whether the load, which asked for
    its result at `asked`, waited for it (perf_counter's). Set against the start-up's phases, it says whether a
    requeued start waits for its check or the check runs beside the rest (bench/NOTES.md, attempt 66)."""
    files, size = share
    done = (f"done {asked - ended:.2f} s before the load asked for it" if ended <= asked
            else f"the load waited {ended - asked:.2f} s for it")
    return f"{files} files ({size / 2**30:.1f} GiB) in {ended - began:.2f} s, {done}"


def verify(path: Path, ahead: VerifyAhead | None = None) -> list[str]:
    """Check a checkpoint's files, split across ranks; every rank gets the whole list of problems."""
    mine = ahead.problems_of(path) if ahead is not None else None
    if mine is None:
        mine = problems(path, dist.get_rank(), dist.get_world_size())
    gathered: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, mine)
    return [problem for part in gathered for problem in part]


def set_aside(path: Path) -> Path:
    """Rename a damaged checkpoint so it is never loaded again but stays on disk for inspection."""
    target, n = path.with_name(path.name + DAMAGED), 1
    while target.exists():  # the same step damaged before, e.g. written again after a fallback
        n += 1
        target = path.with_name(f"{path.name}{DAMAGED}-{n}")
    os.replace(path, target)
    return target


@dataclass(frozen=True)
class Published:
    """A checkpoint now on disk: its folder and step, seconds from its start to publication, and how
    long training was held by it (stage_s: in `save`; wait_s: waiting for an asynchronous save's writes)."""

    path: Path
    step: int
    total_s: float
    stage_s: float
    wait_s: float
    asynchronous: bool

    def record(self) -> dict[str, Any]:
        """Its line in metrics.jsonl."""
        record = {"step": self.step, "ckpt_save_s": self.total_s}
        if self.asynchronous:
            record.update(ckpt_stage_s=self.stage_s, ckpt_wait_s=self.wait_s)
        return record


@dataclass
class PendingSave:
    """An asynchronous save whose shards are still being written."""

    partial: Path
    final: Path
    manifest: dict[str, Any]
    upload: Future
    started: float
    stage_s: float = 0.0  # the training loop's time in `save`


class Checkpointer:
    def __init__(self, root: Path, keep: int, async_save: bool = False, device: torch.device | None = None) -> None:
        self.root = root
        self.keep = keep
        self.async_save = async_save
        self.pending: PendingSave | None = None
        self.phases: dict[str, float] = {}  # seconds of the last save's parts, for the log
        self._published: Published | None = None  # the newest save published and not yet collected
        if async_save:
            self._group = _cpu_group()
            self._staging = HostStaging(device or torch.device("cpu"))
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
            self._prepared: Future | None = None

    def prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Allocate the host buffers of asynchronous saves in the background, ahead of the first save.

        Call once the optimizer has state (after the first step). Pinning a model's worth of host
        memory takes seconds; done here it overlaps training instead of blocking the first save.
        """
        if self.async_save and self._prepared is None:
            model_sd, optim_sd = _state_dicts(model, optimizer)
            self._prepared = self._writer.submit(self._staging.allocate, {MODEL_STATE: model_sd, "optim": optim_sd})

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, train_state: dict[str, Any],
             model_cfg: ModelConfig, config_hash: str) -> Path:
        """Write a checkpoint of everything needed to continue exactly; returns its folder.

        Asynchronous: returns once the copy to host memory is under way; the folder appears when
        `collect` finds every rank done. A save still pending is published first. Either way
        `collect` then gives what was published. Raises CheckpointWriteError on every rank alike.
        """
        self._wait()
        started = time.perf_counter()
        final = self.root / step_dir_name(step)
        partial = final.with_name(final.name + PARTIAL)
        rank = dist.get_rank()

        def make_folder() -> None:
            shutil.rmtree(partial, ignore_errors=True)
            (partial / "rng").mkdir(parents=True)

        _on_rank_0(make_folder, f"cannot create {partial}")  # also the barrier before the shards
        barrier_done = time.perf_counter()
        model_sd, optim_sd = _state_dicts(model, optimizer)
        state = {MODEL_STATE: model_sd, "optim": optim_sd}
        self.phases = {"barrier": barrier_done - started, "state dict": time.perf_counter() - barrier_done}
        torch.save(_rng_state(), partial / "rng" / f"rank{rank}.pt")
        if rank == dist.get_world_size() - 1 and resilience.fault_active("peer_dies_in_save", step):
            resilience.kill_self()
        manifest = {"step": step, "world_size": dist.get_world_size(), "config_hash": config_hash,
                    "model_shape": model_shape(model_cfg), "train_state": train_state}
        if self.async_save:
            waiting = time.perf_counter()
            if self._prepared is not None:
                self._prepared.result()  # the buffers are being allocated: never twice at once
            copying = time.perf_counter()
            self.phases["waiting for buffers"] = copying - waiting
            host_state = self._staging.copy(state)
            self.phases["starting the copy"] = time.perf_counter() - copying
            upload = self._writer.submit(self._write, host_state, partial)
            self.pending = PendingSave(partial, final, manifest, upload, started, time.perf_counter() - started)
            return final
        with _writing_shards_into(partial):
            files = save_shards(state, partial)
        self._finish(partial, final, manifest, files)
        seconds = time.perf_counter() - started
        self._published = Published(final, step, seconds, seconds, 0.0, asynchronous=False)
        return final

    def _write(self, host_state: dict[str, Any], partial: Path) -> dict[str, dict[str, int]]:
        """The writer thread: wait for the host copy, then write and digest this rank's shards."""
        self._staging.copied()
        return save_shards(host_state, partial, self._group)

    def wait_for_staging(self) -> None:
        """Hold the state's next update until a pending save has copied it: call before the optimizer step."""
        if self.pending is not None:
            self._staging.hold_updates()

    def collect(self, device: torch.device, wait: bool) -> Published | None:
        """The save published since the last call, if any; a pending asynchronous save is published
        first when every rank has written its shards, or (wait) once they have. A collective: call
        on all ranks."""
        if self.pending is not None and (wait or not all_agree(not self.pending.upload.done(), device)):
            self._wait()
        published, self._published = self._published, None
        return published

    def _wait(self) -> None:
        """Finish and publish a pending asynchronous save, if there is one."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        waited = time.perf_counter()
        with _writing_shards_into(pending.partial):
            files = pending.upload.result()
        self._finish(pending.partial, pending.final, pending.manifest, files)
        now = time.perf_counter()
        self._published = Published(pending.final, pending.manifest["step"], now - pending.started, pending.stage_s,
                                     now - waited, asynchronous=True)

    def _finish(self, partial: Path, final: Path, manifest: dict[str, Any], files: dict[str, dict[str, int]]) -> None:
        """Once every rank has written (and digested) its files: write the manifest, publish by renaming."""
        rank = dist.get_rank()
        if resilience.fault_active("kill_in_save", manifest["step"]):
            resilience.kill_self()
        gathered: list[dict] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, files)
        manifest["files"] = {name: info for part in gathered for name, info in part.items()}
        _on_rank_0(lambda: self._publish(partial, final, manifest), f"cannot publish {final}")
        if rank == 0:
            try:
                self._prune()
            except OSError as error:  # the new checkpoint is safe; old ones are left for the next save
                log.warning("could not remove old checkpoints (%s): %s", error.filename, error.strerror or error)

    def _publish(self, partial: Path, final: Path, manifest: dict[str, Any]) -> None:
        tmp = partial / (MANIFEST + ".tmp")
        with tmp.open("w") as f:
            json.dump(manifest, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, partial / MANIFEST)
        if final.exists():  # the same step saved again; a crash here leaves the new one to `tidy`
            remove(final)
        os.replace(partial, final)

    def _prune(self) -> None:
        for old in complete_checkpoints(self.root)[: -self.keep]:
            remove(old)

    def load(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             registered: dict[str, Registration] | None = None) -> dict[str, Any]:
        """Restore model, optimizer and this rank's RNG; returns the saved training state. Copies from
        `registered` files may still run when it returns: training's stream waits for them."""
        model_sd, optim_sd = _state_dicts(model, optimizer)
        state = {MODEL_STATE: model_sd, "optim": optim_sd}
        reader = ParallelReader(path, threads=reader_threads(), registered=registered)
        dcp.load(state, storage_reader=reader)
        unloaded = reader.not_requested()
        if unloaded:
            raise CheckpointError(
                f"{path} holds {len(unloaded)} entries that this job's model and optimizer do not take "
                f"({', '.join(unloaded[:3])}{', ...' if len(unloaded) > 3 else ''}): resuming without them would not "
                "continue the run as it was (an optimizer that loads no moments starts them again from zero). "
                "The checkpoint is unchanged; this is a fault of pretrain's state, not of the files: report it "
                "with this message")
        counts = reader.counts  # the load's time is logged by its caller, with the step it resumed
        log.info("%s: %d tensors (%.1f GiB) read as raw bytes, %d of them copied by the GPU from the page cache; "
                 "%d items through torch.load", path.name, counts.direct, counts.direct_bytes / 2**30,
                 counts.registered, counts.through_dcp)
        set_state_dict(model, optimizer, model_state_dict=state[MODEL_STATE], optim_state_dict=state["optim"])
        rng_file = path / "rng" / f"rank{dist.get_rank()}.pt"
        if rng_file.is_file():  # absent when resuming with more processes than saved
            _set_rng_state(torch.load(rng_file, weights_only=False))
        return read_manifest(path)["train_state"]


def _state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """What a checkpoint holds of the model and the optimizer: plain tensors, never a class of torchao's."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return plain_tensors(model_sd), optim_sd


@contextmanager
def _writing_shards_into(partial: Path) -> Iterator[None]:
    """Raise a failed write of the shards as CheckpointWriteError (DCP raises the same CheckpointException on
    every rank). A peer that died or timed out meanwhile is not a write error: its error passes unchanged,
    so the job ends as for any broken collective and is requeued (see collective_failed)."""
    try:
        yield
    except Exception as error:
        if collective_failed(error):
            raise
        raise CheckpointWriteError(f"writing the shards into {partial} failed: {_first_line(error)}") from error


def _first_line(error: BaseException) -> str:
    """The cause of an error in one line, e.g. "[Errno 30] Read-only file system: '...'"."""
    failures = getattr(error, "failures", None)  # DCP's CheckpointException: {rank: (exception, traceback)}
    if failures:
        first = next(iter(failures.values()))
        error = first[0] if isinstance(first, tuple) else first
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _cpu_group() -> dist.ProcessGroup:
    """A gloo group of its own for the background thread of asynchronous saves.

    The writer thread's collectives (DCP's planning and metadata exchange) run beside training's:
    two threads must never share a group, their order could differ between ranks; and gloo
    keeps them off the GPU.
    """
    return dist.new_group(backend="gloo")
