"""On-disk layout of a prepared dataset, shared by the writers and the reader.

A prepared dataset is a folder::

    index.json          what the dataset is (tokenizer, dtype) and its shards, in order; written last
    shards/000000.bin   flat token ids, no header: each document followed by the EOS id
    shards/000000.json  the shard's record (tokens, documents, where they came from), once its .bin is complete
    ...
    tokenizer/SHA/      with a Hugging Face tokenizer: a copy of its tokenizer.json (and of the
                        tokenizer_config.json beside it), so the data keeps the tokenizer that made it
                        (SHA: the first 16 hex digits of the file's sha256, which index.json records)

The dataset's token stream is its shards' tokens in index order. The last `val_tokens` of each shard
belong to the validation split, the rest to train. `index.json` is replaced atomically and names
exactly the shards that belong to the dataset: other files in shards/ (those of an interrupted
prepare) are not part of it. Appending input adds shards and rewrites the index.

Format 1 (train.bin, val.bin and meta.json, before shards) is still read: one segment per split.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pretrain.data.errors import DataError

FORMAT_VERSION = 2
INDEX_FILE = "index.json"
SHARDS_DIR = "shards"
SPLITS = ("train", "val")
TOKEN_DTYPES = ("uint16", "uint32")
LEGACY_FORMAT = 1
LEGACY_META_FILE = "meta.json"
TOKENIZER_DIR = "tokenizer"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


@dataclass(frozen=True)
class Segment:
    """`length` tokens of one file, from token `start`: a split is a list of them."""

    file: Path
    start: int
    length: int


def shard_bin(directory: Path, number: int) -> Path:
    return Path(directory) / SHARDS_DIR / f"{number:06d}.bin"


def shard_record(directory: Path, number: int) -> Path:
    return Path(directory) / SHARDS_DIR / f"{number:06d}.json"


def tokenizer_copy(directory: Path, sha256: str) -> Path:
    """The folder of a dataset that holds its copy of the tokenizer files with this sha256."""
    return Path(directory) / TOKENIZER_DIR / sha256[:16]


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds every token id of the vocabulary."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def val_tokens(tokens: int, val_fraction: float) -> int:
    """Tokens of a shard held out for validation: its last `val_fraction`, leaving at least one for training."""
    return max(min(round(tokens * val_fraction), tokens - 1), 0)


def is_dataset(directory: Path) -> bool:
    return (Path(directory) / INDEX_FILE).is_file() or (Path(directory) / LEGACY_META_FILE).is_file()


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically: readers see the old file or the new one, never a part."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def read_index(directory: Path) -> dict[str, Any]:
    """The dataset's index (format 1's meta.json converted), or a one-line DataError saying what is wrong."""
    directory = Path(directory)
    path = directory / INDEX_FILE
    if not path.is_file() and (directory / LEGACY_META_FILE).is_file():
        path = directory / LEGACY_META_FILE
    if not path.is_file():
        if (directory / SHARDS_DIR).is_dir():
            reason = f"no {INDEX_FILE}: a prepare that did not finish; run it again"
        else:
            reason = f"no {INDEX_FILE}" if directory.is_dir() else "no such directory"
        raise DataError(f"no prepared dataset at {directory} ({reason}; run "
                        f"`python -m pretrain.data.prepare INPUT... --out {directory}`)")
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
        problem = _index_problem(index)
    except ValueError as error:  # includes UnicodeDecodeError
        problem = f"not valid JSON ({error})"
    if problem:
        raise DataError(f"{path}: {problem}")
    return index


def segments(directory: Path, index: dict[str, Any], split: str) -> list[Segment]:
    """The token segments of one split, in stream order (empty ones left out)."""
    directory = Path(directory)
    if index["format"] == LEGACY_FORMAT:
        length = index["num_tokens"][split]
        return [Segment(directory / f"{split}.bin", 0, length)] if length else []
    found = []
    for shard in index["shards"]:
        train = shard["tokens"] - shard["val_tokens"]
        start, length = (0, train) if split == "train" else (train, shard["val_tokens"])
        if length:
            found.append(Segment(shard_bin(directory, shard["number"]), start, length))
    return found


def file_tokens(directory: Path, index: dict[str, Any]) -> dict[Path, int]:
    """Every token file of the dataset with the number of tokens it must hold."""
    if index["format"] == LEGACY_FORMAT:
        return {Path(directory) / f"{split}.bin": index["num_tokens"][split] for split in SPLITS}
    return {shard_bin(directory, shard["number"]): shard["tokens"] for shard in index["shards"]}


def _index_problem(index: Any) -> str:
    """What is wrong with a parsed index (or format 1 meta.json), or "" if nothing."""
    if not isinstance(index, dict):
        return "not a JSON object"
    if index.get("format") not in (FORMAT_VERSION, LEGACY_FORMAT):
        return f"format {index.get('format')!r} is not a supported format ({LEGACY_FORMAT} or {FORMAT_VERSION})"
    if index.get("dtype") not in TOKEN_DTYPES:
        return f"dtype {index.get('dtype')!r} is not one of {', '.join(TOKEN_DTYPES)}"
    if not isinstance(index.get("vocab_size"), int):
        return "missing integer vocab_size"
    counts = index.get("num_tokens")
    if not isinstance(counts, dict) or not all(isinstance(counts.get(split), int) for split in SPLITS):
        return "missing integer num_tokens.train and num_tokens.val"
    if index["format"] == FORMAT_VERSION:
        shards = index.get("shards")
        fields = ("number", "tokens", "val_tokens")
        if not isinstance(shards, list) or not all(
                isinstance(s, dict) and all(isinstance(s.get(k), int) for k in fields) for s in shards):
            return "missing list of shards with integer number, tokens and val_tokens"
    return ""
