"""Smoke tests of the local Slurm test cluster (tests/slurm/localcluster.sh).

They check the properties the pretrain tests rely on: a 2-node job with 2
tasks per node and 2 (fake) GPUs per node runs to COMPLETED and sacct sees it,
and a requeued job restarts and completes, with the requeue visible in sacct.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tests.slurm.fixture import SlurmCluster, slurm_cluster  # noqa: F401

pytestmark = pytest.mark.slurm


def _wait_for(predicate, timeout: float, what: str, cluster: SlurmCluster, job_id: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}\n{cluster.describe_job(job_id)}")
        time.sleep(0.2)


def test_two_node_gpu_job_completes(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    job = slurm_cluster.sbatch(
        "--nodes=2",
        "--ntasks-per-node=2",
        "--gpus-per-node=2",
        f"--output={tmp_path}/%j.out",
        # srun's own messages, e.g. "Job 1 step creation temporarily disabled,
        # retrying" when the second srun comes before slurmctld has freed the
        # first step's resources, go to stderr: keep them out of the tasks' output.
        f"--error={tmp_path}/%j.err",
        "--wrap",
        "srun hostname; srun env | grep SLURM_PROCID",
        cwd=tmp_path,
    )

    state = slurm_cluster.wait_job(job, timeout=60)

    out = (tmp_path / f"{job}.out").read_text()
    output = f"stdout:\n{out}\nstderr:\n{(tmp_path / f'{job}.err').read_text()}"
    assert state == "COMPLETED", f"{output}\n{slurm_cluster.describe_job(job)}"
    assert sorted(re.findall(r"^SLURM_PROCID=(\d+)$", out, re.M)) == ["0", "1", "2", "3"], output
    hostnames = [line for line in out.splitlines() if line and not line.startswith("SLURM_")]
    assert len(hostnames) == 4, output

    rows = slurm_cluster.sacct(job)
    alloc = rows[0]
    assert alloc["JobID"] == job
    assert alloc["State"] == "COMPLETED"
    assert alloc["ExitCode"] == "0:0"
    assert alloc["NodeList"] == "n[1-2]"
    assert "gres/gpu=4" in alloc["AllocTRES"], alloc
    steps = {r["JobID"]: r for r in rows}
    for step in (f"{job}.0", f"{job}.1"):  # the two sruns, each on both nodes
        assert steps[step]["State"] == "COMPLETED", rows
        assert steps[step]["NodeList"] == "n[1-2]", rows


def test_requeued_job_restarts_and_completes(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    # The first run blocks until it is requeued; the second one finishes at once.
    script = (
        f'echo "restart_count=${{SLURM_RESTART_COUNT:-0}}" >> {runs}\n'
        'if [ -z "$SLURM_RESTART_COUNT" ]; then sleep 300; fi\n'
        "echo done\n"
    )
    job = slurm_cluster.sbatch("--nodes=1", f"--output={tmp_path}/%j.out", "--wrap", script, cwd=tmp_path)

    _wait_for(runs.exists, 30, "the first run to start", slurm_cluster, job)
    slurm_cluster.run("scontrol", "requeue", job)
    state = slurm_cluster.wait_job(job, timeout=90)

    assert state == "COMPLETED", slurm_cluster.describe_job(job)
    assert runs.read_text().split() == ["restart_count=0", "restart_count=1"]
    allocs = [r for r in slurm_cluster.sacct(job) if r["JobID"] == job]
    assert [r["State"] for r in allocs] == ["REQUEUED", "COMPLETED"], allocs
    assert allocs[-1]["Restarts"] == "1"
    assert slurm_cluster.restarts(job) == 1
