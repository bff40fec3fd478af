"""Read prepared token datasets and cut them into deterministic samples.

No torch here (the launcher checks datasets on login nodes): batches are int64 numpy arrays.
Sample ``i`` for a given ``seed`` depends only on ``(seed, i, data)``: the
token stream is cut into windows of ``seq_len + 1`` tokens (neighbours share
one token, so every token is a target once per epoch), and epoch ``e`` visits
the windows in an order fixed by ``(seed, e)``. See ``pretrain.data.sampling``
for how sample indices are split across ranks and micro-steps.
"""

import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from pretrain.data.errors import DataError
from pretrain.data.layout import FORMAT_VERSION, META_FILE, SPLITS, bin_file
from pretrain.data.sampling import rank_indices, window_permutation

__all__ = ["DataError", "SyntheticDataset", "TokenDataset", "rank_indices"]

TOKEN_DTYPES = ("uint16", "uint32")
VOCAB_SAMPLE_CHUNKS = 64
VOCAB_SAMPLE_CHUNK_TOKENS = 4096


class TokenDataset:
    """One split of a prepared dataset, memory-mapped read-only.

    Opening fails with a one-line ``DataError`` if the dataset is missing,
    incomplete, empty or inconsistent with its ``meta.json``; ``check`` adds
    the checks that depend on the model.
    """

    def __init__(self, path: str | Path, split: str = "train"):
        self.path = Path(path)
        self.split = split
        if split not in SPLITS:
            raise DataError(f"split={split!r}: must be one of {', '.join(SPLITS)}")
        self.meta = self._load_meta()
        self.bin_path = bin_file(self.path, split)
        self.tokens = self._open_tokens()

    def __reduce__(self):
        # Pickle by path (e.g. for DataLoader workers), not as a copy of the tokens.
        return TokenDataset, (self.path, self.split)

    @property
    def num_tokens(self) -> int:
        return int(self.meta["num_tokens"][self.split])

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def eos_id(self) -> int | None:
        return self.meta.get("eos_id")

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.meta["dtype"])

    def check(self, seq_len: int, model_vocab_size: int) -> None:
        """Fail early, in one line, if this data cannot train the given model."""
        self.num_windows(seq_len)
        if self.vocab_size > model_vocab_size:
            raise self._error(
                f"dataset vocab_size {self.vocab_size} (tokenizer {self.meta.get('tokenizer')}) "
                f"exceeds model vocab_size {model_vocab_size}"
            )
        largest = _sampled_max(self.tokens)
        if largest >= model_vocab_size:
            raise self._error(f"{self.bin_path} contains token id {largest} >= model vocab_size {model_vocab_size}")

    def num_windows(self, seq_len: int) -> int:
        """Samples per epoch: non-overlapping windows of ``seq_len`` inputs (+1 target)."""
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len}: must be >= 1")
        windows = (self.num_tokens - 1) // seq_len
        if windows < 1:
            raise self._error(
                f"{self.split} split has {self.num_tokens} tokens, shorter than one sequence "
                f"(seq_len+1 = {seq_len + 1} tokens)"
            )
        return windows

    def sample_offset(self, index: int, seq_len: int, seed: int) -> int:
        """Start position in the token stream of global sample ``index``."""
        if index < 0:
            raise ValueError(f"sample index {index}: must be >= 0")
        windows = self.num_windows(seq_len)
        epoch, position = divmod(index, windows)
        return int(window_permutation(windows, seed, epoch)[position]) * seq_len

    def get_batch(self, indices: Sequence[int], seq_len: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """Inputs and next-token targets, both int64 of shape ``[len(indices), seq_len]``."""
        offsets = [self.sample_offset(index, seq_len, seed) for index in indices]
        windows = np.stack([self.tokens[offset : offset + seq_len + 1] for offset in offsets])
        return _split_inputs_targets(windows)

    def _load_meta(self) -> dict[str, Any]:
        meta_path = self.path / META_FILE
        if not meta_path.is_file():
            reason = f"no {META_FILE}" if self.path.is_dir() else "no such directory"
            raise self._error(
                f"no prepared dataset at {self.path} ({reason}; run "
                f"`python -m pretrain.data.prepare INPUT... --out {self.path}`)"
            )
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
            problem = _meta_problem(meta, self.split)
        except ValueError as error:  # includes UnicodeDecodeError
            problem = f"not valid JSON ({error})"
        if problem:
            raise self._error(f"{meta_path}: {problem}")
        return meta

    def _open_tokens(self) -> np.ndarray:
        if not self.bin_path.is_file():
            raise self._error(f"missing {self.bin_path} (incomplete dataset; prepare it again)")
        size = self.bin_path.stat().st_size
        if size == 0:
            raise self._error(f"{self.bin_path} is empty (0 tokens)")
        expected = self.num_tokens * self.dtype.itemsize
        if size != expected:
            raise self._error(
                f"{self.bin_path} has {size} bytes but {META_FILE} says {self.num_tokens} "
                f"{self.dtype.name} tokens ({expected} bytes): truncated file or wrong dtype"
            )
        return np.memmap(self.bin_path, dtype=self.dtype, mode="r", shape=(self.num_tokens,))

    def _error(self, problem: str) -> DataError:
        return DataError(f"data.path={self.path}: {problem}")


class SyntheticDataset:
    """Uniformly random tokens with the ``TokenDataset`` sampling interface.

    For throughput benchmarks: no files, and sample ``i`` is still a pure
    function of ``(self.seed, seed, i)``. ``seed`` here picks the corpus, as
    ``path`` does for a real dataset.
    """

    eos_id = None

    def __init__(self, vocab_size: int, seed: int = 0):
        self.vocab_size = vocab_size
        self.seed = seed

    def check(self, seq_len: int, model_vocab_size: int) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len}: must be >= 1")
        if self.vocab_size > model_vocab_size:
            raise DataError(
                f"synthetic data vocab_size {self.vocab_size} exceeds model vocab_size {model_vocab_size}"
            )

    def get_batch(self, indices: Sequence[int], seq_len: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        windows = np.stack([self._sample(index, seq_len + 1, seed) for index in indices])
        return _split_inputs_targets(windows)

    def _sample(self, index: int, length: int, seed: int) -> np.ndarray:
        bits = np.random.PCG64(np.random.SeedSequence([self.seed, seed, index])).random_raw(length)
        return bits % np.uint64(self.vocab_size)


def _split_inputs_targets(windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and next-token targets as int64 arrays (the trainer wraps them in tensors without a copy)."""
    windows = windows.astype(np.int64)
    return np.ascontiguousarray(windows[:, :-1]), np.ascontiguousarray(windows[:, 1:])


def _meta_problem(meta: Any, split: str) -> str:
    """What is wrong with a parsed ``meta.json``, or "" if nothing."""
    if not isinstance(meta, dict):
        return "not a JSON object"
    if meta.get("format") != FORMAT_VERSION:
        return f"format {meta.get('format')!r} is not the supported format {FORMAT_VERSION}"
    if meta.get("dtype") not in TOKEN_DTYPES:
        return f"dtype {meta.get('dtype')!r} is not one of {', '.join(TOKEN_DTYPES)}"
    if not isinstance(meta.get("vocab_size"), int):
        return "missing integer vocab_size"
    counts = meta.get("num_tokens")
    if not isinstance(counts, dict) or not isinstance(counts.get(split), int):
        return f"missing integer num_tokens.{split}"
    return ""


def _sampled_max(tokens: np.ndarray) -> int:
    """Largest token id, read from evenly spread chunks when the file is large."""
    budget = VOCAB_SAMPLE_CHUNKS * VOCAB_SAMPLE_CHUNK_TOKENS
    if len(tokens) <= budget:
        return int(tokens.max())
    starts = np.linspace(0, len(tokens) - VOCAB_SAMPLE_CHUNK_TOKENS, VOCAB_SAMPLE_CHUNKS).astype(np.int64)
    return max(int(tokens[start : start + VOCAB_SAMPLE_CHUNK_TOKENS].max()) for start in starts)
