"""The output layer's loss (pretrain/models/linear_cross_entropy.py): its Triton kernel computes what
F.cross_entropy of the logits computes, loss and gradients, without keeping the logits.

The kernel runs under Triton's interpreter on the CPU (TRITON_INTERPRET=1, read when Triton is imported: so in
a process of its own), compiled on a GPU; either way against `cross_entropy` of the logits, the loss the model
computes without the kernel. Vocabularies are chosen around the kernel's block (one partial block, several).
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from pretrain.models import linear_cross_entropy as lce
from pretrain.models.linear_cross_entropy import LinearCrossEntropy, cross_entropy

from . import triton_checks
from .triton_checks import DEVICES

pytest.importorskip("triton", reason="the output layer's kernel is Triton's")

run_check = partial(triton_checks.run_check, __name__)


def inputs(device: torch.device, dtype: torch.dtype, rows: int, dim: int, vocab: int, spread: float = 1.0):
    torch.manual_seed(0)
    hidden = torch.randn(rows, dim, device=device).mul(spread).to(dtype).requires_grad_()
    weight = torch.randn(vocab, dim, device=device).div(dim**0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), device=device)
    return hidden, weight, targets


def reference(hidden, weight, targets, scale: float = 1.0):
    """Loss and gradients through the logits, as the model computes them without the kernel."""
    loss = cross_entropy(F.linear(hidden, weight).unsqueeze(0), targets.unsqueeze(0))
    grad_hidden, grad_weight = torch.autograd.grad(loss * scale, (hidden, weight))
    return loss.detach(), grad_hidden, grad_weight


def check_loss_and_gradients_match_the_logits_path(device: torch.device, dtype_name: str, vocab: int,
                                                   spread: float) -> None:
    dtype = getattr(torch, dtype_name)
    hidden, weight, targets = inputs(device, dtype, rows=24, dim=32, vocab=vocab, spread=spread)
    want_loss, want_hidden, want_weight = reference(hidden, weight, targets, scale=3.0)
    loss = LinearCrossEntropy.apply(hidden, weight, targets)
    grad_hidden, grad_weight = torch.autograd.grad(loss * 3.0, (hidden, weight))
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert torch.allclose(loss, want_loss, rtol=1e-5, atol=1e-5), (loss, want_loss)
    # float32: the same arithmetic in another order (and another exp() on a GPU). bf16: the logits' gradient is
    # rounded once, to nearest on a GPU as torch rounds it, truncated by Triton's interpreter. Either way far
    # below what a wrong term would give: of the order of the largest gradient.
    relative = {"float32": 1e-4, "bfloat16": 2e-2}[dtype_name]
    for got, want in ((grad_hidden, want_hidden), (grad_weight, want_weight)):
        assert got.dtype == want.dtype
        error = (got.float() - want.float()).abs().max()
        assert error <= relative * want.float().abs().max(), (error, want.float().abs().max())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype_name,vocab,spread", [
    ("float32", 1000, 1.0),             # less than one block of the kernel
    ("float32", 2 * lce.BLOCK + 5, 1.0),  # two full blocks and a partial one
    ("float32", 1000, 300.0),           # logits in the hundreds: the running maximum keeps exp() finite
    ("bfloat16", lce.BLOCK + 100, 1.0),
])
def test_kernel_gives_the_loss_and_gradients_of_cross_entropy_on_the_logits(device, dtype_name, vocab, spread):
    run_check("check_loss_and_gradients_match_the_logits_path", device, dtype_name, vocab, spread)


def check_without_gradients_the_loss_alone(device: torch.device) -> None:
    hidden, weight, targets = inputs(device, torch.float32, rows=8, dim=16, vocab=700)
    want = cross_entropy(F.linear(hidden, weight).unsqueeze(0), targets.unsqueeze(0))
    logits = F.linear(hidden, weight).detach()
    before = logits.clone()
    losses, same = lce.losses_and_gradient(logits, targets, write_grad=False)
    assert same is logits and torch.equal(logits, before)  # nothing written
    assert torch.allclose(losses.mean(), want, rtol=1e-5)
    losses, grad = lce.losses_and_gradient(logits, targets, write_grad=True)
    assert torch.allclose(grad, (torch.softmax(before, -1) - F.one_hot(targets, 700)) / 8, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_without_gradients_reads_the_logits_and_writes_only_the_losses(device):
    run_check("check_without_gradients_the_loss_alone", device)


def check_backward_scales_by_the_float32_gradient(device: torch.device, dtype_name: str) -> None:
    """The backward's products are scaled by the loss's incoming gradient as float32: 1/3 (three micro-batches a
    step) is not rounded to the products' dtype first, as torch's mixed-dtype `mul_` did."""
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    grad = torch.randn(3 * lce.SCALE_BLOCK + 7, device=device).to(dtype)  # a partial block at the end
    third = torch.tensor(1 / 3, device=device)
    want = (grad.float() * third).to(dtype)
    lce.scale_(grad, third)
    assert torch.equal(grad, want)


@pytest.mark.parametrize("device", DEVICES)
def test_backward_scales_its_products_by_the_incoming_gradient_in_float32(device):
    # bf16 on the GPU only: Triton's interpreter truncates where the GPU rounds to nearest.
    for dtype_name in ("float32",) + (("bfloat16",) if device == "cuda" else ()):
        run_check("check_backward_scales_by_the_float32_gradient", device, dtype_name)


def test_kernel_refuses_logits_whose_rows_are_not_contiguous():
    logits = torch.zeros(10, 4).t()
    with pytest.raises(ValueError, match="contiguous rows"):
        lce.losses_and_gradient(logits, torch.zeros(4, dtype=torch.long), write_grad=True)



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_reaches_rows_past_two_to_the_31_elements():
    """The 1B row's logits are 4.2e9 elements: offsets past 2^31 must not wrap around."""
    vocab = 128_256
    rows = 2**31 // vocab + 8
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16)
    targets = torch.randint(0, vocab, (rows,), device="cuda")
    tail = slice(rows - 16, rows)
    want = F.cross_entropy(logits[tail].float(), targets[tail], reduction="none")
    want_grad = (torch.softmax(logits[tail].float(), -1) - F.one_hot(targets[tail], vocab)) / rows
    losses, grad = lce.losses_and_gradient(logits, targets, write_grad=True)
    assert torch.allclose(losses[tail], want, rtol=1e-5)
    assert torch.allclose(grad[tail].float(), want_grad, rtol=1e-2, atol=1e-9)


def check_fsdp2_output_layer_runs_the_kernel_between_its_hooks(device: torch.device) -> None:
    """FSDP2 wraps the output layer as a unit of its own (pretrain.parallel.parallelize): given targets, its
    forward hooks gather the weight the kernel's product reads, and its backward reduces the gradient the
    kernel's backward made. Here at one rank (fsdp.wrap_single_rank), the kernel under Triton's interpreter."""
    from pretrain.compose import compose
    from pretrain.models.llama import Transformer
    from pretrain.parallel.parallelize import build_mesh
    from pretrain.trainer.loop import build_model

    from .helpers import MINI_MODEL, one_process_group

    cfg = compose([*MINI_MODEL, "precision=fp32", "fsdp.wrap_single_rank=true", "fsdp.activation_checkpointing=none"])
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    with one_process_group():
        sharded = build_model(cfg, device, build_mesh(cfg.fsdp, device, 1, 1)).model
        plain = Transformer(cfg.model)
        plain.load_state_dict({k: v.full_tensor() for k, v in sharded.state_dict().items()})
        want = plain(tokens[:, :-1], targets=tokens[:, 1:])
        want.backward()
        lce.fused = lambda hidden: True  # this process runs the kernel on the CPU
        got = sharded(tokens[:, :-1], targets=tokens[:, 1:])
        got.backward()
        assert torch.allclose(got, want, rtol=1e-5), (got, want)
        grads = {name: p.grad.full_tensor() for name, p in sharded.named_parameters()}
        for name, p in plain.named_parameters():
            assert torch.allclose(grads[name], p.grad, rtol=1e-4, atol=1e-6), name


def test_fsdp2_output_layer_runs_the_kernel_between_its_hooks():
    run_check("check_fsdp2_output_layer_runs_the_kernel_between_its_hooks", "cpu")
