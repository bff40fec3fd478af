"""A run's data: where it lives, checking it, and opening its splits.

`data.path=null` means the built-in corpus, prepared into RUN_DIR/data/builtin by the job's rank 0
when it is not there yet (it takes a second), so a run directory holds everything its run used.
"""

from __future__ import annotations

from pathlib import Path

from pretrain.config import Config
from pretrain.data.builtin import ensure_builtin_dataset
from pretrain.data.dataset import SyntheticDataset, TokenDataset
from pretrain.data.errors import DataError
from pretrain.data.tokenizer import ByteTokenizer
from pretrain.data.sampling import rank_indices

__all__ = ["data_dir", "ensure", "check", "open_train", "open_val", "rank_indices", "DataError"]


def data_dir(cfg: Config) -> Path:
    if cfg.data.path is not None:
        return Path(cfg.data.path).expanduser()
    return Path(cfg.run_dir) / "data" / "builtin"


def ensure(cfg: Config) -> None:
    """Prepare the built-in corpus when the run uses it (call from one process only)."""
    if cfg.data.path is None and not cfg.data.synthetic:
        ensure_builtin_dataset(data_dir(cfg))


def check(cfg: Config) -> None:
    """Raise DataError (one line) if the data cannot feed this model at this sequence length."""
    if cfg.data.synthetic:
        return
    if cfg.data.path is None:
        needed = ByteTokenizer().vocab_size
        if cfg.model.vocab_size < needed:
            raise DataError(f"the built-in corpus is tokenized into {needed} byte-level ids, but model.vocab_size="
                            f"{cfg.model.vocab_size}; use model.vocab_size={needed} or more, or data.path=DIR")
        return
    for split in ("train", "val"):
        dataset = TokenDataset(data_dir(cfg), split)
        if split == "train" or dataset.num_tokens > 0:
            dataset.check(cfg.train.seq_len, cfg.model.vocab_size)


def open_train(cfg: Config):
    if cfg.data.synthetic:
        return SyntheticDataset(cfg.model.vocab_size, cfg.train.seed)
    return TokenDataset(data_dir(cfg), "train")


def open_val(cfg: Config):
    """The validation split, or None when there is none long enough (or the data is synthetic)."""
    if cfg.data.synthetic:
        return None
    dataset = TokenDataset(data_dir(cfg), "val")
    if dataset.num_tokens <= cfg.train.seq_len:
        return None
    return dataset
