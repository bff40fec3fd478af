"""Our throughput beside torchtitan's, like for like: same machine, same call, same GPU(s), same
precision, same micro-batch, one after the other.

    python bench/side_by_side.py --titan DIR 1b-1gpu-bf16 1b-1gpu-fp8 [--out DIR]

DIR is the torchtitan reference folder (its titan.sh runs one torchtitan row; its README says what
it needs on the GPU machine); it is not part of this project and travels with the device call.
Each ROW runs torchtitan, then `bench/throughput.py` with the matching settings, and writes
side-NAME.json and side-NAME.md: both tokens/s per GPU (steady state: the mean of the logged
steps after --measure-from), and their ratio.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

FP8 = ["--model.converters", "quantize.linear.float8", "--quantize.linear.float8.filter_fqns", "output"]
# Per row: torchtitan's (gpus, count, toml, flags) and ours (throughput.py setup, overrides).
ROWS: dict[str, dict[str, Any]] = {
    "1b-1gpu-bf16": {"titan": ("0", 1, "llama3_1b_ref.toml", []), "ours": ("1b-1gpu", [])},
    "1b-1gpu-fp8": {"titan": ("0", 1, "llama3_1b_ref.toml", FP8), "ours": ("1b-1gpu", ["precision=fp8"])},
    "1b-2gpu-bf16": {"titan": ("0,1", 2, "llama3_1b_ref.toml", []), "ours": ("1b-2gpu", [])},
    "8b-2gpu-mb2-bf16": {"titan": ("0,1", 2, "llama3_8b_ref.toml", []),
                         "ours": ("8b-2gpu", ["train.micro_batch=2"])},
}
TPS = re.compile(r"step:\s*(\d+)\b.*?\btps:\s*([\d,]+)")


def titan_steady(log: str, measure_from: int) -> float | None:
    """torchtitan's mean tokens/s per GPU ("tps") over its logged steps after measure_from."""
    rates = [float(tps.replace(",", "")) for step, tps in TPS.findall(log) if int(step) > measure_from]
    return statistics.fmean(rates) if rates else None


def run_titan(titan: Path, name: str, row: dict[str, Any], out: Path) -> dict[str, Any]:
    gpus, count, toml, flags = row["titan"]
    command = ["bash", str(titan / "titan.sh"), name, gpus, str(count), toml, *flags]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    log = result.stdout + result.stderr
    (out / f"{name}.log").write_text(log)
    return {"command": " ".join(command[2:]), "exit_code": result.returncode, "log": log}


def run_ours(name: str, row: dict[str, Any], steps: int, measure_from: int, out: Path) -> dict[str, Any]:
    setup, overrides = row["ours"]
    command = [sys.executable, str(common.REPO / "bench" / "throughput.py"), setup, "--name", name, "--out", str(out),
               "--steps", str(steps), "--measure-from", str(measure_from), *overrides]
    subprocess.run(command, capture_output=True, text=True, timeout=900)
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def table(result: dict[str, Any]) -> str:
    ours, titan, ratio = result["ours_tokens_per_s_per_gpu"], result["titan_tokens_per_s_per_gpu"], result["ratio"]
    fmt = lambda v: f"{v:,.0f}" if v else "failed"  # noqa: E731
    return ("| row | ours | torchtitan | ratio |\n|---|---|---|---|\n"
            f"| {result['row']} | {fmt(ours)} | {fmt(titan)} | {f'{ratio:.3f}' if ratio else '-'} |\n\n"
            f"tokens/s per GPU, mean over logged steps {result['measure_from'] + 1}-{result['steps']}.  \n"
            f"ours: `{result['ours_command']}`  \ntorchtitan: `titan.sh {result['titan_command']}`")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rows", nargs="+", choices=sorted(ROWS))
    parser.add_argument("--titan", type=Path, required=True, help="the torchtitan reference folder (titan.sh)")
    parser.add_argument("--out", type=Path, default=common.RESULTS)
    parser.add_argument("--steps", type=int, default=60, help="torchtitan's tomls train 60 steps")
    parser.add_argument("--measure-from", type=int, default=30)
    parser.add_argument("--suffix", default="", help="added to the result names, e.g. -COMMIT for a repeat")
    args = parser.parse_args(argv)
    failed = 0
    for row_name in args.rows:
        row = ROWS[row_name]
        titan = run_titan(args.titan.resolve(), f"titan-{row_name}{args.suffix}", row, args.out)
        ours = run_ours(f"ours-{row_name}{args.suffix}", row, args.steps, args.measure_from, args.out)
        titan_rate = titan_steady(titan["log"], args.measure_from)
        ours_rate = ours.get("steady", {}).get("tokens_per_s_per_gpu")
        result = {"name": f"side-{row_name}{args.suffix}", "row": row_name, **common.stamp(), "steps": args.steps,
                  "measure_from": args.measure_from, "ours_tokens_per_s_per_gpu": ours_rate,
                  "titan_tokens_per_s_per_gpu": titan_rate, "ratio": ours_rate / titan_rate if ours_rate and titan_rate else None,
                  "ours_command": ours.get("command"), "titan_command": titan["command"],
                  "titan_exit_code": titan["exit_code"], "ours_steady": ours.get("steady")}
        common.write_result(args.out, result["name"], result, table(result))
        print(f"{row_name}: ours {ours_rate}, torchtitan {titan_rate}, ratio {result['ratio']}")
        failed += result["ratio"] is None
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
