"""Where a run's words and numbers go.

Rank 0 writes progress to the console and to RUN/train.log (metrics go to RUN/metrics.jsonl,
pretrain.rundir.MetricsFile).
Other ranks log only warnings and errors, to their own stderr (the launcher gives each rank
its own file), so a failure on any rank is still on record.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

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
