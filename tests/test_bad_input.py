"""Bad input is refused before any process starts: one line naming the problem, exit code 2, nothing written.

Adding a case is one line in CASES: the overrides and a fragment the message must contain.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from pretrain import launch
from pretrain.parallel.compat import CPU_ALL_REDUCE
from tests.helpers import MINI_MODEL, hidden_slurm_path, snapshot

CASES = [
    (["model.dim=0"], "model.dim=0: must be greater than 0"),
    (["model.n_layers=-2"], "model.n_layers=-2: must be greater than 0"),
    (["train.micro_batch=0"], "train.micro_batch=0: must be greater than 0"),
    (["train.steps=-1"], "train.steps=-1: must be greater than 0"),
    (["model.n_heads=5"], "model.n_heads=5 does not divide model.dim=256"),
    (["model.n_kv_heads=3"], "model.n_kv_heads=3 does not divide model.n_heads=4"),
    (["train.global_batch=12"], "global batch 12 sequences does not divide by world size 1 x train.micro_batch=16"),
    (["local.nproc=2", "train.global_batch=8"], "does not divide by world size 2"),
    (["train.global_batch_tokens=1000"], "train.global_batch_tokens=1000 is not a multiple of train.seq_len=256"),
    (["train.seq_len=4096"], "train.seq_len=4096 exceeds model.max_seq_len=1024"),
    (["precision=int4"], "Could not find 'precision/int4'"),
    (["precision.float8=blockwise"], "precision.float8='blockwise': unknown; choose one of none, tensorwise, rowwise"),
    (["precision=fp32", "precision.float8=tensorwise"], "precision.float8=tensorwise runs the other operations in bf16"),
    (["precision.float8=rowwise"], "but precision=auto; use precision=bf16 with it (or precision=fp8)"),
    (["precision=fp8", "precision.float8=rowwise", "precision.float8_all_gather=true"],
     "precision.float8_all_gather=true needs precision.float8=tensorwise"),
    (["+cluster=a100x8", "precision=fp8"], "which the GPUs of cluster a100x8 lack (cluster.gpu_fp8=false)"),
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
    (["model.init_from=/nonexistent/hf"], "model.init_from=/nonexistent/hf: no such file or folder"),
    (["train.sample_every=-1"], "train.sample_every=-1: must be 0 (no samples) or more"),
    (["train.sample_every=10", "train.sampling.top_p=1.5"], "train.sampling.top_p=1.5: must be above 0 and at most 1"),
    (["train.sample_every=10", "train.sampling.temperature=-1"], "train.sampling.temperature=-1.0: must be 0"),
    (["train.sample_every=10", "train.sampling.max_new_tokens=1024"], "leaves no room for a prompt"),
    (["data=synthetic", "train.sample_every=10"], "train.sample_every with synthetic data"),
    (["train.sample_every=10", "train.sampling.max_new_tokens=1000", "train.sample_prompts=['" + "x" * 30 + "']"],
     "train.sample_prompts[0] is 30 tokens long, and with train.sampling.max_new_tokens=1000 more that exceeds"),
    (["--fast"], "unknown option --fast"),
    # Values that used to pass the checks and fail on the compute node, after queueing.
    (["optim.lr=nan"], "optim.lr=nan: must be a finite number"),
    (["optim.lr=inf"], "optim.lr=inf: must be a finite number"),
    (["optim.beta2=1.5"], "optim.beta2=1.5: must be in [0, 1)"),
    (["optim.beta1=-0.1"], "optim.beta1=-0.1: must be in [0, 1)"),
    (["optim.weight_decay=-1"], "optim.weight_decay=-1.0: must be 0 or more"),
    (["model.norm_eps=0"], "model.norm_eps=0.0: must be greater than 0"),
    (["train.hang_timeout_s=nan"], "train.hang_timeout_s=nan: must be a finite number"),
    (["model.vocab_size=100"], "the built-in corpus is tokenized into 257 byte-level ids, but model.vocab_size=100"),
    (["train.steps=1.5"], "train.steps=1.5: train.steps expects an integer"),
    (["fsdp.compile=maybe"], "fsdp.compile=maybe: fsdp.compile expects true or false"),
    (["fsdp=zero3"], "options in 'fsdp': full_shard, hybrid_shard, no_shard, shard_grad_op"),
    (["hydra.run.dir=/tmp/a b(c)"], "cannot read the override 'hydra.run.dir=/tmp/a b(c)': mismatched input"),
    (["--cfg", "hydra"], "--cfg hydra: this launcher composes with Hydra but runs nothing of Hydra's"),
    # A line break in any value would escape the batch script (see test_sbatch_scripts.py).
    (["+cluster=a100x8", "cluster.partition='debug\ntouch /tmp/x #'"],
     "cluster.partition='debug\\ntouch /tmp/x #': holds the control character '\\n'"),
    (["+cluster=a100x8", "model.name='tiny\ntouch /tmp/x'"], "model.name='tiny\\ntouch /tmp/x': holds the control"),
    (["+cluster=a100x8", "+cluster.env.FOO='a\rb'"], "cluster.env.FOO='a\\rb': holds the control character"),
    (["+cluster=a100x8", "+cluster.setup=['module load x\ntouch /tmp/x']"], "cluster.setup[0]="),
    (["+cluster=a100x8", "cluster.gpu_bind='per task'"], "cluster.gpu_bind='per task': srun's --gpu-bind takes"),
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


def refusal(capsys, argv: list[str]) -> str:
    """launch.main(argv) must refuse: exit 2 and one line on stderr; returns that line."""
    code = launch.main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, (code, err)
    return err


def test_fp8_where_it_cannot_run_is_refused_before_anything_is_written(tmp_path, capsys, monkeypatch):
    from pretrain.launcher import local

    hidden = tmp_path / "no-torchao" / "torchao"  # as if torchao were not installed, for the device probe
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('No module named torchao')\n")
    monkeypatch.setenv("PYTHONPATH", f"{hidden.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    local.probe.cache_clear()
    err = refusal(capsys, ["precision=fp8", f"hydra.run.dir={tmp_path / 'run'}"])
    local.probe.cache_clear()
    assert "precision.float8=tensorwise needs torchao" in err
    assert not (tmp_path / "run").exists()


def test_dry_run_without_a_cluster_runs_and_writes_nothing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert launch.main(["dry_run=true", "local.nproc=2", f"hydra.run.dir={run_dir}"]) == 0
    out = capsys.readouterr().out
    assert "would train tiny here on 2 x CPU process: 200 steps, global batch 32 sequences" in out
    assert "dry run: nothing was written or run" in out
    assert not run_dir.exists()


def test_off_a_slurm_login_node_a_dry_run_prints_the_job_and_a_submission_says_where_to_submit(
        tmp_path, capsys, monkeypatch):
    """Without Slurm's commands (a laptop, a container) the dry run still prints the batch script and notes
    what is missing; a real submission is refused in one line, before anything is written."""
    monkeypatch.setenv("PATH", hidden_slurm_path(tmp_path))
    run_dir = tmp_path / "run"
    assert launch.main(["+cluster=a100x8", "dry_run=true", f"hydra.run.dir={run_dir}"]) == 0
    out = capsys.readouterr().out
    assert "#SBATCH --gpus-per-node=8" in out and "sbatch is NOT on PATH here: submit from a Slurm login node" in out
    err = refusal(capsys, ["+cluster=a100x8", f"hydra.run.dir={run_dir}"])
    assert "sbatch is not on PATH: submit from a Slurm login node (or load its module), or use dry_run=true" in err
    assert not run_dir.exists()


def test_a_folder_that_is_not_a_run_directory_is_refused_and_left_alone(tmp_path, capsys):
    mine = tmp_path / "my-project"
    mine.mkdir()
    (mine / "config.yaml").write_text("my: own settings\n")
    (mine / "notes.txt").write_text("keep me")
    before = snapshot(mine)
    err = refusal(capsys, ["train.steps=2", f"hydra.run.dir={mine}"])
    assert f"hydra.run.dir={mine} is a folder of other files (config.yaml, notes.txt), not a run directory" in err
    assert snapshot(mine) == before
    empty = tmp_path / "empty"
    empty.mkdir()
    assert launch.main(["dry_run=true", f"hydra.run.dir={empty}"]) == 0  # an empty folder is fine


def test_write_sbatch_to_a_missing_folder_or_a_folder_is_one_line(tmp_path, capsys):
    err = refusal(capsys, ["+cluster=a100x8", f"write_sbatch={tmp_path / 'nope' / 'job.sh'}"])
    assert f"the folder {tmp_path / 'nope'} does not exist" in err
    err = refusal(capsys, ["+cluster=a100x8", f"write_sbatch={tmp_path}"])
    assert f"write_sbatch={tmp_path} is a folder" in err


def test_run_directory_under_proc_is_one_line(capsys):
    err = refusal(capsys, ["hydra.run.dir=/proc/pretrain-run"])
    assert "run directory /proc/pretrain-run: /proc is not a writable folder" in err


def test_cfg_job_prints_the_config(capsys):
    assert launch.main(["--cfg", "job", "train.steps=7"]) == 0
    assert "steps: 7" in capsys.readouterr().out


def test_rerun_names_what_changed_and_refuses_steps_below_the_checkpoint(tmp_path, capfd):
    run_dir = tmp_path / "run"
    base = [*MINI_MODEL, "train.eval_every=0", f"hydra.run.dir={run_dir}"]
    assert launch.main([*base, "train.steps=4", "train.ckpt_every=4"]) == 0
    capfd.readouterr()
    err = refusal(capfd, [*base, "train.steps=2"])
    assert "has a checkpoint at step 4, past train.steps=2: set train.steps above 4" in err
    assert launch.main([*base, "train.steps=6", "train.ckpt_every=4", "optim.lr=0.001"]) == 0
    out = capfd.readouterr().out
    assert f"{run_dir}: settings changed since its last launch (optim.lr: 0.0003 -> 0.001; train.steps: 4 -> 6)" in out
    assert "the earlier config is kept as config.1.yaml" in out and (run_dir / "config.1.yaml").is_file()
    # The same command again: already at its last step, it says so instead of a NaN loss.
    assert launch.main([*base, "train.steps=6", "train.ckpt_every=4", "optim.lr=0.001"]) == 0
    out = capfd.readouterr().out
    assert "nothing to train: the run is already at step 6 of train.steps=6" in out and "nan" not in out


def test_a_run_directory_another_training_holds_is_refused(tmp_path, capsys):
    """Two launches on one run directory never both train: the second is refused while another process
    holds the run's lock (as a training does), and trains once that process has ended."""
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    base = [*MINI_MODEL, "train.steps=2", "train.eval_every=0", f"hydra.run.dir={run_dir}"]
    assert launch.main([*base, "prepare_only=true"]) == 0
    capsys.readouterr()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pretrain import rundir; "
                               "rundir.RunLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(120)",
                               str(run_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = snapshot(run_dir)
        err = refusal(capsys, base)
        assert f"another training is running in {run_dir} (pid {holder.pid} on" in err
        assert snapshot(run_dir) == before
    finally:
        holder.kill()
        holder.wait()
    assert launch.main(base) == 0
