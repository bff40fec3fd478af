"""Tests for pretrain.data: tokenizers, preparation, the built-in corpus and sampling."""

import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from pretrain.data.builtin import builtin_corpus_text, ensure_builtin_dataset
from pretrain.data.dataset import SyntheticDataset, TokenDataset
from pretrain.data.errors import DataError
from pretrain.data.build import prepare
from pretrain.data.layout import token_dtype
from pretrain.data.prepare import main as prepare_main
from pretrain.data.sampling import rank_indices
from pretrain.data.tokenizer import ByteTokenizer, load_tokenizer

BYTE = ByteTokenizer()


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """A folder with one document per text file and per jsonl record."""
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("Hello, world.\n", encoding="utf-8")
    (root / "sub" / "b.md").write_text("# Título\n\nMarkdown ✓\n", encoding="utf-8")
    records = [{"text": "first record"}, {"text": "second record", "id": 2}]
    (root / "c.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n\n", encoding="utf-8")
    (root / "ignored.bin").write_bytes(b"\x00\x01")
    return root


def expected_stream(documents: list[str]) -> np.ndarray:
    return np.concatenate([np.append(BYTE.encode(doc), BYTE.eos_id) for doc in documents])


def write_raw_dataset(path: Path, train: np.ndarray, meta_overrides: dict | None = None) -> Path:
    """A dataset of one shard written by hand, to create broken ones prepare() would never make."""
    (path / "shards").mkdir(parents=True)
    train.tofile(path / "shards" / "000000.bin")
    meta = {
        "format": 2,
        "dtype": "uint16",
        "vocab_size": 257,
        "eos_id": 256,
        "tokenizer": "byte",
        "num_tokens": {"train": len(train), "val": 0},
        "shards": [{"number": 0, "tokens": len(train), "val_tokens": 0, "documents": 1, "sources": []}],
    }
    meta.update(meta_overrides or {})
    (path / "index.json").write_text(json.dumps(meta))
    return path


def stream_of(out: Path) -> np.ndarray:
    """The token stream of a prepared dataset: its shards in index order."""
    index = json.loads((out / "index.json").read_text())
    dtype = np.dtype(index["dtype"])
    return np.concatenate([np.fromfile(out / "shards" / f"{s['number']:06d}.bin", dtype=dtype) for s in index["shards"]])


def one_line_error(excinfo: pytest.ExceptionInfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


# Tokenizers


def test_byte_tokenizer_round_trip():
    text = "héllo wörld 🚀\nend"
    ids = BYTE.encode(text)
    assert ids.max() < 256 and len(ids) == len(text.encode("utf-8"))
    assert BYTE.decode(ids) == text
    assert BYTE.decode([*ids.tolist(), BYTE.eos_id]) == text
    assert BYTE.decode([0xFF, ord("a")]) == "\ufffda"
    assert BYTE.vocab_size == 257 and BYTE.eos_id == 256


def test_load_tokenizer_rejects_missing_json(tmp_path: Path):
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    with pytest.raises(DataError, match="tokenizer"):
        load_tokenizer(str(tmp_path / "missing.json"))


def test_token_dtype_fits_vocab():
    assert token_dtype(257) == np.uint16
    assert token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32


# Preparation


def test_prepare_writes_streamed_tokens_and_index(corpus: Path, tmp_path: Path):
    out = prepare([corpus], tmp_path / "data", val_fraction=0.1)

    documents = ["Hello, world.\n", "first record", "second record", "# Título\n\nMarkdown ✓\n"]
    stream = expected_stream(documents)  # files sorted by path: a.txt, c.jsonl, sub/b.md
    index = json.loads((out / "index.json").read_text())
    num_val = round(len(stream) * 0.1)
    sources = [str(corpus / "a.txt"), str(corpus / "c.jsonl"), str(corpus / "sub" / "b.md")]
    assert index == {
        "format": 2,
        "dtype": "uint16",
        "vocab_size": 257,
        "eos_id": 256,
        "tokenizer": "byte",
        "tokenizer_sha256": None,
        "num_tokens": {"train": len(stream) - num_val, "val": num_val},
        "num_documents": 4,
        "shards": [{"number": 0, "tokens": len(stream), "val_tokens": num_val, "documents": 4, "sources": sources}],
    }
    np.testing.assert_array_equal(stream_of(out), stream)
    train, val = TokenDataset(out, "train"), TokenDataset(out, "val")
    np.testing.assert_array_equal(np.concatenate([train.read(0, train.num_tokens), val.read(0, val.num_tokens)]),
                                  stream)
    assert sorted(p.name for p in out.rglob("*")) == ["000000.bin", "000000.json", "index.json", "shards"]


def test_format_1_datasets_are_still_read(tmp_path: Path):
    """A dataset written before shards (train.bin, val.bin, meta.json) trains as it did."""
    path = tmp_path / "old"
    path.mkdir()
    np.arange(100, dtype=np.uint16).tofile(path / "train.bin")
    np.arange(100, 110, dtype=np.uint16).tofile(path / "val.bin")
    (path / "meta.json").write_text(json.dumps({"format": 1, "dtype": "uint16", "vocab_size": 257, "eos_id": 256,
                                                "tokenizer": "byte", "num_tokens": {"train": 100, "val": 10}}))
    assert TokenDataset(path).read(0, 100).tolist() == list(range(100))
    assert TokenDataset(path, "val").read(0, 10).tolist() == list(range(100, 110))
    TokenDataset(path).check(seq_len=8, model_vocab_size=257)


def test_prepare_cli(corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture):
    assert prepare_main([str(corpus / "a.txt"), "--out", str(tmp_path / "data"), "--val-fraction", "0"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert TokenDataset(tmp_path / "data").num_tokens == len("Hello, world.\n") + 1

    assert prepare_main([str(tmp_path / "missing"), "--out", str(tmp_path / "other")]) == 1
    assert "no such file or directory" in capsys.readouterr().err


def test_prepare_failing_midway_leaves_no_dataset(corpus: Path, tmp_path: Path):
    (corpus / "d.jsonl").write_text('{"text": "fine"}\n{"title": "no text"}\n')
    out = tmp_path / "data"
    with pytest.raises(DataError, match=r'd\.jsonl:2: record has no string "text" field \(keys: title\)'):
        prepare([corpus], out)
    assert not out.exists()  # a first prepare that fails leaves no folder (not even an empty one)

    with pytest.raises(DataError, match="no such file or directory"):
        prepare([tmp_path / "missing.txt"], tmp_path / "never")
    assert not (tmp_path / "never").exists()


def test_prepare_failure_keeps_previous_dataset(corpus: Path, tmp_path: Path):
    out = prepare([corpus], tmp_path / "data")
    before = {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    (corpus / "z.jsonl").write_text("not json\n")
    with pytest.raises(DataError, match="invalid JSON"):
        prepare([corpus], out)
    assert {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_prepare_errors(tmp_path: Path):
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(DataError) as excinfo:
        prepare([tmp_path / "empty_dir"], tmp_path / "out")
    assert "no input files" in one_line_error(excinfo)

    (tmp_path / "blank.txt").write_text("  \n\n")
    with pytest.raises(DataError) as excinfo:
        prepare([tmp_path / "blank.txt"], tmp_path / "out")
    assert "no text to tokenize" in one_line_error(excinfo)

    (tmp_path / "doc.txt").write_text("text")
    with pytest.raises(DataError) as excinfo:
        prepare([tmp_path / "doc.txt"], tmp_path / "doc.txt" / "out")  # a path below a file
    assert "not writable" in one_line_error(excinfo)


def test_prepare_refuses_a_file_that_is_not_text(tmp_path: Path):
    import shutil
    import sys

    program = tmp_path / "python.txt"  # a binary, whatever its name says
    shutil.copy(sys.executable if Path(sys.executable).stat().st_size < 50_000_000 else "/bin/ls", program)
    with pytest.raises(DataError) as excinfo:
        prepare([program], tmp_path / "out")
    assert f"input {program} is not a text file (it holds NUL bytes" in one_line_error(excinfo)
    assert not (tmp_path / "out").exists()


def test_prepare_counts_a_file_reached_twice_once(corpus: Path, tmp_path: Path):
    once = prepare([corpus], tmp_path / "once")
    (corpus / "link.txt").symlink_to(corpus / "a.txt")  # the same document under a second name
    twice = prepare([corpus, corpus / "a.txt"], tmp_path / "twice")  # and given again explicitly
    meta = [json.loads((d / "index.json").read_text()) for d in (once, twice)]
    assert meta[0]["num_tokens"] == meta[1]["num_tokens"]
    assert np.array_equal(stream_of(once), stream_of(twice))


# Built-in corpus


def test_builtin_corpus_is_deterministic_and_sized():
    text = builtin_corpus_text()
    assert text == builtin_corpus_text()
    assert 1_000_000 <= len(text.encode("utf-8")) <= 3_000_000


def test_ensure_builtin_dataset_prepares_once(tmp_path: Path):
    out = ensure_builtin_dataset(tmp_path / "builtin")
    meta_mtime = (out / "index.json").stat().st_mtime_ns
    assert ensure_builtin_dataset(out) == out
    assert (out / "index.json").stat().st_mtime_ns == meta_mtime
    for split in ("train", "val"):
        TokenDataset(out, split).check(seq_len=1024, model_vocab_size=257)


# Sampling


@pytest.fixture
def counting_dataset(tmp_path: Path) -> TokenDataset:
    """Tokens 0, 1, 2, ...: a sample's content reveals its offset."""
    path = write_raw_dataset(tmp_path / "counting", np.arange(1001, dtype=np.uint16), {"vocab_size": 2000})
    return TokenDataset(path)


def test_get_batch_is_deterministic_and_shifted(counting_dataset: TokenDataset):
    inputs, targets = counting_dataset.get_batch([0, 5, 7, 250], seq_len=10, seed=3)
    assert inputs.dtype == targets.dtype == np.int64
    assert inputs.shape == targets.shape == (4, 10)
    assert np.array_equal(targets, inputs + 1)
    assert np.all(inputs[:, 0] % 10 == 0)  # windows start on multiples of seq_len

    again = TokenDataset(counting_dataset.path).get_batch([0, 5, 7, 250], seq_len=10, seed=3)
    assert np.array_equal(again[0], inputs) and np.array_equal(again[1], targets)
    single = counting_dataset.get_batch([7], seq_len=10, seed=3)
    assert np.array_equal(single[0][0], inputs[2])  # independent of the rest of the batch


def test_each_epoch_visits_every_window_once(counting_dataset: TokenDataset):
    windows = counting_dataset.num_windows(seq_len=10)
    assert windows == 100
    epoch0 = [counting_dataset.sample_offset(i, 10, seed=1) for i in range(windows)]
    epoch1 = [counting_dataset.sample_offset(i + windows, 10, seed=1) for i in range(windows)]
    other_seed = [counting_dataset.sample_offset(i, 10, seed=2) for i in range(windows)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(0, 1000, 10))
    assert epoch0 != epoch1 and epoch0 != other_seed


def test_dataset_pickles_by_path(counting_dataset: TokenDataset):
    payload = pickle.dumps(counting_dataset)
    assert len(payload) < 1000  # not a copy of the tokens
    restored = pickle.loads(payload)
    assert np.array_equal(restored.get_batch([4], 10, 0)[0], counting_dataset.get_batch([4], 10, 0)[0])


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_rank_indices_partition_the_global_batch(world_size: int):
    start, global_batch, micro_batch = 96, 16, 2
    grad_accum = global_batch // (world_size * micro_batch)
    taken = [
        rank_indices(start, global_batch, world_size, rank, micro_batch, micro_step)
        for rank in range(world_size)
        for micro_step in range(grad_accum)
    ]
    assert all(block == list(range(block[0], block[0] + micro_batch)) for block in taken)
    flat = [index for block in taken for index in block]
    assert flat == list(range(start, start + global_batch))  # same samples for every world size


def test_rank_indices_rejects_indivisible_batch():
    with pytest.raises(ValueError, match="not divisible"):
        rank_indices(0, global_batch=10, world_size=4, rank=0, micro_batch=1, micro_step=0)


def test_synthetic_dataset_is_deterministic():
    data = SyntheticDataset(vocab_size=50, seed=1)
    inputs, targets = data.get_batch([3, 9], seq_len=16, seed=0)
    assert inputs.shape == targets.shape == (2, 16) and inputs.dtype == np.int64
    assert int(inputs.max()) < 50 and np.array_equal(inputs[:, 1:], targets[:, :-1])
    assert np.array_equal(SyntheticDataset(50, seed=1).get_batch([3, 9], 16, 0)[0], inputs)
    assert not np.array_equal(SyntheticDataset(50, seed=2).get_batch([3, 9], 16, 0)[0], inputs)


# Dataset errors


def test_missing_dataset_error(tmp_path: Path):
    with pytest.raises(DataError) as excinfo:
        TokenDataset(tmp_path / "nowhere")
    message = one_line_error(excinfo)
    assert message.startswith(f"data.path={tmp_path / 'nowhere'}: no prepared dataset")
    assert "python -m pretrain.data.prepare" in message

    (tmp_path / "half").mkdir()
    with pytest.raises(DataError, match="no index.json"):
        TokenDataset(tmp_path / "half")


def test_empty_dataset_error(tmp_path: Path):
    path = write_raw_dataset(tmp_path / "d", np.zeros(0, dtype=np.uint16))
    with pytest.raises(DataError) as excinfo:
        TokenDataset(path).check(seq_len=8, model_vocab_size=257)
    assert "train split has 0 tokens, shorter than one sequence" in one_line_error(excinfo)


def test_wrong_dtype_error(tmp_path: Path):
    path = write_raw_dataset(tmp_path / "d", np.arange(100, dtype=np.uint32))  # meta says uint16
    for failing in (lambda data: data.check(seq_len=8, model_vocab_size=257), lambda data: data.read(0, 8)):
        with pytest.raises(DataError) as excinfo:
            failing(TokenDataset(path))  # checked by the launcher, and by training on first reading the file
        assert "400 bytes but index.json says 100 uint16 tokens (200 bytes)" in one_line_error(excinfo)


def test_missing_shard_error(tmp_path: Path):
    path = write_raw_dataset(tmp_path / "d", np.arange(100, dtype=np.uint16))
    (path / "shards" / "000000.bin").unlink()
    with pytest.raises(DataError) as excinfo:
        TokenDataset(path).check(seq_len=8, model_vocab_size=257)
    assert "missing" in one_line_error(excinfo) and "prepare it again" in str(excinfo.value)


def test_shorter_than_one_sequence_error(tmp_path: Path):
    data = TokenDataset(write_raw_dataset(tmp_path / "d", np.arange(10, dtype=np.uint16)))
    data.check(seq_len=9, model_vocab_size=257)
    with pytest.raises(DataError) as excinfo:
        data.check(seq_len=10, model_vocab_size=257)
    assert "10 tokens, shorter than one sequence" in one_line_error(excinfo)


def test_vocab_too_large_for_model_error(tmp_path: Path):
    data = TokenDataset(write_raw_dataset(tmp_path / "d", np.arange(100, dtype=np.uint16)))
    with pytest.raises(DataError) as excinfo:
        data.check(seq_len=8, model_vocab_size=200)
    assert "dataset vocab_size 257 (tokenizer byte) exceeds model vocab_size 200" in one_line_error(excinfo)


@pytest.mark.parametrize("num_tokens", [100, 1_000_000])  # whole file, then evenly spread chunks
def test_token_id_above_model_vocab_error(tmp_path: Path, num_tokens: int):
    tokens = np.zeros(num_tokens, dtype=np.uint16)
    tokens[-1] = 1000  # meta claims vocab 257: the file is inconsistent with it
    data = TokenDataset(write_raw_dataset(tmp_path / "d", tokens))
    with pytest.raises(DataError) as excinfo:
        data.check(seq_len=8, model_vocab_size=300)
    assert "contains token id 1000 >= model vocab_size 300" in one_line_error(excinfo)


# Hugging Face tokenizers (optional dependency)


def test_prepare_with_trained_bpe_tokenizer(corpus: Path, tmp_path: Path):
    tokenizers = pytest.importorskip("tokenizers", reason="optional `tokenizers` package not installed")
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator([p.read_text() for p in corpus.rglob("*.*") if p.suffix != ".bin"], trainer)
    bpe.save(str(tmp_path / "bpe.json"))

    out = prepare([corpus / "a.txt"], tmp_path / "data", tokenizer=str(tmp_path / "bpe.json"), val_fraction=0)
    data = TokenDataset(out)
    assert data.dtype == np.uint16
    assert data.vocab_size == bpe.get_vocab_size() and data.eos_id == bpe.token_to_id("<|endoftext|>")
    tokens = data.read(0, data.num_tokens)
    assert int(tokens[-1]) == data.eos_id
    assert load_tokenizer(str(tmp_path / "bpe.json")).decode(tokens[:-1]) == "Hello, world.\n"


def test_prepare_with_large_vocab_uses_uint32(tmp_path: Path):
    tokenizers = pytest.importorskip("tokenizers", reason="optional `tokenizers` package not installed")
    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, 70_000)}}
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    words.save(str(tmp_path / "words.json"))
    (tmp_path / "doc.txt").write_text("w2 w69999 w5")

    out = prepare([tmp_path / "doc.txt"], tmp_path / "data", tokenizer=str(tmp_path / "words.json"), val_fraction=0)
    data = TokenDataset(out)
    assert data.dtype == np.uint32 and data.eos_id == 1
    assert data.read(0, data.num_tokens).tolist() == [2, 69999, 5, 1]
