"""Host copies of the training state for asynchronous checkpoint saves.

An asynchronous save writes a copy of the state while training goes on. The copy goes into
host buffers allocated at the first save and reused by every later one: allocating (and on
GPUs pinning) a model's worth of host memory per save stalled training for seconds (6 s per
save for the 1B shape on an H200, bench/NOTES.md). On GPUs the copy runs on a side stream;
the training stream waits for it on the GPU, just before the optimizer changes the state,
so the host is never blocked by it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict


class HostStaging:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._buffers: dict[str, Any] | None = None
        self._stream = torch.cuda.Stream(device) if self.cuda else None
        self._copied: torch.cuda.Event | None = None

    def copy(self, state: dict[str, Any]) -> dict[str, Any]:
        """Start copying `state` into the host buffers; returns the host state dict to write.

        Its tensors are the reused buffers; its other values (e.g. learning rates) are the
        current ones. The caller must not write it before `copied()`, nor start another copy
        before that write has finished.
        """
        if self._buffers is None:
            self._buffers = _create_cpu_state_dict(state, pin_memory=self.cuda)
        if not self.cuda:
            return _copy_state_dict(state, self._buffers)
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            host = _copy_state_dict(state, self._buffers, non_blocking=True)
            self._copied = self._stream.record_event()
        return host

    def hold_updates(self) -> None:
        """Make the training stream wait for the copy (on the GPU): call before the optimizer step."""
        if self._copied is not None:
            torch.cuda.current_stream().wait_event(self._copied)

    def copied(self) -> None:
        """Block the calling thread until the copy is in host memory."""
        if self._copied is not None:
            self._copied.synchronize()
