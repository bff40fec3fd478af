"""Ending a stalled job instead of letting it hang until its time limit.

A rank that dies or stalls leaves the others waiting inside a collective. Two guards bound that
wait: the process group's collective timeout (`train.collective_timeout_s`, set at
init_process_group; it also covers the first step, compile included), and this watchdog, a
thread that ends its process when no training step has completed for `train.hang_timeout_s`.
The launcher (local) or srun's --kill-on-bad-exit (Slurm) then stops the other ranks, and the
batch script requeues the job, which resumes from its last checkpoint.
"""

from __future__ import annotations

import logging
import os
import threading
import time

log = logging.getLogger(__name__)

# Exit code of a process ended by the watchdog.
EXIT_HUNG = 124


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
                          "a rank died or stalled. Ending this process so the job fails fast and can be requeued.",
                          stalled, self.last_step, self.timeout_s)
                for handler in logging.getLogger().handlers:
                    handler.flush()
                os._exit(EXIT_HUNG)
