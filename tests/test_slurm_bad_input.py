"""Cluster and container settings that cannot work are refused before sbatch runs: one line, exit 2,
nothing written, nothing submitted. Adding a case is one line in CASES."""

from __future__ import annotations

import os

import pytest

from pretrain import launch
from tests.helpers import snapshot

A100 = ["+cluster=a100x8"]

CASES = [
    (["+cluster=dgx-superpod"], "Could not find 'cluster/dgx-superpod'"),
    ([*A100, "cluster.nodes=0"], "cluster.nodes=0: must be at least 1"),
    ([*A100, "cluster.gpus_per_node=0"], "cluster.gpus_per_node=0: must be at least 1"),
    ([*A100, "fsdp=hybrid_shard"], "fsdp.strategy=hybrid_shard with shard groups of 8 on 8 ranks leaves a replicate "
                                   "degree of 1"),
    ([*A100, "cluster.time_min=1", "cluster.signal_delay_s=120"],
     "cluster.time_min=1 is not longer than cluster.signal_delay_s=120"),
    (["+cluster=a100x8", "train.global_batch=64", "cluster.nodes=3"], "global batch 64 sequences does not divide by world size 24"),
    ([*A100, "cluster.max_requeues=-1"], "cluster.max_requeues=-1: must be 0 or more"),
    ([*A100, "+cluster.env.BAD-NAME=1"], "cluster.env key 'BAD-NAME' is not a valid environment variable name"),
    ([*A100, "precision.name=fp8"], "precision.name='fp8': unknown"),
]


@pytest.mark.parametrize("overrides,message", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_cluster_config_is_refused(tmp_path, capsys, monkeypatch, overrides, message):
    submitted = fake_sbatch(tmp_path, monkeypatch)
    run_dir = tmp_path / "run"
    code = launch.main([*overrides, f"hydra.run.dir={run_dir}"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert not run_dir.exists() and not submitted.exists()


def fake_sbatch(tmp_path, monkeypatch):
    """An sbatch on PATH that only records being called: the refusals must come before it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "sbatch-was-called"
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\ntouch {record}\necho 'Submitted batch job 1'\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return record


def test_missing_sbatch_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    code = launch.main([*A100, f"hydra.run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and "sbatch is not on PATH" in err and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


def test_unwritable_run_directory_is_refused(tmp_path, capsys, monkeypatch):
    submitted = fake_sbatch(tmp_path, monkeypatch)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code = launch.main([*A100, f"hydra.run.dir={blocker / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and "is not a writable folder" in err
    assert not submitted.exists()


def cluster_file(tmp_path, container: dict) -> list[str]:
    import yaml

    conf = tmp_path / "conf"
    (conf / "cluster").mkdir(parents=True)
    (conf / "cluster" / "mine.yaml").write_text(yaml.safe_dump({"name": "mine", "container": container}))
    return ["+cluster=mine", f"hydra.searchpath=[file://{conf}]"]


@pytest.mark.parametrize("case", ["missing image", "missing bind", "no runtime"])
def test_bad_container_is_refused(tmp_path, capsys, monkeypatch, case):
    submitted = fake_sbatch(tmp_path, monkeypatch)
    image = tmp_path / "pretrain.sif"
    image.write_text("image")
    container = {"image": str(image), "runtime": "auto"}
    if case == "missing image":
        container["image"] = str(tmp_path / "nope.sif")
        message = f"cluster.container.image={tmp_path / 'nope.sif'}: no such file"
    elif case == "missing bind":
        container["binds"] = ["/no/such/scratch:/scratch"]
        message = "container bind source /no/such/scratch does not exist"
    else:
        message = "neither apptainer nor singularity is on PATH"
    if case != "no runtime":
        (tmp_path / "bin" / "apptainer").write_text("#!/bin/sh\n")
        (tmp_path / "bin" / "apptainer").chmod(0o755)
    before = snapshot(tmp_path)
    code = launch.main([*cluster_file(tmp_path, container), f"hydra.run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert not submitted.exists() and not (tmp_path / "run").exists()
    assert {k: v for k, v in snapshot(tmp_path).items() if not k.startswith("conf")} == \
        {k: v for k, v in before.items() if not k.startswith("conf")}
