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
"""

from __future__ import annotations

import collections
import ctypes
import io
import math
import os
import pickle
import struct
import sys
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

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

    def add(self, other: ReadCounts) -> None:
        self.direct += other.direct
        self.direct_bytes += other.direct_bytes
        self.through_dcp += other.through_dcp


class ParallelReader(dcp.FileSystemReader):
    """DCP's file reader, with `threads` threads reading and tensors read as raw bytes where they can be."""

    def __init__(self, path: str | os.PathLike, threads: int) -> None:
        super().__init__(path)
        self.threads = threads
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
            for part in parts:
                self.counts.add(part.result())
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

    def _read_run(self, plan: LoadPlan, name: str, items: list[ReadItem], planner: LoadPlanner) -> ReadCounts:
        """Read a run of one file's items: the raw ones here, the rest through FileSystemReader.read_data."""
        counts, rest, done = ReadCounts(), [], []
        reading = _FileReading(str(self.fs.concat_path(self.path, name)))
        try:
            for item in items:
                direct = self._direct_read(item, planner, reading.fd)
                if direct is None:
                    rest.append(item)
                    continue
                target, start = direct
                reading.read_into(target, start)
                done.append((item, target))
                counts.direct += 1
                counts.direct_bytes += target.nbytes
            reading.finish()
        finally:
            reading.close()
        for item, target in done:
            planner.commit_tensor(item, target)
        if rest:
            super().read_data(replace(plan, items=rest), planner).wait()
            counts.through_dcp = len(rest)
        return counts

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


class _FileReading:
    """One file's direct reads: its descriptor and, for GPU targets, a stream and two pinned buffers."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        self.stream: torch.cuda.Stream | None = None
        self.buffers: list[torch.Tensor] = []
        self.copied: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0

    def read_into(self, target: torch.Tensor, start: int) -> None:
        if target.nbytes == 0:
            return
        if target.device.type == "cpu":
            _read_exactly(self.fd, _memory_of(target), start)
        else:
            self._read_into_gpu(target, start)

    def _read_into_gpu(self, target: torch.Tensor, start: int) -> None:
        """Each chunk read into the pinned buffer whose copy finished, then copied on this file's stream."""
        if self.stream is None:
            self.stream = torch.cuda.Stream(target.device)
            self.stream.wait_stream(torch.cuda.current_stream(target.device))  # the target's last writes
            self.buffers = [torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        flat = target.view(-1).view(torch.uint8)
        with torch.cuda.stream(self.stream):
            for done in range(0, target.nbytes, CHUNK_BYTES):
                n = min(CHUNK_BYTES, target.nbytes - done)
                turn, self.turn = self.turn, 1 - self.turn
                if self.copied[turn] is not None:
                    self.copied[turn].synchronize()
                buffer = self.buffers[turn]
                _read_exactly(self.fd, _memory_of(buffer)[:n], start + done)
                flat[done:done + n].copy_(buffer[:n], non_blocking=True)
                self.copied[turn] = self.stream.record_event()

    def finish(self) -> None:
        """Wait for the copies into the GPU: the targets are then ready for any stream."""
        if self.stream is not None:
            self.stream.synchronize()

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
