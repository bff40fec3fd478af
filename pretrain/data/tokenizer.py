"""Tokenizers: a dependency-free byte tokenizer and a Hugging Face JSON wrapper."""

from pathlib import Path
from typing import Any, Protocol, Sequence

import numpy as np

from pretrain.data.errors import DataError
from pretrain.data.layout import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE

TokenIds = Sequence[int] | np.ndarray

# Special tokens that conventionally end a document, in order of preference.
EOS_TOKEN_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: int | None
    eos_token: str | None

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids: TokenIds) -> str: ...

    def files(self) -> dict[str, Path]:
        """The files that define it, by the names a prepared dataset keeps copies under."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, plus one end-of-document id (256)."""

    name = "byte"
    vocab_size = 257
    eos_id = 256
    eos_token = EOS_TOKEN_NAMES[0]

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids: TokenIds) -> str:
        """Bytes back to text; EOS ids are dropped, broken UTF-8 becomes U+FFFD."""
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def files(self) -> dict[str, Path]:
        return {}

    def hf_json(self) -> dict[str, Any]:
        """This tokenizer as a Hugging Face `tokenizers` file (tokenizer.json): the same ids for the same
        text. Each byte is a token of its own, named by GPT-2's byte-level alphabet, with no merges."""
        alphabet = byte_level_alphabet()
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
        return {"version": "1.0", "truncation": None, "padding": None,
                "added_tokens": [{"id": self.eos_id, "content": self.eos_token, "single_word": False, "lstrip": False,
                                  "rstrip": False, "normalized": False, "special": True}],
                "normalizer": None, "pre_tokenizer": byte_level, "post_processor": None, "decoder": byte_level,
                "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                          "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                          "ignore_merges": False, "vocab": {alphabet[b]: b for b in range(256)}, "merges": []}}


def byte_level_alphabet() -> list[str]:
    """GPT-2's printable name of each byte (the ByteLevel pre-tokenizer's): printable Latin-1 bytes stand
    for themselves, the others for the code points from 256 on, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    names, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            names[byte] = chr(byte)
        else:
            names[byte] = chr(256 + extra)
            extra += 1
    return [names[byte] for byte in range(256)]


class HFTokenizer:
    """A Hugging Face ``tokenizers`` JSON file (the package is imported lazily)."""

    def __init__(self, path: str | Path):
        path = Path(path)
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError:
            raise DataError(
                f"tokenizer {path}: the `tokenizers` package is needed for tokenizer "
                "JSON files (pip install tokenizers), or use the 'byte' tokenizer"
            ) from None
        if not path.is_file():
            raise DataError(f"tokenizer {path}: no such file (expected 'byte' or a tokenizer JSON file)")
        try:
            self._tokenizer = _HFTokenizer.from_file(str(path))
        except Exception as error:  # the Rust side raises plain Exception subclasses
            raise DataError(f"tokenizer {path}: cannot load ({error})") from None
        self.name = str(path.resolve())
        self.path = path
        self.vocab_size: int = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id: int | None = _find_eos_id(self._tokenizer)
        self.eos_token: str | None = None if self.eos_id is None else self._tokenizer.id_to_token(self.eos_id)

    def encode(self, text: str) -> np.ndarray:
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.int64)

    def decode(self, ids: TokenIds) -> str:
        return self._tokenizer.decode([int(i) for i in ids])

    def files(self) -> dict[str, Path]:
        """Its JSON file, and the tokenizer_config.json of a Hugging Face model folder beside it."""
        config = self.path.with_name(TOKENIZER_CONFIG_FILE)
        return {TOKENIZER_FILE: self.path, **({TOKENIZER_CONFIG_FILE: config} if config.is_file() else {})}


def _find_eos_id(tokenizer) -> int | None:
    for name in EOS_TOKEN_NAMES:
        token_id = tokenizer.token_to_id(name)
        if token_id is not None:
            return token_id
    return None


def load_tokenizer(spec: str) -> Tokenizer:
    """``"byte"`` for the byte tokenizer, otherwise a path to a tokenizer JSON file."""
    if spec == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec)
