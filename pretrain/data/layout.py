"""On-disk layout of a prepared dataset, shared by the writer and the reader.

A prepared dataset is a directory holding ``train.bin`` and ``val.bin`` (flat
arrays of token ids, no header) and ``meta.json``; with a Hugging Face tokenizer, a
copy of its ``tokenizer.json`` (and of the ``tokenizer_config.json`` beside it, if
any), so the data keeps the tokenizer that made it. ``meta.json`` is written
last, so its presence marks a complete dataset.
"""

from pathlib import Path

import numpy as np

FORMAT_VERSION = 1
META_FILE = "meta.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPLITS = ("train", "val")


def bin_file(directory: Path, split: str) -> Path:
    """Path of the token file for ``split`` inside a dataset directory."""
    return directory / f"{split}.bin"


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds every token id of the vocabulary."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)
