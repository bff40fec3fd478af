"""Submitting runs to Slurm with submitit, and the host-side part of each job.

One task per GPU; every task runs `pretrain.train.main([RUN_DIR])` (the same as
`python -m pretrain.train RUN_DIR`) through submitit, inside the container when one is
configured. A sweep becomes one job array. The launcher prints the job ids and returns: it
never waits for a job.

Requeue on preemption or time limit: Slurm signals the tasks (`--signal=USR2@signal_delay_s`,
or SIGTERM); the ranks agree at a step boundary, save a checkpoint, rank 0 leaves a request
file in the run directory, and the tasks exit. The batch script, which runs on the host and
not in the container, then sees the request and runs `scontrol requeue` (containers rarely
have scontrol). The requeued job resumes from the checkpoint by itself.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from pretrain.config import ClusterConfig, Config, ConfigError
from pretrain.preemption import EXIT_STOPPED, REQUEUE_REQUEST

# sbatch's --signal names the signal submitit's job environment listens on; ours listens too.
SUBMITIT_SIGNAL = "USR2"


class TrainTask:
    """What each Slurm task runs; pickled by submitit, so it holds only the run directory."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir

    def __call__(self) -> int:
        from pretrain import train

        code = train.main([self.run_dir])
        if code not in (0, EXIT_STOPPED):
            raise RuntimeError(f"training in {self.run_dir} failed with exit code {code}; see its train.log")
        return code


def job_name(run_dir: Path) -> str:
    return "pretrain-" + re.sub(r"[^A-Za-z0-9._-]", "_", run_dir.name)[:100]


def setup_lines(cluster: ClusterConfig, run_dirs: list[str]) -> list[str]:
    """Lines the batch script runs on the host before srun: run directory, environment, user setup."""
    quoted = " ".join(shlex.quote(d) for d in run_dirs)
    lines = [
        "# pretrain: the run directory of this job (of this array task)",
        f"PRETRAIN_RUN_DIRS=({quoted})",
        'export PRETRAIN_RUN_DIR="${PRETRAIN_RUN_DIRS[${SLURM_ARRAY_TASK_ID:-0}]}"',
        "# Preemption also signals this script: carry on to the requeue check below once srun returns.",
        "trap 'echo \"pretrain: batch script got SIGTERM; waiting for the tasks to checkpoint\" >&2' TERM",
    ]
    lines += [f"export {key}={shlex.quote(str(value))}" for key, value in cluster.env.items()]
    if cluster.setup:
        lines += ["# cluster.setup", *cluster.setup]
    return lines


def teardown_lines(cluster: ClusterConfig) -> list[str]:
    """Lines the batch script runs on the host after srun: requeue if training asked for it."""
    limit = cluster.max_requeues
    return [
        "# pretrain: requeue from the host (the training may run in a container without scontrol)",
        f'if [ -f "$PRETRAIN_RUN_DIR/{REQUEUE_REQUEST}" ]; then',
        f'  rm -f "$PRETRAIN_RUN_DIR/{REQUEUE_REQUEST}"',
        f'  if [ "${{SLURM_RESTART_COUNT:-0}}" -lt {limit} ]; then',
        f'    echo "pretrain: requeueing job $SLURM_JOB_ID (restart $(( ${{SLURM_RESTART_COUNT:-0}} + 1 )) of at most {limit})"',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "  else",
        f'    echo "pretrain: not requeued: cluster.max_requeues={limit} reached; submit the same run directory again '
        'to continue" >&2',
        "  fi",
        "fi",
    ]


def python_command(cfg: Config, run_root: Path) -> str:
    """The python the tasks run: the login node's own, or the container's through apptainer/singularity."""
    from pretrain import container

    if cfg.cluster.container is None:
        return shlex.quote(sys.executable)
    return container.exec_prefix(cfg, run_root) + " python3"


def executor_parameters(cfg: Config, run_dirs: list[str]) -> dict[str, Any]:
    cluster = cfg.cluster
    params: dict[str, Any] = {
        "job_name": job_name(Path(cfg.run_dir) if len(run_dirs) == 1 else Path(cfg.run_dir).parent),
        "nodes": cluster.nodes,
        "ntasks_per_node": cluster.gpus_per_node,
        "gpus_per_node": cluster.gpus_per_node,
        "cpus_per_task": cluster.cpus_per_task,
        "time": cluster.time_min,
        "signal_delay_s": cluster.signal_delay_s,
        "setup": setup_lines(cluster, run_dirs),
        "teardown": teardown_lines(cluster),
        "additional_parameters": {"requeue": True},
        "srun_args": ["--kill-on-bad-exit=1"],
    }
    optional = {"partition": cluster.partition, "account": cluster.account, "qos": cluster.qos,
                "constraint": cluster.constraint, "exclude": cluster.exclude,
                "mem": f"{cluster.mem_gb}GB" if cluster.mem_gb is not None else None}
    params.update({key: value for key, value in optional.items() if value is not None})
    return params


def run_root(run_dirs: list[str], sweep_dir: Path | None) -> Path:
    """The folder that holds every run directory of this submission (what the container binds)."""
    return sweep_dir.resolve() if sweep_dir is not None else Path(run_dirs[0])


def make_executor(cfg: Config, root: Path, run_dirs: list[str]):
    import submitit

    executor = submitit.SlurmExecutor(folder=root / "slurm", python=python_command(cfg, root), max_num_timeout=0)
    executor.update_parameters(**executor_parameters(cfg, run_dirs))
    return executor


def batch_script(cfg: Config, root: Path, run_dirs: list[str]) -> str:
    """The sbatch script submitit writes for these runs (what `dry_run=true` prints)."""
    executor = make_executor(cfg, root, run_dirs)
    if len(run_dirs) > 1:
        executor.parameters["map_count"] = len(run_dirs)
    command = " ".join([executor.python, "-u -m submitit.core._submit", shlex.quote(str(executor.folder))])
    return executor._make_submission_file_text(command, "DRYRUN")


def check_submittable(cfgs: list[Config], root: Path) -> None:
    for cfg in cfgs:
        if cfg.cluster.container is not None:
            from pretrain import container

            container.check(cfg, root)
    if shutil.which("sbatch") is None:
        raise ConfigError("sbatch is not on PATH: submit from a Slurm login node (or load its module), "
                          "or use dry_run=true to see the script")


def record_job(run_dir: Path, job) -> dict[str, Any]:
    """Append a submitted job to RUN_DIR/jobs.json, which pretrain.status reads."""
    entry = {"job_id": job.job_id, "submitted": time.strftime("%Y-%m-%dT%H:%M:%S"),
             "stdout": str(job.paths.stdout), "stderr": str(job.paths.stderr)}
    path = run_dir / "jobs.json"
    jobs = json.loads(path.read_text()) if path.is_file() else []
    path.write_text(json.dumps(jobs + [entry], indent=2))
    return entry


def submit(cfgs: list[Config], sweep_dir: Path | None) -> int:
    """Check, write the run directories, submit (one job, or one array for a sweep), print, return."""
    from pretrain import launch

    run_dirs = [cfg.run_dir for cfg in cfgs]
    root = run_root(run_dirs, sweep_dir)
    first = cfgs[0]
    if first.dry_run:
        print(batch_script(first, root, run_dirs))
        print(f"# each of the {first.cluster.nodes * first.cluster.gpus_per_node} tasks runs the same as:")
        print(f"#   {python_command(first, root)} -m pretrain.train $PRETRAIN_RUN_DIR")
        print("# dry run: nothing was written or submitted")
        return 0
    check_submittable(cfgs, root)
    for cfg in cfgs:
        launch.write_run(cfg)
    executor = make_executor(first, root, run_dirs)
    tasks = [TrainTask(d) for d in run_dirs]
    if len(tasks) == 1:
        jobs = [executor.submit(tasks[0])]
    else:
        jobs = executor.submit_array(tasks)
    for job, run_dir in zip(jobs, run_dirs):
        entry = record_job(Path(run_dir), job)
        print(f"submitted job {entry['job_id']}\n  run directory: {run_dir}\n  log (rank 0):  {entry['stdout']}\n"
              f"  errors:        {entry['stderr']}")
    print(f"follow with: python -m pretrain.status {sweep_dir or run_dirs[0]}")
    return 0
