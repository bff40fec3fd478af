"""Requeued start-ups of two package trees, interleaved, from one cold job: an A/B of a start-up change.

    git worktree add /tmp/base HEAD~1
    python bench/requeue_ab.py --base /tmp/base --pairs 8 --name requeue-ab-X
    python bench/requeue_ab.py --base /tmp/base --name requeue-ab-cpu precision=fp32 model.dim=64 ...
    python bench/requeue_ab.py --env-b TORCH_WARM_POOL=0 --trace /tmp/trace --name requeue-ab-env

bench/restart.py measures cold against requeued starts, a pair at a time; a change that saves a few tenths
of a second in a requeued start drowns there in the spread of cold starts. This runs one cold job (this
tree), which stops with a checkpoint and a compile cache, then the requeued job again and again from
that same checkpoint, alternately from the --base tree (A) and from this one (B), the order swapped each
round. Each requeued job trains one step and writes no checkpoint, so every one resumes from the same
state. The figures are the jobs' own start-up records (metrics.jsonl, `startup_s` and its phases):
medians per tree. Without --base both sides are this tree, told apart by --env-a/--env-b (variables
that side's jobs get). --trace DIR runs one more requeued job per side, not counted in the medians, with
torch's structured trace (TORCH_TRACE=DIR/A, DIR/B), and tables where its compilation's time went
(bench/compile_trace.py). Writes NAME.json and NAME.md under --out.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import compile_trace  # noqa: E402
from restart import BASE, startups  # noqa: E402

STOP_AT = 3  # the cold job's steps: warm-up enough for the checkpoint to be a mid-run one


def tree_commit(tree: Path) -> str:
    """The commit a tree is at (a worktree of it), with a + where its files differ from it; outside git (a
    copy on the device machine) its path. This repository's own tree with BENCH_COMMIT set is that commit:
    the device machine's copy carries a stale git history (bench/device.sh says why)."""
    if os.environ.get("BENCH_COMMIT") and tree.resolve() == common.REPO.resolve():
        return os.environ["BENCH_COMMIT"]

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


def job(args: argparse.Namespace, tree: str, repo: Path, overrides: list[str], index: int | str,
        env: dict[str, str] | None = None) -> dict[str, Any]:
    log = args.out / f"{args.name}-{index}-{tree}.log"
    ran = common.launch([*BASE, *overrides, *args.overrides], args.run_dir, args.timeout, log, repo.resolve(), env=env)
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
    for tree, m, source in (("A", a, result["base_commit"] + env_note(result["env"]["A"])),
                            ("B", b, result["this_commit"] + env_note(result["env"]["B"]))):
        if m:
            lines.append(f"| {tree} ({source}) | {m['jobs']} | {m['startup_s']:.2f} | "
                         + " | ".join(f"{m['phases'].get(p, 0):.2f}" for p in phases) + " |")
    cold = result["cold"].get("startup_s")
    return ("medians of each tree's requeued jobs, interleaved; the cold job (this tree): "
            f"{cold if cold is not None else '-'} s\n\n" + "\n".join(lines) + f"\n\ncommand: `{result['command']}`")


def env_note(env: dict[str, str]) -> str:
    return "".join(f", {key}={value}" for key, value in env.items())


def variables(pairs: list[str]) -> dict[str, str]:
    """KEY=VALUE arguments as a dict."""
    if any("=" not in pair for pair in pairs):
        raise SystemExit(f"--env-a/--env-b take KEY=VALUE, not {pairs}")
    return dict(pair.split("=", 1) for pair in pairs)


def traced(args: argparse.Namespace, sides: dict[str, tuple[Path, dict[str, str]]]) -> dict[str, Any]:
    """One more requeued job per side under torch's structured trace; where its compilation's time went."""
    found = {}
    for tree, (repo, env) in sides.items():
        folder = args.trace / tree
        shutil.rmtree(folder, ignore_errors=True)
        ran = job(args, tree, repo, [f"train.steps={STOP_AT + 1}"], "traced", {**env, "TORCH_TRACE": str(folder)})
        found[tree] = {"startup_s": ran["startup_s"], "events": compile_trace.summarize(folder)}
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="extra launcher overrides")
    parser.add_argument("--base", type=Path, default=common.REPO,
                        help="the package tree A (a git worktree of the commit before; default: this tree)")
    parser.add_argument("--env-a", nargs="*", default=[], metavar="KEY=VALUE", help="environment of A's jobs")
    parser.add_argument("--env-b", nargs="*", default=[], metavar="KEY=VALUE", help="environment of B's jobs")
    parser.add_argument("--trace", type=Path, help="one traced requeued job per side, its TORCH_TRACE under this folder")
    parser.add_argument("--pairs", type=int, default=6, help="rounds of one requeued job from each tree")
    parser.add_argument("--name", default="requeue-ab")
    parser.add_argument("--out", type=Path, default=common.RESULTS)
    parser.add_argument("--run-dir", type=Path, default=Path("/tmp/bench-runs/requeue-ab"))
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_intermixed_args(argv)

    sides = {"A": (args.base, variables(args.env_a)), "B": (common.REPO, variables(args.env_b))}
    shutil.rmtree(args.run_dir, ignore_errors=True)
    cold = job(args, "cold", common.REPO, [f"train.steps={STOP_AT + 3}", f"train.stop_at_step={STOP_AT}"], 0,
               sides["B"][1])
    jobs, trace = [], {}
    if cold["startup_s"] is not None:
        for index in range(1, args.pairs + 1):
            order = ("A", "B") if index % 2 else ("B", "A")
            for tree in order:
                repo, env = sides[tree]
                jobs.append(job(args, tree, repo, [f"train.steps={STOP_AT + 1}"], index, env))
        if args.trace:
            trace = traced(args, sides)
    shutil.rmtree(args.run_dir, ignore_errors=True)
    result = {"name": args.name, **common.stamp(), "base": str(args.base), "base_commit": tree_commit(args.base),
              "this_commit": tree_commit(common.REPO), "env": {tree: env for tree, (_, env) in sides.items()},
              "command": cold["command"], "cold": cold, "jobs": jobs,
              "median": {tree: medians(jobs, tree) for tree in ("A", "B")}, "trace": trace}
    text = table(result) + "".join(f"\n\n## {tree}: a traced requeued job (start-up {found['startup_s']} s)\n\n"
                                   + compile_trace.table(found["events"]) for tree, found in trace.items())
    common.write_result(args.out, args.name, result, text)
    print(text)
    return 0 if result["median"]["A"] and result["median"]["B"] else 1


if __name__ == "__main__":
    sys.exit(main())
