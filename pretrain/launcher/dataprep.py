"""`python -m pretrain.data.prepare`: tokenize a corpus here, or as a Slurm job array with +cluster=NAME.

    python -m pretrain.data.prepare INPUT... --out DIR [--tokenizer byte|PATH.json] [--eos TOKEN|none]
        [--text-field text] [--val-fraction 0.005] [--workers N] [--shard-mb 32] [--append]
    python -m pretrain.data.prepare INPUT... --out DIR ... +cluster=NAME [cluster.KEY=VALUE...] [--tasks N]
        [dry_run=true]

INPUT: files, folders (searched recursively) and globs of .txt/.md, .jsonl (.gz, .zst), .parquet, .arrow,
and folders saved by `datasets`' save_to_disk (pretrain.data.inputs). Every non-blank document is
followed by the tokenizer's end-of-document id; the last --val-fraction of each shard's tokens is the
validation split. --append adds the input to the dataset at DIR as new shards.

With +cluster=NAME (the cluster files of the launcher, with the same overrides), the shards are
written by a job array of --tasks tasks (each a range of shards, each with --workers processes,
by default the CPUs Slurm gives it: cluster.cpus_per_task), submitted through submitit as training
is, and a last job writes the index once they have ended. The command returns at once; DIR/index.json
appears when the dataset is complete.
"""

from __future__ import annotations

import argparse
import copy
import math
import re
import shlex
import sys
from pathlib import Path
from typing import Callable, Sequence

from pretrain import compose
from pretrain.config import Config, ConfigError
from pretrain.data import build
from pretrain.data.errors import DataError
from pretrain.data.layout import read_index
from pretrain.data.progress import Progress
from pretrain.data.tokenizer import BYTE
from pretrain.launcher import slurm, submitit_script, validate

# A Hydra override, e.g. +cluster=a100x8 or cluster.cpus_per_task=32 (a path that exists is an input).
OVERRIDE = re.compile(r"\+{0,2}[A-Za-z_][\w.]*=.*")
LOGS_DIR = "slurm"


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """The options, and the Hydra overrides among the positional words."""
    parser = argparse.ArgumentParser(prog="python -m pretrain.data.prepare", description=__doc__.split("\n")[0])
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="files, folders or globs to read")
    parser.add_argument("--out", required=True, type=Path, help="dataset folder to write")
    parser.add_argument("--tokenizer", default=BYTE, help="'byte' or a tokenizer JSON file (default: byte)")
    parser.add_argument("--eos", help="the token that ends a document (default: the tokenizer's own), or 'none'")
    parser.add_argument("--text-field", default=build.DEFAULT_TEXT_FIELD,
                        help=f"jsonl key or parquet/arrow column of the text (default: {build.DEFAULT_TEXT_FIELD})")
    parser.add_argument("--val-fraction", type=float, default=build.DEFAULT_VAL_FRACTION,
                        help=f"share of each shard's tokens held out (default: {build.DEFAULT_VAL_FRACTION})")
    parser.add_argument("--workers", type=int, help="worker processes (default: the CPUs available)")
    parser.add_argument("--shard-mb", type=float, default=build.DEFAULT_SHARD_MB,
                        help=f"input MB per shard (default: {build.DEFAULT_SHARD_MB})")
    parser.add_argument("--append", action="store_true", help="add the input to the dataset at --out")
    parser.add_argument("--tasks", type=int,
                        help="with +cluster: tasks of the job array (default: shards / CPUs per task)")
    args = parser.parse_intermixed_args(list(argv))
    overrides = [word for word in args.inputs if OVERRIDE.fullmatch(word) and not Path(word).exists()]
    args.inputs = [word for word in args.inputs if word not in overrides]
    if not args.inputs:
        parser.error("give at least one INPUT")
    return args, overrides


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, overrides = parse_args(argv)
    try:
        cfg = cluster_config(overrides) if overrides else None
        plan = build.make_plan(args.inputs, args.out, args.tokenizer, args.val_fraction, eos=args.eos,
                               text_field=args.text_field, shard_mb=args.shard_mb, append=args.append,
                               workers=args.workers)
        if cfg is not None:
            return submit(plan, cfg, args.tasks)
        if args.tasks is not None:
            raise ConfigError("--tasks is for a job array: add +cluster=NAME")
        progress = build.run_here(plan)
    except (DataError, ConfigError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"interrupted: {args.out} holds the dataset it held before, if any", file=sys.stderr)
        return 130
    print(build.summary(args.out, progress))
    return 0


def cluster_config(overrides: list[str]) -> Config:
    """The launcher's composed config of these overrides, which must name a cluster."""
    cfg = compose.compose(overrides)
    if cfg.cluster is None:
        raise ConfigError(f"overrides {' '.join(overrides)} are for a job array: add +cluster=NAME (the inputs "
                          "are paths; an input that looks like KEY=VALUE must exist)")
    validate.validate_values(cfg)
    validate.validate_cluster(cfg.cluster)
    return cfg


# ---- the job array ----------------------------------------------------------------------------------------
class ShardTask:
    """One task of the array: its range of the planned shards. Pickled by submitit, so it holds only paths."""

    def __init__(self, out: str, task: int, tasks: int) -> None:
        self.out, self.task, self.tasks = out, task, tasks

    def __call__(self) -> str:
        return _run_or_exit(self.write)

    def write(self) -> str:
        plan = build.Plan.load(self.out)
        numbers = task_numbers(plan.numbers, self.task, self.tasks)
        progress = Progress(sum(part["size"] for n in numbers for part in plan.pieces[n - plan.first_number]))
        workers = plan.workers or build.available_cores()
        build.write_shards(plan, numbers, workers, progress)
        return _said(f"task {self.task}: shards {numbers.start}-{numbers.stop - 1}, {progress.tokens:,} tokens of "
                     f"{progress.documents:,} documents in {progress.elapsed:.1f} s with {workers} workers")


class IndexTask:
    """The last job: the index once every task has ended (or, if one failed, the new shards removed)."""

    def __init__(self, out: str) -> None:
        self.out = out

    def __call__(self) -> str:
        return _run_or_exit(self.publish)

    def publish(self) -> str:
        plan = build.Plan.load(self.out)
        try:
            build.finish(plan)
        except BaseException:
            build.abandon(plan)
            raise
        counts = read_index(Path(self.out))["num_tokens"]
        return _said(f"wrote {self.out}/index.json: {counts['train']} train + {counts['val']} val tokens")


def _said(line: str) -> str:
    """A task's result, also in its log."""
    print(line, flush=True)
    return line


def _run_or_exit(work: Callable[[], str]) -> str:
    """A task's work; an error ends the task with its one line on stderr, not a traceback."""
    try:
        return work()
    except (DataError, OSError) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def task_numbers(numbers: range, task: int, tasks: int) -> range:
    """The contiguous range of shard numbers of one task, the ranges of all tasks covering `numbers`."""
    per, extra = divmod(len(numbers), tasks)
    start = numbers.start + task * per + min(task, extra)
    return range(start, start + per + (1 if task < extra else 0))


def array_tasks(cfg: Config, shards: int, tasks: int | None) -> int:
    if tasks is not None and tasks < 1:
        raise ConfigError(f"--tasks {tasks}: must be at least 1")
    wanted = tasks if tasks is not None else math.ceil(shards / cfg.cluster.cpus_per_task)
    return max(min(wanted, shards), 1)


def executor(cfg: Config, out: Path, name: str, cpus: int, dependency: str | None = None):
    """A submitit executor for one-task jobs of this cluster (inside its container, if it has one), logging to
    out/slurm/: the same allocation settings, environment and setup lines as training's jobs."""
    python = slurm.python_command(cfg, shlex.quote(str(out)), shlex.quote(sys.executable))
    made = slurm.slurm_executor(out / LOGS_DIR, python)
    made.update_parameters(**{**slurm.allocation_parameters(cfg.cluster), "cpus_per_task": cpus}, job_name=name,
                           nodes=1, ntasks_per_node=1, setup=slurm.environment_lines(cfg.cluster),
                           additional_parameters={"dependency": dependency} if dependency else {})
    return made


def with_input_binds(cfg: Config, plan: build.Plan) -> Config:
    """The config, its container (if any) also binding the folders of the inputs and the tokenizer."""
    if not cfg.cluster.uses_container:
        return cfg
    cfg = copy.deepcopy(cfg)
    paths = {str(Path(part["path"]).resolve().parent) for piece in plan.pieces for part in piece}
    if plan.tokenizer != BYTE:
        paths.add(str(Path(plan.tokenizer).resolve().parent))
    cfg.cluster.container.binds += sorted(paths)
    return cfg


def submit(plan: build.Plan, cfg: Config, tasks: int | None) -> int:
    """The array of shard tasks and the index job after it; prints their ids and returns."""
    out = Path(plan.out).resolve()
    cfg = with_input_binds(cfg, plan)
    count = array_tasks(cfg, len(plan.pieces), tasks)
    name = slurm.job_name(out.name).replace("pretrain-", "prepare-", 1)
    checked = slurm.check_submittable([cfg], cfg.dry_run)
    if cfg.dry_run:
        made = executor(cfg, out, name, cfg.cluster.cpus_per_task)
        parameters = {**made.parameters, "map_count": count}
        print(submitit_script.render(parameters, made.folder, submitit_script.submitted_command(made)))
        print(f"# {count} tasks write the {len(plan.pieces)} shards, then one job writes {out}/index.json")
        print("# checked as for a submission: inputs, tokenizer, cluster, " + ", ".join(checked))
        print("# dry run: nothing was written or submitted")
        return 0
    build.begin(plan)
    plan.created = False  # whatever happens, the folder keeps the jobs' logs (slurm/)
    plan.save()
    try:
        jobs = executor(cfg, out, name, cfg.cluster.cpus_per_task).submit_array(
            [ShardTask(str(out), task, count) for task in range(count)])
        array = jobs[0].job_id.split("_")[0]
        index_job = executor(cfg, out, name + "-index", 1, dependency=f"afterany:{array}").submit(IndexTask(str(out)))
    except BaseException:
        build.abandon(plan)
        raise
    plan.jobs = [array, index_job.job_id]
    plan.save()
    print(f"submitted job array {array} ({count} tasks for {len(plan.pieces)} shards) and job {index_job.job_id}, "
          f"which writes {out}/index.json once they have ended\n  logs: {out / LOGS_DIR}/\n"
          f"  follow with: squeue -j {array},{index_job.job_id}")
    return 0
