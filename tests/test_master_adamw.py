"""MasterAdamW (pretrain/parallel/master_adamw.py): torch's AdamW, the clip and the compute copy's refresh in one pass.

Its Triton kernel runs under Triton's interpreter on the CPU (TRITON_INTERPRET=1, which Triton reads when it
is imported: so in a process of its own), compiled on a GPU; either way against torch's own AdamW over the same
steps: clipped ones, a skipped one, weight decay on one group and none on the other. Reading bf16 gradients
from the compute copy (one micro-batch a step) gives what reading their fp32 casts from the masters gives.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch import nn

from pretrain.config import OptimConfig
from pretrain.parallel.master_adamw import MasterAdamW
from pretrain.parallel.master_weights import MasterWeights
from pretrain.trainer.optim import build_optimizer, clip_gradients, gradients, refreshes_copy, step_unless

from . import triton_checks
from .triton_checks import DEVICES

pytest.importorskip("triton", reason="MasterAdamW's kernel is Triton's")

LR, BETAS, EPS = 1e-2, (0.9, 0.95), 1e-8
run_check = partial(triton_checks.run_check, __name__)


def masters_and_copies(device: torch.device) -> tuple[list[nn.Parameter], dict[nn.Parameter, nn.Parameter]]:
    """fp32 master parameters (two matrices, one vector; sizes not multiples of the kernel's block) and bf16 copies."""
    torch.manual_seed(0)
    masters = [nn.Parameter(torch.randn(shape, device=device)) for shape in ((37, 61), (1500,), (3, 700))]
    return masters, {m: nn.Parameter(m.detach().to(torch.bfloat16)) for m in masters}


def assert_rounded(copy: torch.Tensor, master: torch.Tensor) -> None:
    """`copy` is `master` rounded to bf16 to nearest, as torch rounds it, on a GPU; Triton's interpreter
    truncates instead (its fp32 -> bf16 conversion ignores the rounding mode), so there within one bf16 step."""
    if copy.device.type == "cuda":
        assert torch.equal(copy, master.to(torch.bfloat16))
    else:
        torch.testing.assert_close(copy.float(), master, rtol=2**-7, atol=0)


def groups(params: list[nn.Parameter]) -> list[dict]:
    return [{"params": [params[0], params[2]], "weight_decay": 0.1}, {"params": [params[1]], "weight_decay": 0.0}]


@pytest.mark.parametrize("device", DEVICES)
def test_steps_match_torch_adamw_and_the_copy_is_the_rounded_master(device):
    run_check("check_steps_match_torch_adamw", device)


def check_steps_match_torch_adamw(device: torch.device) -> None:
    ours, copies = masters_and_copies(device)
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    mine = MasterAdamW(groups(ours), copies, lr=LR, betas=BETAS, eps=EPS)
    reference = torch.optim.AdamW(groups(theirs), lr=LR, betas=BETAS, eps=EPS, foreach=False)
    plan = [(None, 0.0), (0.25, 0.0), (None, 1.0), (0.5, 0.0), (None, 0.0)]  # (clip coefficient, found_inf)
    for step, (clip, found_inf) in enumerate(plan):
        torch.manual_seed(100 + step)
        for a, b in zip(ours, theirs):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        if clip is not None:
            mine.clip_coef = torch.tensor(clip, device=device)
            torch._foreach_mul_([p.grad for p in theirs], clip)
        step_unless(mine, torch.tensor(found_inf, device=device))
        if not found_inf:
            reference.step()
    for a, b in zip(ours, theirs):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(mine.state[a][key], reference.state[b][key], rtol=2e-6, atol=1e-6)
        assert mine.state[a]["step"].item() == reference.state[b]["step"].item() == 4  # the skipped step not counted
        assert mine.state[a]["step"].dtype == torch.float32 and mine.state[a]["step"].device.type == device.type
        torch.testing.assert_close(a.detach(), b.detach(), rtol=2e-6, atol=1e-6)
        assert_rounded(copies[a].detach(), a.detach())
    assert mine.clip_coef is None  # a coefficient applies to one step


@pytest.mark.parametrize("device", DEVICES)
def test_a_skipped_step_writes_nothing(device):
    run_check("check_a_skipped_step_writes_nothing", device)


def check_a_skipped_step_writes_nothing(device: torch.device) -> None:
    masters, copies = masters_and_copies(device)
    optimizer = MasterAdamW(groups(masters), copies, lr=LR, betas=BETAS, eps=EPS)
    for p in masters:
        p.grad = torch.randn_like(p)
    step_unless(optimizer, torch.tensor(0.0, device=device))
    before = [t.clone() for p in masters for t in (p.detach(), copies[p].detach(), *optimizer.state[p].values())]
    for p in masters:
        p.grad = torch.full_like(p, float("nan"))
    step_unless(optimizer, torch.tensor(1.0, device=device))
    after = [t for p in masters for t in (p.detach(), copies[p].detach(), *optimizer.state[p].values())]
    assert all(torch.equal(x, y) for x, y in zip(before, after))


def test_clip_gradients_gives_clip_grad_norms_norm_and_update():
    """The coefficient handed to the step is the one clip_grad_norm_ multiplies the gradients by."""
    run_check("check_clip_gradients", "cpu")


def check_clip_gradients(device: torch.device) -> None:
    ours, copies = masters_and_copies(device)
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    for a, b in zip(ours, theirs):
        a.grad = torch.randn_like(a) * 3
        b.grad = a.grad.clone()
    mine = MasterAdamW(groups(ours), copies, lr=LR, betas=BETAS, eps=EPS)
    reference = torch.optim.AdamW(groups(theirs), lr=LR, betas=BETAS, eps=EPS, foreach=False)
    norm = clip_gradients(mine, ours, max_norm=1.0)
    expected = clip_gradients(reference, theirs, max_norm=1.0)
    assert torch.equal(norm, expected) and expected > 1
    assert all(torch.equal(a.grad * mine.clip_coef, b.grad) for a, b in zip(ours, theirs))  # scaled in the step only
    mine.step()
    reference.step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(mine.state[a]["exp_avg"], reference.state[b]["exp_avg"], rtol=2e-6, atol=1e-6)


def test_its_state_dict_is_adamws():
    """Checkpoints do not depend on which of the two optimizers wrote them."""
    run_check("check_state_dict", "cpu")


def check_state_dict(device: torch.device) -> None:
    masters, copies = masters_and_copies(device)
    mine = MasterAdamW(groups(masters), copies, lr=LR, betas=BETAS, eps=EPS)
    for p in masters:
        p.grad = torch.randn_like(p)
    mine.step()
    others = [nn.Parameter(p.detach().clone()) for p in masters]
    reference = torch.optim.AdamW(groups(others), lr=LR, betas=BETAS, eps=EPS, fused=True)
    for p in others:
        p.grad = torch.randn_like(p)
    reference.step()
    saved, expected = mine.state_dict(), reference.state_dict()
    assert saved["param_groups"] == expected["param_groups"]
    for index, state in saved["state"].items():
        assert {k: (v.dtype, v.shape) for k, v in state.items()} == {
            k: (v.dtype, v.shape) for k, v in expected["state"][index].items()}
    reference.load_state_dict(saved)
    mine.load_state_dict(expected)


def test_one_process_with_master_weights_on_a_gpu_gets_master_adamw():
    """The choice only (the parameters stay on the CPU: nothing runs)."""
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    master = MasterWeights(model, torch.bfloat16)
    master.track_gradients()
    cuda = torch.device("cuda")
    assert refreshes_copy(build_optimizer(model, OptimConfig(), cuda, master, micro_batches=2))
    assert not refreshes_copy(build_optimizer(model, OptimConfig(fused=False), cuda, master))
    assert not refreshes_copy(build_optimizer(model, OptimConfig(), torch.device("cpu"), master))
    assert not refreshes_copy(build_optimizer(model, OptimConfig(), cuda))


@pytest.mark.parametrize("dtype, micro_batches, in_copy", [
    (torch.bfloat16, 1, True), (torch.bfloat16, 2, False), (torch.float16, 1, False)])
def test_gradients_stay_in_a_bf16_copy_with_one_micro_batch(dtype, micro_batches, in_copy):
    """Where MasterAdamW reads the copy's gradients, backward leaves them there and makes no fp32 ones; with
    several micro-batches they accumulate in fp32, and fp16's stay in fp32 for the loss scale to be divided out."""
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    master = MasterWeights(model, dtype)
    master.track_gradients()
    optimizer = build_optimizer(model, OptimConfig(), torch.device("cuda"), master, micro_batches=micro_batches)
    assert optimizer.gradients_in_copy == in_copy
    master.compute(torch.ones(2, 8, dtype=dtype)).sum().backward()
    params = list(model.parameters())
    assert all((p.grad is None) == in_copy and (master.copies()[p].grad is None) != in_copy for p in params)
    assert [g.dtype for g in gradients(optimizer, params)] == [dtype if in_copy else torch.float32] * len(params)
    optimizer.zero_grad()
    assert gradients(optimizer, params) == []


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_gradients_read_from_the_copy_update_as_their_fp32_casts_do(device):
    run_check("check_gradients_in_copy", device)


def check_gradients_in_copy(device: torch.device) -> None:
    """The same steps, clipped by clip_gradients, once reading bf16 gradients from the copies and once their
    fp32 casts from the masters: the same norms, moments, weights and copies."""
    from_copy, copies = masters_and_copies(device)
    from_master = [nn.Parameter(p.detach().clone()) for p in from_copy]
    other_copies = {m: nn.Parameter(copies[c].detach().clone()) for m, c in zip(from_master, from_copy)}
    reading_copy = MasterAdamW(groups(from_copy), copies, lr=LR, betas=BETAS, eps=EPS, gradients_in_copy=True)
    reading_master = MasterAdamW(groups(from_master), other_copies, lr=LR, betas=BETAS, eps=EPS)
    for step in range(3):
        torch.manual_seed(200 + step)
        for a, b in zip(from_copy, from_master):
            copies[a].grad = (torch.randn_like(a) * 2).to(torch.bfloat16)
            b.grad = copies[a].grad.float()
        norms = [clip_gradients(opt, params, max_norm=1.0)
                 for opt, params in ((reading_copy, from_copy), (reading_master, from_master))]
        torch.testing.assert_close(norms[0], norms[1], rtol=1e-6, atol=0)
        assert norms[0].dtype == torch.float32 and norms[0] > 1
        reading_copy.step()
        reading_master.step()
        reading_copy.zero_grad()
        reading_master.zero_grad()
        assert all(copies[a].grad is None for a in from_copy)
    for a, b in zip(from_copy, from_master):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(reading_copy.state[a][key], reading_master.state[b][key], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)
        assert_rounded(copies[a].detach(), a.detach())


@pytest.mark.parametrize("in_copy", [True, False])
@pytest.mark.parametrize("device", DEVICES)
def test_a_new_optimizer_loads_the_moments_and_step_counts_a_checkpoint_holds(device, in_copy):
    """A resumed job loads a checkpoint into an optimizer that has not stepped. torch's get_state_dict makes
    such an optimizer's state with a step on zero gradients that it puts on the masters; MasterAdamW reading
    the copy's gradients took none, made no state, and the load read the weights alone: every resume of a
    one-GPU bf16 run with one micro-batch a step started its moments from zero (found 2026-12-06)."""
    run_check(f"check_resume_{'in_copy' if in_copy else 'from_masters'}", device)


def check_resume_in_copy(device: torch.device) -> None:
    check_resume(device, in_copy=True)


def check_resume_from_masters(device: torch.device) -> None:
    check_resume(device, in_copy=False)


def check_resume(device: torch.device, in_copy: bool) -> None:
    import tempfile
    from pathlib import Path

    from pretrain.config import ModelConfig
    from pretrain.trainer.checkpoint import Checkpointer
    from tests import helpers

    def built(seed: int) -> tuple[nn.Module, MasterWeights, MasterAdamW]:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)).to(device)
        master = MasterWeights(model, torch.bfloat16)
        master.track_gradients()
        if in_copy:
            master.keep_gradients_in_copy()
        return model, master, MasterAdamW(groups_of(model), master.copies(), lr=LR, betas=BETAS, eps=EPS,
                                          gradients_in_copy=in_copy)

    def groups_of(model: nn.Module) -> list[dict]:
        params = list(model.parameters())
        return [{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0}]

    model, master, optimizer = built(0)
    for _ in range(2):
        master.compute(torch.randn(4, 8, dtype=torch.bfloat16, device=device)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    with helpers.one_process_group(), tempfile.TemporaryDirectory() as folder:
        path = Checkpointer(Path(folder), keep=1).save(2, model, optimizer, {"step": 2}, ModelConfig(), "hash")
        resumed, _, fresh = built(1)
        Checkpointer(Path(folder), keep=1).load(path, resumed, fresh)
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
        assert fresh.state[q].keys() == optimizer.state[p].keys() == {"step", "exp_avg", "exp_avg_sq"}
        for key, value in optimizer.state[p].items():
            assert torch.equal(fresh.state[q][key], value), key
        assert fresh.state[q]["step"].item() == 2
