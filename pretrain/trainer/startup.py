"""How long a job took to start: from the process's start to the end of its first step, by phase.

Preempted and time-limited jobs restart often, and each restart pays process start, model build,
checkpoint load and compilation again before it trains; this makes that cost visible in the log
and in metrics.jsonl (a record with `startup_s`), so a slow restart is seen, not guessed.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any


def process_age_s() -> float:
    """Seconds since this process started (the kernel's start time; 0 where /proc is missing)."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)


class StartupClock:
    """Phases of a job's start, each timed from the end of the one before."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {"process start and imports": process_age_s()}
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self._last
        self._last = now

    @property
    def total_s(self) -> float:
        return sum(self.phases.values())

    def record(self, step: int) -> dict[str, Any]:
        return {"step": step, "startup_s": round(self.total_s, 2),
                "startup": {name: round(s, 2) for name, s in self.phases.items()}}

    def line(self) -> str:
        return f"{self.total_s:.1f} s from process start to the first step: " + ", ".join(
            f"{name} {s:.1f} s" for name, s in self.phases.items())
