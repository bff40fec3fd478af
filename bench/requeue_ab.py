"""Requeued start-ups of two package trees, interleaved, from one cold job: an A/B of a start-up change.

    git worktree add /tmp/base HEAD~1
    python bench/requeue_ab.py --base /tmp/base --pairs 8 --name requeue-ab-X
    python bench/requeue_ab.py --base /tmp/base --name requeue-ab-cpu precision=fp32 model.dim=64 ...

bench/restart.py measures cold against requeued starts, a pair at a time; a change that saves a few tenths
of a second in a requeued start drowns there in the spread of cold starts. This runs one cold job (this
tree), which stops with a checkpoint and a compile cache, then the requeued job again and again from
that same checkpoint, alternately from the --base tree (A) and from this one (B), the order swapped each
round. Each requeued job trains one step and writes no checkpoint, so every one resumes from the same
state. The figures are the jobs' own start-up records (metrics.jsonl, `startup_s` and its phases):
medians per tree. Writes NAME.json and NAME.md under --out.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from restart import BASE, startups  # noqa: E402

STOP_AT = 3  # the cold job's steps: warm-up enough for the checkpoint to be a mid-run one


def tree_commit(tree: Path) -> str:
    """The commit a tree is at (a worktree of it), with a + where its files differ from it; outside git (a
    copy on the device machine) its path."""
    def git(*command: str) -> str:
        return subprocess.run(["git", "-C", str(tree), *command], capture_output=True, text=True).stdout.strip()
    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return str(tree)
    return head + ("+" if git("status", "--porcelain", "--untracked-files=no") else "")


def startup(run_dir: Path) -> dict[str, Any]:
    """The newest start-up record of the run (a resumed job truncates the metrics after its checkpoint)."""
    records = startups(run_dir)
    return records[-1] if records else {}


def job(args: argparse.Namespace, tree: str, repo: Path, overrides: list[str], index: int) -> dict[str, Any]:
    log = args.out / f"{args.name}-{index}-{tree}.log"
    ran = common.launch([*BASE, *overrides, *args.overrides], args.run_dir, args.timeout, log, repo.resolve())
    record = startup(args.run_dir) if ran["exit_code"] == 0 else {}
    print(f"{index} {tree}: exit {ran['exit_code']}, start-up {record.get('startup_s')} s {record.get('startup', {})}",
          flush=True)
    return {"tree": tree, **ran, "startup_s": record.get("startup_s"), "startup": record.get("startup", {})}


def medians(jobs: list[dict[str, Any]], tree: str) -> dict[str, Any]:
    done = [j for j in jobs if j["tree"] == tree and j["startup_s"] is not None]
    if not done:
        return {}
    phases = dict.fromkeys(p for j in done for p in j["startup"])
    return {"jobs": len(done), "startup_s": statistics.median(j["startup_s"] for j in done),
            "phases": {p: statistics.median(j["startup"].get(p, 0.0) for j in done) for p in phases}}


def table(result: dict[str, Any]) -> str:
    a, b = result["median"].get("A", {}), result["median"].get("B", {})
    phases = list(dict.fromkeys([*a.get("phases", {}), *b.get("phases", {})]))
    lines = ["| tree | requeued jobs | start-up (s) | " + " | ".join(phases) + " |",
             "|---|---|---|" + "---|" * len(phases)]
    for tree, m, source in (("A", a, result["base_commit"]), ("B", b, result["this_commit"])):
        if m:
            lines.append(f"| {tree} ({source}) | {m['jobs']} | {m['startup_s']:.2f} | "
                         + " | ".join(f"{m['phases'].get(p, 0):.2f}" for p in phases) + " |")
    cold = result["cold"].get("startup_s")
    return ("medians of each tree's requeued jobs, interleaved; the cold job (this tree): "
            f"{cold if cold is not None else '-'} s\n\n" + "\n".join(lines) + f"\n\ncommand: `{result['command']}`")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="extra launcher overrides")
    parser.add_argument("--base", type=Path, required=True, help="the package tree A (a git worktree of the commit before)")
    parser.add_argument("--pairs", type=int, default=6, help="rounds of one requeued job from each tree")
    parser.add_argument("--name", default="requeue-ab")
    parser.add_argument("--out", type=Path, default=common.RESULTS)
    parser.add_argument("--run-dir", type=Path, default=Path("/tmp/bench-runs/requeue-ab"))
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_intermixed_args(argv)

    shutil.rmtree(args.run_dir, ignore_errors=True)
    cold = job(args, "cold", common.REPO, [f"train.steps={STOP_AT + 3}", f"train.stop_at_step={STOP_AT}"], 0)
    jobs = []
    if cold["startup_s"] is not None:
        for index in range(1, args.pairs + 1):
            order = (("A", args.base), ("B", common.REPO))
            for tree, repo in (order if index % 2 else order[::-1]):
                jobs.append(job(args, tree, repo, [f"train.steps={STOP_AT + 1}"], index))
    shutil.rmtree(args.run_dir, ignore_errors=True)
    result = {"name": args.name, **common.stamp(), "base": str(args.base), "base_commit": tree_commit(args.base),
              "this_commit": tree_commit(common.REPO), "command": cold["command"], "cold": cold, "jobs": jobs, "median": {tree: medians(jobs, tree) for tree in ("A", "B")}}
    common.write_result(args.out, args.name, result, table(result))
    print(table(result))
    return 0 if result["median"]["A"] and result["median"]["B"] else 1


if __name__ == "__main__":
    sys.exit(main())
