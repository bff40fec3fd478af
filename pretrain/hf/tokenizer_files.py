"""The tokenizer of an exported folder: what `AutoTokenizer.from_pretrained(DIR)` loads.

The run's data names its tokenizer (pretrain.data.source.tokenizer_spec). A Hugging Face tokenizer.json
is copied, with the tokenizer_config.json of its model folder where the data kept one; the built-in
byte-level tokenizer is written as a `tokenizers` file that encodes alike (ByteTokenizer.hf_json).
Without a tokenizer_config.json, one is written naming the end-of-document token and the context length.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from pretrain.config import Config
from pretrain.data import source
from pretrain.data.layout import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE
from pretrain.data.tokenizer import ByteTokenizer, Tokenizer


def write(cfg: Config, folder: Path) -> Tokenizer | None:
    """Write the run's tokenizer into `folder`; returns it, or None for synthetic data (no tokenizer).
    DataError when the run's data, which holds it, cannot be read."""
    tokenizer = source.tokenizer(cfg)
    if tokenizer is None:
        return None
    if isinstance(tokenizer, ByteTokenizer):
        (folder / TOKENIZER_FILE).write_text(json.dumps(tokenizer.hf_json(), ensure_ascii=False))
    for name, path in tokenizer.files().items():
        shutil.copyfile(path, folder / name)
    if not (folder / TOKENIZER_CONFIG_FILE).is_file():
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tokenizer.eos_token,
                  "model_max_length": cfg.model.max_seq_len, "clean_up_tokenization_spaces": False}
        (folder / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return tokenizer
