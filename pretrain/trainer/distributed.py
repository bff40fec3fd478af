"""Process identity and the process group: from torchrun-style variables or from Slurm.

One process per GPU. The standard RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT
variables win (torchrun, our local launcher, any launcher that sets them); otherwise Slurm's
srun variables are used. NCCL where CUDA is available, gloo elsewhere (CPU test nodes).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

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


def detect() -> DistEnv:
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        return DistEnv(
            rank=int(env["RANK"]),
            world_size=world,
            local_rank=int(env.get("LOCAL_RANK", 0)),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodes = int(env.get("SLURM_JOB_NUM_NODES", env.get("SLURM_NNODES", 1)))
        return DistEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            local_world_size=int(env["SLURM_NTASKS"]) // max(nodes, 1),
            master_addr=env.get("MASTER_ADDR") or expand_nodelist(env["SLURM_JOB_NODELIST"])[0],
            master_port=int(env.get("MASTER_PORT") or slurm_port(env.get("SLURM_JOB_ID", "0"))),
        )
    return DistEnv(0, 1, 0, 1, "127.0.0.1", free_port())


def gpu_index(local_rank: int, device_count: int, environ: dict[str, str] | os._Environ) -> int:
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


def device_for(env: DistEnv) -> torch.device:
    if torch.cuda.is_available():
        index = gpu_index(env.local_rank, torch.cuda.device_count(), os.environ)
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def init_process_group(env: DistEnv, device: torch.device, timeout_s: float = 600) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=timeout_s),
        **kwargs,
    )


def collective_failed(error: BaseException) -> bool:
    """Whether `error` is a collective that broke (a peer died, or it timed out), not this rank's own fault.

    Such a job is requeued and resumes from its last checkpoint; an error of its own (a full disk) stops
    the run instead, so the two must not be confused: a checkpoint write whose collectives broke is the
    first kind. NCCL and the rendezvous store raise torch.distributed.DistError; gloo (CPU runs, and the
    gloo group of asynchronous checkpoint writes on GPUs) raises a plain RuntimeError from its transport,
    whose message names gloo's source ("[.../gloo/transport/tcp/pair.cc:537] Read error ...: Connection
    reset by peer").
    """
    return isinstance(error, dist.DistError) or (isinstance(error, RuntimeError) and "/gloo/" in str(error))


def all_agree(flag: bool, device: torch.device) -> bool:
    """True on every rank when `flag` is true on any rank: one small all-reduce."""
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item() > 0)
