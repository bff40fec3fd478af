"""A run's data: where it lives, checking it, and opening its splits.

`data.path=null` means the built-in corpus, prepared into RUN_DIR/data/builtin by the job's rank 0
when it is not there yet (it takes a second), so a run directory holds everything its run used.
`data.mix` names several prepared datasets, sampled by weight (pretrain.data.mixture).
"""

from __future__ import annotations

from pathlib import Path

from pretrain.config import Config
from pretrain.data.builtin import ensure_builtin_dataset
from pretrain.data.dataset import SyntheticDataset, TokenDataset
from pretrain.data.errors import DataError
from pretrain.data.layout import TOKENIZER_FILE, read_index, tokenizer_copy
from pretrain.data.mixture import MixtureDataset, check_compatible
from pretrain.data.sampling import rank_indices
from pretrain.data.tokenizer import BYTE, NO_EOS, ByteTokenizer, HFTokenizer, Tokenizer

__all__ = ["data_dir", "data_paths", "ensure", "check", "open_train", "open_val", "tokenizer_spec", "tokenizer",
           "rank_indices", "DataError"]


def data_dir(cfg: Config) -> Path:
    if cfg.data.path is not None:
        return Path(cfg.data.path).expanduser()
    return Path(cfg.run_dir) / "data" / "builtin"


def data_paths(cfg: Config) -> list[Path]:
    """The prepared datasets the run reads that live outside its run directory (for container binds)."""
    if cfg.data.mix:
        return [Path(source.path).expanduser() for _, source in sorted(cfg.data.mix.items())]
    return [Path(cfg.data.path).expanduser()] if cfg.data.path is not None else []


def ensure(cfg: Config) -> None:
    """Prepare the built-in corpus when the run uses it (call from one process only)."""
    if cfg.data.path is None and not cfg.data.mix and not cfg.data.synthetic:
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
    if cfg.data.path is None and not cfg.data.mix:
        needed = ByteTokenizer().vocab_size
        if cfg.model.vocab_size < needed:
            raise DataError(f"the built-in corpus is tokenized into {needed} byte-level ids, but model.vocab_size="
                            f"{cfg.model.vocab_size}; use model.vocab_size={needed} or more, or data.path=DIR")
        return
    opened = {split: _open(cfg, split) for split in ("train", "val")}
    for split, datasets in opened.items():
        for dataset in datasets.values():
            if split == "train" or dataset.num_tokens > 0:
                dataset.check(cfg.train.seq_len, cfg.model.vocab_size)
        if len(datasets) > 1:
            check_compatible(datasets)
    if cfg.data.mix:
        _mixture(cfg, opened["train"])  # the weights as whole samples of a block


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


def _tokenized_by(cfg: Config) -> tuple[Path, dict] | None:
    """The dataset whose tokenizer the run's data uses (a mixture's sources share one) and its index."""
    if cfg.data.synthetic:
        return None
    folder = data_paths(cfg)[0] if data_paths(cfg) else data_dir(cfg)
    return (folder, read_index(folder)) if (cfg.data.path or cfg.data.mix) else (folder, {"tokenizer": BYTE})


def tokenizer_spec(cfg: Config) -> str | None:
    """What the run's data was tokenized with: "byte", the path of a tokenizer JSON file (the dataset's
    copy; for data prepared before datasets kept one, the file it was made with), or None (synthetic)."""
    found = _tokenized_by(cfg)
    if found is None:
        return None
    folder, index = found
    if index.get("tokenizer", BYTE) == BYTE:
        return BYTE
    copy = tokenizer_copy(folder, index["tokenizer_sha256"]) / TOKENIZER_FILE if index.get("tokenizer_sha256") else None
    return str(copy) if copy is not None and copy.is_file() else index["tokenizer"]


def tokenizer(cfg: Config) -> Tokenizer | None:
    """The tokenizer of the run's data, with the end-of-document id it was prepared with; None for
    synthetic data."""
    spec = tokenizer_spec(cfg)
    if spec is None:
        return None
    eos_id = _tokenized_by(cfg)[1].get("eos_id", ByteTokenizer().eos_id)
    if spec == BYTE:
        return ByteTokenizer(eos=eos_id is not None)
    loaded = HFTokenizer(spec, eos=NO_EOS)
    loaded.use_eos(eos_id)
    return loaded


def open_train(cfg: Config):
    if cfg.data.synthetic:
        return SyntheticDataset(cfg.model.vocab_size, cfg.train.seed)
    if cfg.data.mix:
        return _mixture(cfg, _open(cfg, "train"))
    return TokenDataset(data_dir(cfg), "train")


def _mixture(cfg: Config, sources: dict[str, TokenDataset]) -> MixtureDataset:
    return MixtureDataset(sources, {name: source.weight for name, source in cfg.data.mix.items()})


def open_val(cfg: Config) -> dict[str, TokenDataset]:
    """The validation splits long enough for one sequence: {"": split} for one dataset, {NAME: split} per
    source of a mixture; {} when there is none (or the data is synthetic)."""
    if cfg.data.synthetic:
        return {}
    splits = _open(cfg, "val")
    if not cfg.data.mix:
        splits = {"": splits[str(data_dir(cfg))]}
    return {name: split for name, split in splits.items() if split.num_tokens > cfg.train.seq_len}


def _open(cfg: Config, split: str) -> dict[str, TokenDataset]:
    """One split of every dataset the run reads, by mixture name (by path for a single dataset)."""
    if cfg.data.mix:
        return {name: _opened(name, source.path, split) for name, source in sorted(cfg.data.mix.items())}
    return {str(data_dir(cfg)): TokenDataset(data_dir(cfg), split)}


def _opened(name: str, path: str, split: str) -> TokenDataset:
    try:
        return TokenDataset(Path(path).expanduser(), split)
    except DataError as error:
        raise DataError(f"data.mix.{name}: {error}") from None
