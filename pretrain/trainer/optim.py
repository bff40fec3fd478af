"""AdamW and its learning-rate schedule: linear warmup, then cosine decay to min_lr_ratio * lr."""

from __future__ import annotations

import math

import torch
from torch import nn

from pretrain.config import OptimConfig, uses_fused_adamw


def lr_factor(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Multiplier of cfg.lr at `step` (0-based count of optimizer steps taken)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    decay_steps = max(total_steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / decay_steps, 1.0)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW; norms and biases (1-D parameters) get no weight decay."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    fused = uses_fused_adamw(cfg, device.type == "cuda")
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        fused=fused,
        foreach=None if fused else True,
    )


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
