"""Precision: which dtype the model computes in, and fp16's dynamic loss scaling.

Master weights, optimizer state and gradient reductions are fp32 in every mode; only the
compute dtype changes (FSDP2's MixedPrecisionPolicy casts parameters at all-gather time; one process
without FSDP2 keeps a copy in the compute dtype, pretrain.parallel.master_weights).
"""

from __future__ import annotations

import torch

from pretrain.config import PrecisionConfig, resolved_precision

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def resolve(name: str, device: torch.device) -> str:
    """`auto` becomes bf16 on a GPU that supports it and fp32 elsewhere (config.resolved_precision)."""
    cuda = device.type == "cuda"
    return resolved_precision(name, cuda, cuda and torch.cuda.is_bf16_supported())


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    return DTYPES[resolve(name, device)]


def allow_tf32() -> None:
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


class LossScaler:
    """Dynamic loss scaling for fp16.

    The loss is multiplied by `scale` before backward; `unscale_` divides the gradients back.
    The caller decides from the (globally all-reduced) gradient norm whether the step is finite,
    so every rank agrees without an extra collective: with sharded gradients no single rank can
    tell alone. An overflow halves the scale and the step is skipped; `growth_interval`
    finite steps in a row double it.
    """

    def __init__(self, cfg: PrecisionConfig, enabled: bool) -> None:
        self.enabled = enabled
        self.scale = cfg.init_scale if enabled else 1.0
        self.growth_interval = cfg.growth_interval
        self.good_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    def unscale_(self, grads: list[torch.Tensor]) -> None:
        if not self.enabled:
            return
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)

    def update(self, finite: bool) -> None:
        if not self.enabled:
            return
        if not finite:
            self.scale = max(self.scale / 2.0, 1.0)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= 2.0
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
