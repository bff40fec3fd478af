"""What keeps a job alive, or ends it on purpose: stop requests, the stall watchdog, injected faults.

Stopping on a signal. Slurm sends the signal given by `--signal` before the time limit, and
SIGTERM on preemption or `scancel`; Ctrl-C sends SIGINT to a local run. Work inside a signal
handler is unsafe (it may interrupt a collective), so the handler records the request and the
training loop asks every rank, with one small all-reduce after each step, whether any of them was
asked to stop. All ranks then save and exit together. On CUDA the answer comes one step late:
each step's all-reduce is read at the next step, so the host never waits for the GPU to drain
(see pretrain.trainer.deferred). Under submitit the task's process has submitit's handlers first
(they requeue with scontrol from inside the task, which the containers our users run in lack):
StopRequest.install replaces them, and the batch script requeues from the host instead.

Ending a stalled job. A rank that dies or stalls leaves the others waiting inside a collective.
Two guards bound that wait: the process group's collective timeout (`train.collective_timeout_s`,
set at init_process_group; it also covers the first step, compile included), and StepWatchdog, a
thread that ends its process when no training step has completed for `train.hang_timeout_s`,
after printing each thread's stack (where it waited) to stderr. The local launcher or srun's
--kill-on-bad-exit then stops the other ranks, and the batch script requeues the job, which
resumes from its last checkpoint.

Injected faults, for tests: inert unless PRETRAIN_FAULTS is set.
PRETRAIN_FAULTS is a comma-separated list of NAME@WHEN, e.g. "nan_loss@5,nan_grad@7-9,kill_in_save@4":
  nan_loss@STEPS       the loss of those steps becomes NaN (every rank)
  nan_grad@STEPS       one gradient element of those steps becomes NaN (rank 0)
  kill_in_save@STEPS   the process kills itself (SIGKILL) after writing its shards of that step's
                       checkpoint, before the checkpoint is published
  kill_in_remove@STEPS the process kills itself after deleting the first file of that step's
                       checkpoint when it is pruned (or replaced)
  peer_dies_in_save@STEPS  the last rank kills itself as it starts writing its shards of that step's
                       checkpoint, leaving the other ranks in the save's collectives
STEPS is N or A-B (inclusive). Faults of a node or rank name WHERE instead, a node (Slurm's node
name, else the hostname) or rankN:
  preflight_fail@WHERE the preflight check's matrix product there comes out wrong (one entry changed
                       after it is computed, so the real check sees it)
The tests use it to show what happens when things break.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pretrain.rundir import REQUEUE_REQUEST, STOPPED_NOTICE, ExitCode
from pretrain.trainer.deferred import DeferredValue

log = logging.getLogger("pretrain")

# USR2 is what submitit's sbatch scripts ask Slurm for (--signal=USR2@delay); USR1 for hand-written
# scripts; TERM for preemption and scancel; INT for Ctrl-C on a local run (a second one aborts at once).
SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)
# Signals that mean "time is up, come back later": the job asks to be requeued. SIGTERM comes from
# scancel (the user wants it gone) or from preemption (Slurm requeues or cancels it itself), which
# signal the batch script too; the batch script requeues only a SIGTERM that reached the tasks alone.
REQUEUE_SIGNALS = ("SIGUSR1", "SIGUSR2")


# ---- stop requests ------------------------------------------------------------------------------
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
            os._exit(ExitCode.ABORTED)
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


def in_slurm_job() -> bool:
    """Whether a Slurm batch script runs this process (and acts on the notes below when it ends)."""
    return "SLURM_JOB_ID" in os.environ


def leave_stop_note(run_dir: Path, step: int, kind: int, reason: str) -> None:
    """Tell the batch script why the ranks stopped (in a Slurm job; see in_slurm_job).

    A time-limit signal (StopRequest.REQUEUE) asks for a requeue (REQUEUE_REQUEST). SIGTERM or SIGINT
    (StopRequest.STOP) leaves STOPPED_NOTICE: the batch script requeues when it was not signalled
    itself, since then the job was neither cancelled nor preempted (a node shutting down, a signal
    sent to the job's steps only) and ending it would leave the run unfinished.
    """
    name = REQUEUE_REQUEST if kind == StopRequest.REQUEUE else STOPPED_NOTICE
    (run_dir / name).write_text(f"{os.environ['SLURM_JOB_ID']} stopped at step {step} ({reason})\n")


def clear_stop_notes(run_dir: Path) -> None:
    """Forget the last attempt's notes: this attempt resumes, and will leave its own."""
    for name in (REQUEUE_REQUEST, STOPPED_NOTICE):
        (run_dir / name).unlink(missing_ok=True)


# ---- the stall watchdog -------------------------------------------------------------------------
class StepWatchdog:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.last_beat = time.monotonic()
        self.last_step = 0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="step-watchdog", daemon=True)

    def start(self) -> None:
        if self.timeout_s > 0:
            self.last_beat = time.monotonic()
            self._thread.start()

    def beat(self, step: int) -> None:
        self.last_step = step
        self.last_beat = time.monotonic()

    def stop(self) -> None:
        """End the watch and wait for the thread: nothing of it may outlive the process group."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def _watch(self) -> None:
        poll = min(max(self.timeout_s / 10, 0.5), 10.0)
        while not self._stopped.wait(poll):
            stalled = time.monotonic() - self.last_beat
            if stalled > self.timeout_s:
                log.error("no training step completed for %.0f s (last was step %d; train.hang_timeout_s=%.0f): "
                          "a rank died or stalled. Ending this process so the job fails fast and can be requeued; "
                          "where each of its threads was waiting follows.", stalled, self.last_step, self.timeout_s)
                for handler in logging.getLogger().handlers:
                    handler.flush()
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                os._exit(ExitCode.HUNG)


# ---- injected faults ----------------------------------------------------------------------------
@lru_cache(maxsize=8)
def _parse(spec: str) -> dict[str, list[str]]:
    faults: dict[str, list[str]] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, when = item.partition("@")
        faults.setdefault(name, []).append(when)
    return faults


def _matches(when: str, step: int) -> bool:
    low, _, high = when.partition("-")
    return int(low) <= step <= int(high or low)


def fault_active(name: str, step: int) -> bool:
    """Whether fault `name` is injected at `step`."""
    whens = _parse(os.environ.get("PRETRAIN_FAULTS", "")).get(name, [])
    return any(_matches(when, step) for when in whens)


def kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def fault_active_on(name: str, node: str, rank: int) -> bool:
    """Whether fault `name` is injected on this node or rank (NAME@NODE or NAME@rankN)."""
    whens = _parse(os.environ.get("PRETRAIN_FAULTS", "")).get(name, [])
    return node in whens or f"rank{rank}" in whens


class Faults:
    """The faults PRETRAIN_FAULTS injects into the training loop; with it unset, nothing at all."""

    def __init__(self, spec: str) -> None:
        self.names = set(_parse(spec))

    @classmethod
    def from_environment(cls) -> Faults:
        return cls(os.environ.get("PRETRAIN_FAULTS", ""))

    def poisoned_loss(self, loss_fn: Any, next_step: Any) -> Any:
        """loss_fn, or (nan_loss) one whose loss is NaN at the steps named (next_step() tells the step)."""
        if "nan_loss" not in self.names:
            return loss_fn

        def poisoned(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            loss = loss_fn(inputs, targets)
            return loss * float("nan") if fault_active("nan_loss", next_step()) else loss

        return poisoned

    def after_backward(self, grads: list[torch.Tensor], step: int, is_main: bool) -> None:
        """nan_grad: one gradient element of rank 0 becomes NaN at the steps named."""
        if "nan_grad" in self.names and is_main and fault_active("nan_grad", step) and grads:
            grad = grads[0]
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            local.view(-1)[0] = float("nan")
