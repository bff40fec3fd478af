"""The training loss as the loop calls it: eager, or compiled when the blocks are.

With a 128k vocabulary the logits are the largest activation of the model (4096 tokens x
128256 x 2 bytes = 1 GiB per sequence in bf16). Eager cross-entropy upcasts them to fp32 and
runs log-softmax and its backward as separate kernels, each a full pass over an fp32 copy;
compiled, the upcast, log-sum-exp and gradient fuse into a few passes over the bf16 logits and
no fp32 copy is kept for backward. The result is the same function (fp32 arithmetic inside).
"""

from __future__ import annotations

from typing import Callable

import torch

from pretrain.models.llama import cross_entropy

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def build_loss(compile: bool) -> LossFn:
    """cross_entropy(logits, targets), compiled on request (fsdp.compile)."""
    return torch.compile(cross_entropy) if compile else cross_entropy
