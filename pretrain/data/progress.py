"""The progress line of a prepare: documents, tokens, input MB/s and ETA, redrawn on a terminal only.

Written here rather than with a progress-bar package: one line, no dependency, and silent in logs
and job output (stderr not a terminal), where the summary line at the end says what was done.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

REDRAW_S = 0.5


class Progress:
    def __init__(self, total_bytes: int, stream: TextIO | None = None):
        self.stream = stream or sys.stderr
        self.shown = self.stream.isatty()
        self.total_bytes = max(total_bytes, 1)
        self.documents = self.tokens = self.input_bytes = 0
        self.started = self.drawn = time.monotonic()

    def add(self, documents: int, tokens: int, input_bytes: int) -> None:
        self.documents += documents
        self.tokens += tokens
        self.input_bytes += input_bytes
        if self.shown and time.monotonic() - self.drawn >= REDRAW_S:
            self.draw()

    def draw(self) -> None:
        self.drawn = time.monotonic()
        self.stream.write(f"\r{self.line()}\033[K")
        self.stream.flush()

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        rate = self.input_bytes / elapsed
        done = min(self.input_bytes / self.total_bytes, 1.0)
        eta = (self.total_bytes - self.input_bytes) / rate if rate > 0 else float("inf")
        return (f"{self.documents:,} documents | {self.tokens / 1e6:,.1f}M tokens | {rate / 1e6:,.1f} MB/s | "
                f"{done:.0%} | ETA {duration(eta)}")

    def close(self) -> None:
        if self.shown:
            self.draw()
            self.stream.write("\n")
            self.stream.flush()

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started


def duration(seconds: float) -> str:
    if seconds == float("inf"):
        return "?"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"
