"""Stopping cleanly on a signal: the handler only sets a flag; ranks agree at a step boundary.

Slurm sends the signal given by `--signal` before the time limit, and SIGTERM on preemption
or `scancel`. Work inside a signal handler is unsafe (it may interrupt a collective), so the
handler records the request and the training loop asks every rank, with one small all-reduce
after each step, whether any of them was asked to stop. All ranks then save and exit together.
On CUDA the answer comes one step late: each step's all-reduce is read at the next step,
so the host never waits for the GPU to drain (see pretrain.deferred).
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

from pretrain.deferred import DeferredValue
from pretrain.distributed import all_agree

SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class StopRequest:
    def __init__(self) -> None:
        self.requested = False
        self.reason = ""
        self._pending: DeferredValue | None = None

    def install(self) -> None:
        for sig in SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame) -> None:
        self.requested = True
        self.reason = signal.Signals(signum).name

    def agreed(self, device: torch.device) -> bool:
        """Whether any rank was asked to stop; every rank gets the same answer at the same step."""
        stop = self._agreed_late(device) if device.type == "cuda" else all_agree(self.requested, device)
        if stop and not self.reason:
            self.reason = "a signal on another rank"
        return stop

    def _agreed_late(self, device: torch.device) -> bool:
        """The answer of the previous call's all-reduce; this call's is read by the next one."""
        flag = torch.full((1,), float(self.requested), device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        previous, self._pending = self._pending, DeferredValue(flag)
        return previous is not None and bool(previous.get().item() > 0)
