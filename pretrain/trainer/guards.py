"""Guards against non-finite numbers: steps skipped for a non-finite loss or gradient, and weights
checked before they are saved.

A non-finite gradient norm (from a non-finite loss or gradient on any rank, or an fp16 overflow)
skips the update on every rank alike, since the norm is all-reduced. With fused AdamW and no loss
scaling the skip happens on the device (the flag stays there: no host sync) and is counted when the
flag is read, two steps later in training (`settle(keep_newest=1)`); fp16 and the CPU decide on the
host at once.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

from pretrain.trainer.deferred import DeferredValue
from pretrain.trainer.optim import step_unless

log = logging.getLogger("pretrain")


class NonFiniteStepsError(RuntimeError):
    """Too many steps in a row were skipped; the message says what to do."""


class SkippedSteps:
    """Counts skipped updates (`skipped`, `in_a_row`, kept in checkpoints) and stops a run that
    keeps skipping (train.max_bad_steps in a row; fp16 overflows only lower the loss scale)."""

    def __init__(self, max_in_a_row: int, loss_scaled: bool) -> None:
        self.max_in_a_row = max_in_a_row
        self.loss_scaled = loss_scaled
        self.skipped = 0
        self.in_a_row = 0
        self._unsettled: list[tuple[int, DeferredValue]] = []  # flags still on the device

    def step(self, optimizer: torch.optim.Optimizer, norm: torch.Tensor, step: int, on_device: bool) -> bool | None:
        """The optimizer step unless `norm` is non-finite. Returns whether it stepped, or None when
        that is decided on the device (and counted at `settle`)."""
        if on_device:
            finite = torch.isfinite(norm)
            flag = DeferredValue(finite)  # taken before the update is queued: reading it never waits for the update
            step_unless(optimizer, found_inf=(~finite).float())
            self._unsettled.append((step, flag))
            return None
        finite = math.isfinite(float(norm))
        if finite:
            optimizer.step()
        self.count(step, finite)
        return finite

    def settle(self, keep_newest: int = 0) -> None:
        """Count the updates whose flags were left on the device, all but the `keep_newest` latest.

        The training loop keeps its previous step's flag at the start of a step: reading it would wait for
        that step's backward to end, and the host, held there, would queue the next step's first kernels only
        once the device had run dry (about 1.7 ms idle a step on an H100, `profile-1b-mb8-99742f3`). A flag
        two steps old has long been computed."""
        cut = max(len(self._unsettled) - keep_newest, 0)
        unsettled, self._unsettled = self._unsettled[:cut], self._unsettled[cut:]
        for step, finite in unsettled:
            self.count(step, bool(finite.get().item()))

    def count(self, step: int, finite: bool) -> None:
        if finite:
            self.in_a_row = 0
            return
        self.skipped += 1
        self.in_a_row += 1
        what = "gradient overflow (fp16), loss scale lowered" if self.loss_scaled else "non-finite loss or gradient"
        log.warning("step %d skipped: %s (%d in a row, %d in all)", step, what, self.in_a_row, self.skipped)
        if self.in_a_row >= self.max_in_a_row and not self.loss_scaled:
            raise NonFiniteStepsError(
                f"{self.in_a_row} steps in a row had a non-finite loss or gradient "
                f"(train.max_bad_steps={self.max_in_a_row}); training stopped at step {step}. "
                "Lower optim.lr, raise optim.warmup_steps or check the data; the last checkpoint is intact.")


def params_finite(model: torch.nn.Module, device: torch.device) -> bool:
    """True when every parameter shard on every rank is finite."""
    bad = torch.zeros((), device=device)
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        bad += (~torch.isfinite(local)).sum()
    dist.all_reduce(bad)
    return bad.item() == 0
