"""AdamW, gradient clipping, and the learning-rate schedule: linear warmup, then cosine decay to
min_lr_ratio * lr."""

from __future__ import annotations

import importlib.util
import math

import torch
from torch import nn

from pretrain.config import OptimConfig, uses_fused_adamw
from pretrain.parallel.master_adamw import MasterAdamW
from pretrain.parallel.master_weights import MasterWeights


def lr_factor(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Multiplier of cfg.lr at `step` (0-based count of optimizer steps taken)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    decay_steps = max(total_steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / decay_steps, 1.0)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device,
                    master: MasterWeights | None = None, micro_batches: int = 1) -> torch.optim.AdamW:
    """AdamW; norms and biases (1-D parameters) get no weight decay. With master weights on a GPU, where
    fused AdamW would run, MasterAdamW, which also refreshes their compute copy (`refreshes_copy`); with one
    micro-batch a step (`micro_batches`: the backward passes each step's gradients sum) and a bf16 copy, it
    reads the copy's gradients as they are (no loss scale to divide out, nothing to accumulate in fp32)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = uses_fused_adamw(cfg, device.type == "cuda")
    if master is not None and fused and device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        in_copy = micro_batches == 1 and master.dtype == torch.bfloat16
        if in_copy:
            master.keep_gradients_in_copy()
        return MasterAdamW(groups, master.copies(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                           gradients_in_copy=in_copy)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused,
                             foreach=None if fused else True)


def refreshes_copy(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's step also writes the master weights' compute copy (no refresh after it)."""
    return isinstance(optimizer, MasterAdamW)


def gradients(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients of `params` that the optimizer's next step reads (MasterAdamW's may be on the compute copy)."""
    found = map(optimizer.gradient, params) if isinstance(optimizer, MasterAdamW) else (p.grad for p in params)
    return [grad for grad in found if grad is not None]


def clip_gradients(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale the gradients to a total norm of at most `max_norm` (as torch.nn.utils.clip_grad_norm_ does);
    returns their norm before, a device tensor. MasterAdamW takes the coefficient into its next step instead
    of a pass over the gradients."""
    if not isinstance(optimizer, MasterAdamW):
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
    # get_total_norm's, summed in float32 also where the gradients are bf16 (it would round each norm to them).
    norms = torch._foreach_norm(gradients(optimizer, params), 2, dtype=torch.float32)
    norm = torch.linalg.vector_norm(torch.stack(norms))
    optimizer.clip_coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    return norm


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `step_unless` can skip this optimizer's update on the device: fused AdamW reads
    a found-inf flag inside its kernel; the foreach and for-loop versions do not."""
    return bool(optimizer.defaults.get("fused"))


def step_unless(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """optimizer.step(), leaving parameters, moments and step counts untouched where found_inf is 1.

    Passed as torch.amp.GradScaler passes it (an attribute the fused step reads), so no host
    sync is needed to decide whether to step.
    """
    optimizer.found_inf = found_inf
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf
