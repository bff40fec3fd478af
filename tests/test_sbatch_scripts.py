"""The hand-run sbatch scripts under sbatch/ come from the same code as the submitit path and cannot drift."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.rundir import FAILED_MARKER, REQUEUE_REQUEST, STOPPED_NOTICE
from tests.helpers import REPO, losses
from tests.sbatch_examples import FAKE_RUNTIME, SCRIPTS, generate
from tests.slurm.fixture import slurm_cluster  # noqa: F401

@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_committed_script_is_what_the_launcher_generates(script):
    assert generate(script) == script.read_text(), \
        f"{script} is stale: regenerate it with python -m tests.sbatch_examples"


FAKE_RUNTIME_PATH = f"{FAKE_RUNTIME}{os.pathsep}{os.environ['PATH']}"


def sections(script: str) -> dict[str, list[str]]:
    """The script split at submitit's section comments: '# Parameters', '# setup', '# command', '# teardown'."""
    parts: dict[str, list[str]] = {}
    current = "head"
    for line in script.splitlines():
        if line in ("# Parameters", "# setup", "# command", "# teardown"):
            current = line[2:]
            continue
        parts.setdefault(current, []).append(line)
    return parts


def test_hand_run_script_and_submitit_script_agree(tmp_path):
    image = tmp_path / "pretrain.sif"
    image.write_text("stand-in")
    overrides = ["+cluster=h100x8", "cluster.nodes=2", "cluster.container.runtime=apptainer",
                 f"cluster.container.image={image}", "train.global_batch=32", "train.micro_batch=2"]
    plain = tmp_path / "plain.sh"
    env = {**os.environ, "PATH": FAKE_RUNTIME_PATH}
    made = subprocess.run([sys.executable, "-m", "pretrain.launch", *overrides, f"write_sbatch={plain}"], cwd=REPO,
                          capture_output=True, text=True, env=env)
    assert made.returncode == 0, made.stderr
    dry = subprocess.run([sys.executable, "-m", "pretrain.launch", *overrides, "dry_run=true",
                          f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO, capture_output=True, text=True, env=env)
    assert dry.returncode == 0, dry.stderr
    a, b = sections(plain.read_text()), sections(dry.stdout.split("# each of the")[0])

    def flags(lines):  # log paths and job names differ by design
        return [l for l in lines if l.startswith("#SBATCH") and not re.match(r"#SBATCH --(output|error|job-name)", l)]

    assert flags(a["Parameters"]) == flags(b["Parameters"]) and "#SBATCH --nodes=2" in a["Parameters"]
    def common(setup: list[str]) -> list[str]:  # the run directory's definition differs by design
        if "PRETRAIN_CONFIG_END" in setup:  # the hand-run script carries the run's config: leave it out
            start = next(i for i, line in enumerate(setup) if line.startswith("if [ ! -f"))
            setup = setup[:start] + setup[setup.index("fi", start) + 1:]
        return [line for line in setup if "PRETRAIN_RUN_DIR" not in line and not line.startswith("# pretrain")]

    assert common(a["setup"]) == common(b["setup"])
    config_block = a["setup"][a["setup"].index(next(l for l in a["setup"] if l.startswith("if [ ! -f"))):]
    assert "model:" in config_block and "  dim: 256" in config_block  # the resolved config travels in the script
    assert a["teardown"] == b["teardown"] and any("scontrol requeue" in l for l in a["teardown"])
    srun_a = next(l for l in a["command"] if l.startswith("srun"))
    srun_b = next(l for l in b["command"] if l.startswith("srun"))
    container = "apptainer exec --nv --env PYTHONNOUSERSITE=1 --bind {} " + f"{image} python3"
    assert container.format('"$PRETRAIN_RUN_DIR"') + " -m pretrain.train" in srun_a
    assert container.format(shlex.quote(str(tmp_path / "run"))) + " -u -m submitit.core._submit" in srun_b
    for srun in (srun_a, srun_b):
        assert "--kill-on-bad-exit=1" in srun and "--cpus-per-task=16" in srun


@pytest.mark.slurm
def test_hand_run_script_trains_on_the_local_cluster(slurm_cluster, tmp_path):
    import yaml

    conf = tmp_path / "conf"
    (conf / "cluster").mkdir(parents=True)
    (conf / "cluster" / "localtest.yaml").write_text(yaml.safe_dump({
        "name": "localtest", "partition": "debug", "nodes": 2, "gpus_per_node": 2, "cpus_per_task": 1,
        "mem_gb": None, "time_min": 10, "env": {"OMP_NUM_THREADS": "1"}}))
    script = tmp_path / "job.sh"
    made = subprocess.run([sys.executable, "-m", "pretrain.launch", "+cluster=localtest",
                           f"hydra.searchpath=[file://{conf}]", "train.steps=8", "train.micro_batch=4",
                           "train.log_every=1", "precision=fp32", f"write_sbatch={script}"],
                          cwd=REPO, capture_output=True, text=True, env=slurm_cluster.env)
    assert made.returncode == 0, made.stderr
    (tmp_path / "runs" / "slurm").mkdir(parents=True)
    job = slurm_cluster.sbatch(str(script), cwd=tmp_path)
    assert slurm_cluster.wait_job(job, timeout=300) == "COMPLETED", slurm_cluster.describe_job(job)
    run_dir = tmp_path / "runs" / f"sbatch-{job}"
    assert sorted(losses(run_dir)) == list(range(1, 9))
    assert "world size 4" in (run_dir / "train.log").read_text()


# Values a user might type that are shell syntax: each, if the script ran it, would create a file
# named pwned* in the folder the script runs in.
HOSTILE = ["cluster.partition='debug;touch pwned1'", "cluster.account='$(touch pwned2)'",
           "model.name='`touch pwned3`'", "+cluster.env.EVIL='$(touch pwned4); `touch pwned4`'",
           "cluster.qos=\"it's;touch pwned5\""]


def stand_in_slurm(folder: Path) -> Path:
    """srun, scontrol and sbatch that only record their arguments (and srun the EVIL variable it was given)."""
    folder.mkdir()
    for name in ("srun", "scontrol", "sbatch"):
        (folder / name).write_text(f'#!/bin/bash\nprintf "%s\\n" "{name}" "$@" "EVIL=$EVIL" >> "$SLURM_CALLS"\n')
        (folder / name).chmod(0o755)
    return folder


def header_and_body(script: str) -> tuple[list[str], list[str]]:
    """The #SBATCH lines sbatch reads (up to the first command) and the lines after."""
    lines = script.splitlines()
    first_command = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("#"))
    return [l for l in lines[:first_command] if l.startswith("#SBATCH")], lines[first_command:]


def test_generated_scripts_run_no_value_as_a_command(tmp_path):
    """Both scripts (write_sbatch's and the submitted one, as a dry run prints it) run under bash with
    stand-in Slurm commands: no value is executed, and the #SBATCH header stays whole."""
    work = tmp_path / "work"
    work.mkdir()
    bin_dir = stand_in_slurm(tmp_path / "bin")
    plain = tmp_path / "plain.sh"
    base = ["+cluster=a100x8", *HOSTILE]
    made = subprocess.run([sys.executable, "-m", "pretrain.launch", *base, f"write_sbatch={plain}"], cwd=REPO,
                          capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    dry = subprocess.run([sys.executable, "-m", "pretrain.launch", *base, "dry_run=true",
                          f"hydra.run.dir='{work}/run $(touch pwned6)'"], cwd=REPO, capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr
    submitted = tmp_path / "submitted.sh"
    submitted.write_text(dry.stdout.split("# each of the")[0])
    for script in (plain, submitted):
        header, body = header_and_body(script.read_text())
        for flag in ("--requeue", "--signal=USR2@120", "--time=2880", "--partition='debug;touch pwned1'"):
            assert f"#SBATCH {flag}" in header, (script, flag)
        assert not any(line.startswith("#SBATCH") for line in body)
        calls = tmp_path / f"{script.stem}.calls"
        env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "7",
               "SLURM_SUBMIT_DIR": str(work), "SLURM_CALLS": str(calls)}
        ran = subprocess.run(["bash", str(script)], cwd=work, env=env, capture_output=True, text=True, timeout=60)
        assert ran.returncode == 0, ran.stderr
        recorded = calls.read_text().splitlines()
        assert recorded[0] == "srun" and "--cpus-per-task=12" in recorded
        assert "EVIL=$(touch pwned4); `touch pwned4`" in recorded  # the value arrived as a value
        assert "scontrol" not in recorded  # nothing asked for a requeue
    assert sorted(p.name for p in tmp_path.rglob("pwned*")) == []


# What the batch script does after srun: (notes the ranks left, whether the job itself got SIGTERM,
# srun's exit status, the requeue reason it prints or None for no requeue).
AFTER_SRUN = {
    "finished": ((), False, 0, None),
    "time_limit": ((REQUEUE_REQUEST,), False, 0, "stopped with a checkpoint before the time limit"),
    "tasks_alone_got_sigterm": ((STOPPED_NOTICE,), False, 0, "the tasks were stopped by a signal this job was not sent"),
    "scancel_or_preemption": ((STOPPED_NOTICE,), True, 0, None),
    "a_rank_crashed": ((), False, 137, "a task failed with exit code 137"),
    "ranks_killed_by_scancel": ((), True, 143, None),
    "an_error_a_rerun_repeats": ((FAILED_MARKER,), False, 1, None),
}


@pytest.mark.parametrize("case", AFTER_SRUN)
def test_the_batch_script_requeues_exactly_what_slurm_did_not_end(tmp_path, case):
    """The generated setup and teardown run under bash around a stand-in srun that leaves the ranks'
    notes, signals the script as scancel would, and exits with srun's status; scontrol records."""
    from pretrain.config import ClusterConfig
    from pretrain.launcher.slurm import run_dir_lines, setup_lines, teardown_lines

    notes, batch_signalled, status, reason = AFTER_SRUN[case]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / STOPPED_NOTICE).write_text("left by the last attempt\n")  # never this attempt's
    srun = "".join(f'echo x > "$PRETRAIN_RUN_DIR/{note}"; ' for note in notes)
    srun += "kill -TERM $$; " if batch_signalled else ""
    cluster = ClusterConfig(name="x", max_requeues=3)
    script = "\n".join([*setup_lines(cluster, run_dir_lines([str(run_dir)])), f"( {srun}exit {status} )",
                        *teardown_lines(cluster)])
    bin_dir = stand_in_slurm(tmp_path / "bin")
    calls = tmp_path / "calls"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "7",
           "SLURM_CALLS": str(calls)}
    env.pop("SLURM_RESTART_COUNT", None)
    ran = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert ran.returncode == status, ran.stderr
    recorded = calls.read_text().splitlines() if calls.exists() else []
    if reason is None:
        assert "scontrol" not in recorded and "requeueing" not in ran.stdout, ran.stdout
    else:
        assert recorded[:3] == ["scontrol", "requeue", "7"]
        assert f"pretrain: requeueing job 7 ({reason}" in ran.stdout
