"""Where a run's words and numbers go.

Rank 0 writes progress to the console and to RUN/train.log, and metrics to RUN/metrics.jsonl.
Other ranks log only warnings and errors, to their own stderr (the launcher gives each rank
its own file), so a failure on any rank is still on record.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

FORMAT = "%(asctime)s %(levelname).1s [rank%(rank)s] %(message)s"


class _RankFilter(logging.Filter):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


def setup(run_dir: Path, rank: int) -> None:
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handlers: list[logging.Handler] = []
    if rank == 0:
        handlers.append(logging.StreamHandler(sys.stdout))
        handlers.append(logging.FileHandler(run_dir / "train.log"))
    else:
        handlers.append(logging.StreamHandler(sys.stderr))
    for handler in handlers:
        # On the handlers, not the root logger: libraries such as submitit set their own loggers' levels.
        handler.setLevel(logging.INFO if rank == 0 else logging.WARNING)
        handler.setFormatter(logging.Formatter(FORMAT, datefmt="%H:%M:%S"))
        handler.addFilter(_RankFilter(rank))
        root.addHandler(handler)
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)


class MetricsFile:
    """metrics.jsonl: one JSON object per logged step, appended and flushed at once."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def truncate_after(self, step: int) -> None:
        """On resume: keep records up to `step`; move later ones (from the lost attempt) aside, never delete."""
        if not self.path.is_file():
            return
        kept, dropped = [], []
        for line in self.path.read_text().splitlines():
            try:
                (kept if json.loads(line).get("step", 0) <= step else dropped).append(line)
            except json.JSONDecodeError:
                dropped.append(line)  # a line cut short by a crash
        if not dropped:
            return
        with self.path.with_name("metrics.discarded.jsonl").open("a") as f:
            f.write("\n".join(dropped) + "\n")
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.path)

    def records(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


def human_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"
