"""Bad input is refused before any process starts: one line naming the problem, exit code 2, nothing written.

Adding a case is one line in CASES: the overrides and a fragment the message must contain.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from pretrain import launch
from pretrain.parallelize import CPU_ALL_REDUCE
from tests.helpers import snapshot

CASES = [
    (["model.dim=0"], "model.dim=0: must be greater than 0"),
    (["model.n_layers=-2"], "model.n_layers=-2: must be greater than 0"),
    (["train.micro_batch=0"], "train.micro_batch=0: must be greater than 0"),
    (["train.steps=-1"], "train.steps=-1: must be greater than 0"),
    (["model.n_heads=5"], "model.n_heads=5 does not divide model.dim=256"),
    (["model.n_kv_heads=3"], "model.n_kv_heads=3 does not divide model.n_heads=4"),
    (["train.global_batch=12"], "global batch 12 sequences does not divide by world size 1 x train.micro_batch=8"),
    (["local.nproc=2", "train.global_batch=8"], "does not divide by world size 2"),
    (["train.global_batch_tokens=1000"], "train.global_batch_tokens=1000 is not a multiple of train.seq_len=256"),
    (["train.seq_len=4096"], "train.seq_len=4096 exceeds model.max_seq_len=1024"),
    (["precision=int4"], "Could not find 'precision/int4'"),
    (["precision.float8=blockwise"], "precision.float8='blockwise': unknown; choose one of none, tensorwise, rowwise"),
    (["precision=fp32", "precision.float8=tensorwise"], "precision.float8=tensorwise runs the other operations in bf16"),
    (["precision.float8=rowwise"], "but precision=auto; use precision=bf16 with it (or precision=fp8)"),
    (["+cluster=a100x8", "train.global_batch=64", "precision=fp8"], "which the GPUs of cluster a100x8 lack (cluster.gpu_fp8=false)"),
    (["precision.name=fp8"], "precision.name='fp8': unknown; choose one of auto, bf16, fp16, fp32"),
    (["precision=fp16"], "precision=fp16 needs a CUDA GPU"),
    (["fsdp=zero3"], "Could not find 'fsdp/zero3'"),
    (["fsdp.strategy=zero3"], "fsdp.strategy='zero3': unknown; choose one of full_shard"),
    (["fsdp.activation_checkpointing=some"], "fsdp.activation_checkpointing='some': unknown"),
    (["fsdp=hybrid_shard", "local.nproc=2"], "leaves a replicate degree of 1"),
    (["fsdp=hybrid_shard", "local.nproc=4", "fsdp.shard_size=3", "train.micro_batch=4"],
     "fsdp.shard_size=3 does not divide the world size 4"),
    (["data.path=/nonexistent/data"], "data.path=/nonexistent/data"),
    (["model.dimm=3"], "Could not override 'model.dimm'"),
    (["model.dim=wide"], "model.dim=wide"),
    (["optim.min_lr_ratio=2"], "optim.min_lr_ratio=2.0: must be between 0 and 1"),
    (["--fast"], "unknown option --fast"),
]
if not CPU_ALL_REDUCE:  # torch 2.7: FSDP2 cannot all-reduce gradients over gloo
    CASES += [(["fsdp=no_shard", "local.nproc=2"], "fsdp.strategy=no_shard on CPUs needs torch 2.8 or newer"),
              (["fsdp=hybrid_shard", "local.nproc=4", "fsdp.shard_size=2", "train.micro_batch=4"],
               "fsdp.strategy=hybrid_shard on CPUs needs torch 2.8 or newer")]


@pytest.mark.parametrize("overrides,message", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_config_is_refused_in_one_line(tmp_path, capsys, overrides, message):
    run_dir = tmp_path / "run"
    code = launch.main([*overrides, f"hydra.run.dir={run_dir}"])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert not run_dir.exists()


def write_tokens(folder, tokens: np.ndarray, dtype: str, claimed: int | None = None, vocab: int = 257) -> None:
    import json

    folder.mkdir(parents=True)
    tokens.astype(dtype).tofile(folder / "train.bin")
    np.zeros(0, dtype=dtype).tofile(folder / "val.bin")
    meta = {"format": 1, "dtype": "uint16", "vocab_size": vocab, "eos_id": 256, "tokenizer": "byte",
            "num_tokens": {"train": claimed if claimed is not None else len(tokens), "val": 0}, "sources": []}
    (folder / "meta.json").write_text(json.dumps(meta))


DATA_CASES = {
    "empty": (np.zeros(0), "uint16", None, 257, "data.path="),
    "wrong dtype": (np.arange(1000) % 200, "uint32", 1000, 257, "data.path="),
    "shorter than one sequence": (np.arange(100) % 200, "uint16", None, 257, "shorter than one sequence"),
    "ids above the model vocab": (np.full(5000, 400), "uint16", None, 257, "token id 400 >= model vocab_size 320"),
    "tokenizer vocab above the model's": (np.arange(5000) % 200, "uint16", None, 50000, "exceeds model vocab_size 320"),
}


@pytest.mark.parametrize("case", list(DATA_CASES))
def test_bad_data_is_refused(tmp_path, capsys, case):
    tokens, dtype, claimed, vocab, message = DATA_CASES[case]
    data = tmp_path / "data"
    write_tokens(data, tokens, dtype, claimed, vocab)
    before = snapshot(tmp_path)
    code = launch.main([f"data.path={data}", f"hydra.run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert snapshot(tmp_path) == before


def test_checkpoint_of_another_model_is_refused_and_kept(tmp_path, capsys):
    run_dir = tmp_path / "run"
    identity = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    before = {name: os.environ.get(name) for name in identity}
    assert launch.main(["train.steps=2", "train.eval_every=0", f"hydra.run.dir={run_dir}"]) == 0
    # An in-process run leaves no rank identity behind for the processes and jobs started after it.
    assert {name: os.environ.get(name) for name in identity} == before
    capsys.readouterr()
    before = snapshot(run_dir)
    code = launch.main(["train.steps=4", "model.dim=128", f"hydra.run.dir={run_dir}"])
    err = capsys.readouterr().err
    assert code == 2
    assert "was written for another model shape: dim=256 (this run: 128)" in err and err.count("\n") == 1, err
    assert snapshot(run_dir) == before


def test_run_directory_that_cannot_be_created_is_refused(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    code = launch.main([f"hydra.run.dir={blocker / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and f"{blocker} is not a writable folder" in err, err
    assert blocker.read_text() == "not a folder"
