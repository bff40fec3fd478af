"""A checkpoint file's checksum, of either kind a manifest records (rundir.CHECKSUM_KINDS).

CRC32C is what saves record: the CPU computes it with an instruction of its own (google-crc32c's compiled
library, 16 GB/s a core on the CPU machine against 3.3 for zlib's CRC32). CRC32 is what manifests written
before attempt 65 hold, and what a save records where google-crc32c has only its pure-Python fallback.

A file is summed where it lies: mapped read-only, its pages in the page cache are read by the sum itself.
Read into the process instead, 16 MiB at a time, each byte was copied into fresh memory before it was summed:
on one GPU a requeued job's check of its 17 GiB ran beside the start-up at a third of its rate alone, and the
start-up's model phase grew (bench/NOTES.md, attempt 66). A file that cannot be mapped is read as before.
Either way the sum runs without the interpreter lock: ctypes releases it around libcrc32c's own function
(google-crc32c's `extend` keeps it for anything but `bytes`), zlib around buffers of more than 5 KiB.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path

import google_crc32c
import torch

from pretrain.rundir import CHECKSUM_KINDS

READ_CHUNK = 1 << 24

# How each kind extends a checksum over bytes that were read (the fallback, and tests' reference).
_EXTEND: dict[str, Callable[[int, bytes], int]] = {
    "crc32c": google_crc32c.extend,
    "crc32": lambda value, chunk: zlib.crc32(chunk, value),
}
EXTEND = {kind: _EXTEND[kind] for kind in CHECKSUM_KINDS}


def saved_kind() -> str:
    """The kind of checksum a save records: CRC32C where google-crc32c's compiled extension is installed."""
    return "crc32c" if google_crc32c.implementation == "c" else "crc32"


@functools.cache
def _crc32c_extend() -> Callable[[int, int, int], int] | None:
    """libcrc32c's `crc32c_extend(crc, address, length)`, which google-crc32c's extension calls: found through the
    extension, whose dependencies `dlsym` searches. None where only the pure-Python fallback is installed."""
    if google_crc32c.implementation != "c":
        return None
    try:
        from google_crc32c import _crc32c

        extend = ctypes.CDLL(_crc32c.__file__).crc32c_extend
    except (ImportError, OSError, AttributeError):  # another build of it: the sum reads as before
        return None
    extend.restype, extend.argtypes = ctypes.c_uint32, [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
    return extend


def checksum_of(path: Path, kind: str | None = None) -> int:
    """The file's checksum of that kind (a key of EXTEND; by default what a save records)."""
    kind = kind or saved_kind()
    with path.open("rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        summed = _sum_mapped(f.fileno(), size, kind) if size else 0
        return summed if summed is not None else _sum_read(f, kind)


def _sum_mapped(fd: int, size: int, kind: str) -> int | None:
    """The checksum of the file's pages, mapped read-only; None where it cannot be mapped, or summed in place."""
    extend = _crc32c_extend() if kind == "crc32c" else None
    if kind == "crc32c" and extend is None:
        return None
    # A requeue on another node finds the file on the shared file system, not in the page cache: read it all
    # ahead, as a read of 16 MiB would be, rather than fault it in a readahead window at a time.
    try:
        os.posix_fadvise(fd, 0, size, os.POSIX_FADV_WILLNEED)
    except OSError:  # advice only
        pass
    try:
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    except (OSError, ValueError):  # a file system that does not map files
        return None
    with mapping:
        if extend is None:
            return zlib.crc32(mapping)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch's note that it cannot mark a tensor read-only
            pages = torch.frombuffer(mapping, dtype=torch.uint8)
        try:
            return int(extend(0, pages.data_ptr(), size))
        finally:
            del pages  # the mapping's only export: it closes once the tensor is gone


def _sum_read(f, kind: str) -> int:
    extend, value = EXTEND[kind], 0
    while chunk := f.read(READ_CHUNK):
        value = extend(value, chunk)
    return value
