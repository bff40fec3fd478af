"""`python -m pretrain.status [ROOT...]`: this user's runs, their Slurm jobs and their progress.

Finds run directories (those with a config.yaml) under each ROOT (default: ./runs). For a
submitted run (a jobs.json, written at submission) it asks Slurm for the newest job's state
(sacct, or scontrol when accounting is off); a run trained here shows LOCAL, or FINISHED once it has
reached its last step. The last step and loss come from metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

from pretrain import rundir


def find_runs(roots: list[Path]) -> list[Path]:
    found = set()
    for root in roots:
        if rundir.is_run_dir(root):
            found.add(root.resolve())
        if root.is_dir():
            found.update(p.parent.resolve() for p in root.rglob(rundir.MARKER) if rundir.is_run_dir(p.parent))
    return sorted(found)


def _run(cmd: list[str]) -> str | None:
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout if result.returncode == 0 else None


def job_state(job_id: str) -> tuple[str, int]:
    """The job's current state and how many times Slurm restarted it (requeues).

    sacct where the cluster keeps accounting; otherwise scontrol, which knows the jobs that are
    queued, running, or ended within the last MinJobAge seconds (300 by default), restarts included.
    """
    out = _run(["sacct", "-j", job_id, "-X", "-n", "-P", "--duplicates", "-o", "JobID,State"])
    if out:
        rows = [line.split("|") for line in out.splitlines() if line.strip()]
        mine = [state for jid, state in rows if jid == job_id]
        if mine:
            return mine[-1].split()[0], sum(1 for state in mine if state.startswith("REQUEUED"))
    out = _run(["scontrol", "show", "job", "-o", job_id])
    state, restarts = re.search(r"\bJobState=(\S+)", out or ""), re.search(r"\bRestarts=(\d+)", out or "")
    if state:
        return state.group(1), int(restarts.group(1)) if restarts else 0
    return "UNKNOWN", 0


def describe(run_dir: Path) -> dict[str, object]:
    records = [r for r in rundir.metrics(run_dir) if "loss" in r]
    last = records[-1] if records else {}
    row = {"run": str(run_dir), "step": last.get("step", "-"), "loss": f"{last['loss']:.4f}" if "loss" in last else "-"}
    jobs_file = run_dir / rundir.JOBS_FILE
    if not jobs_file.is_file():
        state = "FINISHED" if rundir.is_finished(run_dir) else "LOCAL"
        return {**row, "job": "-", "state": state, "restarts": last.get("restarts", 0)}
    jobs = json.loads(jobs_file.read_text())
    job_id = jobs[-1]["job_id"]
    state, requeues = job_state(job_id)
    return {**row, "job": job_id, "state": state, "restarts": requeues + len(jobs) - 1}


def table(rows: list[dict[str, object]]) -> str:
    columns = ["job", "state", "restarts", "step", "loss", "run"]
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in columns}
    lines = ["  ".join(c.upper().ljust(widths[c]) for c in columns)]
    lines += ["  ".join(str(r[c]).ljust(widths[c]) for c in columns) for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain.status", description=__doc__.split("\n")[0])
    parser.add_argument("roots", nargs="*", type=Path, default=[Path("runs")], help="run or sweep directories")
    args = parser.parse_args(argv)
    runs = find_runs(args.roots)
    if not runs:
        print(f"no runs under {', '.join(map(str, args.roots))} (folders with a config.yaml)", file=sys.stderr)
        return 1
    print(table([describe(run) for run in runs]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
