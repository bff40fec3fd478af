"""Fault injection, a testing hook: make a chosen node or rank misbehave so tests can see the job react.

    PRETRAIN_FAULTS="preflight_fail@n2"            the preflight matrix product on node n2 comes out wrong
    PRETRAIN_FAULTS="preflight_fail@rank1,..."     ... on rank 1 (any node)

A comma-separated list of FAULT@WHERE, WHERE being a node (Slurm's node name, else the hostname)
or rankN. Unset or empty, nothing happens. The faults are injected into the real code path (the
product is computed, then one entry changed), so what is tested is what runs.
"""

from __future__ import annotations

import os

ENV = "PRETRAIN_FAULTS"
FAULTS = ("preflight_fail",)


def parse(value: str) -> list[tuple[str, str]]:
    """[(fault, where), ...]; ValueError for an unknown fault or a missing @WHERE."""
    faults = []
    for item in filter(None, (part.strip() for part in value.split(","))):
        name, at, where = item.partition("@")
        if name not in FAULTS or not at or not where:
            raise ValueError(f"{ENV}={value!r}: {item!r} is not FAULT@NODE or FAULT@rankN with FAULT one of "
                             f"{', '.join(FAULTS)}")
        faults.append((name, where))
    return faults


def active(fault: str, node: str, rank: int) -> bool:
    """Whether `fault` is to be injected on this node and rank."""
    return any(name == fault and where in (node, f"rank{rank}") for name, where in parse(os.environ.get(ENV, "")))
