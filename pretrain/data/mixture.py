"""Mixtures (`data.mix`): several prepared datasets sampled together, each with a weight.

Which source global sample ``i`` comes from is a pure function of ``(seed, i)``, as its content is for
one dataset, so a resumed run and a run on another number of processes read the same samples.
Samples come in blocks of MIX_BLOCK: each block holds exactly ``counts[s]`` samples of source ``s``
(the weights turned into whole numbers that add up to the block), in an order fixed by
``(seed, block)``. The ``j``-th sample the mixture takes from a source is that source's own sample
``j`` (its windows in its own order, epoch after epoch), with ``j`` = block x counts[s] + the slots
of ``s`` before it in its block. Sources are taken in the order of their names.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence

import numpy as np

from pretrain.data.dataset import TokenDataset, split_inputs_targets
from pretrain.data.errors import DataError

MIX_BLOCK = 10_000
# Told apart from the window permutations' (seed, epoch) streams.
MIX_STREAM = 0x6D6978


def block_counts(weights: Sequence[float], block: int = MIX_BLOCK) -> list[int]:
    """Samples of each source per block: the weights' shares of the block, rounded by largest remainder."""
    total = float(sum(weights))
    exact = [block * weight / total for weight in weights]
    counts = [int(share) for share in exact]
    by_remainder = sorted(range(len(exact)), key=lambda s: (counts[s] - exact[s], s))
    for source in by_remainder[: block - sum(counts)]:
        counts[source] += 1
    return counts


@lru_cache(maxsize=8)
def block_layout(counts: tuple[int, ...], seed: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """For each slot of one block: its source, and how many slots of that source come before it."""
    size = sum(counts)
    keys = np.random.PCG64(np.random.SeedSequence([seed, block, MIX_STREAM])).random_raw(size)
    sources = np.repeat(np.arange(len(counts)), counts)[np.argsort(keys, kind="stable")]
    grouped = np.argsort(sources, kind="stable")
    ranks = np.empty(size, dtype=np.int64)
    ranks[grouped] = np.arange(size) - np.repeat(np.cumsum(counts) - counts, counts)
    sources.setflags(write=False)
    ranks.setflags(write=False)
    return sources, ranks


class MixtureDataset:
    """The sources of a mixture (one split each) behind the TokenDataset sampling interface."""

    def __init__(self, sources: dict[str, TokenDataset], weights: dict[str, float]):
        self.names = sorted(sources)
        self.sources = [sources[name] for name in self.names]
        self.counts = tuple(block_counts([weights[name] for name in self.names]))
        for name, count, weight in zip(self.names, self.counts, (weights[n] for n in self.names)):
            if count == 0:
                raise DataError(f"data.mix.{name}.weight={weight}: less than one sample in {MIX_BLOCK} of the "
                                "mixture; raise its weight or leave the source out")
        check_compatible(sources)
        first = self.sources[0]
        self.vocab_size, self.eos_id = first.vocab_size, first.eos_id

    def locate(self, index: int, seed: int) -> tuple[int, int]:
        """(position of the source in self.names, the source's own sample index) of global sample ``index``."""
        if index < 0:
            raise ValueError(f"sample index {index}: must be >= 0")
        block, slot = divmod(index, MIX_BLOCK)
        sources, ranks = block_layout(self.counts, seed, block)
        source = int(sources[slot])
        return source, block * self.counts[source] + int(ranks[slot])

    def get_batch(self, indices: Sequence[int], seq_len: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        windows = []
        for index in indices:
            source, own = self.locate(index, seed)
            windows.append(self.sources[source].window(own, seq_len, seed))
        return split_inputs_targets(np.stack(windows))


def check_compatible(sources: dict[str, TokenDataset]) -> None:
    """Every source tokenized alike: the same tokenizer file (by content), vocabulary and EOS id."""
    names = sorted(sources)
    first = sources[names[0]]
    for name in names[1:]:
        other = sources[name]
        for what, key in (("tokenizer", _tokenizer_of), ("vocab_size", lambda d: d.vocab_size),
                          ("EOS id", lambda d: d.eos_id)):
            if key(first) != key(other):
                shown = [d.meta.get("tokenizer") if what == "tokenizer" else key(d) for d in (first, other)]
                raise DataError(f"data.mix: {names[0]} and {name} differ in their {what} ({shown[0]} vs "
                                f"{shown[1]}); prepare every source of a mixture with the same --tokenizer and --eos")


def _tokenizer_of(dataset: TokenDataset) -> str:
    """The tokenizer file's sha256 (its name for the byte tokenizer and datasets of format 1)."""
    return dataset.meta.get("tokenizer_sha256") or str(dataset.meta.get("tokenizer"))
