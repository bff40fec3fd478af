"""The CUDA caching allocator's settings, given to torch through its environment before it starts.

A job's memory is one large peak (the activations at the turn from forward to backward) over blocks
of many sizes. With the allocator's default fixed-size segments, the space reserved ran 4-27% above the
peak allocated in our H200 runs, and a run that fits by its allocations can still fail on an 80 GB card
for want of one contiguous block. Expandable segments map more physical memory into one growing virtual
range instead, so reserved memory stays close to what is allocated; torchtitan starts its jobs with them
too. A setting the user made (either variable) is left as it is. Torch-free: it runs before torch is
imported, since the allocator reads its variable once, at its first use.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from importlib import metadata

SETTING = "expandable_segments:True"
# Torch 2.8 began to warn that the old name is deprecated, yet 2.9.1 ignored expandable_segments under the
# new one (pytorch#183387); 2.11 took it under either name, without a warning (seen on the GPU machine:
# bench/results/alloc-names-f312e2f.txt); from 2.12 the new name is the documented one, the old an alias.
NEW_NAME, OLD_NAME = "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"
NEW_NAME_FROM = (2, 12)


def variable_for(torch_version: str) -> str:
    """The variable this torch reads its allocator settings from, without warning where it can."""
    major, minor = (int(part) for part in torch_version.split("+")[0].split(".")[:2])
    return NEW_NAME if (major, minor) >= NEW_NAME_FROM else OLD_NAME


def configure(environ: MutableMapping[str, str], torch_version: str | None = None) -> str | None:
    """Ask for expandable segments unless the user set the allocator's variable; returns the variable set."""
    if NEW_NAME in environ or OLD_NAME in environ:
        return None
    if torch_version is None:
        try:
            torch_version = metadata.version("torch")
        except metadata.PackageNotFoundError:  # torch on a path without its metadata: the name every version reads
            torch_version = "0.0"
    name = variable_for(torch_version)
    environ[name] = SETTING
    return name
