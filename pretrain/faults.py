"""Fault injection for tests: inert unless PRETRAIN_FAULTS is set.

PRETRAIN_FAULTS is a comma-separated list of NAME@WHEN, e.g. "nan_loss@5,nan_grad@7-9,kill_in_save@4":
  nan_loss@STEPS       the loss of those steps becomes NaN (every rank)
  nan_grad@STEPS       one gradient element of those steps becomes NaN (rank 0)
  kill_in_save@STEPS   the process kills itself (SIGKILL) after writing its shards of that step's
                       checkpoint, before the checkpoint is published
  kill_in_remove@STEPS the process kills itself after deleting the first file of that step's
                       checkpoint when it is pruned (or replaced)
STEPS is N or A-B (inclusive). Faults of a node or rank name WHERE instead, a node (Slurm's node
name, else the hostname) or rankN:
  preflight_fail@WHERE the preflight check's matrix product there comes out wrong (one entry changed
                       after it is computed, so the real check sees it)
The tests use it to show what happens when things break.
"""

from __future__ import annotations

import os
import signal
from functools import lru_cache


@lru_cache(maxsize=8)
def _parse(spec: str) -> dict[str, list[str]]:
    faults: dict[str, list[str]] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, when = item.partition("@")
        faults.setdefault(name, []).append(when)
    return faults


def _matches(when: str, step: int) -> bool:
    low, _, high = when.partition("-")
    return int(low) <= step <= int(high or low)


def active(name: str, step: int) -> bool:
    """Whether fault `name` is injected at `step`."""
    whens = _parse(os.environ.get("PRETRAIN_FAULTS", "")).get(name, [])
    return any(_matches(when, step) for when in whens)


def kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def active_on(name: str, node: str, rank: int) -> bool:
    """Whether fault `name` is injected on this node or rank (NAME@NODE or NAME@rankN)."""
    whens = _parse(os.environ.get("PRETRAIN_FAULTS", "")).get(name, [])
    return node in whens or f"rank{rank}" in whens
