"""Rotary position embeddings (pretrain/models/rope.py): the Triton kernel rotates each pair of channels as
`rotate`, the tensor operations that run without it, does, forward and backward.

The kernel runs under Triton's interpreter on the CPU (TRITON_INTERPRET=1, read when Triton is imported: so in
a process of its own), compiled on a GPU. Head dimensions include one that is not a power of two (96: the kernel
pads its rows), inputs strided as the model's are (a view of a projection's output; attention's gradient, which
comes transposed) and rotations that start past position 0 (generation with a cache).
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from pretrain.models import rope
from pretrain.models.rope import rope_frequencies, rope_rotation, rotate

from . import triton_checks
from .triton_checks import DEVICES

pytest.importorskip("triton", reason="the rotation's kernel is Triton's")

run_check = partial(triton_checks.run_check, __name__, timeout=600)


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to rounding: both compute in float32 (fused multiply-adds may differ) and round once to the
    dtype; a wrong pairing or sign is of the order of the values themselves."""
    assert got.dtype == want.dtype and got.shape == want.shape
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[want.dtype]
    error = (got.float() - want.float()).abs().max()
    assert error <= tolerance * want.float().abs().max(), (error, want.float().abs().max())


def projection(device: torch.device, dtype: torch.dtype, batch: int, seq: int, heads: int, head_dim: int):
    """q as the model makes it: a [batch, seq, heads, head_dim] view of a linear layer's output, leaf of a graph."""
    torch.manual_seed(0)
    flat = torch.randn(batch, seq, heads * head_dim, device=device).mul(3).to(dtype).requires_grad_()
    return flat, flat.view(batch, seq, heads, head_dim)


def check_kernel_rotates_as_the_tensor_operations(device: torch.device, dtype_name: str, head_dim: int,
                                                  start: int) -> None:
    dtype = getattr(torch, dtype_name)
    batch, seq, heads = 2, 11, 3
    table = rope_frequencies(head_dim, start + seq + 5, 10_000.0, device)
    freqs = table[start:start + seq]
    flat, x = projection(device, dtype, batch, seq, heads, head_dim)
    # The upstream gradient as attention's backward hands it: [batch, heads, seq, head_dim] transposed back.
    grad = torch.randn(batch, heads, seq, head_dim, device=device).to(dtype).transpose(1, 2)
    want = rotate(x, freqs)
    (want_grad,) = torch.autograd.grad(want, flat, grad)
    got = rope_rotation(x, freqs, False)
    assert got.is_contiguous()
    close(got, want)
    (got_grad,) = torch.autograd.grad(got, flat, grad)
    close(got_grad, want_grad)
    # Rotating back undoes the rotation.
    close(rope_rotation(got.detach(), freqs, True), x.detach())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype_name,head_dim,start", [
    ("float32", 128, 0),
    ("float32", 96, 0),     # not a power of two: padded rows
    ("float32", 64, 7),     # rotations from position 7 on, as with a cache
    ("bfloat16", 128, 0),
])
def test_kernel_rotates_as_the_tensor_operations_forward_and_backward(device, dtype_name, head_dim, start):
    run_check("check_kernel_rotates_as_the_tensor_operations", device, dtype_name, head_dim, start)


def check_compiled_blocks_keep_the_kernel(device: torch.device, checkpointing: str) -> None:
    """The model's blocks compile as one graph (fullgraph=True): the kernel's operator must trace (its fake
    version gives the output's shape), and a compiled model computes what the tensor operations do, also with
    the blocks checkpointed (selective: the policy recomputes the rotation in backward). On the CPU `fused` is
    told to pick the kernel, which then runs under the interpreter."""
    from pretrain.config import ModelConfig
    from pretrain.models.llama import Transformer
    from pretrain.parallel.parallelize import apply_activation_checkpointing

    torch.library.opcheck(rope_rotation, (torch.randn(2, 5, 2, 8, device=device),
                                          rope_frequencies(8, 5, 10_000.0, device), False))
    cfg = ModelConfig(name="tiny", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=97,
                      max_seq_len=32)
    torch.manual_seed(0)
    model = Transformer(cfg).to(device)
    model.init_weights()
    tokens = torch.randint(0, cfg.vocab_size, (2, 17), device=device)
    rope.fused = lambda x: False
    want = model(tokens[:, :-1], targets=tokens[:, 1:])
    want_grads = torch.autograd.grad(want, list(model.parameters()))
    rope.fused = lambda x: True
    apply_activation_checkpointing(model, checkpointing)
    for block in model.layers:
        block.compile(fullgraph=True)
    got = model(tokens[:, :-1], targets=tokens[:, 1:])
    got_grads = torch.autograd.grad(got, list(model.parameters()))
    assert torch.allclose(got, want, rtol=1e-5), (got, want)
    for (name, _), g, w in zip(model.named_parameters(), got_grads, want_grads):
        assert torch.allclose(g, w, rtol=1e-4, atol=1e-6), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("checkpointing", ["none", "selective", "full"])
def test_compiled_blocks_keep_the_kernel_in_their_graph(device, checkpointing):
    run_check("check_compiled_blocks_keep_the_kernel", device, checkpointing)


def test_rotation_keeps_each_pairs_length_and_turns_it_by_its_angle():
    """What RoPE is, checked on `rotate` itself: pair k of position t turns by t * theta^(-2k/d)."""
    head_dim, seq = 8, 6
    freqs = rope_frequencies(head_dim, seq, 10_000.0)
    x = torch.randn(1, seq, 1, head_dim, dtype=torch.float64)
    out = rotate(x, freqs).double()
    pairs_in, pairs_out = (torch.view_as_complex(t.reshape(seq, head_dim // 2, 2).contiguous()) for t in (x, out))
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), 10_000.0 ** (-torch.arange(0, head_dim, 2) / head_dim))
    assert torch.allclose(pairs_out, pairs_in * torch.polar(torch.ones_like(angles), angles), atol=1e-6)
