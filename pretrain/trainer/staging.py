"""Host copies of the training state for asynchronous checkpoint saves.

An asynchronous save writes a copy of the state while training goes on. The copy goes into
host buffers allocated once per run and reused by every save: allocating (and on GPUs pinning)
a model's worth of host memory per save stalled training for seconds (6 s per save for the 1B
shape on an H200, bench/NOTES.md). The buffers are allocated here rather than by torch's
`_create_cpu_state_dict`, which first copies every sharded tensor to the host (26 s for the
1B shape's 17 GiB on an H200), and they can be allocated ahead of the first save, in a
background thread (`allocate`). On GPUs the copy runs on a side stream; the training stream
waits for it on the GPU, just before the optimizer changes the state, so the host is never
blocked by it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from pretrain.parallel.compat import copy_state_dict, host_dtensor


def host_buffers(state: Any, pin: bool) -> Any:
    """Empty host tensors shaped like every tensor of `state` (DTensors keep their sharding)."""
    if isinstance(state, DTensor):
        return host_dtensor(state, host_buffers(state.to_local(), pin))
    if isinstance(state, torch.Tensor):
        return torch.empty(state.shape, dtype=state.dtype, pin_memory=pin)
    if isinstance(state, dict):
        return {key: host_buffers(value, pin) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(host_buffers(value, pin) for value in state)
    return state


def layout(state: Any) -> Any:
    """The keys, shapes and dtypes of a state dict's tensors: what its host buffers must match."""
    if isinstance(state, torch.Tensor):
        return (tuple(state.shape), state.dtype)
    if isinstance(state, dict):
        return {key: layout(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return [layout(value) for value in state]
    return None


class HostStaging:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._buffers: dict[str, Any] | None = None
        self._layout: Any = None
        self._stream = torch.cuda.Stream(device) if self.cuda else None
        self._copied: torch.cuda.Event | None = None

    def allocate(self, state: dict[str, Any]) -> None:
        """Allocate host buffers for states laid out like `state` (may run in another thread)."""
        self._layout = layout(state)
        self._buffers = host_buffers(state, pin=self.cuda)

    def copy(self, state: dict[str, Any]) -> dict[str, Any]:
        """Start copying `state` into the host buffers; returns the host state dict to write.

        Its tensors are the reused buffers; its other values (e.g. learning rates) are the
        current ones. The caller must not write it before `copied()`, nor start another copy
        before that write has finished. Buffers made for another layout (e.g. before the
        optimizer had state) are replaced.
        """
        if self._buffers is None or layout(state) != self._layout:
            self.allocate(state)
        if not self.cuda:
            return copy_state_dict(state, self._buffers)
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            host = copy_state_dict(state, self._buffers, non_blocking=True)
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
