"""A test module's check of one of the package's Triton kernels, run on a device: compiled on a GPU, and on the CPU
under Triton's interpreter (TRITON_INTERPRET=1, which Triton reads when it is imported: so in a process of its own).

A check is a function of the test module taking the device first; the tests parametrize over DEVICES."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import torch

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


def run_check(module: str, name: str, device: str, *args, timeout: float = 300) -> None:
    """The check `name` of test module `module` (its import name) on `device`, with `args` (literals)."""
    if device == "cuda":
        getattr(importlib.import_module(module), name)(torch.device("cuda"), *args)
        return
    call = f"import torch, {module} as t; t.{name}(torch.device('cpu'), *{args!r})"
    done = subprocess.run([sys.executable, "-c", call], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
