"""One process without FSDP: fp32 master weights, and a copy of them in the compute dtype that trains.

FSDP2 at one rank still copies every parameter into its all-gather buffer and every gradient out of
its reduce-scatter buffer, at each step: 17 ms of a 520 ms step for the 1B shape on an H200
(bench/NOTES.md). torchtitan skips FSDP on one GPU and computes under autocast, which changes the
numerics (the activations between matmuls stay fp32). Here they stay exactly those of FSDP2's
MixedPrecisionPolicy(param_dtype, reduce_dtype=fp32) at one rank:
- forward and backward run on a copy of the fp32 weights in the compute dtype (FSDP2's all-gather cast);
- each gradient is added in fp32 to its master weight's as soon as autograd has it, and dropped
  (FSDP2's reduce-scatter at one rank is that cast, and it accumulates micro-batches in fp32 too);
- after each optimizer step the copy is refreshed from the master weights. On a GPU the optimizer's own
  kernel does that in the pass that updates them (pretrain.parallel.master_adamw); its update is fused
  AdamW's up to float32 rounding, not bit for bit.
The optimizer, checkpoints, gradient clipping and finite checks see only the master weights (and, where kept
there, the copy's gradients), under the model's own parameter names, so a checkpoint is the same whether
FSDP2 wrote it or not.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

# What wrapping adds to parameter names: activation checkpointing, and compile outside Module.compile.
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def plain_name(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def compute_copy(master: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A deep copy of `master` whose parameters are cast to `dtype` (buffers as they are: RoPE's tables
    stay fp32, as FSDP2 leaves them); tied parameters stay tied. No fp32 copy is made on the way."""
    memo = {id(p): nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad) for p in master.parameters()}
    return copy.deepcopy(master, memo)


class MasterWeights:
    """`master` keeps the weights; `compute` (made here) runs the steps. Convert, wrap or compile the
    compute copy's layers first, then call `track_gradients` once."""

    def __init__(self, master: nn.Module, dtype: torch.dtype) -> None:
        self.master = master
        self.dtype = dtype
        self.compute = compute_copy(master, dtype)
        self._hooks: list[RemovableHandle] = []
        self._computes: list[nn.Parameter] = []  # paired by position with _masters
        self._masters: list[nn.Parameter] = []

    def track_gradients(self) -> None:
        """Pair each compute parameter with its master by name, and route its gradients to the master."""
        masters = dict(self.master.named_parameters())
        computes = {plain_name(name): p for name, p in self.compute.named_parameters()}
        if computes.keys() != masters.keys():
            raise RuntimeError(f"the compute copy's parameters {sorted(computes.keys() ^ masters.keys())} have no "
                               "master weight (or the reverse): a conversion renamed them")
        self._computes, self._masters = [computes[name] for name in masters], list(masters.values())
        self._hooks = [compute.register_post_accumulate_grad_hook(_into(master))
                       for compute, master in zip(self._computes, self._masters) if compute.requires_grad]

    def keep_gradients_in_copy(self) -> None:
        """Leave each gradient where autograd put it, on the compute copy, for an optimizer that reads it
        there: with one micro-batch a step, the fp32 gradient would be that one cast (bf16 -> fp32 is exact)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def copies(self) -> dict[nn.Parameter, nn.Parameter]:
        """Each master parameter's compute copy (after `track_gradients`)."""
        return dict(zip(self._masters, self._computes))

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the master weights into the compute copy (after an optimizer step or a load)."""
        if self._computes:
            torch._foreach_copy_(self._computes, self._masters)


def _into(master: nn.Parameter):
    def accumulate(compute: nn.Parameter) -> None:
        with torch.no_grad():
            if master.grad is None:
                master.grad = compute.grad.to(master.dtype)
            else:
                master.grad.add_(compute.grad)
        compute.grad = None

    return accumulate
