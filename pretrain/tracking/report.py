"""`python -m pretrain.report RUN_OR_SWEEP_DIR [--out DIR]`: a table of the runs and plots of their curves.

    python -m pretrain.report runs/sweeps/2024-05-01/12-00-00_tiny

Reads only each run's metrics.jsonl, so it works without W&B and while the runs go on. Prints
one row per run (steps, final loss, best eval loss, tokens/s, MFU, restarts) and writes, to
DIR (default: RUN_OR_SWEEP_DIR/report), loss against steps and against tokens with one line per
run, and throughput over time: each as a PNG (with matplotlib: pip install matplotlib) and as
the JSON of its data.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain import rundir
from pretrain.tracking import charts

COLUMNS = ("run", "steps", "final loss", "best eval loss", "tokens/s", "MFU", "restarts")


@dataclass
class RunSummary:
    name: str
    steps: int
    final_loss: float | None
    best_eval_loss: float | None
    tokens_per_s: float | None  # median over logged steps: the first, with start-up costs, does not skew it
    mfu: float | None
    restarts: int


def summarize(name: str, records: list[dict[str, Any]]) -> RunSummary:
    train = charts.train_records(records)
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    return RunSummary(
        name=name,
        steps=max((r["step"] for r in records), default=0),
        final_loss=train[-1]["loss"] if train else None,
        best_eval_loss=min(evals) if evals else None,
        tokens_per_s=_median([r["tokens_per_s"] for r in train if "tokens_per_s" in r]),
        mfu=_median([r["mfu"] for r in train if "mfu" in r]),
        restarts=max((r.get("restarts", 0) for r in records), default=0),
    )


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def table(summaries: list[RunSummary]) -> str:
    rows = [COLUMNS] + [(s.name, str(s.steps), _number(s.final_loss, "{:.4f}"), _number(s.best_eval_loss, "{:.4f}"),
                         _number(s.tokens_per_s, "{:,.0f}"), _number(s.mfu, "{:.1%}"), str(s.restarts))
                        for s in summaries]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(width) if i == 0 else cell.rjust(width) for i, (cell, width) in
                       enumerate(zip(row, widths))) for row in rows]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def _number(value: float | None, form: str) -> str:
    return "-" if value is None else form.format(value)


def write_charts(metrics: dict[str, list[dict[str, Any]]], out_dir: Path) -> list[Path]:
    """Write each chart's data, and its PNG when matplotlib is installed; the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    built = [charts.loss_by_step(metrics), charts.loss_by_tokens(metrics), charts.throughput_over_time(metrics)]
    written = [charts.write_data(chart, out_dir) for chart in built]
    try:
        written += [charts.draw(chart, out_dir) for chart in built]
    except ImportError:
        print(f"matplotlib is not installed, so no PNG plots (pip install matplotlib); their data is in {out_dir}")
    return written


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pretrain.report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path, help="a run directory or a sweep directory")
    parser.add_argument("--out", type=Path, help="where to write the plots (default: PATH/report)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    run_dirs = rundir.run_dirs(args.path)
    if not run_dirs:
        print(rundir.not_found(args.path), file=sys.stderr)
        return 2
    metrics = {run_dir.name: rundir.metrics(run_dir) for run_dir in run_dirs}
    print(table([summarize(name, records) for name, records in metrics.items()]))
    try:
        written = write_charts(metrics, args.out or args.path / "report")
    except OSError as error:
        print(f"error: cannot write the plots to {args.out or args.path / 'report'}: {error.strerror or error}",
              file=sys.stderr)
        return 2
    print("wrote " + ", ".join(str(path) for path in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
