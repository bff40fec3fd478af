"""Writing one shard: documents through the tokenizer in batches, into shards/NNNNNN.bin and its record.

The tokens go to NNNNNN.bin.partial, renamed to NNNNNN.bin once complete; the record NNNNNN.json,
written after it, is the mark of a finished shard. A shard's bytes depend only on its documents and
the tokenizer, so a dataset is the same whichever process, machine or job array task wrote each shard.
"""

from __future__ import annotations

import os
from typing import Callable, Iterable, Iterator

import numpy as np

from pretrain.data import readers
from pretrain.data.inputs import Piece
from pretrain.data.layout import shard_bin, shard_record, write_json
from pretrain.data.tokenizer import Tokenizer

# A batch for the tokenizer's batch encoding: about 1 MB of text, enough to amortise the call.
BATCH_CHARACTERS = 1 << 20
BATCH_DOCUMENTS = 4096
# How many parts a shard record names in the index (its own record lists them all).
SOURCES_SHOWN = 3

# report(documents, tokens, input bytes): progress since the last call.
Report = Callable[[int, int, int], None]


def piece_texts(piece: Piece, text_field: str) -> Iterator[tuple[str, int]]:
    """(document, input bytes of the piece read so far) for every document of the piece's parts."""
    before = 0
    for part in piece:
        for text, done in readers.documents(part, text_field):
            yield text, before + done
        before += part.size


def write_shard(out, number: int, texts: Iterable[tuple[str, int]], sources: list[str], tokenizer: Tokenizer,
                dtype: np.dtype, report: Report, size: int = 0) -> dict:
    """Tokenize the non-blank documents of `texts` into shard `number` of the dataset at `out`; its record.

    size: the input bytes of `texts`, all reported by the end."""
    path = shard_bin(out, number)
    partial = path.with_name(path.name + ".partial")
    documents = tokens = reported_bytes = 0
    with open(partial, "wb") as sink:
        for batch, done in _batches(texts):
            ids = tokenizer.encode_documents(batch, dtype)
            sink.write(memoryview(ids))
            documents += len(batch)
            tokens += len(ids)
            report(len(batch), len(ids), done - reported_bytes)
            reported_bytes = done
    report(0, 0, max(size - reported_bytes, 0))
    os.replace(partial, path)
    record = {"number": number, "tokens": tokens, "documents": documents, "sources": sources}
    write_json(shard_record(out, number), record)
    return record


def _batches(texts: Iterable[tuple[str, int]]) -> Iterator[tuple[list[str], int]]:
    batch: list[str] = []
    characters = done = 0
    for text, done in texts:
        if not text or text.isspace():
            continue
        batch.append(text)
        characters += len(text)
        if characters >= BATCH_CHARACTERS or len(batch) >= BATCH_DOCUMENTS:
            yield batch, done
            batch, characters = [], 0
    if batch:
        yield batch, done


def index_entry(record: dict, val_tokens: int) -> dict:
    """What the index says of a shard: its record, with its first sources only."""
    sources = record["sources"]
    shown = sources[:SOURCES_SHOWN] + ([f"(+{len(sources) - SOURCES_SHOWN} more)"]
                                       if len(sources) > SOURCES_SHOWN else [])
    return {"number": record["number"], "tokens": record["tokens"], "val_tokens": val_tokens,
            "documents": record["documents"], "sources": shown}
