"""Prepare as a Slurm job array on the local test cluster (tests/slurm/localcluster.sh): shard ranges in the
tasks, the index from a last job, and the same dataset, byte for byte, as a prepare on this machine."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pretrain.data.build import prepare
from tests.helpers import REPO
from tests.slurm.fixture import SlurmCluster, slurm_cluster  # noqa: F401
from tests.test_prepare import DOCUMENTS, files_of, jsonl, mixed_corpus
from tests.test_slurm_submit import write_cluster_conf

pytestmark = pytest.mark.slurm

SHARD_MB = "0.002"


def submit_prepare(cluster: SlurmCluster, conf: Path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "pretrain.data.prepare", *args, "+cluster=localtest",
                             f"hydra.searchpath=[file://{conf}]"], cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, **cluster.env}, timeout=120)
    return result, time.monotonic() - started


def jobs_of(result: subprocess.CompletedProcess) -> tuple[str, str]:
    found = re.search(r"submitted job array (\d+) \((\d+) tasks for \d+ shards\) and job (\d+)", result.stdout)
    assert found, result.stdout + result.stderr
    return found.group(1), found.group(3)


def dataset_files(out: Path) -> dict[str, bytes]:
    return {name: blob for name, blob in files_of(out).items() if not name.startswith("slurm/")}


def test_a_job_array_writes_the_same_dataset_as_a_prepare_here(slurm_cluster, tmp_path):
    corpus = mixed_corpus(tmp_path / "in")
    conf = write_cluster_conf(tmp_path, nodes=1, cpus_per_task=1)
    out = tmp_path / "array"
    result, elapsed = submit_prepare(slurm_cluster, conf, str(corpus), "--out", str(out), "--shard-mb", SHARD_MB,
                                     "--tasks", "3")
    assert result.returncode == 0, result.stderr + result.stdout
    assert elapsed < 30  # it submits and returns
    array, index_job = jobs_of(result)
    assert "3 tasks" in result.stdout and f"{out}/index.json" in result.stdout

    assert slurm_cluster.wait_job(index_job, timeout=300) == "COMPLETED", slurm_cluster.describe_job(index_job)
    for task in range(3):  # one job of the array per shard range
        assert slurm_cluster.wait_job(f"{array}_{task}", timeout=60) == "COMPLETED"
    here = prepare([corpus], tmp_path / "here", shard_mb=float(SHARD_MB), workers=2)
    assert dataset_files(out) == files_of(here)  # index, shards and records alike; no plan left behind
    logs = "".join(p.read_text() for p in (out / "slurm").glob("*_log.out"))
    assert "task 0: shards 0-" in logs and f"wrote {out}/index.json" in logs


def test_a_failed_task_leaves_the_previous_dataset_and_says_which_shards(slurm_cluster, tmp_path):
    corpus = mixed_corpus(tmp_path / "in")
    conf = write_cluster_conf(tmp_path, nodes=1, cpus_per_task=1)
    out = prepare([corpus], tmp_path / "data", shard_mb=float(SHARD_MB))
    before = files_of(out)
    (corpus / "b" / "docs.jsonl").write_bytes(jsonl(DOCUMENTS) + b"{broken\n")
    result, _ = submit_prepare(slurm_cluster, conf, str(corpus), "--out", str(out), "--shard-mb", SHARD_MB,
                               "--tasks", "2")
    assert result.returncode == 0, result.stderr + result.stdout
    array, index_job = jobs_of(result)
    assert slurm_cluster.wait_job(index_job, timeout=300) == "FAILED", slurm_cluster.describe_job(index_job)
    assert dataset_files(out) == before  # the new shards removed, the old index and shards untouched
    errors = "".join(p.read_text() for p in (out / "slurm").glob("*_log.err"))
    assert "docs.jsonl:62: invalid JSON" in errors
    assert "were not written (their tasks failed or were cancelled: see their logs)" in errors
    again = prepare([tmp_path / "in" / "a"], out)  # nothing of the failed prepare is in the way
    assert (again / "index.json").is_file()
