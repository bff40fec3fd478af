"""Which rank this process is, and which GPU it drives: from torchrun-style variables or from Slurm.

One process per GPU. The standard RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT variables win
(torchrun, our local launcher, any launcher that sets them); otherwise Slurm's srun variables are used.
No torch here: the job reads its identity before torch is imported (pretrain.trainer.cuda_context).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from pretrain.hosts import expand_nodelist, free_port


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def slurm_port(job_id: str) -> int:
    """A port all tasks of one job agree on without talking: derived from the job id."""
    return 20000 + int(re.sub(r"\D", "", job_id) or 0) % 20000


def launched_by_torchrun(environ: Mapping[str, str]) -> bool:
    return "RANK" in environ and "WORLD_SIZE" in environ


def launched_by_srun(environ: Mapping[str, str]) -> bool:
    return "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ


def local_rank(environ: Mapping[str, str]) -> int:
    """This process's rank among those of its node."""
    if launched_by_torchrun(environ):
        return int(environ.get("LOCAL_RANK", 0))
    if launched_by_srun(environ):
        return int(environ.get("SLURM_LOCALID", 0))
    return 0


def detect() -> DistEnv:
    env = os.environ
    if launched_by_torchrun(env):
        world = int(env["WORLD_SIZE"])
        return DistEnv(
            rank=int(env["RANK"]),
            world_size=world,
            local_rank=local_rank(env),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
        )
    if launched_by_srun(env):
        nodes = int(env.get("SLURM_JOB_NUM_NODES", env.get("SLURM_NNODES", 1)))
        return DistEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=local_rank(env),
            local_world_size=int(env["SLURM_NTASKS"]) // max(nodes, 1),
            master_addr=env.get("MASTER_ADDR") or expand_nodelist(env["SLURM_JOB_NODELIST"])[0],
            master_port=int(env.get("MASTER_PORT") or slurm_port(env.get("SLURM_JOB_ID", "0"))),
        )
    return DistEnv(0, 1, 0, 1, "127.0.0.1", free_port())


def gpu_index(local_rank: int, device_count: int, environ: Mapping[str, str]) -> int:
    """The GPU a rank drives, among the `device_count` it sees.

    Slurm gives a task either its job's GPUs of the node (the default: CUDA_VISIBLE_DEVICES lists
    them) or one GPU (--gpu-bind=per_task:1): then local rank modulo what is visible. With
    --gpu-bind=none srun unsets CUDA_VISIBLE_DEVICES, and on a node shared with other jobs and
    without device cgroups the task sees every GPU of the node: it must take its job's own, which
    SLURM_JOB_GPUS names, not GPU local_rank, which may belong to another job.
    """
    job_gpus = [int(g) for g in environ.get("SLURM_JOB_GPUS", "").split(",") if g.strip().isdigit()]
    if "CUDA_VISIBLE_DEVICES" not in environ and job_gpus and device_count > len(job_gpus) \
            and max(job_gpus) < device_count:
        return job_gpus[local_rank % len(job_gpus)]
    return local_rank % device_count
