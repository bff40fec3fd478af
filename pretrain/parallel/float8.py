"""FP8 matmuls for the transformer blocks' linear layers, through torchao's float8 training.

Each converted layer casts its input, weight and output gradient to float8 with dynamic scales
(one per tensor, `tensorwise`, or one per row, `rowwise`: finer scales, closer to bf16, slower)
and multiplies with `torch._scaled_mm`; master weights, optimizer state, checkpoints and every
other operation stay as they are, so a checkpoint moves freely between bf16 and float8 runs.
Not converted: the output layer (its logits feed the loss directly: torchtitan and torchao leave
it in bf16 for accuracy too) and any layer whose sizes are not multiples of 16 (`_scaled_mm`
needs them). The FP8 matrix units exist from compute capability 8.9 (H100, H200, L40S) on; an
A100 has none.

Where FSDP2 shards the model, `all_gather=True` makes torchao wrap each converted weight's shard in a
tensor subclass that FSDP2 all-gathers in FP8 (`precompute_scales` after each optimizer step computes
their scales in one all-reduce); `plain_tensors` unwraps them for checkpoints, which stay plain.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch
from torch import nn

MIN_CAPABILITY = (8, 9)
SKIPPED_LAYERS = ("output",)


class Float8Unavailable(RuntimeError):
    """float8 was asked for where it cannot run; the message says why and what to do."""


def check_available(recipe: str, device: torch.device) -> None:
    """Raise Float8Unavailable, saying what to do, where FP8 matmuls cannot run on this device."""
    if recipe == "none":
        return
    try:
        import torchao.float8  # noqa: F401
    except ImportError as error:
        raise Float8Unavailable(
            f"precision.float8={recipe} needs torchao, which is not importable here ({error}). Install the "
            "version made for your torch (pip install 'pretrain[fp8]'; torch 2.7 pairs with torchao 0.11) "
            "or set precision.float8=none") from error
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < MIN_CAPABILITY:
            raise Float8Unavailable(
                f"precision.float8={recipe} needs FP8 matrix units (compute capability 8.9 or later: H100, H200, "
                f"L40S); {torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}. "
                "Set precision.float8=none (bf16) on this GPU")
    elif not cpu_has_fp8_matmul():
        raise Float8Unavailable(f"precision.float8={recipe}: torch {torch.__version__} has no FP8 matmul on CPUs; "
                                "FP8 is meant for H100-class GPUs. Set precision.float8=none")


def require(recipe: str, device: torch.device, compiled: bool) -> None:
    """Refuse, before any work starts, a run that cannot do FP8 matmuls here; warn of a slow one."""
    check_available(recipe, device)
    if recipe == "none":
        return
    log = logging.getLogger("pretrain")
    if not compiled:
        log.warning("precision.float8 without fsdp.compile: the FP8 casts run as separate kernels and are "
                    "usually slower than bf16; set fsdp.compile=true")
    if device.type == "cpu":
        log.warning(
            "precision.float8=%s on CPUs: FP8 matmuls are emulated there, hundreds of times slower than bf16 "
            "(fit for tests of tiny models only)", recipe)


def cpu_has_fp8_matmul() -> bool:
    """Whether this torch multiplies FP8 on CPUs (2.13 emulates it, 2.7 has none): tried, not guessed by version."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    scale = torch.tensor(1.0)
    try:
        torch._scaled_mm(a, a.t(), scale_a=scale, scale_b=scale, out_dtype=torch.bfloat16)
    except (NotImplementedError, RuntimeError):
        return False
    return True


def eligible(module: nn.Module, fqn: str) -> bool:
    """A linear layer torchao may convert: not the output layer, sizes multiples of 16."""
    if fqn.split(".")[-1] in SKIPPED_LAYERS:
        return False
    return isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert(model: nn.Module, recipe: str, all_gather: bool = False) -> int:
    """Swap the eligible nn.Linear layers for torchao's Float8Linear in place; returns how many.

    `all_gather` (tensorwise only, before FSDP2 wraps the model): their weights become torchao's
    subclass that FSDP2 all-gathers in FP8. Call `require` first: it says why FP8 cannot run here
    where this would fail obscurely.
    """
    if recipe == "none":
        return 0
    from dataclasses import replace

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    if all_gather:
        config = replace(config, enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config, module_filter_fn=eligible)
    return count(model)


def precompute_scales(model: nn.Module) -> None:
    """The FP8 all-gathers' weight scales, for every layer at once: call whenever the weights changed.

    Without it each weight's all-gather first all-reduces its own absolute maximum: one small
    collective per layer and step instead of one in all."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


def plain_tensors(state: dict[str, Any]) -> dict[str, Any]:
    """A model's state dict with the FP8 all-gather weights as the plain tensors they wrap.

    Saved as they are, those weights would pickle torchao's class into the checkpoint, which then
    only a process that imports torchao could read (a bf16 run, an export). The wrapped tensor is
    the weight's storage itself, so a load into the plain view loads the weight.
    """
    fsdp_utils = sys.modules.get("torchao.float8.fsdp_utils")  # never imported: no such weights
    wrapper = getattr(fsdp_utils, "WeightWithDynamicFloat8CastTensor", None)
    if wrapper is None:
        return state
    return {key: _unwrapped(value, wrapper) for key, value in state.items()}


def _unwrapped(value: Any, wrapper: type) -> Any:
    """The DTensor over the plain tensor a weight's FSDP2 shard wraps (only FSDP2's weights are wrapped)."""
    from torch.distributed.tensor import DTensor  # here: the launcher's device probe imports this module

    if isinstance(value, DTensor) and isinstance(value._local_tensor, wrapper):
        return DTensor.from_local(value._local_tensor._tensor, value.device_mesh, value.placements,
                                  run_check=False, shape=value.shape, stride=value.stride())
    return value


def count(model: nn.Module) -> int:
    """Linear layers that multiply in FP8."""
    return sum(1 for module in model.modules() if type(module).__name__ == "Float8Linear")
