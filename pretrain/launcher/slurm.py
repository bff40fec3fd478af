"""Submitting runs to Slurm with submitit, and all of the batch script: the host side of each job.

One task per GPU; every task runs `pretrain.train.main([RUN_DIR])` (what `python -m pretrain.train
RUN_DIR` runs), inside the container when one is configured. A sweep becomes one job array. The
launcher prints the job ids and returns: it never waits for a job. Submission goes through
submitit (its executor, job arrays and job objects); the script is submitit's template with our
setup and teardown lines, rendered by submitit_script for dry runs and `write_sbatch` as well, so
that all three are one template.

Requeue on preemption or time limit: Slurm signals the tasks (`--signal=USR2@signal_delay_s`,
or SIGTERM); the ranks agree at a step boundary, save a checkpoint, rank 0 leaves a request
file in the run directory, and the tasks exit. The batch script, which runs on the host and
not in the container, then sees the request and runs `scontrol requeue` (containers rarely
have scontrol). The requeued job resumes from the checkpoint by itself. The rule for the other
endings is generated from pretrain.rundir.ExitCode.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from pretrain import rundir
from pretrain.config import ClusterConfig, Config, ConfigError
from pretrain.launcher import container, submitit_script
from pretrain.rundir import EXCLUDE_NODES, FAILED_MARKER, REQUEUE_REQUEST, STOPPED_NOTICE, ExitCode


class JobEntry:
    """What each Slurm task runs; pickled by submitit, so it holds only the run directory.

    The trainer is looked up by name when the task runs, so the launcher never imports it (nor torch).
    """

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir

    def __call__(self) -> int:
        code = importlib.import_module("pretrain.train").main([self.run_dir])
        if code not in (ExitCode.OK, ExitCode.STOPPED):
            # train.main printed the one-line reason; the task ends with its exit code, no traceback.
            raise SystemExit(int(code))
        return int(code)


def job_name(name: str) -> str:
    """Slurm's job name for a run: letters, digits and `._-` only (it is written into the batch script)."""
    return "pretrain-" + re.sub(r"[^A-Za-z0-9._-]", "_", name)[:100]


def run_dir_lines(run_dirs: list[str]) -> list[str]:
    """Setup lines naming the run directory of this job (of this array task, for a sweep)."""
    quoted = " ".join(shlex.quote(d) for d in run_dirs)
    return [
        "# pretrain: the run directory of this job (of this array task)",
        f"PRETRAIN_RUN_DIRS=({quoted})",
        'export PRETRAIN_RUN_DIR="${PRETRAIN_RUN_DIRS[${SLURM_ARRAY_TASK_ID:-0}]}"',
    ]


def setup_lines(cluster: ClusterConfig, run_dir_definition: list[str]) -> list[str]:
    """Lines the batch script runs on the host before srun: run directory, environment, user setup."""
    lines = [
        *run_dir_definition,
        "# Ranks and the rendezvous come from Slurm, not from the environment sbatch was called in.",
        "unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT",
        "# An error or a stop noted by the last attempt is not this one's.",
        f'rm -f "$PRETRAIN_RUN_DIR/{FAILED_MARKER}" "$PRETRAIN_RUN_DIR/{STOPPED_NOTICE}"',
        "# Preemption also signals this script: carry on to the requeue check below once srun returns.",
        "trap 'PRETRAIN_GOT_TERM=1; echo \"pretrain: batch script got SIGTERM; waiting for the tasks to checkpoint\" >&2' TERM",
    ]
    return lines + environment_lines(cluster)


def environment_lines(cluster: ClusterConfig) -> list[str]:
    """cluster.env exported, then the cluster.setup lines: what every job of the cluster runs first."""
    lines = [f"export {key}={shlex.quote(str(value))}" for key, value in cluster.env.items()]
    return lines + (["# cluster.setup", *cluster.setup] if cluster.setup else [])


def teardown_lines(cluster: ClusterConfig) -> list[str]:
    """Lines the batch script runs on the host after srun: requeue if training asked for it, or if a
    rank crashed, hung or lost a collective (any exit code but ExitCode.final()'s), or without the
    nodes that failed the preflight check, if any did; never after an error a rerun would repeat (a
    bad config, a diverged loss, an unwritable checkpoint): the rank that met it notes it in
    FAILED_MARKER, since srun reports the ranks it then had to kill with their signal's exit codes.

    SIGTERM to the job (scancel, preemption, `scontrol requeue`) reaches this script as well as the
    tasks, and then Slurm decides: nothing is requeued from here. When only the tasks got it (their
    node shutting down, `scancel --signal=TERM` without --full, a stray kill of a step) the ranks
    stop with a checkpoint and note it in STOPPED_NOTICE, and the job is requeued: it was not ended,
    so it must not finish with the run half done."""
    limit = cluster.max_requeues
    final = "|".join(str(int(code)) for code in ExitCode.final())
    return [
        "pretrain_srun_status=$?",
        "# pretrain: requeue from the host (the training may run in a container without scontrol)",
        "pretrain_requeue() {",
        f'  if [ "${{SLURM_RESTART_COUNT:-0}}" -lt {limit} ]; then',
        f'    echo "pretrain: requeueing job $SLURM_JOB_ID ($1; restart $(( ${{SLURM_RESTART_COUNT:-0}} + 1 )) of at most {limit})"',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "  else",
        f'    echo "pretrain: not requeued ($1): cluster.max_requeues={limit} reached; submit the same run directory '
        'again to continue" >&2',
        "    return 1",
        "  fi",
        "}",
        f'if [ -s "$PRETRAIN_RUN_DIR/{EXCLUDE_NODES}" ]; then',
        *requeue_without_lines(),
        f'elif [ -f "$PRETRAIN_RUN_DIR/{REQUEUE_REQUEST}" ]; then',
        f'  rm -f "$PRETRAIN_RUN_DIR/{REQUEUE_REQUEST}"',
        '  pretrain_requeue "stopped with a checkpoint before the time limit"',
        f'elif [ -s "$PRETRAIN_RUN_DIR/{FAILED_MARKER}" ]; then',
        f'  echo "pretrain: not requeued: the training stopped on an error a requeue would repeat: '
        f'$(head -n 1 "$PRETRAIN_RUN_DIR/{FAILED_MARKER}")" >&2',
        f'elif [ -f "$PRETRAIN_RUN_DIR/{STOPPED_NOTICE}" ] && [ -z "${{PRETRAIN_GOT_TERM:-}}" ]; then',
        '  pretrain_requeue "the tasks were stopped by a signal this job was not sent: not a scancel or a '
        'preemption (a node shutting down, a signal to the steps only); scancel $SLURM_JOB_ID ends it for good"',
        'elif [ -z "${PRETRAIN_GOT_TERM:-}" ]; then',
        '  case "$pretrain_srun_status" in',
        f"    {final}) ;;",
        '    *) pretrain_requeue "a task failed with exit code $pretrain_srun_status" ;;',
        "  esac",
        "fi",
        'exit "$pretrain_srun_status"',
    ]


def requeue_without_lines() -> list[str]:
    """The batch script's branch (on the host, after srun) for a run directory with EXCLUDE_NODES (the
    nodes that failed pretrain.trainer.preflight): requeue the job (teardown_lines' pretrain_requeue)
    and add those nodes to its ExcNodeList.

    Slurm refuses to change the exclusions of a running job, so the order is requeue, then update:
    the requeued job is completing, and the batch script outlives the SIGTERM the requeue sends
    (the setup lines trap it) for the cluster's KillWait, long enough for `scontrol update`.
    """
    path = f'"$PRETRAIN_RUN_DIR/{EXCLUDE_NODES}"'
    return [
        f"  PRETRAIN_BAD_NODES=$(sort -u {path} | paste -sd, -)",
        f'  rm -f {path} "$PRETRAIN_RUN_DIR/{REQUEUE_REQUEST}"',
        '  PRETRAIN_EXCLUDED=$(scontrol show job -o "$SLURM_JOB_ID" | grep -o "ExcNodeList=[^ ]*" | cut -d= -f2)',
        '  case "$PRETRAIN_EXCLUDED" in ""|"(null)") PRETRAIN_EXCLUDED=$PRETRAIN_BAD_NODES ;; '
        '*) PRETRAIN_EXCLUDED=$PRETRAIN_EXCLUDED,$PRETRAIN_BAD_NODES ;; esac',
        '  if pretrain_requeue "preflight failed on $PRETRAIN_BAD_NODES, now excluded: '
        'ExcNodeList=$PRETRAIN_EXCLUDED"; then',
        "    for attempt in 1 2 3 4 5; do",
        '      scontrol update JobId="$SLURM_JOB_ID" ExcNodeList="$PRETRAIN_EXCLUDED" && break',
        "      sleep 1",
        "    done",
        "  fi",
    ]


def python_command(cfg: Config, run_root: str, host_python: str) -> str:
    """The python the tasks run: host_python, or the image's python3 through apptainer/singularity."""
    if not cfg.cluster.uses_container:
        return host_python
    return container.exec_prefix(cfg, run_root) + " python3"


def executor_parameters(cfg: Config, name: str, run_dir_definition: list[str]) -> dict[str, Any]:
    """Everything the batch script says besides its command: #SBATCH flags, setup and teardown lines."""
    cluster = cfg.cluster
    params: dict[str, Any] = {
        **allocation_parameters(cluster),
        "job_name": name,
        "nodes": cluster.nodes,
        "ntasks_per_node": cluster.gpus_per_node,
        "gpus_per_node": cluster.gpus_per_node,
        "signal_delay_s": cluster.signal_delay_s,
        "setup": setup_lines(cluster, run_dir_definition),
        "teardown": teardown_lines(cluster),
        "additional_parameters": {"requeue": True},
        # srun no longer inherits --cpus-per-task from sbatch (Slurm 22.05+): without it each task gets one CPU.
        "srun_args": ["--kill-on-bad-exit=1", f"--cpus-per-task={cluster.cpus_per_task}",
                      *([f"--gpu-bind={cluster.gpu_bind}"] if cluster.gpu_bind else [])],
    }
    return params


def allocation_parameters(cluster: ClusterConfig) -> dict[str, Any]:
    """The #SBATCH settings of every job on the cluster, training or not: where, how long, CPUs, memory."""
    optional = {"partition": cluster.partition, "account": cluster.account, "qos": cluster.qos,
                "constraint": cluster.constraint, "exclude": cluster.exclude,
                "mem": f"{cluster.mem_gb}GB" if cluster.mem_gb is not None else None}
    return {"cpus_per_task": cluster.cpus_per_task, "time": cluster.time_min,
            **{key: value for key, value in optional.items() if value is not None}}


def run_root(run_dirs: list[str], sweep_dir: Path | None) -> Path:
    """The folder that holds every run directory of this submission (what the container binds)."""
    return sweep_dir.resolve() if sweep_dir is not None else Path(run_dirs[0])


def slurm_executor(folder: Path, python: str):
    """submitit's SlurmExecutor logging to `folder`, never retried by submitit (requeues are ours).

    Its constructor refuses a machine without srun, but a dry run prints the script on any machine (a
    laptop, a container): check_submittable has already refused a real submission where sbatch is
    missing, with a message that says what to do, so that check is skipped here."""
    import submitit

    class ScriptExecutor(submitit.SlurmExecutor):
        @classmethod
        def affinity(cls) -> int:
            return 1

    return ScriptExecutor(folder=folder, python=python, max_num_timeout=0)


def make_executor(cfg: Config, root: Path, run_dirs: list[str]):
    python = python_command(cfg, shlex.quote(str(root)), shlex.quote(sys.executable))
    executor = slurm_executor(root / "slurm", python)
    name = job_name((Path(run_dirs[0]) if len(run_dirs) == 1 else root).name)
    executor.update_parameters(**executor_parameters(cfg, name, run_dir_lines(run_dirs)))
    return executor


def batch_script(cfg: Config, root: Path, run_dirs: list[str]) -> str:
    """The sbatch script a submission of these runs submits (what `dry_run=true` prints)."""
    executor = make_executor(cfg, root, run_dirs)
    parameters = {**executor.parameters, **({"map_count": len(run_dirs)} if len(run_dirs) > 1 else {})}
    return submitit_script.render(parameters, executor.folder, submitit_script.submitted_command(executor))


# A hand-run script's run directory (override with PRETRAIN_RUN_DIR=... sbatch ...) and logs, relative to
# the folder sbatch is called from. The job id is the same after a requeue, so a requeued job resumes.
PLAIN_RUN_DIR = [
    "# pretrain: the run directory (set PRETRAIN_RUN_DIR when calling sbatch to choose it)",
    'export PRETRAIN_RUN_DIR="${PRETRAIN_RUN_DIR:-$SLURM_SUBMIT_DIR/runs/sbatch-$SLURM_JOB_ID}"',
    'mkdir -p "$PRETRAIN_RUN_DIR"',
]
PLAIN_LOGS = "runs/slurm"
CONFIG_END = "PRETRAIN_CONFIG_END"


def config_lines(cfg: Config) -> list[str]:
    """Setup lines that give a new run directory the run's resolved config.yaml and its mark (a
    requeued job finds them there): the job then starts as every job does, from its run directory."""
    from pretrain.launcher.preparation import config_text

    text = config_text(cfg).rstrip("\n")
    if any(line == CONFIG_END for line in text.splitlines()):
        raise ConfigError(f"a value of the config is the line {CONFIG_END}, which ends the script's config block")
    return [
        f'if [ ! -f "$PRETRAIN_RUN_DIR/{rundir.CONFIG_FILE}" ]; then',
        f"  cat > \"$PRETRAIN_RUN_DIR/{rundir.CONFIG_FILE}\" <<'{CONFIG_END}'",
        *text.splitlines(),
        CONFIG_END,
        f'  echo "{{\\"created\\": \\"$(date +%Y-%m-%dT%H:%M:%S)\\"}}" > "$PRETRAIN_RUN_DIR/{rundir.MARKER}"',
        "fi",
    ]


def plain_batch_script(cfg: Config, overrides: list[str]) -> str:
    """A standalone sbatch script: the same #SBATCH lines, setup, srun, container and requeue as the
    submitit path, with the run's resolved config inside; each task runs `python -m pretrain.train
    RUN_DIR` (no submitit)."""
    python = python_command(cfg, '"$PRETRAIN_RUN_DIR"', shlex.quote(sys.executable))
    command = " ".join([python, "-m pretrain.train", '"$PRETRAIN_RUN_DIR"'])
    placeholder = "/__pretrain_logs__"  # submitit makes log paths absolute; ours are relative to the submit dir
    cfg = dataclasses.replace(cfg, run_dir="$PRETRAIN_RUN_DIR")
    params = executor_parameters(cfg, job_name(cfg.model.name), PLAIN_RUN_DIR + config_lines(cfg))
    text = submitit_script.render(params, placeholder, command).replace(placeholder, PLAIN_LOGS)
    header = ["# Generated by: python -m pretrain.launch " + " ".join(shlex.quote(o) for o in overrides),
              "# Regenerate rather than edit. From the folder that should hold runs/:",
              "#   mkdir -p runs/slurm && sbatch THIS_FILE", ""]
    lines = text.split("\n")
    return "\n".join(lines[:1] + header + lines[1:])


def write_plain_script(cfg: Config, overrides: list[str]) -> int:
    checked = check_submittable([cfg], dry_run=True)
    path = Path(cfg.write_sbatch)
    try:
        path.write_text(plain_batch_script(cfg, overrides))
        path.chmod(0o755)
    except OSError as error:
        raise ConfigError(f"write_sbatch={path}: cannot write it ({error.strerror or error})") from None
    print(f"checked as for a submission: config, memory estimate, data, {', '.join(checked)}")
    print(f"wrote {path}: submit it with `sbatch {path}`; nothing was submitted")
    return 0


def check_submittable(cfgs: list[Config], dry_run: bool) -> list[str]:
    """What a submission needs beyond the config: the image, the bind sources and a runtime (each
    refused when missing), and sbatch (refused, or in a dry run noted). Returns what was checked."""
    checked: list[str] = []
    for cfg in cfgs:
        if cfg.cluster.uses_container:
            checked += [what for what in container.check(cfg) if what not in checked]
    if shutil.which("sbatch") is not None:
        return checked + ["sbatch on PATH"]
    if not dry_run:
        raise ConfigError("sbatch is not on PATH: submit from a Slurm login node (or load its module), "
                          "or use dry_run=true to see the script")
    return checked + ["sbatch is NOT on PATH here: submit from a Slurm login node"]


# Job states in which a job holds, or will hold, its run directory.
ACTIVE_STATES = ("PENDING", "CONFIGURING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING",
                 "SUSPENDED", "COMPLETING", "SIGNALING", "STAGE_OUT")


def check_no_active_job(run_dir: Path) -> None:
    """Refuse a second job on a run directory whose last job is queued or running."""
    from pretrain.launcher import status

    path = run_dir / rundir.JOBS_FILE
    if not path.is_file():
        return
    job_id = json.loads(path.read_text())[-1]["job_id"]
    state, _ = status.job_state(job_id)
    if state in ACTIVE_STATES:
        raise ConfigError(f"job {job_id} is {state} on {run_dir}: two jobs must not train in one run directory; "
                          f"wait for it, cancel it (scancel {job_id}), or use another hydra.run.dir")


def record_job(run_dir: Path, job) -> dict[str, Any]:
    """Append a submitted job to RUN_DIR/jobs.json, which pretrain.status reads."""
    entry = {"job_id": job.job_id, "submitted": time.strftime("%Y-%m-%dT%H:%M:%S"),
             "stdout": str(job.paths.stdout), "stderr": str(job.paths.stderr)}
    path = run_dir / rundir.JOBS_FILE
    jobs = json.loads(path.read_text()) if path.is_file() else []
    path.write_text(json.dumps(jobs + [entry], indent=2))
    return entry


def submit(cfgs: list[Config], sweep_dir: Path | None) -> int:
    """Check, write the run directories, submit (one job, or one array for a sweep), print, return."""
    from pretrain.launcher.preparation import write_run

    run_dirs = [cfg.run_dir for cfg in cfgs]
    root = run_root(run_dirs, sweep_dir)
    first = cfgs[0]
    checked = check_submittable(cfgs, first.dry_run)
    for run_dir in run_dirs:
        check_no_active_job(Path(run_dir))
    if first.dry_run:
        print(batch_script(first, root, run_dirs))
        print(f"# each of the {first.cluster.nodes * first.cluster.gpus_per_node} tasks runs the same as:")
        print(f"#   {make_executor(first, root, run_dirs).python} -m pretrain.train \"$PRETRAIN_RUN_DIR\"")
        print("# checked as for a submission: config, memory estimate, data, " + ", ".join(checked))
        print("# dry run: nothing was written or submitted")
        return 0
    for cfg in cfgs:
        write_run(cfg)
    executor = make_executor(first, root, run_dirs)
    tasks = [JobEntry(d) for d in run_dirs]
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
