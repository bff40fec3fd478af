"""Stopping cleanly on a signal: the handler only sets a flag; ranks agree at a step boundary.

Slurm sends the signal given by `--signal` before the time limit, and SIGTERM on preemption
or `scancel`. Work inside a signal handler is unsafe (it may interrupt a collective), so the
handler records the request and the training loop asks every rank, with one small all-reduce
after each step, whether any of them was asked to stop. All ranks then save and exit together.
On CUDA the answer comes one step late: each step's all-reduce is read at the next step,
so the host never waits for the GPU to drain (see pretrain.deferred).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pretrain.deferred import DeferredValue

# USR2 is what submitit's sbatch scripts ask Slurm for (--signal=USR2@delay); USR1 for hand-written
# scripts; TERM for preemption and scancel; INT for Ctrl-C on a local run (a second one aborts at once).
SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)
# Signals that mean "time is up, come back later": the job asks to be requeued. SIGTERM comes from
# scancel (the user wants it gone) or from preemption (Slurm requeues or cancels it itself).
REQUEUE_SIGNALS = ("SIGUSR1", "SIGUSR2")
# Exit code of a run that stopped on a signal after saving a checkpoint (to be requeued or rerun).
EXIT_STOPPED = 3
# Exit code of a run aborted by a second Ctrl-C, without a checkpoint (as a shell reports SIGINT).
EXIT_ABORTED = 130
# Left in the run directory by rank 0 after a signalled stop; the batch script requeues on it.
REQUEUE_REQUEST = ".requeue"


class StopRequest:
    """Set by a signal handler; read collectively at step boundaries."""

    # What a rank was asked, as a number the ranks can all-reduce with MAX: requeue wins over stop.
    NONE, STOP, REQUEUE = 0, 1, 2

    def __init__(self) -> None:
        self.local = self.NONE
        self.agreed_kind = self.NONE
        self.reason = ""
        self._pending: DeferredValue | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}

    def uninstall(self) -> None:
        """Give the signals back (a run inside the launcher's process must not leave its handlers behind)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if name == "SIGINT" and self.local != self.NONE:
            os.write(2, b"pretrain: second Ctrl-C: aborting now, without a checkpoint (the last one is intact)\n")
            os._exit(EXIT_ABORTED)
        self.local = max(self.local, self.REQUEUE if name in REQUEUE_SIGNALS else self.STOP)
        self.reason = self.reason or name

    @property
    def wants_requeue(self) -> bool:
        return self.agreed_kind == self.REQUEUE

    def agreed(self, device: torch.device) -> bool:
        """True on every rank when any rank got a signal: one small all-reduce.

        On CUDA the answer comes one step late: each step's all-reduce is read at the next step,
        so the host never waits for the GPU to drain (see pretrain.deferred).
        """
        value = torch.tensor([float(self.local)], device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        if device.type == "cuda":
            previous, self._pending = self._pending, DeferredValue(value)
            self.agreed_kind = int(previous.get().item()) if previous is not None else self.NONE
        else:
            self.agreed_kind = int(value.item())
        if self.agreed_kind and not self.reason:
            self.reason = "a signal on another rank"
        return self.agreed_kind != self.NONE


def request_requeue(run_dir: Path, step: int) -> bool:
    """Ask the batch script to requeue this Slurm job; False outside Slurm (nothing to requeue)."""
    if "SLURM_JOB_ID" not in os.environ:
        return False
    (run_dir / REQUEUE_REQUEST).write_text(f"{os.environ['SLURM_JOB_ID']} stopped at step {step}\n")
    return True


def clear_requeue_request(run_dir: Path) -> None:
    (run_dir / REQUEUE_REQUEST).unlink(missing_ok=True)
