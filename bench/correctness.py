"""Does bf16 (and fp16 with loss scaling) train like fp32? Loss curves of one seed on real text.

    python bench/correctness.py [--steps 100] [--out bench/results]
    python bench/correctness.py --runs-of bf16 fp8 fp8-rowwise --name correctness-fp8
    python bench/correctness.py --runs-of bf16 --micro-batch 32 --name correctness-mb32

Runs of `python -m pretrain.launch` on the built-in corpus (data.path=null), the same model,
seed, data order and settings, differing only in precision: fp32 (eager; the reference), bf16
compiled (as the benchmarks run) and eager (to tell compilation from rounding), and fp16
compiled with a deliberately high initial loss scale, so that the first steps overflow and
are skipped. A second fp32 run with another seed gives the run-to-run spread as a yardstick.
FP8 runs (`--runs-of fp8 ...`) compare the float8 recipes the same way. A step is 32 sequences, by default two
micro-batches of 16 (accumulated in fp32); `--micro-batch 32` makes it one (one process in bf16 then keeps its
gradients in bf16: pretrain/trainer/optim.py).
Every step is logged. bf16 (and FP8) passes if its loss is within TOLERANCE of fp32's at every step;
fp16 if it never diverges (finite losses, final loss within FP16_FINAL_TOLERANCE of fp32's);
its skipped steps and final loss scale are reported.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

# |loss_bf16 - loss_fp32| <= max(ABS, REL * loss_fp32) at every step.
TOLERANCE = {"abs": 0.05, "rel": 0.02}
FP16_FINAL_TOLERANCE = 0.05
RUNS = {"fp32": ["precision=fp32", "fsdp.compile=false"],
        "fp32-seed2": ["precision=fp32", "fsdp.compile=false", "train.seed=1235"],
        "bf16": ["precision=bf16", "fsdp.compile=true"],
        "bf16-eager": ["precision=bf16", "fsdp.compile=false"],
        "fp16": ["precision=fp16", "fsdp.compile=true", "precision.init_scale=1e9"],
        "fp8": ["precision=fp8", "fsdp.compile=true"],
        "fp8-rowwise": ["precision=fp8", "precision.float8=rowwise", "fsdp.compile=true"]}
# The runs of one call by default; --runs-of picks others (fp32 is always run: the reference).
DEFAULT_RUNS = ("fp32", "fp32-seed2", "bf16", "bf16-eager", "fp16")


def base_overrides(model: str, steps: int, micro_batch: int) -> list[str]:
    return [f"model={model}", "data=builtin", "train.seq_len=1024", "train.global_batch=32", f"train.micro_batch={micro_batch}",
            f"train.steps={steps}", "train.log_every=1", "train.eval_every=0", "train.ckpt_every=0", "local.nproc=1"]


def losses(records: list[dict[str, Any]]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def compare(reference: dict[int, float], other: dict[int, float]) -> dict[str, Any]:
    steps = sorted(set(reference) & set(other))
    diffs = [abs(other[s] - reference[s]) for s in steps]
    allowed = [max(TOLERANCE["abs"], TOLERANCE["rel"] * reference[s]) for s in steps]
    worst = max(range(len(steps)), key=lambda i: diffs[i] / allowed[i]) if steps else None
    return {
        "steps_compared": len(steps),
        "max_abs_diff": max(diffs) if diffs else None,
        "mean_abs_diff": sum(diffs) / len(diffs) if diffs else None,
        "worst_step": steps[worst] if worst is not None else None,
        "within_tolerance": bool(steps) and all(d <= a for d, a in zip(diffs, allowed)),
        "all_finite": all(math.isfinite(other[s]) for s in steps),
    }


def table(result: dict[str, Any]) -> str:
    curves = result["losses"]
    marks = [s for s in (1, 10, 25, 50, 75, 100, result["steps"]) if s <= result["steps"]]
    marks = sorted(set(marks))
    rows = ["| step | " + " | ".join(curves) + " |", "|---|" + "---|" * len(curves)]
    for step in marks:
        rows.append(f"| {step} | " + " | ".join(f"{c.get(step, float('nan')):.4f}" for c in curves.values()) + " |")
    rows += [""] + [f"{name} vs fp32: max |diff| {c['max_abs_diff']:.4f} (step {c['worst_step']}), mean "
                    f"{c['mean_abs_diff']:.4f}; tolerance max({TOLERANCE['abs']}, {TOLERANCE['rel']:.0%} of the fp32 "
                    f"loss) at every step: {'PASS' if c['within_tolerance'] else 'FAIL'}"
                    for name, c in result["vs_fp32"].items()]
    if "fp16" in curves:
        f = result["vs_fp32"]["fp16"]
        rows += ["", f"fp16 vs fp32: max |diff| {f['max_abs_diff']:.4f}, final loss within {FP16_FINAL_TOLERANCE:.0%}: "
                 f"{'PASS' if result['fp16_ok'] else 'FAIL'}; skipped steps {result['fp16_skipped_steps']}, "
                 f"final loss scale {result['fp16_loss_scale']}"]
    rows += ["", "commands:"] + [f"- `{c}`" for c in result["commands"].values()]
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-125m")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", type=Path, default=common.RESULTS)
    parser.add_argument("--runs", type=Path, default=Path("/tmp/bench-runs"))
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--micro-batch", type=int, default=16, choices=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--runs-of", nargs="+", choices=list(RUNS), default=list(DEFAULT_RUNS),
                        help="which runs to compare with fp32")
    parser.add_argument("--name", default="correctness", help="result files NAME.json and NAME.md")
    args = parser.parse_args()

    names = ["fp32"] + [name for name in args.runs_of if name != "fp32"]
    curves, commands, records = {}, {}, {}
    for name in names:
        precision = RUNS[name]
        overrides = base_overrides(args.model, args.steps, args.micro_batch) + precision
        ran = common.launch(overrides, args.runs / f"correctness-{name}", args.timeout,
                            args.out / f"correctness-{name}.log")
        records[name] = common.metrics(args.runs / f"correctness-{name}")
        curves[name] = losses(records[name])
        commands[name] = ran["command"]
        print(name, ran["exit_code"], ran["wall_s"], "s", f"final loss {curves[name].get(args.steps)}", flush=True)
    result = {
        **common.stamp(), "model": args.model, "steps": args.steps, "tolerance": TOLERANCE, "commands": commands,
        "losses": curves, "vs_fp32": {name: compare(curves["fp32"], curves[name]) for name in names if name != "fp32"},
    }
    passed = all(c["within_tolerance"] for name, c in result["vs_fp32"].items() if name.startswith(("bf16", "fp8")))
    if "fp16" in curves:
        fp16_last = [r for r in records["fp16"] if "loss" in r][-1:] or [{}]
        fp32_final = curves["fp32"].get(args.steps, math.nan)
        fp16_final = curves["fp16"].get(args.steps, math.nan)
        result.update(fp16_ok=math.isfinite(fp16_final) and abs(fp16_final - fp32_final) <= FP16_FINAL_TOLERANCE * fp32_final,
                      fp16_skipped_steps=fp16_last[0].get("skipped_steps"), fp16_loss_scale=fp16_last[0].get("loss_scale"))
        passed = passed and result["fp16_ok"]
    common.write_result(args.out, args.name, result, table(result))
    print(table(result))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
