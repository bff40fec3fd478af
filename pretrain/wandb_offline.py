"""A run's offline W&B data on disk: its fragments, and the records in each.

W&B writes an offline run to RUN/wandb/offline-run-DATE_TIME-ID/run-ID.wandb. Each attempt of
a requeued or resumed job opens the same W&B run again and writes a new folder: a fragment of
the run. `wandb sync` uploads the fragments of one run in order and, once one is uploaded,
leaves a `run-ID.wandb.synced` marker beside it.

A .wandb file is a LevelDB-style log (what wandb-core writes; wandb 0.31 ships no Python reader
for it): a 7-byte header, then 32 KiB blocks of chunks, each with a CRC-32, a length and a type
(a whole record, or its first, middle or last piece). A record is a serialized
`wandb.proto.wandb_internal_pb2.Record`. Reading stops at the first incomplete or damaged chunk:
the end of a log that is still being written, or that of a job killed mid-write.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HEADER = struct.Struct("<4sHB")
HEADER_IDENT, HEADER_MAGIC = b":W&B", 0xBEE1
CHUNK = struct.Struct("<IHB")
BLOCK_SIZE = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
# How much of a log's end `is_closed` reads: the exit record is small and among the last written.
TAIL_BLOCKS = 2


class WandbFileError(ValueError):
    """Not a .wandb log this reader understands."""


def fragments(run_dir: Path) -> list[Path]:
    """The run's offline .wandb files, oldest attempt first (folder names start with the start time)."""
    return sorted((Path(run_dir) / "wandb").glob("offline-run-*/run-*.wandb"), key=lambda p: p.parent.name)


def is_synced(fragment: Path) -> bool:
    return fragment.with_name(fragment.name + ".synced").exists()


def mark_synced(fragment: Path) -> None:
    """Write the marker `wandb sync` leaves, so that it skips this fragment from now on."""
    fragment.with_name(fragment.name + ".synced").touch()


def read_records(path: Path, tail_blocks: int | None = None) -> Iterator[Any]:
    """The Record protos of a .wandb file, in order; with tail_blocks, only those starting in its last blocks."""
    from wandb.proto import wandb_internal_pb2

    with Path(path).open("rb") as f:
        _check_header(path, f.read(HEADER.size))
        start = HEADER.size
        if tail_blocks is not None:
            size = f.seek(0, 2)
            start = max(start, (size // BLOCK_SIZE - tail_blocks + 1) * BLOCK_SIZE)
        f.seek(start)
        data = f.read()
    for payload in _payloads(data, start):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        yield record


def _check_header(path: Path, header: bytes) -> None:
    if len(header) < HEADER.size:
        raise WandbFileError(f"{path}: too short for a .wandb header")
    ident, magic, _version = HEADER.unpack(header)
    if ident != HEADER_IDENT or magic != HEADER_MAGIC:
        raise WandbFileError(f"{path}: not a .wandb file")


def _payloads(data: bytes, offset: int) -> Iterator[bytes]:
    """Reassembled records in `data`, which starts at `offset` in the file; pieces of one begun earlier are skipped."""
    pieces: list[bytes] | None = None
    pos = 0
    while True:
        left_in_block = BLOCK_SIZE - (offset + pos) % BLOCK_SIZE
        if left_in_block < CHUNK.size:  # a block's last bytes are padding when no chunk header fits
            pos += left_in_block
        if pos + CHUNK.size > len(data):
            return
        checksum, length, kind = CHUNK.unpack_from(data, pos)
        body = data[pos + CHUNK.size: pos + CHUNK.size + length]
        if len(body) < length or zlib.crc32(body, zlib.crc32(bytes([kind]))) != checksum:
            return
        pos += CHUNK.size + length
        if kind == FULL:
            pieces = None
            yield body
        elif kind == FIRST:
            pieces = [body]
        elif kind == MIDDLE and pieces is not None:
            pieces.append(body)
        elif kind == LAST and pieces is not None:
            yield b"".join(pieces + [body])
            pieces = None


def run_id(fragment: Path) -> str:
    """The W&B run id, from the folder name offline-run-DATE_TIME-ID."""
    return fragment.parent.name.split("-", 3)[3]


def is_closed(fragment: Path) -> bool:
    """Whether the attempt that wrote this fragment finished it (W&B wrote its exit record)."""
    return any(record.HasField("exit") for record in read_records(fragment, tail_blocks=TAIL_BLOCKS))
