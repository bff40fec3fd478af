"""AdamW over fp32 master weights that also clips the gradients and refreshes their compute copy, in one pass.

One process without FSDP2 (pretrain.parallel.master_weights) ends each step with three passes over its fp32
master weights: clipping multiplies every gradient (a read and a write), torch's fused AdamW reads weight,
gradient and both moments and writes weight and moments, and the refresh reads the weights once more to
write their bf16 copy: 42 bytes a parameter, 64 GB a step for the 1B shape. Here one Triton kernel per
parameter reads gradient, weight and moments once, scales the gradient by the clip coefficient, updates as
torch's fused AdamW does and writes weight, moments and the copy: 30 bytes (bench/NOTES.md, attempt 35).

The state is AdamW's (a float32 step count on the device, exp_avg, exp_avg_sq), so a checkpoint is the same
whichever optimizer wrote it. The update is torch's fused AdamW's, in float32 throughout where torch's kernel
takes some products in float64 and its bias corrections from pow where this one uses exp2: weights agree
with torch's to a few float32 roundings, not bit for bit (tests/test_master_adamw.py).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

# Elements per Triton program, and its warps (bench/optimizer_step.py --sweep measures the choices).
BLOCK = 1024
NUM_WARPS = 4


class MasterAdamW(torch.optim.AdamW):
    """Fused AdamW whose step also writes each updated master weight into its compute copy (`copies`: master
    parameter -> compute parameter, same shape, contiguous).

    Before a step, set `clip_coef` (a device scalar) to have the gradients scaled by it inside the update,
    as torch.nn.utils.clip_grad_norm_ would have scaled them; it applies to that step only. `found_inf`
    skips the step on the device, as for fused AdamW. With `gradients_in_copy`, each parameter's gradient
    is its copy's (any dtype; read as float32), and `zero_grad` clears those."""

    def __init__(self, params: Iterable[Any], copies: Mapping[nn.Parameter, nn.Parameter], lr: float,
                 betas: tuple[float, float], eps: float, gradients_in_copy: bool = False) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, fused=True)
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"]:
                raise ValueError("MasterAdamW supports neither amsgrad nor maximize")
            for p in group["params"]:
                copy = copies.get(p)
                if copy is None or copy.shape != p.shape or not (p.is_contiguous() and copy.is_contiguous()):
                    raise ValueError("MasterAdamW needs, for every master parameter, a compute copy of the same "
                                     "shape, both contiguous")
        self.copies = copies
        self.gradients_in_copy = gradients_in_copy
        self.clip_coef: torch.Tensor | None = None
        # The state exists from the start, not from the first step: a resumed job loads a checkpoint into an
        # optimizer that has not stepped, and torch's get_state_dict makes such an optimizer's state by a step
        # on zero gradients it puts on the masters, which this one ignores when it reads the copies'. Without
        # state the load would read the weights alone and the moments would start again from zero.
        for group in self.param_groups:
            for p in group["params"]:
                self._state_of(p)

    def gradient(self, p: nn.Parameter) -> torch.Tensor | None:
        """The gradient the next step reads for master parameter `p`."""
        return self.copies[p].grad if self.gradients_in_copy else p.grad

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        if self.gradients_in_copy:
            copies = [self.copies[p] for group in self.param_groups for p in group["params"]]
            for copy in copies:
                if set_to_none:
                    copy.grad = None
                elif copy.grad is not None:
                    copy.grad.zero_()

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        if closure is not None:
            raise ValueError("MasterAdamW.step takes no closure")
        clip, self.clip_coef = self.clip_coef, None
        found_inf = getattr(self, "found_inf", None)
        for group in self.param_groups:
            params = [p for p in group["params"] if self.gradient(p) is not None]
            if not params:
                continue
            states = [self._state_of(p) for p in params]
            steps = [state["step"] for state in states]
            torch._foreach_add_(steps, 1)
            device = params[0].device
            # One kernel variant for every call: absent flags are passed as their neutral values.
            clip_t = clip if clip is not None else _constant(1.0, device)
            found_t = found_inf if found_inf is not None else _constant(0.0, device)
            for p, state in zip(params, states):
                update(p, self.gradient(p), state["exp_avg"], state["exp_avg_sq"], state["step"], self.copies[p], group,
                       clip_t, found_t)
            if found_inf is not None:
                torch._foreach_sub_(steps, [found_inf] * len(steps))

    def _state_of(self, p: nn.Parameter) -> dict[str, torch.Tensor]:
        """AdamW's state of `p` (fused: the step count on the device), made when it is first asked for."""
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state


def update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
           step: torch.Tensor, copy: torch.Tensor, group: Mapping[str, Any], clip_coef: torch.Tensor,
           found_inf: torch.Tensor) -> None:
    """One parameter's AdamW update (its step count already advanced), its gradient first scaled by
    `clip_coef`, the result also written into `copy`; all stays as it was where `found_inf` is 1."""
    import triton

    lr, (beta1, beta2), weight_decay, eps = group["lr"], group["betas"], group["weight_decay"], group["eps"]
    if not grad.is_contiguous():  # autograd lays a gradient out as its parameter: only a hand-made one is not
        raise ValueError("MasterAdamW needs contiguous gradients")
    n = param.numel()
    _kernel()[(triton.cdiv(n, BLOCK),)](
        param, grad, exp_avg, exp_avg_sq, copy, step, clip_coef, found_inf, n,
        lr, lr * weight_decay, beta1, 1 - beta1, beta2, 1 - beta2, math.log2(beta1), math.log2(beta2), eps,
        BLOCK=BLOCK, num_warps=NUM_WARPS)


@functools.cache
def _constant(value: float, device: torch.device) -> torch.Tensor:
    return torch.full((), value, dtype=torch.float32, device=device)


@functools.cache
def _kernel():
    """The Triton kernel, imported at first use: importing Triton is not free, and CPUs need none."""
    from pretrain.parallel.master_adamw_kernel import master_adamw

    return master_adamw
