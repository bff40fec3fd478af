"""The report's charts: one line per run, from metrics.jsonl; the data as JSON and, with matplotlib, a PNG.

The JSON beside each PNG holds exactly what is drawn (title, axes, and each line's label and
points), so the numbers behind a plot can be checked or re-plotted elsewhere.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


# The largest unit of which the longest run spans at least two.
TIME_UNITS = ((3600.0, "hours"), (60.0, "minutes"), (1.0, "seconds"))


@dataclass
class Line:
    label: str
    points: list[tuple[float, float]]


@dataclass
class Chart:
    name: str  # file name stem
    title: str
    x_label: str
    y_label: str
    lines: list[Line] = field(default_factory=list)

    def add(self, label: str, points: list[tuple[float, float]]) -> None:
        """Add a run's line; a run without points yet has none."""
        if points:
            self.lines.append(Line(label, points))


def train_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if "loss" in r]


def loss_by_step(runs: dict[str, list[dict[str, Any]]]) -> Chart:
    chart = Chart("loss_vs_step", "Training loss", "step", "loss")
    for label, records in runs.items():
        chart.add(label, [(r["step"], r["loss"]) for r in train_records(records)])
    return chart


def loss_by_tokens(runs: dict[str, list[dict[str, Any]]]) -> Chart:
    chart = Chart("loss_vs_tokens", "Training loss", "tokens seen", "loss")
    for label, records in runs.items():
        chart.add(label, [(r["tokens_seen"], r["loss"]) for r in train_records(records) if "tokens_seen" in r])
    return chart


def throughput_over_time(runs: dict[str, list[dict[str, Any]]]) -> Chart:
    """Tokens/s against wall-clock time since each run's first logged step; restarts show as gaps."""
    timed = {label: [r for r in train_records(records) if "time" in r] for label, records in runs.items()}
    span_s = max((rs[-1]["time"] - rs[0]["time"] for rs in timed.values() if rs), default=0.0)
    seconds_per_unit, unit = next((size, name) for size, name in TIME_UNITS if span_s >= 2 * size or size == 1.0)
    chart = Chart("throughput", "Throughput", f"{unit} since the first logged step", "tokens/s")
    for label, records in timed.items():
        chart.add(label, [((r["time"] - records[0]["time"]) / seconds_per_unit, r["tokens_per_s"]) for r in records])
    return chart


def write_data(chart: Chart, out_dir: Path) -> Path:
    path = Path(out_dir) / f"{chart.name}.json"
    path.write_text(json.dumps(asdict(chart), indent=1) + "\n")
    return path


def draw(chart: Chart, out_dir: Path) -> Path:
    """Write the chart as a PNG. Needs matplotlib (ImportError without it)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 5), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for line in chart.lines:
        xs, ys = zip(*line.points)
        axes.plot(xs, ys, label=line.label, marker="." if len(line.points) < 50 else None)
    axes.set(title=chart.title, xlabel=chart.x_label, ylabel=chart.y_label)
    axes.grid(alpha=0.3)
    if chart.lines:
        axes.legend(fontsize="small")
    path = Path(out_dir) / f"{chart.name}.png"
    figure.savefig(path, dpi=120)
    return path
