"""Reading the documents of one part of the input (pretrain.data.inputs), in every format.

Each reader yields `(text, done)`: a document and how many of the part's input bytes are read so far
(for progress). Documents are streamed: memory holds one batch of rows (parquet, arrow) or one line
(jsonl), whatever the file's size. Malformed input fails with a one-line DataError naming the file
and the line or row. pyarrow (parquet, arrow) and zstandard (.zst) are imported only when such a
file is read.
"""

from __future__ import annotations

import gzip
import io
import json
import zlib
from pathlib import Path
from typing import IO, Any, Callable, Iterator

from pretrain.data.errors import DataError
from pretrain.data.inputs import EXTRAS, Part, first_line, open_parquet

ROWS_PER_BATCH = 1024


def documents(part: Part, text_field: str) -> Iterator[tuple[str, int]]:
    if part.format == "text":
        yield Path(part.path).read_text(encoding="utf-8", errors="replace"), part.size
    elif part.format == "parquet":
        yield from _parquet_texts(part, text_field)
    elif part.format == "arrow":
        yield from _arrow_texts(part, text_field)
    else:
        yield from _jsonl_texts(part, text_field)


# ---- JSON lines, plain or compressed -----------------------------------------------------------------
def _jsonl_texts(part: Part, text_field: str) -> Iterator[tuple[str, int]]:
    for line_number, line, done in _lines(part):
        if not line.strip():
            continue
        try:
            record = json.loads(line.decode("utf-8", errors="replace"))
        except json.JSONDecodeError as error:
            raise DataError(f"{_where(part, line_number)}: invalid JSON ({error.msg}); "
                            "every line must be one JSON object") from None
        text = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            found = f"keys: {', '.join(list(record)[:8])}" if isinstance(record, dict) else "not a JSON object"
            raise DataError(f'{_where(part, line_number)}: record has no string "{text_field}" field ({found}); '
                            "choose the field with --text-field")
        yield text, done


def _lines(part: Part) -> Iterator[tuple[int, bytes, int]]:
    """(line number within the part, line, input bytes read) for every line of the part."""
    with open(part.path, "rb") as raw:
        if part.format == "jsonl":
            yield from _byte_range_lines(raw, part)
            return
        stream = _decompressed(raw, part)
        number = 0
        try:
            for line in stream:
                number += 1
                yield number, line, min(raw.tell(), part.size)
        except (OSError, EOFError, zlib.error) as error:  # gzip.BadGzipFile is an OSError
            raise DataError(f"{part.path}: damaged gzip stream after line {number} ({error}); "
                            "download or write it again") from None
        except _zstd_error() as error:
            raise DataError(f"{part.path}: damaged zstd stream after line {number} ({error}); "
                            "download or write it again") from None


def _byte_range_lines(raw: IO[bytes], part: Part) -> Iterator[tuple[int, bytes, int]]:
    """The lines that start within [start, stop) of an uncompressed file."""
    stop = part.stop if part.stop is not None else part.size
    position = part.start
    raw.seek(max(part.start - 1, 0))
    if part.start > 0 and raw.read(1) != b"\n":
        position += len(raw.readline())  # the line that began before start is the previous part's
    number = 0
    while position < stop:
        line = raw.readline()
        if not line:
            return
        number += 1
        position += len(line)
        yield number, line, position - part.start


def _decompressed(raw: IO[bytes], part: Part) -> IO[bytes]:
    if part.format == "jsonl.gz":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    try:
        import zstandard
    except ImportError:
        raise DataError(f"{part.path}: reading .zst files needs the zstandard package ({EXTRAS})") from None
    return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True))


def _zstd_error() -> type[Exception]:
    try:
        import zstandard
    except ImportError:
        return DataError  # never raised by the stream: without zstandard no .zst is read
    return zstandard.ZstdError


def _where(part: Part, line_number: int) -> str:
    """FILE:LINE of a part's line; a byte range counts the lines before it only when this is needed."""
    if part.format == "jsonl" and part.start:
        with open(part.path, "rb") as raw:
            before = raw.read(part.start)
        # A part that starts inside a line begins after it: that line's end lies beyond `before`.
        line_number += before.count(b"\n") + (0 if before.endswith(b"\n") else 1)
    return f"{part.path}:{line_number}"


# ---- columns: parquet and arrow ------------------------------------------------------------------
def _parquet_texts(part: Part, text_field: str) -> Iterator[tuple[str, int]]:
    parquet = open_parquet(part.path)
    metadata = parquet.metadata
    stop = part.stop if part.stop is not None else metadata.num_row_groups
    groups = list(range(part.start, stop))
    _check_column(part, parquet.schema_arrow, text_field)
    first_row = sum(metadata.row_group(i).num_rows for i in range(part.start))
    rows = sum(metadata.row_group(i).num_rows for i in groups) or 1
    batches = parquet.iter_batches(batch_size=ROWS_PER_BATCH, row_groups=groups, columns=[text_field])
    yield from _column_texts(part, _guarded(part, batches), text_field, first_row,
                             lambda read: part.size * read // rows)


def _arrow_texts(part: Part, text_field: str) -> Iterator[tuple[str, int]]:
    try:
        import pyarrow as pa
    except ImportError:
        raise DataError(f"{part.path}: reading arrow files needs pyarrow ({EXTRAS})") from None
    source = pa.memory_map(part.path)
    try:
        reader = pa.ipc.open_stream(source)  # what datasets' save_to_disk writes
    except pa.ArrowInvalid:
        try:
            reader = pa.ipc.open_file(source)
        except pa.ArrowInvalid as error:
            raise DataError(f"{part.path}: not an Arrow IPC stream or file ({first_line(error)})") from None
    _check_column(part, reader.schema, text_field)
    if isinstance(reader, pa.ipc.RecordBatchFileReader):
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    else:
        batches = iter(reader)
    yield from _column_texts(part, _guarded(part, batches), text_field, 0, lambda _: min(source.tell(), part.size))


def _check_column(part: Part, schema, text_field: str) -> None:
    if text_field not in schema.names:
        raise DataError(f'{part.path}: no column "{text_field}" (columns: {", ".join(schema.names[:12])}); '
                        "choose it with --text-field")
    kind = str(schema.field(text_field).type)
    if kind not in ("string", "large_string", "string_view"):
        raise DataError(f'{part.path}: column "{text_field}" holds {kind}, not text; choose a text column '
                        "with --text-field")


def _column_texts(part: Part, batches: Iterator[Any], text_field: str, first_row: int,
                  bytes_done: Callable[[int], int]) -> Iterator[tuple[str, int]]:
    """The column's values, batch by batch; bytes_done turns the rows read into input bytes, for progress."""
    read = 0
    for batch in batches:
        column = batch.column(batch.schema.get_field_index(text_field))
        if column.null_count:
            at = first_row + read + column.is_null().to_pylist().index(True)
            raise DataError(f'{part.path}: row {at}: "{text_field}" is null; drop such rows or fill them with text')
        read += len(column)
        done = bytes_done(read)
        for text in column.to_pylist():
            yield text, done


def _guarded(part: Part, batches: Iterator[Any]) -> Iterator[Any]:
    """Batches, with pyarrow's errors on damaged data as one-line DataErrors naming the file."""
    try:
        yield from batches
    except (OSError, ValueError) as error:  # ArrowInvalid is a ValueError, ArrowIOError an OSError
        raise DataError(f"{part.path}: damaged data ({first_line(error)}); download or write it again") from None
