"""Preparing real corpora: every input format, every token kept, any number of workers, failures and
interruptions that leave the previous dataset (or none), appending shards."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pretrain.data.build import prepare
from pretrain.data.dataset import TokenDataset
from pretrain.data.errors import DataError
from pretrain.data.progress import Progress
from pretrain.data.tokenizer import ByteTokenizer, load_tokenizer
from tests.helpers import REPO, hidden_slurm_path
from tests.test_data import expected_stream, one_line_error, stream_of

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
zstandard = pytest.importorskip("zstandard")
tokenizers = pytest.importorskip("tokenizers")

DOCUMENTS = [f"Document {i}: " + "ünïcode and words. " * (i % 7 + 1) + "\n" for i in range(60)] + ["  \n"]
KEPT = [doc for doc in DOCUMENTS if doc.strip()]  # blank documents are skipped


def jsonl(documents: list[str], field: str = "text") -> bytes:
    return "".join(json.dumps({field: doc, "id": i}) + "\n" for i, doc in enumerate(documents)).encode()


def write_format(folder: Path, kind: str, documents: list[str] = DOCUMENTS, field: str = "text") -> Path:
    """The documents as one input of format `kind`; returns the path to give prepare."""
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "txt":
        for i, doc in enumerate(documents):
            (folder / f"{i:03d}.txt").write_text(doc, encoding="utf-8")
        return folder
    if kind == "jsonl":
        (folder / "docs.jsonl").write_bytes(jsonl(documents, field))
    elif kind in ("jsonl.gz", "json.gz"):
        (folder / f"docs.{kind}").write_bytes(gzip.compress(jsonl(documents, field)))
    elif kind == "jsonl.zst":
        (folder / "docs.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl(documents, field)))
    elif kind == "parquet":
        pq.write_table(pa.table({field: documents, "id": list(range(len(documents)))}), folder / "docs.parquet",
                       row_group_size=7)
    elif kind == "arrow":
        table = pa.table({field: documents})
        with pa.ipc.new_file(folder / "docs.arrow", table.schema) as writer:
            writer.write_table(table, max_chunksize=9)
    elif kind == "datasets":
        datasets = pytest.importorskip("datasets")
        datasets.Dataset.from_dict({field: documents}).save_to_disk(str(folder / "saved"), num_shards=3)
        return folder / "saved"
    return folder / next(p.name for p in folder.iterdir())


FORMATS = ["txt", "jsonl", "jsonl.gz", "json.gz", "jsonl.zst", "parquet", "arrow", "datasets"]


@pytest.mark.parametrize("kind", FORMATS)
def test_every_format_gives_every_document_in_order(tmp_path: Path, kind: str):
    given = write_format(tmp_path / "in", kind)
    out = prepare([given], tmp_path / "out", val_fraction=0.0)
    np.testing.assert_array_equal(stream_of(out), expected_stream(KEPT))
    assert TokenDataset(out).meta["num_documents"] == len(KEPT)


@pytest.mark.parametrize("kind", ["jsonl.zst", "parquet", "datasets"])
def test_text_field_names_the_key_or_column(tmp_path: Path, kind: str):
    given = write_format(tmp_path / "in", kind, field="content")
    with pytest.raises(DataError) as excinfo:
        prepare([given], tmp_path / "out")
    assert '"text"' in one_line_error(excinfo) and "--text-field" in str(excinfo.value)
    out = prepare([given], tmp_path / "out", text_field="content", val_fraction=0.0)
    np.testing.assert_array_equal(stream_of(out), expected_stream(KEPT))


def test_folders_and_globs_mix_formats_in_path_order(tmp_path: Path):
    write_format(tmp_path / "in" / "a", "parquet", DOCUMENTS[:10])
    write_format(tmp_path / "in" / "b", "jsonl.zst", DOCUMENTS[10:20])
    write_format(tmp_path / "in" / "c", "datasets", DOCUMENTS[20:30])
    (tmp_path / "in" / "c" / "notes.json").write_text("{}")  # neither a format nor part of the saved dataset
    out = prepare([tmp_path / "in"], tmp_path / "out", val_fraction=0.0)
    np.testing.assert_array_equal(stream_of(out), expected_stream(DOCUMENTS[:30]))
    globbed = prepare([str(tmp_path / "in" / "**" / "*.jsonl.zst"), str(tmp_path / "in" / "a" / "*.parquet")],
                      tmp_path / "globbed", val_fraction=0.0)
    np.testing.assert_array_equal(stream_of(globbed), expected_stream(DOCUMENTS[10:20] + DOCUMENTS[:10]))
    with pytest.raises(DataError, match="no file matches this pattern"):
        prepare([str(tmp_path / "in" / "*.nothing")], tmp_path / "none")


def test_a_dataset_dict_folder_asks_for_one_split(tmp_path: Path):
    datasets = pytest.importorskip("datasets")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]}),
                          "test": datasets.Dataset.from_dict({"text": ["b"]})}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError) as excinfo:
        prepare([tmp_path / "dd"], tmp_path / "out")
    assert f"give the folder of one split, e.g. {tmp_path / 'dd' / 'train'}" in one_line_error(excinfo)


def test_malformed_input_names_the_file_and_the_line_or_row(tmp_path: Path):
    lines = jsonl(DOCUMENTS[:40]).splitlines(keepends=True)
    lines[33] = b'{"text": "cut off\n'
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"".join(lines))
    for shard_mb in (32, 0.0005):  # one part, and byte ranges: the line number counts from the file's start
        with pytest.raises(DataError) as excinfo:
            prepare([bad], tmp_path / "out", shard_mb=shard_mb, workers=2)
        assert one_line_error(excinfo).startswith(f"{bad}:34: invalid JSON")
    assert not (tmp_path / "out").exists()

    truncated = tmp_path / "cut.jsonl.gz"
    truncated.write_bytes(gzip.compress(jsonl(DOCUMENTS))[:-30])
    with pytest.raises(DataError, match=rf"{truncated}: damaged gzip stream after line \d+"):
        prepare([truncated], tmp_path / "out")
    damaged = tmp_path / "damaged.jsonl.zst"
    damaged.write_bytes(zstandard.ZstdCompressor().compress(jsonl(DOCUMENTS))[:-40] + b"\xff" * 40)
    with pytest.raises(DataError, match=rf"{damaged}: damaged zstd stream"):
        prepare([damaged], tmp_path / "out")

    nulls = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"text": ["a", "b", None, "d"]}), nulls, row_group_size=2)
    with pytest.raises(DataError) as excinfo:
        prepare([nulls], tmp_path / "out")
    assert one_line_error(excinfo) == f'{nulls}: row 2: "text" is null; drop such rows or fill them with text'
    numbers = tmp_path / "numbers.parquet"
    pq.write_table(pa.table({"text": [1, 2]}), numbers)
    with pytest.raises(DataError, match='column "text" holds int64, not text'):
        prepare([numbers], tmp_path / "out")
    fake = tmp_path / "fake.parquet"
    fake.write_text("not parquet")
    with pytest.raises(DataError, match=f"{fake}: not a readable parquet file"):
        prepare([fake], tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ---- every token kept ---------------------------------------------------------------------------------------
def bert_style_tokenizer(path: Path, corpus: list[str]) -> Path:
    """A WordPiece tokenizer like a sentence-embedding model's: [CLS]/[SEP] added, truncation at 16 tokens
    and padding, saved in its tokenizer.json, as the ones on the hub are."""
    wordpiece = tokenizers.Tokenizer(tokenizers.models.WordPiece(unk_token="[UNK]"))
    wordpiece.normalizer = tokenizers.normalizers.BertNormalizer()
    wordpiece.pre_tokenizer = tokenizers.pre_tokenizers.BertPreTokenizer()
    trainer = tokenizers.trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"])
    wordpiece.train_from_iterator(corpus, trainer)
    wordpiece.post_processor = tokenizers.processors.BertProcessing(("[SEP]", 3), ("[CLS]", 2))
    wordpiece.enable_truncation(max_length=16)
    wordpiece.enable_padding(length=16, pad_id=0, pad_token="[PAD]")
    wordpiece.save(str(path))
    assert json.loads(path.read_text())["truncation"]["max_length"] == 16
    return path


def byte_level_tokenizer(path: Path, corpus: list[str]) -> Path:
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(corpus, trainer)
    bpe.enable_truncation(max_length=8)
    bpe.save(str(path))
    return path


def documents_of(out: Path, eos_id: int) -> list[list[int]]:
    tokens = stream_of(out).tolist()
    documents, current = [], []
    for token in tokens:
        if token == eos_id:
            documents.append(current)
            current = []
        else:
            current.append(token)
    assert current == []
    return documents


LONG = [" ".join(f"word{(i * 7 + j) % 50} and more text" for j in range(40 + i)) for i in range(12)]


def test_a_tokenizer_that_truncates_keeps_every_token_of_every_document(tmp_path: Path):
    path = bert_style_tokenizer(tmp_path / "bert.json", LONG)
    write_format(tmp_path / "in", "jsonl", LONG)
    out = prepare([tmp_path / "in"], tmp_path / "out", tokenizer=str(path), eos="[SEP]", val_fraction=0.0,
                  workers=2, shard_mb=0.001)
    own = tokenizers.Tokenizer.from_file(str(path))
    own.no_truncation()
    own.no_padding()
    expected = [own.encode(doc, add_special_tokens=False).ids for doc in LONG]
    assert all(len(ids) > 100 for ids in expected)  # far past the file's 16
    assert documents_of(out, eos_id=3) == expected


def test_a_byte_level_tokenizer_round_trips_every_document(tmp_path: Path):
    path = byte_level_tokenizer(tmp_path / "bpe.json", LONG)
    write_format(tmp_path / "in", "parquet", LONG)
    out = prepare([tmp_path / "in"], tmp_path / "out", tokenizer=str(path), val_fraction=0.0)
    tokenizer = load_tokenizer(str(path))
    decoded = [tokenizer.decode(ids) for ids in documents_of(out, tokenizer.eos_id)]
    assert decoded == LONG


def test_a_tokenizer_without_an_end_of_document_token_needs_a_choice(tmp_path: Path):
    path = bert_style_tokenizer(tmp_path / "bert.json", LONG)
    write_format(tmp_path / "in", "jsonl", LONG[:2])
    with pytest.raises(DataError) as excinfo:
        prepare([tmp_path / "in"], tmp_path / "out", tokenizer=str(path))
    message = one_line_error(excinfo)
    assert "has no end-of-document token" in message and "--eos TOKEN" in message and "--eos none" in message
    assert not (tmp_path / "out").exists()
    with pytest.raises(DataError, match=r"--eos <\|endoftext\|>: tokenizer .* has no such token"):
        prepare([tmp_path / "in"], tmp_path / "out", tokenizer=str(path), eos="<|endoftext|>")
    joined = prepare([tmp_path / "in"], tmp_path / "none", tokenizer=str(path), eos="none", val_fraction=0.0)
    assert TokenDataset(joined).eos_id is None
    own = tokenizers.Tokenizer.from_file(str(path))
    own.no_truncation()
    assert stream_of(joined).tolist() == [t for doc in LONG[:2] for t in own.encode(doc, add_special_tokens=False).ids]


def test_byte_tokenizer_batch_matches_one_document_at_a_time():
    byte = ByteTokenizer()
    batch = ["", "a", "héllo 🚀", "x" * 1000]
    expected = np.concatenate([np.append(byte.encode(doc), 256) for doc in batch])
    np.testing.assert_array_equal(byte.encode_documents(batch, np.dtype(np.uint16)), expected)
    assert byte.encode_documents(batch, np.dtype(np.uint16)).dtype == np.uint16
    unseparated = ByteTokenizer(eos=False).encode_documents(batch, np.dtype(np.uint16))
    assert unseparated.tolist() == [b for doc in batch for b in doc.encode()]


# ---- workers, shards, failures ----------------------------------------------------------------------------
def mixed_corpus(root: Path) -> Path:
    write_format(root / "a", "txt", DOCUMENTS[:15])
    write_format(root / "b", "jsonl", DOCUMENTS * 3)
    write_format(root / "c", "parquet", DOCUMENTS)
    write_format(root / "d", "jsonl.zst", DOCUMENTS[::-1])
    return root


def files_of(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_the_output_is_the_same_for_any_number_of_workers(tmp_path: Path):
    corpus = mixed_corpus(tmp_path / "in")
    path = byte_level_tokenizer(tmp_path / "bpe.json", DOCUMENTS)
    one = prepare([corpus], tmp_path / "one", tokenizer=str(path), workers=1, shard_mb=0.002, val_fraction=0.1)
    three = prepare([corpus], tmp_path / "three", tokenizer=str(path), workers=3, shard_mb=0.002, val_fraction=0.1)
    index = json.loads((one / "index.json").read_text())
    assert len(index["shards"]) >= 6 and index["num_tokens"]["val"] > 0
    assert files_of(one) == files_of(three)  # byte for byte, the index and every shard and record
    # The same stream as one shard would hold, with each shard's tail as validation.
    whole = prepare([corpus], tmp_path / "whole", tokenizer=str(path), workers=1, val_fraction=0.0)
    assert np.array_equal(stream_of(one), stream_of(whole))


def test_a_failing_worker_stops_the_prepare_and_keeps_the_previous_dataset(tmp_path: Path):
    corpus = mixed_corpus(tmp_path / "in")
    out = prepare([corpus], tmp_path / "out", shard_mb=0.002)
    before = files_of(out)
    (corpus / "b" / "docs.jsonl").write_bytes(jsonl(DOCUMENTS) + b"{broken\n")
    with pytest.raises(DataError, match=r"docs\.jsonl:62: invalid JSON"):
        prepare([corpus], out, shard_mb=0.002, workers=3)
    assert files_of(out) == before


def start_prepare(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pretrain.data.prepare", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def kill_after_shards(process: subprocess.Popen, shards: Path, count: int, timeout: float = 120) -> None:
    """SIGKILL the prepare (and its workers) once `count` new shard records exist: mid-way, as a crash would."""
    deadline = time.monotonic() + timeout
    while len(list(shards.glob("*.json"))) < count:
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the prepare wrote no shards"
        time.sleep(0.02)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def test_a_killed_prepare_leaves_the_previous_dataset_or_none(tmp_path: Path):
    big = [doc * 40 for doc in LONG] * 5
    write_format(tmp_path / "in", "jsonl", big)
    path = byte_level_tokenizer(tmp_path / "bpe.json", LONG)
    args = [str(tmp_path / "in"), "--tokenizer", str(path), "--shard-mb", "0.05", "--workers", "2"]
    first = tmp_path / "first"
    kill_after_shards(start_prepare(*args, "--out", str(first)), first / "shards", 2)
    assert not (first / "index.json").exists()
    with pytest.raises(DataError) as excinfo:
        TokenDataset(first)
    assert "no index.json: a prepare that did not finish; run it again" in one_line_error(excinfo)

    previous = prepare([tmp_path / "in"], tmp_path / "out", tokenizer=str(path), val_fraction=0.0, shard_mb=1)
    reference = files_of(previous)
    kill_after_shards(start_prepare(*args, "--out", str(previous)), previous / "shards", 4)
    data = TokenDataset(previous)
    assert np.array_equal(data.read(0, data.num_tokens), stream_of(previous))
    assert {name: blob for name, blob in files_of(previous).items() if name in reference} == reference

    again = prepare([tmp_path / "in"], previous, tokenizer=str(path), val_fraction=0.0, shard_mb=1)
    assert np.array_equal(stream_of(again), np.frombuffer(b"".join(
        reference[k] for k in sorted(reference) if k.endswith(".bin")), dtype=np.uint16))
    index = json.loads((again / "index.json").read_text())
    listed = {f"shards/{s['number']:06d}.{ext}" for s in index["shards"] for ext in ("bin", "json")}
    kept_tokenizer = f"tokenizer/{index['tokenizer_sha256'][:16]}/tokenizer.json"  # the copy the dataset keeps
    assert set(files_of(again)) == listed | {"index.json", kept_tokenizer}  # the killed prepare's shards are gone


def test_append_adds_shards_with_the_same_tokenizer_only(tmp_path: Path):
    write_format(tmp_path / "one", "jsonl", DOCUMENTS[:20])
    write_format(tmp_path / "two", "parquet", DOCUMENTS[20:])
    out = prepare([tmp_path / "one"], tmp_path / "out", val_fraction=0.0)
    before = files_of(out)
    prepare([tmp_path / "two"], out, val_fraction=0.0, append=True)
    index = json.loads((out / "index.json").read_text())
    assert [s["number"] for s in index["shards"]] == [0, 1]
    assert {k: v for k, v in files_of(out).items() if k.startswith("shards/000000")} == {
        k: v for k, v in before.items() if k.startswith("shards/")}
    np.testing.assert_array_equal(stream_of(out), expected_stream(KEPT))
    path = byte_level_tokenizer(tmp_path / "bpe.json", LONG)
    with pytest.raises(DataError, match="--append: .* was prepared with tokenizer byte .* append with the same"):
        prepare([tmp_path / "two"], out, tokenizer=str(path), append=True)
    with pytest.raises(DataError, match="--append: no prepared dataset at"):
        prepare([tmp_path / "two"], tmp_path / "nothing", append=True)
    assert not (tmp_path / "nothing").exists()


def test_the_cli_prints_the_dataset_and_its_speed(tmp_path: Path):
    write_format(tmp_path / "in", "parquet")
    result = subprocess.run([sys.executable, "-m", "pretrain.data.prepare", str(tmp_path / "in"), "--out",
                             str(tmp_path / "out"), "--workers", "2"], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "in 1 shards; this prepare: " in result.stdout and "tokens/s" in result.stdout
    assert result.stderr == ""  # no progress line when stderr is not a terminal
    refused = subprocess.run([sys.executable, "-m", "pretrain.data.prepare", str(tmp_path / "in"), "--out",
                              str(tmp_path / "x"), "--workers", "0"], cwd=REPO, capture_output=True, text=True)
    assert refused.returncode == 1 and refused.stderr == "error: --workers 0: must be at least 1\n"


def test_a_job_array_dry_run_checks_prints_the_script_and_writes_nothing(tmp_path: Path, capsys, monkeypatch):
    """Also where Slurm's commands are missing (a laptop): the script is printed, and what is missing noted."""
    from pretrain.data.prepare import main

    monkeypatch.setenv("PATH", hidden_slurm_path(tmp_path))
    write_format(tmp_path / "in", "parquet")
    assert main([str(tmp_path / "in"), "--out", str(tmp_path / "out"), "+cluster=a100x8", "cluster.cpus_per_task=4",
                 "--shard-mb", "0.0005", "dry_run=true"]) == 0
    out = capsys.readouterr().out
    assert "#SBATCH --array=0-" in out and "#SBATCH --cpus-per-task=4" in out and "#SBATCH --ntasks-per-node=1" in out
    assert "--gpus" not in out and "# dry run: nothing was written or submitted" in out
    assert "sbatch is NOT on PATH here" in out
    assert not (tmp_path / "out").exists()
    assert main([str(tmp_path / "in"), "--out", str(tmp_path / "out"), "dry_run=true"]) == 1
    assert "are for a job array: add +cluster=NAME" in capsys.readouterr().err


class FakeTerminal:
    def __init__(self):
        self.text = ""

    def isatty(self):
        return True

    def write(self, text):
        self.text += text

    def flush(self):
        pass


def test_the_progress_line_shows_documents_tokens_speed_and_eta():
    terminal = FakeTerminal()
    progress = Progress(total_bytes=4_000_000, stream=terminal)
    progress.add(documents=1234, tokens=2_500_000, input_bytes=1_000_000)
    progress.close()
    line = terminal.text.strip("\r\n").split("\r")[-1]
    assert line.startswith("1,234 documents | 2.5M tokens | ") and " MB/s | 25% | ETA " in line
