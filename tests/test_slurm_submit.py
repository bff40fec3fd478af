"""Submission to a real Slurm cluster on localhost (tests/slurm/localcluster.sh): two nodes n1, n2 with
two fake GPUs each and no CUDA, so each job trains on CPUs with gloo, exactly as the launcher submits it."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import MINI_MODEL, REPO, hidden_slurm_path, last_step_record, launch, losses, metrics
from tests.slurm.fixture import SlurmCluster, slurm_cluster  # noqa: F401

pytestmark = pytest.mark.slurm

# A user's own cluster file, as the README says to write one: the local test cluster's shape.
LOCAL_CLUSTER = {
    "name": "localtest", "partition": "debug", "nodes": 2, "gpus_per_node": 2, "cpus_per_task": 1,
    "mem_gb": None, "time_min": 10, "signal_delay_s": 30, "env": {"OMP_NUM_THREADS": "1"},
}
TRAIN = ("train.micro_batch=4", "train.log_every=1", "train.eval_every=0", "precision=fp32")


def write_cluster_conf(folder: Path, **changes) -> Path:
    conf = folder / "myconf"
    (conf / "cluster").mkdir(parents=True, exist_ok=True)
    (conf / "cluster" / "localtest.yaml").write_text(yaml.safe_dump({**LOCAL_CLUSTER, **changes}))
    return conf


@pytest.fixture
def cluster_conf(tmp_path) -> Path:
    return write_cluster_conf(tmp_path)


def submit(cluster: SlurmCluster, conf: Path, *overrides: str, env: dict | None = None):
    return launch("+cluster=localtest", f"hydra.searchpath=[file://{conf}]", *overrides,
                  env={**cluster.env, **(env or {})}, timeout=120)


def job_id_of(run_dir: Path) -> str:
    return json.loads((run_dir / "jobs.json").read_text())[-1]["job_id"]


def wait_for_step(run_dir: Path, step: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run_dir / "metrics.jsonl").is_file() and any(s >= step for s in losses(run_dir)):
            return
        time.sleep(0.3)
    raise TimeoutError(f"{run_dir} did not reach step {step}")


def status_row(cluster: SlurmCluster, run_dir: Path, env: dict | None = None) -> list[str]:
    """`python -m pretrain.status RUN`'s row: job, state, restarts, step, loss, run."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "pretrain.status", str(run_dir)], capture_output=True, text=True,
                            env={**os.environ, **cluster.env, **(env or {})}, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()[1].split()


def test_two_node_job_completes_and_launch_returns_at_once(slurm_cluster, cluster_conf, tmp_path):
    run_dir = tmp_path / "run"
    started = time.monotonic()
    result = submit(slurm_cluster, cluster_conf, "train.steps=24", *TRAIN, f"hydra.run.dir={run_dir}")
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stderr + result.stdout
    job = job_id_of(run_dir)
    assert f"submitted job {job}" in result.stdout and f"run directory: {run_dir}" in result.stdout
    assert str(run_dir / "slurm" / f"{job}_0_log.out") in result.stdout
    # The launcher came back while the job had not finished.
    assert slurm_cluster.squeue_state(job) in ("PENDING", "CONFIGURING", "RUNNING"), elapsed
    assert elapsed < 20

    during = status_row(slurm_cluster, run_dir)
    assert during[0] == job and during[1] in ("PENDING", "CONFIGURING", "RUNNING"), during

    assert slurm_cluster.wait_job(job, timeout=300) == "COMPLETED", slurm_cluster.describe_job(job)
    assert status_row(slurm_cluster, run_dir)[:4] == [job, "COMPLETED", "0", "24"]
    alloc = [r for r in slurm_cluster.sacct(job) if r["JobID"] == job][-1]
    assert alloc["NodeList"] == "n[1-2]" and "gres/gpu=4" in alloc["AllocTRES"]
    curve = losses(run_dir)
    assert sorted(curve) == list(range(1, 25)), "each step logged once: one rank wrote the metrics"
    assert curve[24] < curve[1] - 1.0
    log = (run_dir / "train.log").read_text()
    assert "world size 4" in log and "[rank1]" not in log
    for rank in range(4):  # each rank's stderr in its own file
        assert (run_dir / "slurm" / f"{job}_{rank}_log.err").is_file()


SHIPPED_CLUSTERS = sorted(p.stem for p in (REPO / "conf" / "cluster").glob("*.yaml"))


@pytest.mark.parametrize("nodes", [1, 2, 3, 4, 16])
@pytest.mark.parametrize("name", SHIPPED_CLUSTERS)
def test_every_shipped_cluster_dry_runs_with_nothing_else(tmp_path, capsys, monkeypatch, name, nodes):
    from pretrain import launch as launcher

    (tmp_path / "pretrain.sif").write_text("stand-in")  # h100x8's image is ~/pretrain.sif; the others run on the host
    # Slurm's commands hidden too: a dry run prints the job on any machine.
    monkeypatch.setenv("PATH", f"{REPO / 'tests' / 'fake_container'}{os.pathsep}{hidden_slurm_path(tmp_path)}")
    monkeypatch.setenv("HOME", str(tmp_path))
    args = [f"+cluster={name}", "dry_run=true", f"hydra.run.dir={tmp_path / 'run'}"]
    code = launcher.main(args + ([] if nodes == 1 else [f"cluster.nodes={nodes}"]))
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"#SBATCH --nodes={nodes}" in out and "# dry run: nothing was written or submitted" in out
    assert not (tmp_path / "run").exists()


# A shipped cluster file shrunk to the local test cluster: the job is what `+cluster=NAME` alone submits.
LOCAL_SIZES = ("cluster.partition=debug", "cluster.gpus_per_node=2", "cluster.cpus_per_task=1", "cluster.mem_gb=null",
               "cluster.time_min=10", "cluster.signal_delay_s=30", "+cluster.env.OMP_NUM_THREADS=1")


def test_shipped_clusters_submit_and_complete_with_their_defaults(slurm_cluster, tmp_path):
    image = tmp_path / "pretrain.sif"
    image.write_text("stand-in image")
    env = {**slurm_cluster.env, "PATH": f"{REPO / 'tests' / 'fake_container'}{os.pathsep}{os.environ['PATH']}",
           "FAKE_CONTAINER_RECORD": str(tmp_path / "container.jsonl"), "FAKE_CONTAINER_PATH": os.environ["PATH"]}
    points = {"a100x8": [], "a100x8-2nodes": ["cluster.nodes=2"], "a100x4": [],
              "h100x8": [f"cluster.container.image={image}"]}
    jobs = {}
    for label, extra in points.items():
        run_dir = tmp_path / label
        result = launch(f"+cluster={label.split('-')[0]}", *LOCAL_SIZES, *extra, "train.steps=4",
                        f"hydra.run.dir={run_dir}", env=env, timeout=120)
        assert result.returncode == 0, result.stderr + result.stdout
        jobs[label] = (job_id_of(run_dir), run_dir)
    for label, (job, run_dir) in jobs.items():
        assert slurm_cluster.wait_job(job, timeout=300) == "COMPLETED", (label, slurm_cluster.describe_job(job))
        world = 4 if label == "a100x8-2nodes" else 2
        assert f"world size {world}, global batch {16 * world} = 1 micro-batch of 16" in (run_dir / "train.log").read_text()
        assert max(losses(run_dir)) == 4
    assert (tmp_path / "container.jsonl").is_file()  # h100x8's tasks ran in the (stand-in) container


def test_each_task_runs_on_the_cpus_and_gpus_it_was_given(slurm_cluster, tmp_path):
    """srun gets --cpus-per-task (it no longer inherits it from sbatch since Slurm 22.05): each rank's CPU
    affinity, as the preflight records it, is cluster.cpus_per_task (the test cluster binds tasks to CPUs).
    cluster.gpu_bind reaches srun: by default each task sees the job's GPUs of its node, with per_task:1
    one each, with none (srun then unsets CUDA_VISIBLE_DEVICES) every GPU of the node."""
    jobs = []
    for gpus, cpus, bind, visible in ((1, 2, None, ["0"]), (2, 1, "per_task:1", ["0", "1"]),
                                      (2, 1, "none", ["all", "all"])):
        run_dir = tmp_path / f"{gpus}x{cpus}-{bind}"
        conf = write_cluster_conf(tmp_path / f"conf-{run_dir.name}", nodes=1, gpus_per_node=gpus, cpus_per_task=cpus,
                                  gpu_bind=bind)
        result = submit(slurm_cluster, conf, "train.steps=2", *TRAIN, *MINI_MODEL, f"hydra.run.dir={run_dir}")
        assert result.returncode == 0, result.stderr + result.stdout
        jobs.append((job_id_of(run_dir), run_dir, gpus, cpus, bind, visible))
    for job, run_dir, gpus, cpus, bind, visible in jobs:
        assert slurm_cluster.wait_job(job, timeout=300) == "COMPLETED", slurm_cluster.describe_job(job)
        script = (run_dir / "slurm" / f"{job}_submission.sh").read_text()
        assert f"--cpus-per-task={cpus}" in script and (f"--gpu-bind={bind}" in script) == (bind is not None)
        record = next(r for r in metrics(run_dir) if r.get("preflight") == "passed")
        assert [r["cpus"] for r in record["ranks"]] == [cpus] * gpus, record["ranks"]
        assert [r["visible"] for r in record["ranks"]] == visible, record["ranks"]


def test_dry_run_shows_the_script_and_submits_nothing(tmp_path):
    run_dir = tmp_path / "run"
    result = launch("+cluster=a100x8", "cluster.nodes=4", "dry_run=true",
                    "train.micro_batch=2", f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for line in ("#SBATCH --nodes=4", "#SBATCH --gpus-per-node=8", "#SBATCH --ntasks-per-node=8",
                 "#SBATCH --signal=USR2@120", "#SBATCH --time=2880", "#SBATCH --requeue", "srun ",
                 "-m pretrain.train \"$PRETRAIN_RUN_DIR\"", 'scontrol requeue "$SLURM_JOB_ID"'):
        assert line in out, line
    assert "nothing was written or submitted" in out
    assert not run_dir.exists()


def test_dry_run_quotes_values_instead_of_running_them(tmp_path):
    marker = tmp_path / "pwned"
    result = launch("+cluster=a100x8", "dry_run=true",
                    f"+cluster.env.EVIL='$(touch {marker}); `touch {marker}`'", f"hydra.run.dir={tmp_path}/my run")
    assert result.returncode == 0, result.stderr
    script = result.stdout.split("# each of the")[0]
    assert f"export EVIL='$(touch {marker}); `touch {marker}`'" in script
    assert f"PRETRAIN_RUN_DIRS=('{tmp_path}/my run')" in script
    # Run the script's setup part in a shell: the values stay values.
    import subprocess

    setup = script.split("# setup")[1].split("# command")[0]
    shown = subprocess.run(["bash", "-c", setup + '\necho "$EVIL"; echo "$PRETRAIN_RUN_DIR"'], capture_output=True,
                           text=True)
    assert shown.stdout.splitlines() == [f"$(touch {marker}); `touch {marker}`", f"{tmp_path}/my run"]
    assert not marker.exists()


def test_sweep_is_one_job_array(slurm_cluster, cluster_conf, tmp_path):
    sweep = tmp_path / "sweep"
    result = submit(slurm_cluster, cluster_conf, "-m", "optim.lr=1e-3,2e-3,4e-3", "cluster.nodes=1",
                    "train.steps=6", *TRAIN, *MINI_MODEL, f"hydra.sweep.dir={sweep}")
    assert result.returncode == 0, result.stderr + result.stdout
    run_dirs = sorted(p.parent for p in sweep.glob("*/jobs.json"))
    assert len(run_dirs) == 3
    job_ids = [job_id_of(d) for d in run_dirs]
    array = {j.split("_")[0] for j in job_ids}
    assert len(array) == 1 and sorted(j.split("_")[1] for j in job_ids) == ["0", "1", "2"]
    for job in job_ids:
        assert slurm_cluster.wait_job(job, timeout=300) == "COMPLETED", slurm_cluster.describe_job(job)
    rates = set()
    for run_dir in run_dirs:
        rates.add(yaml.safe_load((run_dir / "config.yaml").read_text())["optim"]["lr"])
        assert max(losses(run_dir)) == 6
    assert rates == {1e-3, 2e-3, 4e-3}


PREEMPT = ("train.steps=30", "train.ckpt_every=10", *TRAIN, *MINI_MODEL)


@pytest.fixture(scope="module")
def uninterrupted_loss(slurm_cluster, tmp_path_factory) -> float:
    """The final loss of the preemption tests' job when nothing interrupts it."""
    tmp = tmp_path_factory.mktemp("reference")
    conf = write_cluster_conf(tmp)
    run_dir = tmp / "run"
    assert submit(slurm_cluster, conf, *PREEMPT, f"hydra.run.dir={run_dir}").returncode == 0
    assert slurm_cluster.wait_job(job_id_of(run_dir), timeout=300) == "COMPLETED"
    return losses(run_dir)[30]


def assert_resumed_to_the_same_end(cluster: SlurmCluster, run_dir: Path, job: str, reference: float,
                                   requeued_as: tuple[str, ...] = ("REQUEUED",)) -> None:
    assert cluster.wait_job(job, timeout=400) == "COMPLETED", cluster.describe_job(job)
    assert cluster.restarts(job) >= 1
    states = [r["State"] for r in cluster.sacct(job) if r["JobID"] == job]
    assert any(state.split()[0] in requeued_as for state in states), states
    assert "resumed from" in (run_dir / "train.log").read_text()
    assert losses(run_dir)[30] == pytest.approx(reference, abs=1e-6)
    assert last_step_record(run_dir)["restarts"] >= 1


def test_signal_checkpoints_requeues_and_resumes(slurm_cluster, cluster_conf, tmp_path, uninterrupted_loss):
    run_dir = tmp_path / "run"
    assert submit(slurm_cluster, cluster_conf, *PREEMPT, f"hydra.run.dir={run_dir}").returncode == 0
    job = job_id_of(run_dir)
    wait_for_step(run_dir, 12)
    slurm_cluster.run("scancel", "--signal=USR2", job)
    assert_resumed_to_the_same_end(slurm_cluster, run_dir, job, uninterrupted_loss)
    # Status says the same with accounting (sacct) and, on a cluster without it, from scontrol.
    assert status_row(slurm_cluster, run_dir)[:4] == [job, "COMPLETED", "1", "30"]
    without_sacct = {"PATH": hidden_slurm_path(tmp_path, hide=("sacct",))}
    assert status_row(slurm_cluster, run_dir, env=without_sacct)[:4] == [job, "COMPLETED", "1", "30"]
    out = (run_dir / "slurm" / f"{job}_0_log.out").read_text()
    assert "the job will be requeued" in out
    batch_out = "".join(p.read_text() for p in (run_dir / "slurm").glob(f"{job}_0_log.out"))
    assert f"pretrain: requeueing job {job} (stopped with a checkpoint before the time limit; restart 1 of at most 10)" in batch_out


def test_scontrol_requeue_resumes(slurm_cluster, cluster_conf, tmp_path, uninterrupted_loss):
    run_dir = tmp_path / "run"
    assert submit(slurm_cluster, cluster_conf, *PREEMPT, f"hydra.run.dir={run_dir}").returncode == 0
    job = job_id_of(run_dir)
    wait_for_step(run_dir, 12)
    slurm_cluster.run("scontrol", "requeue", job)
    assert_resumed_to_the_same_end(slurm_cluster, run_dir, job, uninterrupted_loss)


def test_requeue_works_with_scontrol_hidden_in_a_container(slurm_cluster, tmp_path, uninterrupted_loss):
    run_dir = tmp_path / "run"
    image = tmp_path / "pretrain.sif"
    image.write_bytes(b"stand-in image")
    record = tmp_path / "container.jsonl"
    env = {"PATH": f"{REPO / 'tests' / 'fake_container'}{os.pathsep}{os.environ['PATH']}",
           "FAKE_CONTAINER_RECORD": str(record), "FAKE_CONTAINER_PATH": hidden_slurm_path(tmp_path)}
    conf = write_cluster_conf(tmp_path, container={"image": str(image), "runtime": "apptainer"})
    result = submit(slurm_cluster, conf, *PREEMPT, f"hydra.run.dir={run_dir}", env=env)
    assert result.returncode == 0, result.stderr + result.stdout
    job = job_id_of(run_dir)
    wait_for_step(run_dir, 12)
    slurm_cluster.run("scancel", "--signal=USR2", job)
    assert_resumed_to_the_same_end(slurm_cluster, run_dir, job, uninterrupted_loss)
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(calls) >= 8  # 4 tasks, before and after the requeue
    assert all(c["nv"] and c["image"] == str(image) and c["scontrol_inside"] == "none" for c in calls)
    assert all(str(run_dir) in c["binds"] for c in calls)
    assert {c["env"]["SLURM_PROCID"] for c in calls} == {"0", "1", "2", "3"}
    assert all(c["env"]["PRETRAIN_RUN_DIR"] == str(run_dir) for c in calls)


def test_killed_node_ends_the_job_which_is_requeued_and_resumes(slurm_cluster, cluster_conf, tmp_path,
                                                              uninterrupted_loss):
    from tests.helpers import training_processes_of

    run_dir = tmp_path / "run"
    assert submit(slurm_cluster, cluster_conf, *PREEMPT, f"hydra.run.dir={run_dir}").returncode == 0
    job = job_id_of(run_dir)
    wait_for_step(run_dir, 12)
    # Every process of node n2's tasks (ranks 2 and 3), as if the node had died.
    victims = training_processes_of(job, "n2")
    assert victims
    for pid in victims:
        os.kill(pid, 9)
    assert_resumed_to_the_same_end(slurm_cluster, run_dir, job, uninterrupted_loss)
    batch_out = (run_dir / "slurm" / f"{job}_0_log.out").read_text()
    assert "a task failed with exit code" in batch_out


def test_wandb_key_reaches_the_job_only_through_the_environment(slurm_cluster, cluster_conf, tmp_path):
    """A Slurm job logging to W&B (offline: no network here) with a marker key: the key is in nothing it wrote."""
    from tests.test_wandb import MARKER

    run_dir = tmp_path / "run"
    result = submit(slurm_cluster, cluster_conf, "train.steps=4", *TRAIN, "logging.wandb.mode=online",
                    f"hydra.run.dir={run_dir}", env={"WANDB_API_KEY": MARKER, "WANDB_BASE_URL": "http://127.0.0.1:9"})
    assert result.returncode == 0, result.stderr
    job = job_id_of(run_dir)
    assert slurm_cluster.wait_job(job, timeout=300) == "COMPLETED", slurm_cluster.describe_job(job)
    assert "logging offline" in (run_dir / "train.log").read_text().lower()
    written = [p for p in run_dir.rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in written)
    assert [p for p in written if MARKER.encode() in p.read_bytes()] == []
    assert MARKER not in result.stdout + result.stderr
