"""What an offline W&B run file holds, read back with wandb's own Record protos, for the tests only.

A .wandb file is a LevelDB-style log (what wandb-core writes; wandb ships no Python reader for it):
a 7-byte header, then 32 KiB blocks of chunks, each with a CRC-32, a length and a type (a whole
record, or its first, middle or last piece). A record is a serialized
`wandb.proto.wandb_internal_pb2.Record`. Reading stops at the first incomplete or damaged chunk.
The format is wandb's private one: the package never reads it (pretrain.tracking.wandb_offline);
the tests do, to check what W&B was sent, and fail loudly if a wandb release changes it.
"""

from __future__ import annotations

import json
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


class WandbFileError(ValueError):
    """Not a .wandb log this reader understands."""



def read_records(path: Path) -> Iterator[Any]:
    """The Record protos of a .wandb file, in order."""
    from wandb.proto import wandb_internal_pb2

    with Path(path).open("rb") as f:
        _check_header(path, f.read(HEADER.size))
        data = f.read()
    for payload in _payloads(data, HEADER.size):
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




def wandb_history(fragment: Path) -> list[dict]:
    """The history rows, in order: the logged values with W&B's _step, _timestamp and _runtime."""
    return [{_item_key(item): json.loads(item.value_json) for item in record.history.item}
            for record in read_records(fragment) if record.HasField("history")]


def wandb_config(fragment: Path) -> dict:
    """The W&B config: the run's initial config, then every update in order."""
    config: dict = {}
    for record in read_records(fragment):
        kind = record.WhichOneof("record_type")
        if kind in ("run", "config"):
            updates = record.run.config if kind == "run" else record.config
            config.update({_item_key(item): json.loads(item.value_json) for item in updates.update})
            for item in updates.remove:
                config.pop(_item_key(item), None)
    return config


def wandb_run_record(fragment: Path):
    """The run record: id, project, group, display name, ..."""
    return next(record.run for record in read_records(fragment) if record.HasField("run"))


def _item_key(item) -> str:
    return item.key or ".".join(item.nested_key)
