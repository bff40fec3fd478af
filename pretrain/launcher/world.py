"""The ranks a run will have: how many, how many per node, on GPUs or CPUs, and what their torch
can do; from the cluster file for Slurm, from this machine's devices for a local run."""

from __future__ import annotations

from dataclasses import dataclass

from pretrain.config import Config
from pretrain.launcher import local


@dataclass(frozen=True)
class World:
    size: int
    per_node: int
    cuda: bool
    # Local runs on GPUs: the first GPU's name and memory (a cluster's come from its file).
    gpu_name: str | None = None
    gpu_memory_gib: float | None = None
    bf16: bool = True
    # Local runs on CPUs: whether this torch's FSDP2 can all-reduce gradients over gloo (2-D meshes);
    # None: not asked yet (local.cpu_all_reduce asks when a check needs it).
    known_cpu_all_reduce: bool | None = True

    @property
    def cpu_all_reduce(self) -> bool:
        if self.known_cpu_all_reduce is None:
            return local.cpu_all_reduce()
        return self.known_cpu_all_reduce


def world_of(cfg: Config) -> World:
    if cfg.cluster is not None:
        return World(cfg.cluster.nodes * cfg.cluster.gpus_per_node, cfg.cluster.gpus_per_node, cuda=True)
    found = local.devices(cfg)
    n = local.nproc(cfg, found)
    return World(n, n, found.gpus > 0, found.gpu_name, found.gpu_memory_gib, found.bf16, found.cpu_all_reduce)
