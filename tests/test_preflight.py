"""The preflight check at the start of each job: devices, the all-reduce, failure messages, and the
requeue without a failing node on the real local Slurm cluster."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
import torch

from pretrain.trainer import preflight, resilience
from tests.helpers import launch, losses, metrics
from tests.slurm.fixture import SlurmCluster, slurm_cluster  # noqa: F401
from tests.test_slurm_submit import job_id_of, submit, write_cluster_conf

SHORT = ("local.nproc=2", "train.steps=4", "train.log_every=2", "train.eval_every=0", "train.ckpt_every=4",
         "preflight.matmul_size=256")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_check_product_is_exact_in_any_dtype(dtype):
    a, b, expected = preflight.exact_product_operands(300, dtype, torch.device("cpu"), seed=7)
    assert torch.equal(a @ b, expected)
    assert torch.equal((a.double() @ b.double()).to(dtype), expected)
    assert int(expected.abs().max()) > 1 and b.abs().sum() > 300  # a real sum, not a bare permutation


def test_the_timed_work_is_launched_under_a_short_switch_interval_restored_after_it():
    """Each launch's wait for the GIL held by another thread of the job is at most the switch interval (5 ms by
    default): the timed products run under a short one, and the job's own comes back even if they fail."""
    before, seen = sys.getswitchinterval(), []
    seconds = preflight.device_seconds(torch.device("cpu"), lambda: seen.append(sys.getswitchinterval()))
    assert seen == [pytest.approx(preflight.LAUNCH_SWITCH_INTERVAL_S)] and seen[0] < before
    assert sys.getswitchinterval() == before and seconds >= 0

    def fails() -> None:
        raise RuntimeError("a product failed")

    with pytest.raises(RuntimeError):
        preflight.device_seconds(torch.device("cpu"), fails)
    assert sys.getswitchinterval() == before


def test_node_faults_are_inert_unless_named(monkeypatch):
    monkeypatch.delenv("PRETRAIN_FAULTS", raising=False)
    assert not resilience.fault_active_on("preflight_fail", "n2", 1)
    monkeypatch.setenv("PRETRAIN_FAULTS", "nan_loss@3,preflight_fail@n2,preflight_fail@rank5")
    assert resilience.fault_active_on("preflight_fail", "n2", 0) and resilience.fault_active_on("preflight_fail", "n1", 5)
    assert not resilience.fault_active_on("preflight_fail", "n1", 0) and not resilience.fault_active_on("nan_loss", "n1", 3)
    assert resilience.fault_active("nan_loss", 3)  # the step faults read the same variable


def test_the_batch_script_requeues_then_excludes():
    from pretrain.config import ClusterConfig
    from pretrain.launcher.slurm import teardown_lines

    script = "\n".join(teardown_lines(ClusterConfig(name="x", max_requeues=3)))
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    branch = script[script.index(f'if [ -s "$PRETRAIN_RUN_DIR/{preflight.EXCLUDE_NODES}" ]'):]
    assert branch.index("pretrain_requeue") < branch.index('scontrol update JobId="$SLURM_JOB_ID" ExcNodeList=')


def test_two_ranks_pass_and_the_result_is_logged(tmp_path):
    run_dir = tmp_path / "run"
    result = launch(*SHORT, f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr + result.stdout
    assert "preflight passed on 2 ranks" in result.stdout and "256 x 256 float32 products exact" in result.stdout
    record = metrics(run_dir)[0]
    assert record["preflight"] == "passed" and record["step"] == 0
    assert record["matmul_n"] == 256 and record["allreduce_mib"] == 16
    assert [r["rank"] for r in record["ranks"]] == [0, 1] and all(r["tflops"] > 0 for r in record["ranks"])
    assert record["busbw_gbps"] > 0
    import os

    assert [r["cpus"] for r in record["ranks"]] == [len(os.sched_getaffinity(0))] * 2  # what each rank may run on
    threads = int(os.environ.get("OMP_NUM_THREADS", max(len(os.sched_getaffinity(0)) // 2, 1)))
    assert [r["threads"] for r in record["ranks"]] == [threads] * 2  # the CPUs shared out between the two
    assert f"CPUs and {threads}-{threads} threads per rank" in result.stdout
    assert [r["device"] for r in record["ranks"]] == ["cpu", "cpu"]
    assert "preflight passed" in (run_dir / "train.log").read_text()
    assert max(losses(run_dir)) == 4


def test_two_ranks_driving_one_gpu_fail_the_preflight():
    from pretrain.trainer.preflight import DeviceResult, shared_devices

    results = [DeviceResult(0, "n1", 1.0, 0, 1, "GPU-a"), DeviceResult(1, "n1", 1.0, 0, 1, "GPU-a"),
               DeviceResult(2, "n2", 1.0, 0, 1, "GPU-a"), DeviceResult(3, "n2", 1.0, 0, 1, "GPU-b")]
    assert shared_devices(results) == ["rank 1 drives the same GPU as rank 0 on n1 (GPU-a)"]
    assert shared_devices([DeviceResult(0, "n1", 1.0, 0, 1), DeviceResult(1, "n1", 1.0, 0, 1)]) == []  # CPUs


def failed_run(tmp_path, *overrides: str, env: dict | None = None) -> tuple[str, dict]:
    run_dir = tmp_path / "run"
    result = launch(*SHORT, *overrides, f"hydra.run.dir={run_dir}", env=env)
    assert result.returncode != 0
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: preflight failed")]
    assert len(errors) == 1, result.stderr
    return errors[0], metrics(run_dir)[0]


def test_a_wrong_product_on_one_rank_ends_the_run_naming_host_and_rank(tmp_path):
    line, record = failed_run(tmp_path, env={"PRETRAIN_FAULTS": "preflight_fail@rank1"})
    assert line == (f"error: preflight failed on {socket.gethostname()} (rank 1: the matrix product was wrong in "
                    f"1 of 65,536 entries)")
    assert record["preflight"] == "failed" and [r["wrong"] for r in record["ranks"]] == [0, 1]
    assert "allreduce_mib" not in record  # devices first: no network test with a bad device


def test_a_slow_device_fails_against_the_floor(tmp_path):
    line, _ = failed_run(tmp_path, "preflight.min_tflops=1000000")
    assert "(rank 0: matrix products ran at " in line and "below the floor of 1000000.0" in line
    assert "rank 1: matrix products ran at" in line


def test_a_slow_network_fails_against_the_floor(tmp_path):
    line, record = failed_run(tmp_path, "preflight.min_busbw_gbps=1000000")
    assert line.startswith("error: preflight failed: all-reduce bus bandwidth ")
    assert f"across {socket.gethostname()} is below preflight.min_busbw_gbps=1000000" in line
    assert record["busbw_gbps"] < 1000000


@pytest.mark.slurm
def test_a_node_failing_preflight_is_excluded_and_the_job_requeued(slurm_cluster, tmp_path):
    """One node's GPUs are broken (injected on n2). n1 is busy at first, so the job lands on n2, fails its
    preflight and is requeued with n2 excluded; once n1 is free the job runs there and completes."""
    conf = write_cluster_conf(tmp_path, nodes=1, gpus_per_node=2)
    blocker = slurm_cluster.sbatch("--nodelist=n1", "--gres=gpu:2", "--output=/dev/null", "--wrap", "sleep 300")
    try:
        deadline = time.monotonic() + 60
        while slurm_cluster.squeue_state(blocker) != "RUNNING" and time.monotonic() < deadline:
            time.sleep(0.5)
        run_dir = tmp_path / "run"
        result = submit(slurm_cluster, conf, "train.steps=4", "train.micro_batch=4", "train.log_every=1",
                        "train.eval_every=0", "precision=fp32", "preflight.matmul_size=256",
                        f"hydra.run.dir={run_dir}", env={"PRETRAIN_FAULTS": "preflight_fail@n2"})
        assert result.returncode == 0, result.stderr + result.stdout
        job = job_id_of(run_dir)
        info = wait_for(lambda: excluded_and_waiting(slurm_cluster, job), timeout=180, what=f"job {job} requeued")
        assert info["ExcNodeList"] == "n2" and info["Restarts"] == "1", info
    finally:
        slurm_cluster.run("scancel", blocker)
    assert slurm_cluster.wait_job(job, timeout=300) == "COMPLETED", slurm_cluster.describe_job(job)
    runs = [r for r in slurm_cluster.sacct(job) if r["JobID"] == job]
    assert [r["NodeList"] for r in runs] == ["n2", "n1"], runs
    log = (run_dir / "train.log").read_text()
    assert ("preflight failed on n2 (rank 0: the matrix product was wrong in 1 of 65,536 entries; rank 1: the matrix "
            "product was wrong in 1 of 65,536 entries); the job is requeued without n2") in log
    assert "preflight passed on 2 ranks (n1)" in log
    outcomes = [r["preflight"] for r in metrics(run_dir) if "preflight" in r]
    assert outcomes == ["failed", "passed"] and max(losses(run_dir)) == 4
    batch_out = (run_dir / "slurm" / f"{job}_0_log.out").read_text()
    assert (f"pretrain: requeueing job {job} (preflight failed on n2, now excluded: ExcNodeList=n2; restart 1 of "
            "at most 10)") in batch_out
    assert not (run_dir / preflight.EXCLUDE_NODES).exists()


def excluded_and_waiting(cluster: SlurmCluster, job: str) -> dict | None:
    info = cluster.scontrol_job(job)
    if info and info.get("JobState") == "PENDING" and info.get("ExcNodeList") not in (None, "(null)"):
        return info
    return None


def wait_for(probe, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.5)
    raise TimeoutError(what)
