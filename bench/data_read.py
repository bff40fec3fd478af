"""What reading a micro-batch costs the training loop: one file, shards, and a mixture of sharded datasets.

    python bench/data_read.py [--tokens 50000000] [--name data-read] [--out bench/results]

The same random tokens written as a dataset of format 1 (one train.bin), as 64 shards, and as a
mixture of three such sharded datasets; then `get_batch` of micro-batches of 8 x 4,096 tokens (the
1B benchmark's shape), for successive sample indices as training reads them, timed after a warm-up
(the window permutation of an epoch is computed once). The loop reads each micro-batch on the CPU
before the GPU's work for it is queued, while the GPU still runs the previous one (kernels are
asynchronous); the figure to compare is the step time of bench/results/1b-1gpu.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import common  # noqa: E402

from pretrain.data.dataset import TokenDataset  # noqa: E402
from pretrain.data.layout import SHARDS_DIR, shard_bin, write_json  # noqa: E402
from pretrain.data.mixture import MixtureDataset  # noqa: E402

MICRO_BATCH, SEQ_LEN, SHARDS, CALLS = 8, 4096, 64, 200


def single_file(path: Path, tokens: np.ndarray) -> Path:
    path.mkdir(parents=True)
    tokens.tofile(path / "train.bin")
    np.zeros(0, np.uint16).tofile(path / "val.bin")
    (path / "meta.json").write_text(json.dumps({"format": 1, "dtype": "uint16", "vocab_size": 32768,
                                                "num_tokens": {"train": len(tokens), "val": 0}}))
    return path


def sharded(path: Path, tokens: np.ndarray) -> Path:
    (path / SHARDS_DIR).mkdir(parents=True)
    shards = []
    for number, part in enumerate(np.array_split(tokens, SHARDS)):
        part.tofile(shard_bin(path, number))
        shards.append({"number": number, "tokens": len(part), "val_tokens": 0, "documents": 1, "sources": []})
    write_json(path / "index.json", {"format": 2, "dtype": "uint16", "vocab_size": 32768, "eos_id": None,
                                     "tokenizer": "bench", "num_tokens": {"train": len(tokens), "val": 0},
                                     "num_documents": SHARDS, "shards": shards})
    return path


def seconds_per_batch(data) -> float:
    data.get_batch(list(range(MICRO_BATCH)), SEQ_LEN, 0)  # warm-up: the epoch's permutation
    began = time.perf_counter()
    for call in range(CALLS):
        start = (call + 1) * MICRO_BATCH
        data.get_batch(list(range(start, start + MICRO_BATCH)), SEQ_LEN, 0)
    return (time.perf_counter() - began) / CALLS


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=50_000_000)
    parser.add_argument("--name", default="data-read")
    parser.add_argument("--out", type=Path, default=common.RESULTS)
    args = parser.parse_args()
    tokens = np.random.default_rng(0).integers(0, 32768, args.tokens, dtype=np.uint16)
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        cases = {"format 1, one file": TokenDataset(single_file(root / "one", tokens)),
                 f"{SHARDS} shards": TokenDataset(sharded(root / "shards", tokens))}
        sources = {name: TokenDataset(sharded(root / name, tokens)) for name in ("web", "code", "math")}
        cases[f"mixture of 3 x {SHARDS} shards"] = MixtureDataset(sources, {"web": 70, "code": 20, "math": 10})
        results = {name: seconds_per_batch(data) for name, data in cases.items()}
    lines = [f"Reading one micro-batch ({MICRO_BATCH} x {SEQ_LEN} tokens) on the CPU: {args.tokens:,} tokens per "
             f"dataset, {CALLS} micro-batches of successive samples after a warm-up.", "",
             "| layout | ms per micro-batch |", "|---|---|"]
    lines += [f"| {name} | {seconds * 1e3:.3f} |" for name, seconds in results.items()]
    record = {"name": args.name, **common.stamp(), "micro_batch": MICRO_BATCH, "seq_len": SEQ_LEN,
              "tokens": args.tokens, "seconds_per_micro_batch": results}
    common.write_result(args.out, args.name, record, "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
