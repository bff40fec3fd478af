"""Faults on the local Slurm cluster: a node that dies in the middle of a job, SIGTERM to one node's
tasks alone, a plain scancel, and a checkpoint folder that turns read-only while a job writes to it."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from pretrain.rundir import complete_checkpoints
from pretrain.trainer.checkpoint import problems
from tests.helpers import training_processes_of
from tests.slurm.fixture import SlurmCluster, slurm_cluster  # noqa: F401
from tests.test_slurm_submit import (PREEMPT, assert_resumed_to_the_same_end, job_id_of, losses, submit,  # noqa: F401
                                     uninterrupted_loss, wait_for_step, write_cluster_conf)

pytestmark = pytest.mark.slurm


def wait_until_requeued(cluster: SlurmCluster, job: str, timeout: float = 180) -> None:
    """Until Slurm has taken the job off its nodes to run it again (PENDING, or a REQUEUED/NODE_FAIL record)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = {r["State"].split()[0] for r in cluster.sacct(job) if r["JobID"] == job}
        if cluster.squeue_state(job) == "PENDING" or states & {"REQUEUED", "NODE_FAIL"}:
            return
        time.sleep(1)
    raise TimeoutError(f"job {job} was not requeued: {cluster.describe_job(job)}")


def test_a_node_that_dies_mid_job_is_requeued_and_resumes_to_the_same_loss(slurm_cluster, tmp_path,
                                                                           uninterrupted_loss):
    run_dir = tmp_path / "run"
    assert submit(slurm_cluster, write_cluster_conf(tmp_path), *PREEMPT, f"hydra.run.dir={run_dir}").returncode == 0
    job = job_id_of(run_dir)
    wait_for_step(run_dir, 12)
    slurm_cluster.kill_node("n2")  # slurmd, step daemons and ranks 2 and 3: a power cut
    try:
        wait_until_requeued(slurm_cluster, job)
    finally:
        slurm_cluster.start_node("n2")  # the node comes back; the requeued job needs both
    # Slurm records the lost attempt as NODE_FAIL when it noticed the node first, else the batch
    # script's own requeue (a task failed) as REQUEUED.
    assert_resumed_to_the_same_end(slurm_cluster, run_dir, job, uninterrupted_loss, ("REQUEUED", "NODE_FAIL"))


def test_sigterm_to_one_nodes_tasks_alone_checkpoints_and_requeues(slurm_cluster, tmp_path, uninterrupted_loss):
    """A node shutting down (systemd's SIGTERM to every process on it), or a stray kill of a step: the
    tasks got SIGTERM, the job did not. The ranks checkpoint together and the job comes back, instead
    of ending COMPLETED with the run half done."""
    run_dir = tmp_path / "run"
    assert submit(slurm_cluster, write_cluster_conf(tmp_path), *PREEMPT, f"hydra.run.dir={run_dir}").returncode == 0
    job = job_id_of(run_dir)
    wait_for_step(run_dir, 12)
    victims = training_processes_of(job, "n2")  # ranks 2 and 3
    assert victims
    for pid in victims:
        os.kill(pid, signal.SIGTERM)
    assert_resumed_to_the_same_end(slurm_cluster, run_dir, job, uninterrupted_loss)
    out = (run_dir / "slurm" / f"{job}_0_log.out").read_text()
    assert "(a signal on another rank); the job will be requeued unless it was cancelled or preempted" in out
    signalled_rank = "".join(p.read_text() for p in (run_dir / "slurm").glob(f"{job}_2_log.*"))
    assert "(SIGTERM); the job will be requeued unless it was cancelled or preempted" in signalled_rank
    assert "rerun the same run directory to resume" not in signalled_rank
    assert (f"pretrain: requeueing job {job} (the tasks were stopped by a signal this job was not sent: not a "
            f"scancel or a preemption") in out


def test_scancel_ends_the_job_for_good_with_its_checkpoints_intact(slurm_cluster, tmp_path):
    run_dir = tmp_path / "run"
    assert submit(slurm_cluster, write_cluster_conf(tmp_path), *PREEMPT, f"hydra.run.dir={run_dir}").returncode == 0
    job = job_id_of(run_dir)
    wait_for_step(run_dir, 12)
    slurm_cluster.run("scancel", job)
    assert slurm_cluster.wait_job(job, timeout=120) == "CANCELLED", slurm_cluster.describe_job(job)
    assert slurm_cluster.restarts(job) == 0
    assert "requeueing" not in (run_dir / "slurm" / f"{job}_0_log.out").read_text()
    saved = complete_checkpoints(run_dir / "checkpoints")
    assert saved and all(problems(path) == [] for path in saved)
    assert "stopping at step" in (run_dir / "train.log").read_text()


@contextmanager
def read_only(folder: Path):
    """`folder` read-only for everyone, root included (a read-only bind mount over itself)."""
    mounted = subprocess.run(["mount", "--bind", str(folder), str(folder)], capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot bind-mount here (needs root): {mounted.stderr.strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], check=True)
        yield
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_read_only_checkpoint_folder_stops_the_job_with_the_previous_checkpoint_intact(slurm_cluster, tmp_path,
                                                                                       uninterrupted_loss):
    run_dir = tmp_path / "run"
    conf = write_cluster_conf(tmp_path)
    assert submit(slurm_cluster, conf, *PREEMPT, f"hydra.run.dir={run_dir}").returncode == 0
    job = job_id_of(run_dir)
    root = run_dir / "checkpoints"
    wait_for_step(run_dir, 11)
    with read_only(root):
        assert slurm_cluster.wait_job(job, timeout=300) == "FAILED", slurm_cluster.describe_job(job)
        saved = complete_checkpoints(root)
        assert [p.name for p in saved] == ["step_00000010"] and problems(saved[0]) == []
    assert slurm_cluster.restarts(job) == 0  # an error a requeue would repeat: not requeued
    errors = (run_dir / "slurm" / f"{job}_0_log.err").read_text()
    assert "error: the checkpoint of step 20 could not be written (cannot create " in errors
    assert f"Read-only file system); the previous checkpoint {root / 'step_00000010'} is intact" in errors
    assert "then rerun the same run directory to resume" in errors
    assert "Traceback" not in errors
    # Writable again: the same run directory resumes from step 10 and ends as an uninterrupted run would.
    assert submit(slurm_cluster, conf, *PREEMPT, f"hydra.run.dir={run_dir}").returncode == 0
    again = job_id_of(run_dir)
    assert slurm_cluster.wait_job(again, timeout=300) == "COMPLETED", slurm_cluster.describe_job(again)
    assert losses(run_dir)[30] == pytest.approx(uninterrupted_loss, abs=1e-6)
