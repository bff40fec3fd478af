"""Reading a rank's DCP shard files fast: several files at a time, each tensor's bytes straight into its target.

DCP's FileSystemReader reads one file after the other, and each tensor with torch.load, which unpickles
it into a new CPU tensor, before copying that into its target; into a GPU, that copy leaves from pageable
memory. A requeued job of the 1B shape spent 4 s of its start on its 17 GiB that way (bench/NOTES.md,
attempts 18-25 and 29). Here `threads` threads share the reading: each file's items are split into runs
of about equal bytes, a run to a thread, so a rank with fewer files than CPUs still uses them. A tensor
whose stored bytes are the bytes its target holds (same dtype, a whole stored chunk or whole rows of it,
a contiguous target) is read with os.preadv,
which releases the GIL while it reads: on the CPU into the target itself, into a GPU through two pinned
buffers that take turns, copied by a CUDA stream of the thread's own. Anything else (byte items, a load
that reshards across columns, a dtype change, a file format this module does not know) goes through
FileSystemReader's own path, unchanged.

A file registered with CUDA ahead of the load (`RegisteredFiles`: mapped read-only, its page-cache pages
locked) goes into the GPU without any of that: one asynchronous copy a tensor, by the GPU's copy engine,
which training's stream waits for instead of the host, so the load returns while the bytes still travel.
"""

from __future__ import annotations

import collections
import ctypes
import io
import math
import mmap
import os
import pickle
import struct
import sys
import threading
import time
import warnings
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from pretrain import hosts

# Bytes a pinned buffer holds. Two per reading thread, up to 16 threads per rank, keep 512 MiB of pinned host
# memory during a load (afterwards torch's host allocator keeps it for later pinned buffers). Pinning more
# at the job's start slowed its process group's set-up by about as much as the load then saved (attempt 47).
CHUNK_BYTES = 16 << 20


@dataclass
class ReadCounts:
    """What a load read: tensors straight into their targets (and their bytes), and items DCP's own path read."""

    direct: int = 0
    direct_bytes: int = 0
    through_dcp: int = 0
    registered: int = 0  # of the direct ones, those the GPU copied from registered files

    def add(self, other: ReadCounts) -> None:
        self.direct += other.direct
        self.direct_bytes += other.direct_bytes
        self.through_dcp += other.through_dcp
        self.registered += other.registered


class ParallelReader(dcp.FileSystemReader):
    """DCP's file reader, with `threads` threads reading and tensors read as raw bytes where they can be."""

    def __init__(self, path: str | os.PathLike, threads: int,
                 registered: dict[str, Registration] | None = None) -> None:
        super().__init__(path)
        self.threads = threads
        self.registered = registered or {}  # resolved file path -> its registration, taken for this load
        self.counts = ReadCounts()
        self._dtypes: dict[str, torch.dtype] = {}
        self._saved: set[str] = set()
        self._requested: set[str] | None = None

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._saved = set(metadata.state_dict_metadata)
        self._dtypes = {fqn: md.properties.dtype for fqn, md in metadata.state_dict_metadata.items()
                        if isinstance(md, TensorStorageMetadata)}

    def not_requested(self) -> list[str]:
        """The checkpoint's entries that the state loaded into did not ask for (DCP ignores them), after a load.

        DCP refuses a state that asks for what a checkpoint lacks, but says nothing of the reverse: an optimizer
        without state, for one, loads the weights alone, and the run goes on from fresh moments. Empty where the
        planner's flattened state is unknown (DCP's default planner keeps it as `state_dict`)."""
        return [] if self._requested is None else sorted(self._saved - self._requested)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        requested = getattr(planner, "state_dict", None)
        self._requested = set(requested) if isinstance(requested, dict) else None
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        runs_per_file = -(-self.threads // max(1, len(per_file)))
        with ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="checkpoint-read") as pool:
            parts = [pool.submit(self._read_run, plan, name, run, planner)
                     for name, items in per_file.items() for run in self._runs(items, runs_per_file)]
            copies = []
            for part in parts:
                counts, copied = part.result()
                self.counts.add(counts)
                copies += [copied] if copied is not None else []
        for event, device in copies:  # training's stream, not the host, waits for the copies from registered files
            torch.cuda.current_stream(device).wait_event(event)
        _release_after([event for event, _ in copies], self.registered)
        self.registered = {}  # released once those copies are done: no later read may use them
        future: torch.futures.Future[None] = torch.futures.Future()
        future.set_result(None)
        return future

    def _runs(self, items: list[ReadItem], count: int) -> list[list[ReadItem]]:
        """A file's items in up to `count` runs of consecutive items with about equal stored bytes each."""
        sizes = [self.storage_data[item.storage_index].length for item in items]
        share, runs, run, filled = sum(sizes) / count, [], [], 0
        for item, size in zip(items, sizes):
            if run and filled + size / 2 > share * (len(runs) + 1) and len(runs) < count - 1:
                runs.append(run)
                run = []
            run.append(item)
            filled += size
        return runs + [run] if run else runs

    def _read_run(self, plan: LoadPlan, name: str, items: list[ReadItem],
                  planner: LoadPlanner) -> tuple[ReadCounts, tuple[torch.cuda.Event, torch.device] | None]:
        """Read a run of one file's items: the raw ones here, the rest through FileSystemReader.read_data.
        Returns what it read and, where it copied from a registered file, the event of those copies."""
        counts, rest, done = ReadCounts(), [], []
        path = str(self.fs.concat_path(self.path, name))
        reading = _FileReading(path, self.registered.get(str(Path(path).resolve())))
        try:
            for item in items:
                direct = self._direct_read(item, planner, reading.fd)
                if direct is None:
                    rest.append(item)
                    continue
                target, start = direct
                counts.registered += reading.read_into(target, start)
                done.append((item, target))
                counts.direct += 1
                counts.direct_bytes += target.nbytes
            copied = reading.finish()
        finally:
            reading.close()
        for item, target in done:
            planner.commit_tensor(item, target)
        if rest:
            super().read_data(replace(plan, items=rest), planner).wait()
            counts.through_dcp = len(rest)
        return counts, copied

    def _direct_read(self, item: ReadItem, planner: LoadPlanner, fd: int) -> tuple[torch.Tensor, int] | None:
        """The target and the file offset of the item's first byte, when its bytes can be read as they lie."""
        info = self.storage_data[item.storage_index]
        if item.type != LoadItemType.TENSOR or getattr(info, "transform_descriptors", None):
            return None
        target = planner.resolve_tensor(item).detach()
        if (target.device.type not in ("cpu", "cuda") or not target.is_contiguous()
                or target.dtype != self._dtypes.get(item.storage_index.fqn)
                or tuple(target.shape) != tuple(item.lengths)):
            return None
        stored = locate_tensor(fd, info.offset, info.length)
        if stored is None or stored.nbytes != math.prod(stored.size) * target.element_size():
            return None
        rows_from = _rows_from(stored.size, tuple(item.storage_offsets), tuple(item.lengths))
        if rows_from is None:
            return None
        row_bytes = stored.nbytes // stored.size[0] if stored.size and stored.size[0] else 0
        return target, stored.start + rows_from * row_bytes


def _rows_from(size: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...]) -> int | None:
    """The first row of a request that is whole rows of the stored tensor (so one byte range), else None."""
    if len(offsets) != len(size) or len(lengths) != len(size):
        return None
    if not size:
        return 0
    if offsets[1:] != (0,) * (len(size) - 1) or lengths[1:] != size[1:] or offsets[0] + lengths[0] > size[0]:
        return None
    return offsets[0]


@dataclass(frozen=True)
class StoredTensor:
    """Where a torch.save'd contiguous tensor's bytes lie in a file, and its shape."""

    start: int
    nbytes: int
    size: tuple[int, ...]


def locate_tensor(fd: int, offset: int, length: int) -> StoredTensor | None:
    """Find the bytes of the tensor torch.save wrote at [offset, offset + length) of a file.

    torch.save writes a zip archive whose data/0 record holds the storage's bytes, uncompressed, and whose
    data.pkl says how the tensor views them. Only a tensor that is its whole storage, in row-major order and
    in this machine's byte order, is located; for anything else (None) the caller uses torch.load.
    """
    try:
        with zipfile.ZipFile(_FileRange(fd, offset, length)) as archive:
            records = {name.split("/", 1)[1]: archive.getinfo(name) for name in archive.namelist() if "/" in name}
            prefix = archive.namelist()[0].split("/", 1)[0]
            data = records.get("data/0")
            if (data is None or data.compress_type != zipfile.ZIP_STORED
                    or [name for name in records if name.startswith("data/")] != ["data/0"]
                    or archive.read(f"{prefix}/byteorder").decode() != sys.byteorder):
                return None
            layout = _TensorLayout(io.BytesIO(archive.read(f"{prefix}/data.pkl"))).load()
        header = os.pread(fd, 30, offset + data.header_offset)
    except (zipfile.BadZipFile, KeyError, ValueError, pickle.UnpicklingError, EOFError, TypeError, IndexError):
        return None
    if (not isinstance(layout, _Layout) or len(header) != 30 or header[:4] != b"PK\x03\x04"
            or not layout.whole_storage()):
        return None
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return StoredTensor(offset + data.header_offset + 30 + name_len + extra_len, data.file_size, layout.size)


@dataclass(frozen=True)
class _Layout:
    """How a pickled tensor views its storage (the arguments of torch._utils._rebuild_tensor_v2)."""

    storage: tuple
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    def whole_storage(self) -> bool:
        row_major, step = [], 1
        for extent in reversed(self.size):
            row_major.insert(0, step)
            step *= extent
        # the persistent id: ("storage", storage type, key, location, number of elements)
        return (self.storage[2] == "0" and self.storage_offset == 0 and self.storage[4] == math.prod(self.size)
                and all(a == b for a, b, extent in zip(self.stride, row_major, self.size) if extent > 1))


def _layout(storage: tuple, storage_offset: int, size: tuple, stride: tuple, *_: Any) -> _Layout:
    return _Layout(storage, storage_offset, tuple(size), tuple(stride))


class _TensorLayout(pickle.Unpickler):
    """Unpickles a torch.save'd plain tensor into its _Layout; anything else is refused (UnpicklingError)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _layout
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name.endswith("Storage"):
            return name
        raise pickle.UnpicklingError(f"not a plain tensor: {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError("not a tensor's storage")
        return pid


class _FileRange(io.RawIOBase):
    """A read-only, seekable view of bytes [offset, offset + length) of an open file (for zipfile)."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        super().__init__()
        self.fd, self.offset, self.length, self.position = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.length}[whence]
        self.position = max(0, base + position)
        return self.position

    def readinto(self, buffer: Any) -> int:
        wanted = max(0, min(len(buffer), self.length - self.position))
        got = os.preadv(self.fd, [memoryview(buffer)[:wanted]], self.offset + self.position) if wanted else 0
        self.position += got
        return got


def reserve_pinned_buffers(device: torch.device, threads: int) -> None:
    """Pin the host memory of a load's buffers (two per file of `threads`) and hand it to torch's pinned-memory
    cache, where the load's own buffers then come from. Pinning takes the driver a while; in a background
    thread from the job's first moments, a requeued job's load does not wait for it."""
    torch.cuda.set_device(device)  # a new thread starts on GPU 0: no context there for another GPU's rank
    buffers = [torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2 * threads)]
    del buffers


# cudaHostRegister's flag for host memory the GPU only reads: what a read-only mapping of a file allows.
_READ_ONLY = 0x08


class Registration:
    """A checkpoint file mapped read-only and registered with CUDA: its pages stay in memory (the page cache's
    own, not a copy), and the GPU's copy engine reads them by DMA as it reads pinned memory."""

    def __init__(self, path: Path, device: torch.device) -> None:
        self.size, self.device = path.stat().st_size, device
        fd = os.open(path, os.O_RDONLY)
        try:
            self._mapping = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch's note that it cannot mark a tensor read-only
            self.host = torch.frombuffer(self._mapping, dtype=torch.uint8)
        try:
            torch.cuda.set_device(device)  # a new thread starts on GPU 0: no context there for another GPU's rank
            code = int(torch.cuda.cudart().cudaHostRegister(self.host.data_ptr(), self.size, _READ_ONLY))
        except BaseException:
            self._unmap()
            raise
        if code:
            self._unmap()
            raise OSError(f"CUDA cannot register it for copies (cudaError {code})")

    def release(self) -> None:
        """Unregister and unmap; only once every copy from it has finished."""
        torch.cuda.set_device(self.device)  # registered in that GPU's context
        torch.cuda.cudart().cudaHostUnregister(self.host.data_ptr())
        self._unmap()

    def _unmap(self) -> None:
        del self.host  # the mapping's only export: it closes once the tensor is gone
        try:
            self._mapping.close()
        except BufferError:  # a view of it still lives somewhere: the mapping goes with it
            pass


class RegisteredFiles:
    """A requeued job's checkpoint files registered with CUDA (`Registration`) as the check ahead passes each,
    for the load to take: its copies then go from the page cache to the GPU while the host moves on to the
    first step (bench/NOTES.md, attempt 57).

    Registering runs in threads of its own, so the check's result never waits for it. Registered pages cannot
    be reclaimed until released, so files are registered within `budget` bytes only; a file that fails to
    register (a device or file system that does not allow it), or is not registered yet when the load starts,
    is read through pinned buffers as before.
    """

    def __init__(self, device: torch.device, budget: int, threads: int = 2) -> None:
        self.device, self.budget = device, budget
        self._lock = threading.Lock()
        self._files: dict[str, Registration] = {}
        self._used = 0
        self._taken = False
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="checkpoint-register")
        self._spans: list[tuple[float, float, int]] = []  # (began, ended, bytes) of each file registered in time
        self.failure: str | None = None

    def add(self, path: Path) -> None:
        """Queue one file for registering (registering waits on the kernel, which pins its pages)."""
        self._pool.submit(self._register, path)

    def _register(self, path: Path) -> None:
        size = path.stat().st_size
        with self._lock:
            if self._taken or self.failure or size == 0 or self._used + size > self.budget:
                return
            self._used += size
        began = time.perf_counter()
        try:
            registration = Registration(path, self.device)
        except Exception as err:  # noqa: BLE001 - whatever stops it, the load reads the file as before
            with self._lock:
                self._used -= size
                self.failure = self.failure or f"{path.name}: {err}"
            return
        with self._lock:
            if not self._taken:
                self._files[str(path.resolve())] = registration
                self._spans.append((began, time.perf_counter(), size))
                return
        registration.release()  # the load started meanwhile and reads this file as before

    def take(self) -> dict[str, Registration]:
        """The files registered so far, for one load, which releases them; any registered later is released at
        once, and none is queued after this."""
        with self._lock:
            self._taken = True
            files, self._files = self._files, {}
        self._pool.shutdown(wait=False)
        return files

    def timing(self, now: float) -> str:
        """For the log, at the load (`now`, perf_counter): the files registered in time (`registering_summary`)."""
        with self._lock:
            return registering_summary(list(self._spans), now)


def registering_summary(spans: list[tuple[float, float, int]], now: float) -> str:
    """How many files were registered, of how many bytes, the seconds the registering threads spent, and when it
    began and ended before `now` (the load). Set against the start-up's phases, it says what a requeued start waits
    for (bench/NOTES.md, attempt 65). `spans` are (began, ended, bytes), perf_counter's."""
    if not spans:
        return "none registered in time"
    seconds = [end - start for start, end, _ in spans]
    began, ended = min(start for start, _, _ in spans), max(end for _, end, _ in spans)
    return (f"{len(spans)} files ({sum(size for _, _, size in spans) / 2**30:.1f} GiB), {sum(seconds):.2f} s of "
            f"registering (longest {max(seconds):.2f} s), begun {now - began:.2f} s and done {now - ended:.2f} s "
            "before the load")


def memory_budget(local_ranks: int, proc: Path = Path("/proc"), cgroups: Path = Path("/sys/fs/cgroup")) -> int:
    """Bytes one of `local_ranks` ranks may keep registered: half of what the node's memory and the job's memory
    cgroups leave free, shared out (none where the node's free memory cannot be read).

    Registered pages cannot be reclaimed. Under a cgroup's limit (Slurm's --mem, enforced by its cgroup plugin)
    page cache counts against the job, so pinning more than the limit leaves would get the job killed for
    memory at every requeue, where the cache alone would have been given back."""
    left = hosts.memory_left(proc, cgroups)
    return 0 if left is None else left // (2 * max(1, local_ranks))


def release_now(registered: dict[str, Registration]) -> None:
    """Release registrations no copy has used."""
    for registration in registered.values():
        registration.release()


def _release_after(copies: list[torch.cuda.Event], registered: dict[str, Registration]) -> None:
    """Release a load's registrations once its copies have finished, in a thread that waits for them."""
    if not registered:
        return

    def release() -> None:
        for event in copies:
            event.synchronize()
        for registration in registered.values():
            registration.release()

    threading.Thread(target=release, name="checkpoint-unregister", daemon=True).start()


class _FileReading:
    """One file's direct reads: its descriptor and, for GPU targets, a stream and either the file's registration
    or two pinned buffers."""

    def __init__(self, path: str, registration: Registration | None = None) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        self.registration = registration
        self.stream: torch.cuda.Stream | None = None
        self.buffers: list[torch.Tensor] = []
        self.copied: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0
        self.asynchronous = False

    def read_into(self, target: torch.Tensor, start: int) -> bool:
        """Read the target's bytes from `start`; True where the GPU copies them from the registration."""
        if target.nbytes == 0:
            return False
        if target.device.type == "cpu":
            _read_exactly(self.fd, _memory_of(target), start)
        elif self.registration is not None and start + target.nbytes <= self.registration.size:
            self._copy_registered(target, start)
            return True
        else:
            self._read_into_gpu(target, start)
        return False

    def _stream_for(self, target: torch.Tensor) -> torch.cuda.Stream:
        if self.stream is None:
            self.stream = torch.cuda.Stream(target.device)
            self.stream.wait_stream(torch.cuda.current_stream(target.device))  # the target's last writes
        return self.stream

    def _copy_registered(self, target: torch.Tensor, start: int) -> None:
        """One copy by the GPU's copy engine from the registered file's pages; nothing waits for it here."""
        stream = self._stream_for(target)
        with torch.cuda.stream(stream):
            target.view(-1).view(torch.uint8).copy_(self.registration.host[start:start + target.nbytes],
                                                     non_blocking=True)
        self.asynchronous = True

    def _read_into_gpu(self, target: torch.Tensor, start: int) -> None:
        """Each chunk read into the pinned buffer whose copy finished, then copied on this file's stream."""
        stream = self._stream_for(target)
        if not self.buffers:
            self.buffers = [torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        flat = target.view(-1).view(torch.uint8)
        with torch.cuda.stream(stream):
            for done in range(0, target.nbytes, CHUNK_BYTES):
                n = min(CHUNK_BYTES, target.nbytes - done)
                turn, self.turn = self.turn, 1 - self.turn
                if self.copied[turn] is not None:
                    self.copied[turn].synchronize()
                buffer = self.buffers[turn]
                _read_exactly(self.fd, _memory_of(buffer)[:n], start + done)
                flat[done:done + n].copy_(buffer[:n], non_blocking=True)
                self.copied[turn] = stream.record_event()

    def finish(self) -> tuple[torch.cuda.Event, torch.device] | None:
        """Without copies from a registration, wait for the copies into the GPU: the targets are then ready for
        any stream. With them, the event a stream of the device must wait for before it uses the targets."""
        if self.stream is None:
            return None
        if self.asynchronous:
            return self.stream.record_event(), self.stream.device
        self.stream.synchronize()
        return None

    def close(self) -> None:
        os.close(self.fd)


def _memory_of(tensor: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes."""
    return memoryview((ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr())).cast("B")


def _read_exactly(fd: int, into: memoryview, offset: int) -> None:
    """Fill `into` from the file at `offset` (a read returns at most 2 GiB on Linux, so in several reads)."""
    while into:
        got = os.preadv(fd, [into], offset)
        if got == 0:
            raise EOFError(f"a checkpoint file ended at byte {offset}, inside a tensor it should hold")
        into, offset = into[got:], offset + got
