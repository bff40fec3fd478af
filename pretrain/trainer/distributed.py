"""This rank's device and the job's process group (its identity: pretrain.trainer.identity).

NCCL where CUDA is available, gloo elsewhere (CPU test nodes).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from pretrain.trainer.identity import DistEnv, gpu_index


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
