"""Tokenizers: a dependency-free byte tokenizer and a Hugging Face JSON wrapper.

Both encode a batch of documents into one flat array, each document followed by the end-of-document
id: that is what a shard holds. A tokenizer file's own truncation and padding are switched off on
loading (a tokenizer.json made for a 128-token embedding model would otherwise keep 128 tokens of
every document, silently), and its special tokens are not added: every token of every document is kept.
"""

from __future__ import annotations

import hashlib
import itertools
from pathlib import Path
from typing import Any, Protocol, Sequence

import numpy as np

from pretrain.data.errors import DataError
from pretrain.data.layout import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE

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
    eos_token: str | None
    # sha256 of the tokenizer file (None for the byte tokenizer): datasets of a mixture must share it.
    fingerprint: str | None

    def encode(self, text: str) -> np.ndarray: ...

    def encode_documents(self, texts: Sequence[str], dtype: np.dtype) -> np.ndarray: ...

    def decode(self, ids: TokenIds) -> str: ...

    def files(self) -> dict[str, Path]:
        """The files that define it, by the names a prepared dataset keeps copies under."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, plus one end-of-document id (256)."""

    name = BYTE
    vocab_size = 257
    fingerprint = None

    def __init__(self, eos: bool = True):
        self.eos_id: int | None = 256 if eos else None
        self.eos_token: str | None = EOS_TOKEN_NAMES[0] if eos else None

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

    def files(self) -> dict[str, Path]:
        return {}

    def hf_json(self) -> dict[str, Any]:
        """This tokenizer as a Hugging Face `tokenizers` file (tokenizer.json): the same ids for the same
        text. Each byte is a token of its own, named by GPT-2's byte-level alphabet, with no merges."""
        alphabet = byte_level_alphabet()
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
        added = [{"id": self.eos_id, "content": self.eos_token, "single_word": False, "lstrip": False,
                  "rstrip": False, "normalized": False, "special": True}] if self.eos_id is not None else []
        return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
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
        self.path = path
        self.fingerprint: str | None = hashlib.sha256(path.read_bytes()).hexdigest()
        self.vocab_size: int = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.use_eos(self._eos_id(eos))

    def use_eos(self, eos_id: int | None) -> None:
        """End documents with `eos_id` (None: no separator), e.g. the one a dataset was prepared with."""
        self.eos_id: int | None = eos_id
        self.eos_token: str | None = None if eos_id is None else self._tokenizer.id_to_token(eos_id)

    def files(self) -> dict[str, Path]:
        """Its JSON file, and the tokenizer_config.json of a Hugging Face model folder beside it."""
        config = self.path.with_name(TOKENIZER_CONFIG_FILE)
        return {TOKENIZER_FILE: self.path, **({TOKENIZER_CONFIG_FILE: config} if config.is_file() else {})}

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
