"""Skipped steps: flags decided on the device and read later, so that the host never drains the device's queue.

The CPU cases use fused AdamW on the CPU, which skips on a found-inf flag as it does on a GPU; the GPU case
checks that the flag is readable while the update it decides is still queued.
"""

import time

import pytest
import torch

from pretrain.trainer.guards import NonFiniteStepsError, SkippedSteps
from pretrain.trainer.optim import skips_on_device


def _param_and_optimizer(device: str = "cpu", optimizer_class: type[torch.optim.AdamW] = torch.optim.AdamW,
                         ) -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
    param = torch.nn.Parameter(torch.ones(8, device=device))
    param.grad = torch.full((8,), 0.5, device=device)
    return param, optimizer_class([param], lr=0.1, fused=True)


def test_the_newest_flag_stays_on_the_device_until_asked_for():
    param, optimizer = _param_and_optimizer()
    assert skips_on_device(optimizer)
    skips = SkippedSteps(max_in_a_row=5, loss_scaled=False)
    before = param.detach().clone()
    assert skips.step(optimizer, torch.tensor(float("nan")), step=1, on_device=True) is None
    assert torch.equal(param.detach(), before)  # the update was skipped on the device
    skips.settle(keep_newest=1)
    assert skips.skipped == 0  # step 1's flag is the newest: not read yet
    skips.step(optimizer, torch.tensor(float("inf")), step=2, on_device=True)
    skips.settle(keep_newest=1)
    assert (skips.skipped, skips.in_a_row) == (1, 1)  # step 1 counted, step 2 still pending
    skips.step(optimizer, torch.tensor(2.0), step=3, on_device=True)
    assert not torch.equal(param.detach(), before)
    skips.settle()
    assert (skips.skipped, skips.in_a_row) == (2, 0)


def test_too_many_skipped_steps_stop_the_run_once_their_flags_are_read():
    _, optimizer = _param_and_optimizer()
    skips = SkippedSteps(max_in_a_row=2, loss_scaled=False)
    for step in (1, 2):
        skips.settle(keep_newest=1)
        skips.step(optimizer, torch.tensor(float("nan")), step=step, on_device=True)
    with pytest.raises(NonFiniteStepsError, match="2 steps in a row .* stopped at step 2"):
        skips.settle(keep_newest=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the order of the device's queue")
def test_the_flag_is_readable_before_the_update_it_decides_has_run():
    """The update is made to wait behind a long device sleep; the flag, taken before the update was queued,
    is readable while the sleep still runs (before: it was taken after the update and waited for it all).

    A first step without the sleep launches every kernel the step uses and makes AdamW's state. CUDA loads
    a kernel lazily at its first launch, and its documentation warns that the load may synchronize the
    context: a first fused AdamW launch behind the sleep can then wait the sleep out whatever the flag's
    order. The test's first run on an H100 (torch 2.11, 2026-12-06), without this warm-up, found the stream
    idle as soon as the step had returned; `waited` now counts the step itself too."""

    class SlowAdamW(torch.optim.AdamW):
        sleep = False

        def step(self, closure=None):
            if self.sleep:
                torch.cuda._sleep(4_000_000_000)  # about 2 s of device time before the update
            return super().step(closure)

    _, optimizer = _param_and_optimizer("cuda", SlowAdamW)
    skips = SkippedSteps(max_in_a_row=5, loss_scaled=False)
    skips.step(optimizer, torch.tensor(1.0, device="cuda").sqrt(), step=1, on_device=True)
    skips.settle()
    torch.cuda.synchronize()
    optimizer.sleep = True
    started = time.monotonic()
    skips.step(optimizer, torch.tensor(1.0, device="cuda").sqrt(), step=2, on_device=True)
    skips.settle()
    waited = time.monotonic() - started
    assert skips.skipped == 0
    assert not torch.cuda.current_stream().query(), f"the flag was read only after the update ({waited:.1f} s)"
    torch.cuda.synchronize()
