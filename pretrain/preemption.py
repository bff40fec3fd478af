"""Stopping cleanly on a signal: the handler only sets a flag; ranks agree at a step boundary.

Slurm sends the signal given by `--signal` before the time limit, and SIGTERM on preemption
or `scancel`. Work inside a signal handler is unsafe (it may interrupt a collective), so the
handler records the request and the training loop asks every rank, with one small all-reduce
after each step, whether any of them was asked to stop. All ranks then save and exit together.
"""

from __future__ import annotations

import signal

import torch

from pretrain.distributed import all_agree

SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class StopRequest:
    def __init__(self) -> None:
        self.requested = False
        self.reason = ""

    def install(self) -> None:
        for sig in SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame) -> None:
        self.requested = True
        self.reason = signal.Signals(signum).name

    def agreed(self, device: torch.device) -> bool:
        stop = all_agree(self.requested, device)
        if stop and not self.reason:
            self.reason = "a signal on another rank"
        return stop
