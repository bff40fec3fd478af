"""What checkpoints cost on the 1B reference shape (model + AdamW state), through the package.

    python bench/checkpoint_cost.py [--out bench/results] [--runs /tmp/bench-runs]

1. Synchronous saves: train a few steps with a checkpoint every 2 steps; the run's metrics give
   each save's time (ckpt_save_s). Then resume one step further: the load time (ckpt_load_s).
2. Asynchronous saves (train.async_checkpoint=true): checkpoints after --async-every and
   2 x --async-every steps (the last awaited at the end), logging every step; the metrics give
   the time training was blocked staging each save (ckpt_stage_s), waiting for the writes of
   the previous one (ckpt_wait_s), and the time to publication (ckpt_save_s), next to the step
   time of the steps around it.
Checkpoints are written to --runs (local disk) and deleted afterwards.
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

BASE = ["model=llama-1b", "data=synthetic", "precision=bf16", "fsdp.compile=false", "train.seq_len=4096",
        "train.micro_batch=4", "train.global_batch=4", "train.eval_every=0", "train.ckpt_keep=1", "local.nproc=1"]


def checkpoint_gb(run_dir: Path) -> float:
    found = sorted((run_dir / "checkpoints").glob("step_*"))
    return sum(f.stat().st_size for f in found[-1].rglob("*") if f.is_file()) / 2**30 if found else 0.0


def sync_saves(runs: Path, out: Path, timeout: float, base: list[str]) -> dict[str, Any]:
    run_dir = runs / "ckpt-sync"
    save = base + ["train.steps=4", "train.ckpt_every=2", "train.log_every=1"]
    first = common.launch(save, run_dir, timeout, out / "ckpt-sync.log")
    size = checkpoint_gb(run_dir)
    load = base + ["train.steps=5", "train.ckpt_every=0", "train.log_every=1"]
    second = common.launch(load, run_dir, timeout, out / "ckpt-load.log")
    records = common.metrics(run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"commands": [first["command"], second["command"] + f" hydra.run.dir=<same>"],
            "exit_codes": [first["exit_code"], second["exit_code"]], "checkpoint_gib": size,
            "save_s": [r["ckpt_save_s"] for r in records if "ckpt_save_s" in r],
            "load_s": [r["ckpt_load_s"] for r in records if "ckpt_load_s" in r],
            "step_time_s": median_step_time(records)}


def async_saves(runs: Path, out: Path, timeout: float, every: int, base: list[str], steps: int | None) -> dict[str, Any]:
    run_dir = runs / "ckpt-async"
    overrides = base + [f"train.steps={steps or 2 * every}", f"train.ckpt_every={every}", "train.log_every=1",
                        "train.async_checkpoint=true"]
    ran = common.launch(overrides, run_dir, timeout, out / "ckpt-async.log")
    records = common.metrics(run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    saves = [r for r in records if "ckpt_stage_s" in r]
    steps = {r["step"]: r["step_time_s"] for r in records if "step_time_s" in r}
    return {"command": ran["command"], "exit_code": ran["exit_code"],
            "saves": saves, "step_time_s": median_step_time(records),
            "steps_after_save": {s["step"]: [steps.get(s["step"] + i) for i in (1, 2, 3)] for s in saves}}


def median_step_time(records: list[dict[str, Any]]) -> float | None:
    times = [r["step_time_s"] for r in records if "step_time_s" in r and r["step"] > 2]
    return statistics.median(times) if times else None


def table(result: dict[str, Any]) -> str:
    s, a = result["sync"], result["async"]
    fmt = lambda xs: ", ".join(f"{x:.1f}" for x in xs) or "-"  # noqa: E731
    rows = ["| | |", "|---|---|"]
    if s:
        rows += [f"| checkpoint size (model + optimizer, 1 rank) | {s['checkpoint_gib']:.1f} GiB |",
                 f"| synchronous save, s (each save) | {fmt(s['save_s'])} |",
                 f"| load (resume), s | {fmt(s['load_s'])} |",
                 f"| step time (eager, micro-batch 4) | {(s['step_time_s'] or 0) * 1000:.0f} ms |"]
    rows.append(f"| async run: median step time | {(a['step_time_s'] or 0) * 1000:.0f} ms |")
    for save in a["saves"]:
        rows.append(f"| async save at step {save['step']}: blocked staging / waiting for writes / published after | "
                    f"{save['ckpt_stage_s']:.2f} s / {save['ckpt_wait_s']:.2f} s / {save['ckpt_save_s']:.1f} s |")
    rows.append(f"| step times after each async save, s | {a['steps_after_save']} |")
    rows += ["", "commands:", *(f"- `{c}`" for c in (s["commands"] if s else [])), f"- `{a['command']}`"]
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=common.RESULTS)
    parser.add_argument("--runs", type=Path, default=Path("/tmp/bench-runs"))
    parser.add_argument("--async-every", type=int, default=40)
    parser.add_argument("--async-only", action="store_true", help="skip the synchronous save and load runs")
    parser.add_argument("--timeout", type=float, default=400)
    parser.add_argument("--async-steps", type=int, help="train this many steps in the async run (default 2 x every)")
    parser.add_argument("--name", default="checkpoint_cost")
    parser.add_argument("overrides", nargs="*", help="extra launcher overrides (e.g. model=tiny to try it on a CPU)")
    args = parser.parse_intermixed_args()
    base = BASE + args.overrides
    sync = None if args.async_only else sync_saves(args.runs, args.out, args.timeout, base)
    result = {**common.stamp(), "settings": base, "sync": sync,
              "async": async_saves(args.runs, args.out, args.timeout, args.async_every, base, args.async_steps)}
    common.write_result(args.out, args.name, result, table(result))
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
