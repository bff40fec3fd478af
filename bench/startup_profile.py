"""Where a job's start-up goes: py-spy samples of its rank's main thread, up to its first step, and of the
threads that read its checkpoint.

    python bench/restart.py --py-spy /path/to/py-spy --name restart-profiled --skip-empty-cache
    python bench/startup_profile.py bench/results/restart-profiled-1-*.speedscope.json --name startup-profile

bench/restart.py --py-spy records each job in speedscope's format, idle time included (a thread
waiting on a file or the GPU is still the start-up's time). This reads each record's rank (the
process that runs pretrain/train.py), keeps its main thread's samples from the process's start to the
end of the first step (its first sample in the loop's code after a step), and writes the seconds of the package's
frames, of its calls into other code (torch, importlib), and of the modules whose import took
longest; and, summed over the rank's checkpoint-reading threads (a requeued job's load makes them and they
end with it, so all their samples are the start-up's), the seconds of each frame they ran. py-spy names
a method with its class in some versions and without it in others: frames are matched by function
name and file. Writes NAME.json and NAME.md under --out.

Sampling slows Python down (compilation most of all), so the figures are shares of a profiled
start-up, not the unprofiled seconds of bench/restart.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

ENTRY = "pretrain/train.py"
LOOP, RESILIENCE = "pretrain/trainer/loop.py", "pretrain/trainer/resilience.py"
# Functions (name, file) of the loop after a step's train_step returns: the first sample in one ends the
# start-up. (Trainer.started alone, which marks it in the loop, is too short to be sampled reliably.)
AFTER_A_STEP = {("started", LOOP), ("beat", RESILIENCE), ("step_done", "pretrain/trainer/progress.py"),
                ("agreed", RESILIENCE), ("report", LOOP), ("save", LOOP)}
IMPORT = "_find_and_load"
FIRST_STEP = ("train_step", LOOP)  # Trainer.train_step: the first step's frames, torch's included, are tabled apart
READING_THREADS = "checkpoint-read"  # shard_reader.ParallelReader's thread names: checkpoint-read_0, _1, ...


def short(file: str) -> str:
    """A frame's file without the folders it was installed in: torch/..., pretrain/..., threading.py."""
    for root in ("site-packages/", "dist-packages/"):
        if root in file:
            return file.split(root, 1)[1]
    if "/pretrain/" in file:
        return "pretrain/" + file.rsplit("/pretrain/", 1)[1]
    return file.rsplit("/", 1)[-1]


def function_of(frame: str) -> tuple[str, str]:
    """('train_step', 'pretrain/trainer/loop.py') of 'Trainer.train_step (pretrain/trainer/loop.py)' or of
    'train_step (pretrain/trainer/loop.py)'."""
    name, file = frame.split(" (", 1)
    return name.rsplit(".", 1)[-1], file[:-1]


def thread_stacks(profile_doc: dict[str, Any]) -> list[tuple[str, list[list[str]], list[float]]]:
    """Each thread's name, stacks (outermost first, as 'function (file)') and their weights.

    py-spy's first frames name the process and thread (with --subprocesses and --threads): dropped."""
    frames = [f"{f['name']} ({short(f['file'])})" if f["file"] else None for f in profile_doc["shared"]["frames"]]
    return [(profile["name"], [[frames[i] for i in sample if frames[i]] for sample in profile["samples"]],
             profile["weights"]) for profile in profile_doc["profiles"]]


def process_of(thread: str) -> str:
    """'Process 12 Thread 14 "name"' -> 'Process 12'."""
    return " ".join(thread.split()[:2])


def rank_thread(threads: list[tuple[str, list[list[str]], list[float]]]) -> tuple[str, list[list[str]], list[float]]:
    """The rank's main thread: the one that runs ENTRY."""
    for name, stacks, weights in threads:
        if any(frame == f"<module> ({ENTRY})" for stack in stacks[:50] for frame in stack[:4]):
            return name, stacks, weights
    raise ValueError(f"no thread runs {ENTRY} in this record")


def until_first_step(stacks: list[list[str]], weights: list[float]) -> tuple[list[list[str]], list[float]]:
    for index, stack in enumerate(stacks):
        if any(function_of(frame) in AFTER_A_STEP for frame in stack):
            return stacks[:index], weights[:index]
    return stacks, weights


def ours(frame: str) -> bool:
    return frame.endswith(".py)") and "(pretrain/" in frame


def inclusive(stacks: list[list[str]], weights: list[float]) -> Counter:
    """Seconds each of the package's frames was on the stack (once per sample however often it recurs)."""
    seconds: Counter = Counter()
    for stack, weight in zip(stacks, weights):
        for frame in {f for f in stack if ours(f)}:
            seconds[frame] += weight
    return seconds


def calls_out(stacks: list[list[str]], weights: list[float]) -> Counter:
    """Seconds in each call the package makes into other code: its innermost frame -> the frame below."""
    seconds: Counter = Counter()
    for stack, weight in zip(stacks, weights):
        inner = max((i for i, frame in enumerate(stack) if ours(frame)), default=None)
        if inner is not None and inner + 1 < len(stack):
            seconds[f"{stack[inner].split(' (', 1)[0]} -> {stack[inner + 1]}"] += weight
    return seconds


def under(stacks: list[list[str]], weights: list[float], function: tuple[str, str]) -> Counter:
    """Seconds each frame, of any file, was on the stack in the samples taken inside `function` (name, file):
    where the first step's time goes (Dynamo's tracing, the caches' loads, the kernels' first runs)."""
    seconds: Counter = Counter()
    for stack, weight in zip(stacks, weights):
        functions = [function_of(frame) for frame in stack]
        if function in functions:
            for frame in set(stack[functions.index(function) + 1:]):
                seconds[frame] += weight
    return seconds


def reading_threads(threads: list[tuple[str, list[list[str]], list[float]]], process: str) -> tuple[int, Counter]:
    """How many checkpoint-reading threads the process ran, and the seconds each frame, of any file, was on
    their stacks, summed over them (idle waits included)."""
    seconds: Counter = Counter()
    count = 0
    for name, stacks, weights in threads:
        if process_of(name) != process or f'"{READING_THREADS}_' not in name:
            continue
        count += 1
        for stack, weight in zip(stacks, weights):
            for frame in set(stack):
                seconds[frame] += weight
    return count, seconds


def imports(stacks: list[list[str]], weights: list[float]) -> Counter:
    """Seconds spent importing each module, with the modules it imports (inclusive)."""
    seconds: Counter = Counter()
    for stack, weight in zip(stacks, weights):
        if not any(frame.startswith(IMPORT + " ") for frame in stack):
            continue
        modules = {frame.split(" (", 1)[1][:-1] for frame in stack if frame.startswith("<module> (")}
        for module in modules:
            seconds[module] += weight
    return seconds


def summarise(path: Path, top: int) -> dict[str, Any]:
    threads = thread_stacks(json.loads(path.read_text()))
    rank, stacks, weights = rank_thread(threads)
    stacks, weights = until_first_step(stacks, weights)
    count, reading = reading_threads(threads, process_of(rank))
    return {"record": path.name, "seconds": round(sum(weights), 2),
            "frames": [[f, round(s, 2)] for f, s in inclusive(stacks, weights).most_common(top)],
            "calls": [[c, round(s, 2)] for c, s in calls_out(stacks, weights).most_common(top)],
            "imports": [[m, round(s, 2)] for m, s in imports(stacks, weights).most_common(top)],
            "first_step": [[f, round(s, 2)] for f, s in under(stacks, weights, FIRST_STEP).most_common(top)],
            "reading_threads": count, "reading": [[f, round(s, 2)] for f, s in reading.most_common(top)]}


def table(result: dict[str, Any]) -> str:
    parts = []
    for record in result["records"]:
        parts.append(f"## {record['record']}: {record['seconds']:.1f} s sampled up to the first step\n\n"
                     "| seconds | the package's frame (inclusive) |\n|---|---|\n"
                     + "\n".join(f"| {s:.2f} | `{f}` |" for f, s in record["frames"])
                     + "\n\n| seconds | its call into other code (inclusive) |\n|---|---|\n"
                     + "\n".join(f"| {s:.2f} | `{c}` |" for c, s in record["calls"])
                     + "\n\n| seconds | module imported (inclusive) |\n|---|---|\n"
                     + "\n".join(f"| {s:.2f} | `{m}` |" for m, s in record["imports"])
                     + f"\n\n| seconds | frame inside {FIRST_STEP[0]} ({FIRST_STEP[1]}, inclusive) |\n|---|---|\n"
                     + "\n".join(f"| {s:.2f} | `{f}` |" for f, s in record["first_step"])
                     + f"\n\n| seconds, summed over {record['reading_threads']} threads | frame of the checkpoint's "
                     "reading threads (inclusive) |\n|---|---|\n"
                     + "\n".join(f"| {s:.2f} | `{f}` |" for f, s in record["reading"]))
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("records", nargs="+", type=Path, help="speedscope files of bench/restart.py --py-spy")
    parser.add_argument("--name", default="startup-profile")
    parser.add_argument("--top", type=int, default=40, help="rows per table")
    parser.add_argument("--out", type=Path, default=common.RESULTS)
    args = parser.parse_args(argv)
    result = {"name": args.name, **common.stamp(), "records": [summarise(p, args.top) for p in args.records]}
    common.write_result(args.out, args.name, result, table(result))
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
