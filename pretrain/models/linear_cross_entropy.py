"""The training loss from the last hidden states: the output layer's product and the mean next-token
cross-entropy, with the gradient of the logits made in the forward pass.

With a 128k vocabulary the logits are the largest activation of the model (1 GiB per sequence of 4096 in
bf16). Apart, the product writes them, the loss reads them for its log-sum-exp and keeps them for backward,
and the loss's backward reads them again to write their gradient into a second buffer of the same size. Here,
on a GPU, one Triton kernel (pretrain/models/cross_entropy_kernel.py) reads each row twice and writes the
gradient over the logits, which nothing else reads: as many passes, in one kernel that runs nearer the card's
bandwidth than the compiled loss's two did, and one logits-sized buffer instead of two (bench/NOTES.md,
attempt 49: 4.9 ms and 8 GiB less a micro-batch of the 1B row). Backward multiplies that gradient with the
weight and the hidden states, as the output layer's backward did, and scales the two products by the loss's
incoming gradient.

The arithmetic is F.cross_entropy's on float32 logits: log-sum-exp and softmax in float32, the gradient
rounded once to the logits' dtype. Elsewhere (a CPU, or fp16 logits: config.FUSED_LOSS_PRECISIONS) the loss
is `cross_entropy` of the logits.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F

from pretrain.config import FUSED_LOSS_PRECISIONS

# Columns a Triton program reads at a time, and its warps: a program a row. On H100s (attempt 49,
# bench/cross_entropy_head.py --sweep, two calls) 16384 columns and 16 warps took 7.9-8.3 ms for the 1B row's
# logits, other blocks of 2048-16384 columns with 4-32 warps 8.3-9.1 ms, and a few programs a multiprocessor
# looping over the rows 8.6-17 ms.
BLOCK = 16384
NUM_WARPS = 16
# Elements a program of the backward's scaling kernel multiplies.
SCALE_BLOCK = 4096
FUSED_DTYPES = tuple({"bf16": torch.bfloat16, "fp32": torch.float32}[name] for name in FUSED_LOSS_PRECISIONS)

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss, computed in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def fused(hidden: torch.Tensor) -> bool:
    """Whether the Triton kernel computes the loss of these hidden states (on a GPU, bf16 or fp32)."""
    return hidden.is_cuda and hidden.dtype in FUSED_DTYPES


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         logits_loss: LossFn = cross_entropy) -> torch.Tensor:
    """cross_entropy(hidden @ weight.T, targets): hidden [..., dim], weight [vocab, dim], targets [...].

    `logits_loss` computes it where the kernel does not (OutputLayer passes its own, which
    pretrain.parallel.parallelize compiles with the blocks)."""
    if not fused(hidden):
        return logits_loss(F.linear(hidden, weight), targets)
    rows, flat_targets = hidden.flatten(0, -2), targets.flatten()
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return LinearCrossEntropy.apply(rows, weight, flat_targets)
    losses, _ = losses_and_gradient(rows @ weight.t(), flat_targets, write_grad=False)
    return losses.mean()


class LinearCrossEntropy(torch.autograd.Function):
    """Forward keeps the logits' gradient (written over them) for backward, not the logits."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        losses, grad_logits = losses_and_gradient(hidden @ weight.t(), targets, write_grad=True)
        ctx.save_for_backward(hidden, weight, grad_logits)
        return losses.mean()

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        hidden, weight, grad_logits = ctx.saved_tensors
        grad_hidden = grad_logits @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grad_logits.t() @ hidden if ctx.needs_input_grad[1] else None
        for grad in (grad_hidden, grad_weight):
            if grad is not None:
                scale_(grad, grad_loss)
        return grad_hidden, grad_weight, None


def scale_(grad: torch.Tensor, scale: torch.Tensor) -> None:
    """grad (contiguous) *= scale, a float32 scalar on its device, without reading it on the host.

    torch's `mul_` (and `_foreach_mul_`, which falls back to it) runs a bf16 tensor times a float32 scalar
    tensor in its unvectorised kernel for mixed dtypes, the scalar rounded to bf16 first: 1.5 ms a step of
    the 1B row on an H100 for these two products (bench/NOTES.md, attempt 52). This kernel reads and
    writes each element once, with the scale in float32."""
    n = grad.numel()
    _kernels().scale_by[(-(-n // SCALE_BLOCK),)](grad, scale.float(), n, BLOCK=SCALE_BLOCK, num_warps=4)


def losses_and_gradient(logits: torch.Tensor, targets: torch.Tensor,
                        write_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's loss (float32), and `logits` itself, overwritten with the mean loss's gradient when
    `write_grad`. `logits` is [rows, vocab] with unit column stride; `targets` [rows]."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1 or targets.shape != (rows,):
        raise ValueError(f"logits {tuple(logits.shape)} (strides {logits.stride()}) and targets "
                         f"{tuple(targets.shape)}: expected [rows, vocab] with contiguous rows and [rows]")
    losses = torch.empty(rows, device=logits.device, dtype=torch.float32)
    _kernels().cross_entropy_rows[(rows,)](logits, targets, losses, logits.stride(0), 1.0 / rows,
                                           N_COLS=vocab, WRITE_GRAD=write_grad, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return losses, logits


@functools.cache
def _kernels():
    """The module of the Triton kernels, imported at first use: importing Triton is not free, and CPUs need none."""
    from pretrain.models import cross_entropy_kernel

    return cross_entropy_kernel
