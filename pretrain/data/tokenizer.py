"""Tokenizers: a dependency-free byte tokenizer and a Hugging Face JSON wrapper."""

from pathlib import Path
from typing import Protocol, Sequence

import numpy as np

from pretrain.data.errors import DataError

TokenIds = Sequence[int] | np.ndarray

# Special tokens that conventionally end a document, in order of preference.
EOS_TOKEN_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: int | None

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids: TokenIds) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, plus one end-of-document id (256)."""

    name = "byte"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids: TokenIds) -> str:
        """Bytes back to text; EOS ids are dropped, broken UTF-8 becomes U+FFFD."""
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")


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
        self.vocab_size: int = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id: int | None = _find_eos_id(self._tokenizer)

    def encode(self, text: str) -> np.ndarray:
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.int64)

    def decode(self, ids: TokenIds) -> str:
        return self._tokenizer.decode([int(i) for i in ids])


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
