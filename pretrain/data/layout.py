"""On-disk layout of a prepared dataset, shared by the writer and the reader.

A prepared dataset is a directory holding ``train.bin`` and ``val.bin`` (flat
arrays of token ids, no header) and ``meta.json``. ``meta.json`` is written
last, so its presence marks a complete dataset.
"""

from pathlib import Path

import numpy as np

FORMAT_VERSION = 1
META_FILE = "meta.json"
SPLITS = ("train", "val")


def bin_file(directory: Path, split: str) -> Path:
    """Path of the token file for ``split`` inside a dataset directory."""
    return directory / f"{split}.bin"


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds every token id of the vocabulary."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)
