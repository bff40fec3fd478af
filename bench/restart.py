"""How long a requeued job takes to start, against a cold start, through `python -m pretrain.launch`.

    python bench/restart.py                       # the 1B shape on 1 GPU, compiled
    python bench/restart.py --name restart-fp8 precision=fp8

A cold start (a new run directory: no checkpoint, no compile cache) trains --every steps and stops
with a checkpoint, as a job does on its time-limit signal; the same command again is the requeued
job: it resumes from that checkpoint with the compile caches the first job left in the run
directory, and stops again. A third job resumes with an empty compile cache (fsdp.compile_cache
naming a new folder), for what the cache is worth. The last job of a series trains to train.steps
and writes no checkpoint. Each job records its start-up by phase in
metrics.jsonl (`startup_s`: from the process's start to the end of its first step); those records
are the figures. Writes NAME.json and NAME.md under --out.

Start-up varies between jobs of the same kind by several seconds (imports, compilation), so
--repeats N runs the whole series N times, each in a new run directory, and the ratio is that of
the medians.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

BASE = ["model=llama-1b", "data=synthetic", "precision=bf16", "fsdp.compile=true", "train.seq_len=4096",
        "train.micro_batch=8", "train.global_batch=8", "train.log_every=5", "train.eval_every=0", "train.ckpt_every=0",
        "optim.warmup_steps=10"]
PROFILE_RATE = 200  # samples per second
JOBS = ("cold", "requeued", "requeued, empty compile cache")


def startups(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in common.metrics(run_dir) if "startup_s" in r]


def table(result: dict[str, Any]) -> str:
    phases = list(dict.fromkeys(p for job in result["jobs"] for p in job.get("startup", {})))
    head = ("| job | series | exit | start-up (s) | " + " | ".join(phases) + " |\n|---|---|---|---|"
            + "---|" * len(phases) + "\n")
    rows = []
    for job in result["jobs"]:
        cells = [f"{job['startup'].get(p, 0):.1f}" for p in phases] if job.get("startup") else ["-"] * len(phases)
        total = f"{job['startup_s']:.1f}" if job.get("startup_s") is not None else "-"
        rows.append(f"| {job['job']} | {job['series']} | {job['exit_code']} | {total} | " + " | ".join(cells) + " |")
    ratio = result.get("restart_over_cold")
    tail = ""
    if ratio:
        tail = (f"\n\nmedian start-up: cold {result['median_s']['cold']:.1f} s, requeued "
                f"{result['median_s']['requeued']:.1f} s; requeued / cold start: **{ratio:.2f}**")
    return head + "\n".join(rows) + tail + f"\n\ncommand: `{result['command']}`"


def run_series(args: argparse.Namespace, series: int) -> list[dict[str, Any]]:
    """One cold job and the requeued ones after it, in a new run directory."""
    run_dir = args.runs / f"{args.name}-{series}"
    shutil.rmtree(run_dir, ignore_errors=True)
    names = JOBS[:2] if args.skip_empty_cache else JOBS
    steps = args.every * len(names)
    jobs = []
    for index, job in enumerate(names):
        cache = []
        if job == JOBS[2]:
            empty = args.runs / f"{args.name}-empty-cache"
            shutil.rmtree(empty, ignore_errors=True)
            cache = [f"fsdp.compile_cache={empty}"]
        # Each job but the last stops with a checkpoint after `every` steps, as on its time limit; the next
        # resumes there. The last ends at train.steps without one (train.ckpt_every=0): 17 GiB less to write.
        stop = [f"train.stop_at_step={args.every * (index + 1)}"] if index < len(names) - 1 else []
        overrides = [*BASE, f"train.steps={steps}", *stop, *cache, *args.overrides]
        log = args.out / f"{args.name}-{series}-{index}.log"
        ran = common.launch(overrides, run_dir, args.timeout, log, args.repo.resolve(),
                            wrapper=profiler(args.py_spy, log.with_suffix(".speedscope.json")))
        found = startups(run_dir)
        record = found[index] if len(found) > index else {}
        jobs.append({"job": job, "series": series, **ran, "startup_s": record.get("startup_s"),
                     "startup": record.get("startup", {}), "first_step": record.get("step")})
        print(f"{series} {job}: exit {ran['exit_code']}, start-up {record.get('startup_s')} s {record.get('startup', {})}")
    shutil.rmtree(run_dir, ignore_errors=True)  # two checkpoints of the 1B shape: 34 GiB
    return jobs


def profiler(py_spy: str | None, out: Path) -> tuple[str, ...]:
    """py-spy's command line that samples the launcher and its ranks, idle time and threads included
    (bench/startup_profile.py reads what it writes)."""
    if not py_spy:
        return ()
    return (py_spy, "record", "--rate", str(PROFILE_RATE), "--format", "speedscope", "--idle", "--threads", "--subprocesses",
            "--output", str(out), "--")


def median_startup(jobs: list[dict[str, Any]], job: str) -> float | None:
    found = [j["startup_s"] for j in jobs if j["job"] == job and j.get("startup_s") is not None]
    return statistics.median(found) if found else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="extra launcher overrides")
    parser.add_argument("--name", default="restart-1b-1gpu")
    parser.add_argument("--every", type=int, default=10, help="steps each job trains before it stops")
    parser.add_argument("--out", type=Path, default=common.RESULTS)
    parser.add_argument("--runs", type=Path, default=Path("/tmp/bench-runs"))
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--skip-empty-cache", action="store_true", help="leave out the third job")
    parser.add_argument("--repo", type=Path, default=common.REPO, help="the package tree to run (for an A/B)")
    parser.add_argument("--repeats", type=int, default=1, help="series of jobs; the figures are their medians")
    parser.add_argument("--py-spy", metavar="PATH", help="sample each job with this py-spy (NAME-S-J.speedscope.json beside its log; "
                        "summarised by bench/startup_profile.py; profiled start-ups are slower)")
    args = parser.parse_intermixed_args(argv)

    jobs = [job for series in range(1, args.repeats + 1) for job in run_series(args, series)]
    result = {"name": args.name, **common.stamp(), "command": jobs[0]["command"], "every": args.every, "jobs": jobs}
    cold, requeued = median_startup(jobs, JOBS[0]), median_startup(jobs, JOBS[1])
    if cold and requeued:
        result.update(median_s={"cold": cold, "requeued": requeued}, restart_over_cold=requeued / cold)
    common.write_result(args.out, args.name, result, table(result))
    print(table(result))
    return 0 if cold and requeued else 1


if __name__ == "__main__":
    sys.exit(main())
