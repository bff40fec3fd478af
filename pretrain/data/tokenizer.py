"""Tokenizers: a dependency-free byte tokenizer and a Hugging Face JSON wrapper.

Both encode a batch of documents into one flat array, each document followed by the end-of-document
id: that is what a shard holds. A tokenizer file's own truncation and padding are switched off on
loading (a tokenizer.json made for a 128-token embedding model would otherwise keep 128 tokens of
every document, silently), and its special tokens are not added: every token of every document is kept.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np

from pretrain.data.errors import DataError

TokenIds = Sequence[int] | np.ndarray

# Special tokens that conventionally end a document, in order of preference.
EOS_TOKEN_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
# --eos NO_EOS: documents follow each other with no id between them.
NO_EOS = "none"
BYTE = "byte"


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: int | None
    # sha256 of the tokenizer file (None for the byte tokenizer): datasets of a mixture must share it.
    fingerprint: str | None

    def encode(self, text: str) -> np.ndarray: ...

    def encode_documents(self, texts: Sequence[str], dtype: np.dtype) -> np.ndarray: ...

    def decode(self, ids: TokenIds) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, plus one end-of-document id (256)."""

    name = BYTE
    vocab_size = 257
    fingerprint = None

    def __init__(self, eos: bool = True):
        self.eos_id: int | None = 256 if eos else None

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def encode_documents(self, texts: Sequence[str], dtype: np.dtype) -> np.ndarray:
        """All bytes in one numpy pass: the EOS positions are known from the documents' lengths."""
        encoded = [text.encode("utf-8") for text in texts]
        data = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        if self.eos_id is None:
            return data.astype(dtype)
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        ends = np.cumsum(lengths + 1) - 1
        out = np.empty(len(data) + len(encoded), dtype=dtype)
        is_eos = np.zeros(len(out), dtype=bool)
        is_eos[ends] = True
        out[is_eos] = self.eos_id
        out[~is_eos] = data
        return out

    def decode(self, ids: TokenIds) -> str:
        """Bytes back to text; EOS ids are dropped, broken UTF-8 becomes U+FFFD."""
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizers`` JSON file (the package is imported lazily)."""

    def __init__(self, path: str | Path, eos: str | None = None):
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
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        self.name = str(path.resolve())
        self.fingerprint: str | None = hashlib.sha256(path.read_bytes()).hexdigest()
        self.vocab_size: int = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id: int | None = self._eos_id(eos)

    def encode(self, text: str) -> np.ndarray:
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.int64)

    def encode_documents(self, texts: Sequence[str], dtype: np.dtype) -> np.ndarray:
        """The batch through the library's batch encoding (no offsets kept: they are not needed)."""
        documents = [encoding.ids for encoding in self._tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
        if self.eos_id is not None:
            for ids in documents:
                ids.append(self.eos_id)
        count = sum(map(len, documents))
        return np.fromiter(itertools.chain.from_iterable(documents), dtype=dtype, count=count)

    def decode(self, ids: TokenIds) -> str:
        return self._tokenizer.decode([int(i) for i in ids])

    def _eos_id(self, eos: str | None) -> int | None:
        """The end-of-document id: the token named by --eos, else the first conventional one found."""
        if eos == NO_EOS:
            return None
        if eos is not None:
            token_id = self._tokenizer.token_to_id(eos)
            if token_id is None:
                raise DataError(f"--eos {eos}: tokenizer {self.name} has no such token; name one of its special "
                                f"tokens, or --eos {NO_EOS} to join documents without a separator")
            return token_id
        for name in EOS_TOKEN_NAMES:
            token_id = self._tokenizer.token_to_id(name)
            if token_id is not None:
                return token_id
        raise DataError(f"tokenizer {self.name} has no end-of-document token (none of {', '.join(EOS_TOKEN_NAMES)}): "
                        f"name the one that separates documents with --eos TOKEN (e.g. --eos [SEP] for a BERT-style "
                        f"tokenizer), or --eos {NO_EOS} to join documents without a separator")


def load_tokenizer(spec: str, eos: str | None = None) -> Tokenizer:
    """``"byte"`` for the byte tokenizer, otherwise a path to a tokenizer JSON file.

    eos: None for the tokenizer's own end-of-document token, a token's text, or NO_EOS for none.
    """
    if spec == BYTE:
        if eos not in (None, NO_EOS):
            raise DataError(f"--eos {eos}: the byte tokenizer's end-of-document id is 256; "
                            f"--eos takes a token of a tokenizer JSON file, or {NO_EOS}")
        return ByteTokenizer(eos=eos is None)
    return HFTokenizer(spec, eos)


def single_threaded() -> None:
    """Encode in this thread only: parallelism comes from worker processes, one per core."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
