"""Read prepared token datasets and cut them into deterministic samples.

No torch here (the launcher checks datasets on login nodes): batches are int64 numpy arrays.
Sample ``i`` for a given ``seed`` depends only on ``(seed, i, data)``: the
token stream is cut into windows of ``seq_len + 1`` tokens (neighbours share
one token, so every token is a target once per epoch), and epoch ``e`` visits
the windows in an order fixed by ``(seed, e)``. See ``pretrain.data.sampling``
for how sample indices are split across ranks and micro-steps.
"""

from collections import OrderedDict
from pathlib import Path
from typing import Sequence

import numpy as np

from pretrain.data.errors import DataError
from pretrain.data.layout import INDEX_FILE, SPLITS, Segment, file_tokens, read_index, segments
from pretrain.data.sampling import rank_indices, window_permutation

__all__ = ["DataError", "SyntheticDataset", "TokenDataset", "rank_indices"]

VOCAB_SAMPLE_CHUNKS = 64
VOCAB_SAMPLE_CHUNK_TOKENS = 4096
# Token files kept memory-mapped at once (each map holds a file descriptor).
OPEN_FILES = 128


class TokenDataset:
    """One split of a prepared dataset (pretrain.data.layout): its shards' segments read as one token
    stream, each shard memory-mapped read-only when first needed.

    Opening fails with a one-line ``DataError`` if the dataset is missing, incomplete or its index is
    broken; ``check`` adds the checks of every file and those that depend on the model.
    """

    def __init__(self, path: str | Path, split: str = "train"):
        self.path = Path(path)
        self.split = split
        if split not in SPLITS:
            raise DataError(f"split={split!r}: must be one of {', '.join(SPLITS)}")
        try:
            self.meta = read_index(self.path)
        except DataError as error:
            raise self._error(str(error)) from None
        self.segments = segments(self.path, self.meta, split)
        self.file_tokens = file_tokens(self.path, self.meta)
        self.starts = np.cumsum([0] + [segment.length for segment in self.segments])
        self._maps: OrderedDict[Path, np.memmap] = OrderedDict()

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
        """Fail early, in one line, if this data cannot train the given model: every file there at its size,
        enough tokens, and no token id the model's vocabulary lacks."""
        self.check_files()
        self.num_windows(seq_len)
        if self.vocab_size > model_vocab_size:
            raise self._error(
                f"dataset vocab_size {self.vocab_size} (tokenizer {self.meta.get('tokenizer')}) "
                f"exceeds model vocab_size {model_vocab_size}"
            )
        largest, where = self._sampled_max()
        if largest >= model_vocab_size:
            raise self._error(f"{where} contains token id {largest} >= model vocab_size {model_vocab_size}")

    def check_files(self) -> None:
        for path, tokens in self.file_tokens.items():
            self._check_file(path, tokens)

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

    def window(self, index: int, seq_len: int, seed: int) -> np.ndarray:
        """The ``seq_len + 1`` tokens of sample ``index``."""
        return self.read(self.sample_offset(index, seq_len, seed), seq_len + 1)

    def get_batch(self, indices: Sequence[int], seq_len: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """Inputs and next-token targets, both int64 of shape ``[len(indices), seq_len]``."""
        return split_inputs_targets(np.stack([self.window(index, seq_len, seed) for index in indices]))

    def read(self, offset: int, length: int) -> np.ndarray:
        """``length`` tokens of the split's stream from ``offset``, across shard boundaries."""
        if offset < 0 or offset + length > self.num_tokens:
            raise ValueError(f"tokens [{offset}, {offset + length}) are outside the {self.num_tokens} of the split")
        at = int(np.searchsorted(self.starts, offset, side="right")) - 1
        pieces = []
        while length > 0:
            segment = self.segments[at]
            local = offset - int(self.starts[at])
            take = min(length, segment.length - local)
            pieces.append(self._tokens(segment)[segment.start + local: segment.start + local + take])
            offset, length, at = offset + take, length - take, at + 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def _tokens(self, segment: Segment) -> np.ndarray:
        """The whole token file of a segment, mapped (and its size checked) on first use; the least recently
        used is unmapped beyond OPEN_FILES."""
        tokens = self._maps.get(segment.file)
        if tokens is None:
            count = self.file_tokens[segment.file]
            self._check_file(segment.file, count)
            tokens = self._maps[segment.file] = np.memmap(segment.file, dtype=self.dtype, mode="r", shape=(count,))
            if len(self._maps) > OPEN_FILES:
                self._maps.popitem(last=False)
        self._maps.move_to_end(segment.file)
        return tokens

    def _check_file(self, path: Path, tokens: int) -> int:
        """The file's size in bytes, which must be that of `tokens` tokens of the dataset's dtype."""
        if not path.is_file():
            raise self._error(f"missing {path} (incomplete dataset; prepare it again)")
        size = path.stat().st_size
        expected = tokens * self.dtype.itemsize
        if size != expected:
            raise self._error(
                f"{path} has {size} bytes but {INDEX_FILE} says {tokens} {self.dtype.name} tokens "
                f"({expected} bytes): truncated file or wrong dtype"
            )
        return size

    def _sampled_max(self) -> tuple[int, Path]:
        """The largest token id and its file, read from evenly spread chunks when the split is large."""
        if self.num_tokens <= VOCAB_SAMPLE_CHUNKS * VOCAB_SAMPLE_CHUNK_TOKENS:
            starts, chunk = [0], self.num_tokens
        else:
            chunk = VOCAB_SAMPLE_CHUNK_TOKENS
            starts = np.linspace(0, self.num_tokens - chunk, VOCAB_SAMPLE_CHUNKS).astype(np.int64).tolist()
        largest, start = max((int(self.read(start, chunk).max()), start) for start in starts)
        return largest, self.segments[int(np.searchsorted(self.starts, start, side="right")) - 1].file

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
        return split_inputs_targets(windows)

    def _sample(self, index: int, length: int, seed: int) -> np.ndarray:
        bits = np.random.PCG64(np.random.SeedSequence([self.seed, seed, index])).random_raw(length)
        return bits % np.uint64(self.vocab_size)


def split_inputs_targets(windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and next-token targets as int64 arrays (the trainer wraps them in tensors without a copy)."""
    windows = windows.astype(np.int64)
    return np.ascontiguousarray(windows[:, :-1]), np.ascontiguousarray(windows[:, 1:])
