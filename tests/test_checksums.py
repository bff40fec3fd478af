"""A checkpoint file's checksum summed in place (mapped read-only), against the same sum over bytes read, and
without the interpreter lock: a requeued job's check runs beside its start-up's Python."""

from __future__ import annotations

import mmap
import threading
import time
import zlib

import google_crc32c
import pytest

from pretrain.trainer import checksums
from pretrain.trainer.checksums import checksum_of


def write(path, size: int, seed: int = 0):
    block = bytes((seed + i * 7) % 251 for i in range(4096))
    with path.open("wb") as f:
        for offset in range(0, size, len(block)):
            f.write(block[:min(len(block), size - offset)])
    return path


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 5 << 20, (16 << 20) + 3])
def test_a_mapped_files_checksums_are_those_of_its_bytes(tmp_path, size):
    path = write(tmp_path / "__0_0.distcp", size, seed=size % 13)
    data = path.read_bytes()
    assert checksum_of(path, "crc32c") == google_crc32c.value(data)
    assert checksum_of(path, "crc32") == zlib.crc32(data)
    assert checksum_of(path) == checksum_of(path, checksums.saved_kind())


def test_a_file_that_cannot_be_mapped_or_a_crc32c_without_its_library_is_summed_as_read(tmp_path, monkeypatch):
    """A file system that refuses to map a file (some FUSE mounts), or google-crc32c built without a library
    ctypes can call: the sums are the same, read 16 MiB at a time."""
    path = write(tmp_path / "__0_0.distcp", (32 << 20) + 17)
    data = path.read_bytes()
    monkeypatch.setattr(checksums, "_crc32c_extend", lambda: None)
    assert checksum_of(path, "crc32c") == google_crc32c.value(data)
    monkeypatch.undo()

    def refuse(*args, **kwargs):
        raise OSError(19, "No such device")

    monkeypatch.setattr(mmap, "mmap", refuse)
    assert checksum_of(path, "crc32c") == google_crc32c.value(data)
    assert checksum_of(path, "crc32") == zlib.crc32(data)


@pytest.mark.parametrize("kind", ["crc32c", "crc32"])
def test_a_sum_in_place_leaves_the_interpreter_to_other_threads(tmp_path, kind):
    """While a thread sums 512 MiB, the main thread runs Python throughout: its longest pause is a fraction of
    the sum's time (holding the lock, as google-crc32c's `extend` does for a mapping, it would be all of it)."""
    path = write(tmp_path / "__0_0.distcp", 512 << 20)
    checksum_of(path, kind)  # into the page cache
    beats: list[float] = []
    span: list[float] = []

    def summing() -> None:
        began = time.perf_counter()
        checksum_of(path, kind)
        span.extend([began, time.perf_counter()])

    thread = threading.Thread(target=summing)
    thread.start()
    while thread.is_alive():
        beats.append(time.perf_counter())
    thread.join()
    began, ended = span
    inside = [t for t in beats if began <= t <= ended]
    longest = max(b - a for a, b in zip([began, *inside], [*inside, ended]))
    assert ended - began > 0.01, "too short a sum to tell"
    assert longest < 0.5 * (ended - began), (longest, ended - began)

