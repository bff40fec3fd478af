"""Hosts and ports: Slurm's node lists, and a free TCP port for a local rendezvous. No torch.

Slurm writes node lists in its hostlist syntax, e.g. `gpu[012-015,20],cpu1` or
`rack[1-2]-n[01-04]` (several bracket groups make their product). `scontrol show hostnames`
expands them, but containers rarely have scontrol, so the job expands them itself.
"""

from __future__ import annotations

import itertools
import re
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def expand_nodelist(nodelist: str) -> list[str]:
    """Every host of a Slurm node list, in Slurm's order."""
    hosts: list[str] = []
    for group in _top_level_groups(nodelist):
        parts = re.split(r"(\[[^\]]*\])", group)
        choices = [_expand_ranges(part[1:-1]) if part.startswith("[") else [part] for part in parts if part]
        hosts += ["".join(combination) for combination in itertools.product(*choices)]
    if not hosts:
        raise ValueError(f"cannot read the Slurm node list {nodelist!r}")
    return hosts


def _top_level_groups(nodelist: str) -> list[str]:
    """`a[1,2],b` -> ["a[1,2]", "b"]: split at the commas outside brackets."""
    groups, depth, current = [], 0, ""
    for char in nodelist.strip():
        if char == "," and depth == 0:
            groups.append(current)
            current = ""
            continue
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth < 0:
            raise ValueError(f"cannot read the Slurm node list {nodelist!r}: unbalanced brackets")
        current += char
    if depth:
        raise ValueError(f"cannot read the Slurm node list {nodelist!r}: unbalanced brackets")
    return [group for group in groups + [current] if group]


def _expand_ranges(spec: str) -> list[str]:
    """`01-03,7` -> ["01", "02", "03", "7"], keeping each range's zero padding."""
    values = []
    for item in spec.split(","):
        low, _, high = item.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ValueError(f"cannot read the Slurm node range {item!r}")
        values += [str(n).zfill(len(low)) for n in range(int(low), int(high or low) + 1)]
    return values
