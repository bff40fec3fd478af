"""What a prepare reads: input files found from paths, globs and folders, cut into the pieces that become shards.

Formats, by name: `.txt`/`.md` (a file is one document); `.jsonl`, `.jsonl.gz`/`.json.gz`,
`.jsonl.zst`/`.json.zst` (one JSON object per line, the text under --text-field); `.parquet` and
`.arrow` (the --text-field column); a folder written by `datasets`' `save_to_disk` (its `.arrow`
files, in the order its state.json lists them, read with pyarrow: `datasets` itself is not needed).
A file given by name whose name says none of these is read as text.

A piece is a list of parts (a whole file, a range of a parquet file's row groups, or a byte range
of an uncompressed jsonl file) of about `shard_bytes` input bytes: small files are grouped, large
ones split where the format allows (compressed streams cannot be split). The pieces depend only on
the inputs and `shard_bytes`, never on the number of workers, so neither does the output.
"""

from __future__ import annotations

import glob
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from pretrain.data.errors import DataError

FORMATS = {".txt": "text", ".md": "text", ".jsonl": "jsonl", ".jsonl.gz": "jsonl.gz", ".json.gz": "jsonl.gz",
           ".jsonl.zst": "jsonl.zst", ".json.zst": "jsonl.zst", ".parquet": "parquet", ".arrow": "arrow"}
UNCOMPRESSED_TEXT = ("text", "jsonl")
HF_STATE_FILE = "state.json"
HF_DATASET_DICT_FILE = "dataset_dict.json"
TEXT_PROBE_BYTES = 8192
EXTRAS = "pip install -e '.[data]'"
GLOB_CHARACTERS = "*?["


@dataclass(frozen=True)
class Part:
    """A file, or the range [start, stop) of one: row groups of a parquet file, bytes of a jsonl file."""

    path: str
    format: str
    size: int  # input bytes (uncompressed for parquet): for grouping, scheduling and progress
    start: int = 0
    stop: int | None = None

    def describe(self) -> str:
        if self.stop is None:
            return self.path
        unit = "row groups" if self.format == "parquet" else "bytes"
        return f"{self.path} ({unit} {self.start}-{self.stop})"

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Part:
        return Part(**data)


Piece = list[Part]


def format_of(path: Path) -> str | None:
    """The input format a file's name says, or None."""
    name = path.name.lower()
    return next((kind for suffix, kind in FORMATS.items() if name.endswith(suffix)), None)


def find_input_files(inputs: Sequence[str | Path]) -> list[Path]:
    """Explicit files as given, the files of globs and folders (sorted, a `datasets` folder's in its own
    order); each file once, however many paths (symbolic links, overlapping folders) lead to it."""
    files: list[Path] = []
    for given in inputs:
        path = Path(given).expanduser()
        if path.exists():
            files += _files_of(path)
        elif any(c in str(given) for c in GLOB_CHARACTERS):
            matches = sorted(glob.glob(str(path), recursive=True))
            if not matches:
                raise DataError(f"input {given}: no file matches this pattern")
            files += [file for match in matches for file in _files_of(Path(match))]
        else:
            raise DataError(f"input {given}: no such file or directory")
    if not files:
        searched = ", ".join(str(path) for path in inputs) or "(no inputs given)"
        raise DataError(f"no input files ({', '.join(FORMATS)} or a datasets folder) found in {searched}")
    first_paths: dict[Path, Path] = {}
    for path in files:
        first_paths.setdefault(path.resolve(), path)
    unique = list(first_paths.values())
    for path in unique:
        if (format_of(path) or "text") in UNCOMPRESSED_TEXT:
            check_is_text(path)
    return unique


def _files_of(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if (path / HF_DATASET_DICT_FILE).is_file():
        raise DataError(f"input {path} is a datasets DatasetDict (splits {_splits(path)}): give the folder of "
                        f"one split, e.g. {path / 'train'}")
    if (path / HF_STATE_FILE).is_file():
        return _hf_arrow_files(path)
    roots = sorted(p.parent for p in path.rglob(HF_STATE_FILE) if (p.parent / "dataset_info.json").is_file())
    entries = [(root, _hf_arrow_files(root)) for root in roots]
    entries += [(p, [p]) for p in path.rglob("*")
                if format_of(p) and p.is_file() and not any(root in p.parents for root in roots)]
    return [file for _, group in sorted(entries, key=lambda entry: entry[0]) for file in group]


def _hf_arrow_files(folder: Path) -> list[Path]:
    """The data files of a `save_to_disk` folder, in the order of its state.json."""
    state_path = folder / HF_STATE_FILE
    try:
        state = json.loads(state_path.read_text(encoding="utf-8"))
        names = [entry["filename"] for entry in state["_data_files"]]
    except (ValueError, KeyError, TypeError) as error:
        raise DataError(f"{state_path}: not the state.json of a datasets save_to_disk folder ({error!r})") from None
    missing = [name for name in names if not (folder / name).is_file()]
    if missing:
        raise DataError(f"input {folder}: its {HF_STATE_FILE} lists {missing[0]}, which is missing")
    return [folder / name for name in names]


def _splits(folder: Path) -> str:
    try:
        return ", ".join(json.loads((folder / HF_DATASET_DICT_FILE).read_text())["splits"])
    except (ValueError, KeyError, TypeError):
        return "unknown"


def check_is_text(path: Path) -> None:
    """Refuse a file that is not text (a NUL byte in its first block, as in any binary: ELF, images, archives)."""
    with open(path, "rb") as head:
        if b"\0" in head.read(TEXT_PROBE_BYTES):
            raise DataError(f"input {path} is not a text file (it holds NUL bytes, like a program or an archive); "
                            f"give text, markdown, jsonl (optionally .gz or .zst), parquet or arrow files")


def plan_pieces(files: Sequence[Path], shard_bytes: int) -> list[Piece]:
    """The pieces of the input, in order: parts grouped until a piece holds at least shard_bytes."""
    pieces: list[Piece] = []
    current: Piece = []
    size = 0
    for part in (part for path in files for part in _parts(path, shard_bytes)):
        current.append(part)
        size += part.size
        if size >= shard_bytes:
            pieces.append(current)
            current, size = [], 0
    return pieces + ([current] if current else [])


def _parts(path: Path, shard_bytes: int) -> Iterator[Part]:
    kind = format_of(path) or "text"
    size = path.stat().st_size
    if kind == "parquet":
        yield from _parquet_parts(path, shard_bytes)
    elif kind == "jsonl" and size > shard_bytes:
        for start in range(0, size, shard_bytes):
            yield Part(str(path), kind, min(shard_bytes, size - start), start, min(start + shard_bytes, size))
    else:
        yield Part(str(path), kind, size)


def _parquet_parts(path: Path, shard_bytes: int) -> Iterator[Part]:
    """Runs of row groups of about shard_bytes (uncompressed) each."""
    metadata = open_parquet(path).metadata
    sizes = [metadata.row_group(i).total_byte_size for i in range(metadata.num_row_groups)]
    start, size = 0, 0
    for stop in range(1, len(sizes) + 1):
        size += sizes[stop - 1]
        if size >= shard_bytes or stop == len(sizes):
            whole = start == 0 and stop == len(sizes)
            yield Part(str(path), "parquet", size, start, None if whole else stop)
            start, size = stop, 0


def piece_to_json(piece: Piece) -> list[dict[str, Any]]:
    return [asdict(part) for part in piece]


def piece_from_json(data: list[dict[str, Any]]) -> Piece:
    return [Part.from_dict(part) for part in data]


def open_parquet(path: Path | str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading parquet files needs pyarrow ({EXTRAS})") from None
    try:
        return pq.ParquetFile(path)
    except Exception as error:  # pyarrow raises ArrowInvalid, OSError
        raise DataError(f"{path}: not a readable parquet file ({first_line(error)})") from None


def first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
