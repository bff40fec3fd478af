"""Rotary position embeddings (RoPE), with channels paired as (0, 1), (2, 3), ... as in Llama's reference code
and torchtitan: each pair of a query's or key's head vector is rotated by an angle that grows with the position.

On a GPU one Triton kernel rotates the pairs (pretrain/models/rope_kernel.py), forward and backward (the
backward is the rotation by minus the angle). The same products written as tensor operations and compiled
(`rotate`, what runs elsewhere) become kernels that load each element's pair partner with its own strided
load, which Triton cannot vectorise: on an H100 they moved their bytes at about 1.2 TB/s, 8.7 ms of the 1B
step, where this kernel, which loads whole rows and splits them into pairs in registers, takes 4.7 ms
(bench/NOTES.md, attempt 51). Both compute in float32 and round once to x's dtype.
"""

from __future__ import annotations

import functools

import torch

# Elements a Triton program rotates (4096: 32 head vectors of 128), and its warps. On an H100 (bench/rope.py --sweep)
# 1024-16384 elements and 2-16 warps ran within 10% of each other.
ELEMENTS = 4096
NUM_WARPS = 4


def rope_frequencies(head_dim: int, seq_len: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """Rotations (cos, sin)(t*w_k) for positions t < seq_len, shape [seq_len, head_dim/2, 2].

    Real rather than complex: the kernel reads real pairs, and torch.compile cannot generate code for
    complex tensors (it falls back to eager kernels for them).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    return torch.view_as_real(torch.polar(torch.ones_like(angles), angles))


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of x [batch, seq, heads, head_dim] by freqs [>= seq, head_dim/2, 2] (the
    rotations of x's positions from the first on): the kernel on a GPU, `rotate` elsewhere."""
    freqs = freqs[: x.shape[1]]
    if fused(x):
        return rope_rotation(x, freqs, False)
    return rotate(x, freqs)


def fused(x: torch.Tensor) -> bool:
    """Whether the Triton kernel rotates x: on a GPU."""
    return x.is_cuda


def rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """The complex product (a + ib)(cos + i sin), written out in real arithmetic; freqs [seq, head_dim/2, 2]."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    rotation = freqs.view(1, x.shape[1], 1, -1, 2)
    cos, sin = rotation[..., 0], rotation[..., 1]
    rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


@torch.library.custom_op("pretrain::rope_rotation", mutates_args=())
def rope_rotation(x: torch.Tensor, freqs: torch.Tensor, inverse: bool) -> torch.Tensor:
    """x [batch, seq, heads, head_dim] rotated by freqs [seq, head_dim/2, 2], or by minus those
    angles with `inverse`, into a new contiguous tensor of x's dtype. An operator of its own, so that
    torch.compile keeps the kernel in the blocks' graphs (fullgraph) and autograd knows its backward."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if freqs.stride(-1) != 1 or freqs.stride(-2) != 2:
        freqs = freqs.contiguous()
    batch, seq, heads, head_dim = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = batch * seq * heads
    if rows == 0:
        return out
    padded = 1 << (head_dim - 1).bit_length()
    per_program = max(1, ELEMENTS // padded)
    _kernel()[(-(-rows // per_program),)](
        x, freqs, out, rows, seq, heads, x.stride(0), x.stride(1), x.stride(2), freqs.stride(0),
        HEAD_DIM=head_dim, PADDED_DIM=padded, INVERSE=inverse, ROWS=per_program, num_warps=NUM_WARPS)
    return out


@rope_rotation.register_fake
def _rope_rotation_shape(x: torch.Tensor, freqs: torch.Tensor, inverse: bool) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _save_rotation(ctx, inputs: tuple, output: torch.Tensor) -> None:
    _, freqs, inverse = inputs
    ctx.save_for_backward(freqs)
    ctx.inverse = inverse


def _rotation_backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
    """A rotation's transpose is the rotation by minus its angle."""
    (freqs,) = ctx.saved_tensors
    return rope_rotation(grad, freqs, not ctx.inverse), None, None


rope_rotation.register_autograd(_rotation_backward, setup_context=_save_rotation)


@functools.cache
def _kernel():
    """The Triton kernel, imported at first use: importing Triton is not free, and CPUs need none."""
    from pretrain.models.rope_kernel import rotate_pairs

    return rotate_pairs
