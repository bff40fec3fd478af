"""Run directories on disk: a run, or the runs of a sweep, and how far each one has got.

A run directory is one with the config.yaml that `pretrain.launch` writes; a sweep directory
holds one per point, named `INDEX_OVERRIDES`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any


def is_run_dir(path: Path) -> bool:
    return (Path(path) / "config.yaml").is_file()


def run_dirs(path: Path) -> list[Path]:
    """[path] for a run directory, a sweep's run directories in point order, or [] for neither."""
    path = Path(path)
    if is_run_dir(path):
        return [path]
    if not path.is_dir():
        return []
    return sorted((child for child in path.iterdir() if is_run_dir(child)), key=_point_order)


def not_found(path: Path) -> str:
    """The one-line error of the commands that take a run or sweep directory and got neither."""
    return f"error: {path} is neither a run directory nor a sweep directory (none with a config.yaml)"


def _point_order(run_dir: Path) -> tuple[int, str]:
    index = re.match(r"\d+", run_dir.name)
    return (int(index.group()) if index else -1, run_dir.name)


def planned_steps(run_dir: Path) -> int:
    from omegaconf import OmegaConf

    return int(OmegaConf.load(Path(run_dir) / "config.yaml").train.steps)


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The records of the run's metrics.jsonl; a line being written (or cut short by a crash) is left out."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def last_step(run_dir: Path) -> int:
    """The last step in the run's metrics.jsonl, 0 before the first."""
    return max((record.get("step", 0) for record in metrics(run_dir)), default=0)


def is_finished(run_dir: Path) -> bool:
    return last_step(run_dir) >= planned_steps(run_dir)
