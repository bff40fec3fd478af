"""Reading small device values on the host without draining the device's queue.

`tensor.item()` on a CUDA tensor waits for everything queued so far, so the host stops
feeding the GPU until it has run dry, and the next step starts from an empty queue. Flags
the loop needs every step (a skipped update, a stop request) are therefore copied into
pinned host memory behind an event when they are computed and read a step later, when
that event has long passed: the host waits for nothing queued after the flag.
"""

from __future__ import annotations

import torch


class DeferredValue:
    """A copy of a small tensor, readable on the host once the device has computed it."""

    def __init__(self, value: torch.Tensor) -> None:
        value = value.detach()
        self._event = None
        if value.device.type == "cuda":
            self._host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            self._host.copy_(value, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = value

    def get(self) -> torch.Tensor:
        """The value on the host; waits only for the work queued before it was taken."""
        if self._event is not None:
            self._event.synchronize()
        return self._host
