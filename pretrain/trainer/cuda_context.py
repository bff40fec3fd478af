"""The rank's CUDA context, made by the driver in a thread while the job imports torch.

A job spends its first seconds importing torch and the trainer, holding the interpreter lock; then
`torch.cuda.set_device` creates the GPU's primary context, a few tenths of a second more on the
critical path of every start and every requeued restart. The driver's own calls release the lock
(ctypes drops it around foreign calls), so `cuInit` and `cuDevicePrimaryCtxRetain` made from a thread
at the process's start run beside the imports, and the CUDA runtime, which uses the device's primary
context, finds it made. The GPU is the one `pretrain.trainer.distributed.device_for` will choose: a
context on another rank's GPU would cost that GPU memory. Where there is no driver or no GPU nothing
happens, and torch reports whatever is wrong when it gets there.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Mapping

from pretrain.trainer.identity import gpu_index, local_rank

DRIVER = "libcuda.so.1"


class DriverError(RuntimeError):
    pass


class Context:
    """The outcome of making the context: the device's ordinal and how long it took, or why it was not made."""

    def __init__(self) -> None:
        self.ordinal: int | None = None
        self.seconds: float | None = None
        self.problem: str | None = None


def _check(result: int, call: str) -> None:
    if result != 0:
        raise DriverError(f"{call} returned CUresult {result}")


def retain_primary_context(environ: Mapping[str, str], context: Context) -> None:
    """Make (retain) the primary context of this rank's GPU; record the outcome in `context`."""
    started = time.perf_counter()
    try:
        driver = ctypes.CDLL(DRIVER)
        _check(driver.cuInit(0), "cuInit")
        count = ctypes.c_int()
        _check(driver.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
        if count.value == 0:
            raise DriverError("no GPU visible")
        ordinal = gpu_index(local_rank(environ), count.value, environ)
        device = ctypes.c_int()
        _check(driver.cuDeviceGet(ctypes.byref(device), ordinal), "cuDeviceGet")
        handle = ctypes.c_void_p()
        _check(driver.cuDevicePrimaryCtxRetain(ctypes.byref(handle), device), "cuDevicePrimaryCtxRetain")
    except (OSError, AttributeError, DriverError) as problem:  # no driver, an old one, or no GPU: torch decides
        context.problem = str(problem)
        return
    context.ordinal, context.seconds = ordinal, time.perf_counter() - started


def start_in_background(environ: Mapping[str, str] = os.environ) -> tuple[threading.Thread, Context]:
    """Start making this rank's context; the job goes on importing meanwhile (the thread is a daemon)."""
    context = Context()
    thread = threading.Thread(target=retain_primary_context, args=(dict(environ), context),
                              name="cuda-context", daemon=True)
    thread.start()
    return thread, context
