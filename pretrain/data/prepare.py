"""Tokenize text files into a prepared dataset (files described in layout.py).

    python -m pretrain.data.prepare INPUT... --out DIR [--tokenizer byte|PATH.json] [--val-fraction 0.005]

INPUT is a text file or a folder searched recursively for *.txt, *.md and
*.jsonl (one JSON object per line with a "text" field). Every non-blank file
(or jsonl record) is one document, followed by the tokenizer's EOS id. The last
``val_fraction`` of the token stream becomes the validation split.
"""

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from pretrain.data.errors import DataError
from pretrain.data.layout import FORMAT_VERSION, META_FILE, SPLITS, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, bin_file, \
    token_dtype
from pretrain.data.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIX = ".jsonl"
COPY_BUFFER_BYTES = 1 << 20
TEXT_PROBE_BYTES = 8192


def prepare(
    inputs: Sequence[Path], out: Path, tokenizer: str = "byte", val_fraction: float = 0.005
) -> Path:
    """Tokenize ``inputs`` (files or folders) into the dataset directory ``out``."""
    files = find_input_files([Path(path) for path in inputs])
    return write_dataset(
        iter_documents(files),
        Path(out),
        load_tokenizer(tokenizer),
        val_fraction,
        sources=[str(path) for path in files],
    )


def find_input_files(inputs: Sequence[Path]) -> list[Path]:
    """Explicit files as given, plus the supported files inside folders (sorted); each file once,
    however many paths (symbolic links, overlapping folders) lead to it; every one of them text."""
    suffixes = (*TEXT_SUFFIXES, JSONL_SUFFIX)
    files: list[Path] = []
    for path in inputs:
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.suffix in suffixes and p.is_file())
        elif path.is_file():
            files.append(path)
        else:
            raise DataError(f"input {path}: no such file or directory")
    if not files:
        searched = ", ".join(str(path) for path in inputs) or "(no inputs given)"
        raise DataError(f"no input files ({', '.join(suffixes)}) found in {searched}")
    first_paths: dict[Path, Path] = {}
    for path in files:
        first_paths.setdefault(path.resolve(), path)
    unique = list(first_paths.values())
    for path in unique:
        check_is_text(path)
    return unique


def check_is_text(path: Path) -> None:
    """Refuse a file that is not text (a NUL byte in its first block, as in any binary: ELF, images, archives)."""
    with open(path, "rb") as head:
        if b"\0" in head.read(TEXT_PROBE_BYTES):
            raise DataError(f"input {path} is not a text file (it holds NUL bytes, like a program or an archive); "
                            "give text, markdown or jsonl files")


def iter_documents(files: Iterable[Path]) -> Iterator[str]:
    """One document per text file, or per record of a jsonl file."""
    for path in files:
        if path.suffix == JSONL_SUFFIX:
            yield from _jsonl_texts(path)
        else:
            yield path.read_text(encoding="utf-8", errors="replace")


def _jsonl_texts(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8", errors="replace") as lines:
        for line_number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{path}:{line_number}: invalid JSON ({error.msg})") from None
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise DataError(f'{path}:{line_number}: record has no string "text" field')
            yield text


def write_dataset(
    documents: Iterable[str],
    out: Path,
    tokenizer: Tokenizer,
    val_fraction: float,
    sources: Sequence[str],
) -> Path:
    """Stream ``documents`` through ``tokenizer`` into the dataset directory ``out``.

    Everything is written into a staging folder inside ``out`` and moved into
    place only once complete, ``meta.json`` last: a crash or error leaves either
    the previous dataset or no ``meta.json`` at all, never a half dataset that
    looks complete.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction={val_fraction}: must be in [0, 1)")
    if tokenizer.eos_id is None:
        log.warning("tokenizer %s has no EOS token: documents are not separated", tokenizer.name)
    dtype = token_dtype(tokenizer.vocab_size)
    created = not out.exists()
    staging = _make_staging_dir(out)
    published = False
    try:
        num_tokens = _write_tokens(documents, tokenizer, dtype, bin_file(staging, "train"))
        if num_tokens == 0:
            raise DataError(f"no text to tokenize in {_describe(sources)}")
        num_val = min(round(num_tokens * val_fraction), num_tokens - 1)
        _move_tail(bin_file(staging, "train"), bin_file(staging, "val"), num_val * dtype.itemsize)
        for name, path in tokenizer.files().items():
            shutil.copyfile(path, staging / name)
        meta = {
            "format": FORMAT_VERSION,
            "dtype": dtype.name,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
            "tokenizer": tokenizer.name,
            "num_tokens": {"train": num_tokens - num_val, "val": num_val},
            "sources": list(sources),
        }
        (staging / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        _publish(staging, out)
        published = True
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if created and not published:
            shutil.rmtree(out, ignore_errors=True)  # a failed first prepare leaves no folder behind
    return out


def _make_staging_dir(out: Path) -> Path:
    try:
        out.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(dir=out, prefix=".staging-"))
    except OSError as error:
        raise DataError(f"output {out}: not writable ({error.strerror or error})") from None


def _write_tokens(documents: Iterable[str], tokenizer: Tokenizer, dtype: np.dtype, path: Path) -> int:
    """Append each non-blank document and its EOS to ``path``; return the token count."""
    separator = np.asarray([] if tokenizer.eos_id is None else [tokenizer.eos_id], dtype=dtype)
    num_tokens = 0
    with open(path, "wb") as sink:
        for text in documents:
            if not text.strip():
                continue
            ids = tokenizer.encode(text).astype(dtype)
            sink.write(ids.tobytes())
            sink.write(separator.tobytes())
            num_tokens += len(ids) + len(separator)
    return num_tokens


def _move_tail(source: Path, target: Path, num_bytes: int) -> None:
    """Move the last ``num_bytes`` of ``source`` into a new file ``target``."""
    keep = source.stat().st_size - num_bytes
    with open(source, "r+b") as head, open(target, "wb") as tail:
        head.seek(keep)
        shutil.copyfileobj(head, tail, COPY_BUFFER_BYTES)
        head.truncate(keep)


def _publish(staging: Path, out: Path) -> None:
    (out / META_FILE).unlink(missing_ok=True)
    for split in SPLITS:
        os.replace(bin_file(staging, split), bin_file(out, split))
    for name in (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE):  # the copies of this tokenizer, none of an earlier one
        (out / name).unlink(missing_ok=True)
        if (staging / name).is_file():
            os.replace(staging / name, out / name)
    os.replace(staging / META_FILE, out / META_FILE)


def _describe(sources: Sequence[str], limit: int = 3) -> str:
    shown = ", ".join(sources[:limit])
    return shown + (f" (+{len(sources) - limit} more)" if len(sources) > limit else "")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain.data.prepare", description=__doc__.split("\n")[0])
    parser.add_argument("inputs", nargs="+", type=Path, metavar="INPUT", help="text/markdown/jsonl files or folders")
    parser.add_argument("--out", required=True, type=Path, help="dataset directory to write")
    parser.add_argument("--tokenizer", default="byte", help="'byte' or a tokenizer JSON file (default: byte)")
    parser.add_argument("--val-fraction", type=float, default=0.005, help="share of tokens held out (default: 0.005)")
    args = parser.parse_args(argv)
    try:
        out = prepare(args.inputs, args.out, args.tokenizer, args.val_fraction)
    except (DataError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    meta = json.loads((out / META_FILE).read_text(encoding="utf-8"))
    counts = meta["num_tokens"]
    print(f"wrote {out}: {counts['train']} train + {counts['val']} val tokens ({meta['dtype']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
