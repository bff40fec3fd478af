"""Where this package leans on torch's private parts, and the workarounds for older torch: one place,
each piece with a test (tests/test_compat.py) that fails loudly when a torch release changes it.

- FSDP2's gradient reduction over gloo (CPU test runs): torch >= 2.8 has a public switch
  (`set_force_sum_reduction_for_comms`); on 2.7 the factors FSDP uses for fp16 gradients are chosen
  through its private `_get_gradient_divide_factors`.
- Host copies of sharded state for asynchronous checkpoints (pretrain.trainer.staging): torch has
  no public way to make a DTensor whose local shard lives on the host while its mesh is on GPUs, nor
  to copy a state dict into such buffers; `_copy_state_dict` and the `_local_tensor` assignment are
  what torch's own `_create_cpu_state_dict` uses.
- Which rows of a parameter a rank holds (model.init_from reads only those): DTensor has no public
  way to say where its local shard lies in the whole; `compute_local_shape_and_global_offset` is what
  DCP uses for it.
- Inductor's cache key (prefetch_triton_key): newer torch can compute its hash of Triton's install
  ahead (`codecache.triton_key.prefetch`, in 2.13); older torch (2.7) calls Triton's own cached
  function, which a thread of ours then fills.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

# torch >= 2.8: FSDP2 can be told to reduce with SUM (see reduce_gloo_gradients_by_sum). Older FSDP2
# cannot all-reduce across a 2-D mesh on CPUs at all (no AVG in gloo, no CPU event), so
# hybrid_shard and no_shard need a GPU there.
CPU_ALL_REDUCE = hasattr(FSDPModule, "set_force_sum_reduction_for_comms")


def reduce_gloo_gradients_by_sum(model: nn.Module) -> None:
    """Make FSDP2 average gradients over gloo with SUM and a division, not ReduceOp.AVG.

    FSDP2 reduces fp32/bf16 gradients with AVG, which gloo lacks for all-reduce before
    torch 2.8 (HSDP and no_shard fail) and turns silently into a SUM for reduce-scatter
    (pytorch/pytorch#162338: gradients come out world-size times too large). Newer torch has
    a switch for exactly this; on torch 2.7 (1-D meshes only) the factors FSDP uses for fp16
    gradients (SUM, divided by about sqrt(N) before and N/sqrt(N) after) are chosen on CPUs
    whatever the gradients' dtype.
    """
    if CPU_ALL_REDUCE:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
        return
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

    original = collectives._get_gradient_divide_factors
    if getattr(original, "sums_on_cpu", False):
        return

    def divide_factors(reduce_scatter_group, all_reduce_group, reduce_dtype, device_type=""):
        if device_type == "cpu":
            reduce_dtype = torch.float16  # only selects the factors; the reduction keeps its dtype
        return original(reduce_scatter_group, all_reduce_group, reduce_dtype, device_type)

    divide_factors.sums_on_cpu = True
    collectives._get_gradient_divide_factors = divide_factors


def host_dtensor(like: DTensor, local: torch.Tensor) -> DTensor:
    """A DTensor with `like`'s mesh, placements and global shape whose local shard is `local`, a host
    tensor (DTensor.from_local would move it to the mesh's device)."""
    hosted = DTensor.from_local(torch.empty_like(like.to_local(), device="meta"), like.device_mesh, like.placements,
                                run_check=False, shape=like.shape, stride=like.stride())
    hosted._local_tensor = local
    return hosted


def copy_state_dict(state: dict[str, Any], into: dict[str, Any], non_blocking: bool = False) -> dict[str, Any]:
    """Copy every tensor of `state` (DTensors: their local shards) into the matching tensor of `into`;
    returns `into` with `state`'s other values."""
    from torch.distributed._state_dict_utils import _copy_state_dict

    return _copy_state_dict(state, into, non_blocking=non_blocking)


def local_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, range]:
    """The part of a parameter this rank holds, and which rows of the whole it is: a DTensor's local
    shard (FSDP2 splits dim 0 only), or a plain tensor whole."""
    if not isinstance(tensor, DTensor):
        return tensor, range(tensor.shape[0])
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    if any(offset[1:]) or tuple(shape[1:]) != tuple(tensor.shape[1:]):
        raise ValueError(f"a parameter split along more than its rows ({tensor.placements}): only FSDP's are read")
    return tensor.to_local(), range(offset[0], offset[0] + shape[0])


def prefetch_triton_key() -> None:
    """Start hashing Triton's install, part of Inductor's cache key, in a background thread.

    Every process that runs compiled code computes that hash once, at its first compiled call: the
    SHA-256 of libtriton (about 500 MB) and of Triton's sources, 0.3 s on the 2-core CPU machine and
    longer on a node whose page cache does not yet hold the container's copy. A requeued job, whose
    graphs all come from the compile cache, pays it inside its first step. Hashing and file reads
    release the interpreter lock, so in a thread started once Triton is imported it costs the main
    thread nothing. No Triton (torch's CPU build alone): nothing to do.
    """
    from torch._inductor import codecache

    prefetch = getattr(getattr(codecache, "triton_key", None), "prefetch", None)
    if prefetch is not None:
        prefetch()  # torch's own: a first call before it is done waits for it instead of hashing again
        return
    key = _tritons_cached_key()
    if key is not None:
        threading.Thread(target=key, name="triton-key", daemon=True).start()


def _tritons_cached_key() -> Callable[[], str] | None:
    """Triton's own triton_key, an lru_cache, which torch calls: in triton.runtime.cache since about
    Triton 3.4, in triton.compiler.compiler before (3.3, torch 2.7's)."""
    for module in ("triton.runtime.cache", "triton.compiler.compiler"):
        try:
            key = getattr(__import__(module, fromlist=["triton_key"]), "triton_key", None)
        except ImportError:
            return None
        if key is not None:
            return key
    return None
