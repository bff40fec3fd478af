"""A run's data: where it lives, checking it, and opening its splits.

`data.path=null` means the built-in corpus, prepared into RUN_DIR/data/builtin by the job's rank 0
when it is not there yet (it takes a second), so a run directory holds everything its run used.
"""

from __future__ import annotations

import json
from pathlib import Path

from pretrain.config import Config
from pretrain.data.builtin import ensure_builtin_dataset
from pretrain.data.dataset import SyntheticDataset, TokenDataset
from pretrain.data.errors import DataError
from pretrain.data.layout import META_FILE, TOKENIZER_FILE
from pretrain.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from pretrain.data.sampling import rank_indices

__all__ = ["data_dir", "ensure", "check", "open_train", "open_val", "tokenizer_spec", "tokenizer", "rank_indices",
           "DataError"]


def data_dir(cfg: Config) -> Path:
    if cfg.data.path is not None:
        return Path(cfg.data.path).expanduser()
    return Path(cfg.run_dir) / "data" / "builtin"


def ensure(cfg: Config) -> None:
    """Prepare the built-in corpus when the run uses it (call from one process only)."""
    if cfg.data.path is None and not cfg.data.synthetic:
        ensure_builtin_dataset(data_dir(cfg))


def check(cfg: Config) -> None:
    """Raise DataError (one line) if the data cannot feed this model at this sequence length, or its
    tokenizer makes a sample prompt too long for the model."""
    if cfg.data.synthetic:
        return
    check_data(cfg)
    if cfg.train.sample_every:
        check_prompts(cfg)


def check_data(cfg: Config) -> None:
    """The data's vocabulary within the model's, and enough tokens for a sequence."""
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


def check_prompts(cfg: Config) -> None:
    """Each of train.sample_prompts, tokenized, leaves room for train.sampling.max_new_tokens in the model."""
    new = cfg.train.sampling.max_new_tokens
    encode = tokenizer(cfg).encode
    for index, prompt in enumerate(cfg.train.sample_prompts):
        length = len(encode(prompt))
        if length + new > cfg.model.max_seq_len:
            raise DataError(f"train.sample_prompts[{index}] is {length} tokens long, and with "
                            f"train.sampling.max_new_tokens={new} more that exceeds model.max_seq_len="
                            f"{cfg.model.max_seq_len}: shorten it or ask for fewer tokens")


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


def tokenizer_spec(cfg: Config) -> str | None:
    """What the run's data was tokenized with: "byte", the path of a tokenizer JSON file (the dataset's
    copy; for data prepared before datasets kept one, the file it was made with), or None (synthetic)."""
    if cfg.data.synthetic:
        return None
    if cfg.data.path is None:
        return "byte"
    folder = data_dir(cfg)
    try:
        meta = json.loads((folder / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise DataError(f"data.path={folder}: cannot read its {META_FILE} ({error}), which names the tokenizer") \
            from None
    if meta.get("tokenizer") == "byte":
        return "byte"
    return str(folder / TOKENIZER_FILE) if (folder / TOKENIZER_FILE).is_file() else meta.get("tokenizer")


def tokenizer(cfg: Config) -> Tokenizer | None:
    """The tokenizer of the run's data, or None for synthetic data."""
    spec = tokenizer_spec(cfg)
    return None if spec is None else load_tokenizer(spec)
