"""Hosts and ports: Slurm's node lists, a free TCP port for a local rendezvous, and the memory this process
may still take (the node's, and its memory cgroups' where they set limits). No torch.

Slurm writes node lists in its hostlist syntax, e.g. `gpu[012-015,20],cpu1` or
`rack[1-2]-n[01-04]` (several bracket groups make their product). `scontrol show hostnames`
expands them, but containers rarely have scontrol, so the job expands them itself.
"""

from __future__ import annotations

import itertools
import re
import socket
from pathlib import Path


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


def memory_left(proc: Path = Path("/proc"), cgroups: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes this process may still take: what the kernel counts as available on the node, within what each
    memory cgroup above the process leaves below its limit; None where the node's count cannot be read."""
    available = _mem_available(proc)
    return None if available is None else min([available, *_cgroup_headroom(proc, cgroups)])


def _mem_available(proc: Path) -> int | None:
    """Bytes the kernel counts as available on the node now (MemAvailable), or None where it cannot be read."""
    try:
        with (proc / "meminfo").open() as meminfo:
            return next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def _cgroup_headroom(proc: Path, cgroups: Path) -> list[int]:
    """Bytes below its memory limit, for this process's memory cgroup and each above it that has a limit
    (cgroup v2: memory.max and memory.current; v1: the memory controller's limit_in_bytes and usage_in_bytes)."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":
            found += _headroom_up(cgroups, cgroups / path.lstrip("/"), "memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            root = cgroups / "memory"
            found += _headroom_up(root, root / path.lstrip("/"), "memory.limit_in_bytes", "memory.usage_in_bytes")
    return found


def _headroom_up(root: Path, folder: Path, limit_file: str, usage_file: str) -> list[int]:
    """Limit less usage of `folder` and each folder above it up to `root`, where both read as numbers."""
    found = []
    while True:
        try:
            found.append(max(0, int((folder / limit_file).read_text()) - int((folder / usage_file).read_text())))
        except (OSError, ValueError):  # no such file, or "max": no limit at this level
            pass
        if folder == root or root not in folder.parents:
            return found
        folder = folder.parent
