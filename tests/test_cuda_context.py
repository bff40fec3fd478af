"""The rank's CUDA context made by the driver in a thread while the job imports (pretrain.trainer.cuda_context).

The thread must make the context of the GPU that torch will then drive, and no other (a context costs
the GPU's memory); without a driver or a GPU it must end quietly and leave the choice to torch.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from pretrain.trainer import cuda_context, identity

from .helpers import REPO


@pytest.mark.parametrize("environ,expected", [
    ({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}, 1),                              # torchrun, our launcher
    ({"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2",
      "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_ID": "7"}, 2),                          # srun
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "SLURM_PROCID": "0", "SLURM_NTASKS": "1",
      "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "node1"}, 3),                              # torchrun inside an allocation
    ({}, 0),                                                                               # a plain process
])
def test_the_thread_reads_the_local_rank_the_job_will_use(monkeypatch, environ, expected):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert identity.local_rank(os.environ) == identity.detect().local_rank == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")
def test_without_a_gpu_the_thread_ends_without_a_context_and_says_why():
    thread, context = cuda_context.start_in_background()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert context.ordinal is None and context.seconds is None
    assert context.problem


PROBE = r"""
import ctypes, json
from pretrain.trainer import cuda_context
driver = ctypes.CDLL(cuda_context.DRIVER)
assert driver.cuInit(0) == 0
count = ctypes.c_int()
assert driver.cuDeviceGetCount(ctypes.byref(count)) == 0

def active(ordinal):
    device, flags, state = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    assert driver.cuDeviceGet(ctypes.byref(device), ordinal) == 0
    assert driver.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(state)) == 0
    return state.value

before = [active(i) for i in range(count.value)]
thread, context = cuda_context.start_in_background()
thread.join()
after = [active(i) for i in range(count.value)]
import torch
from pretrain.trainer import distributed, identity
device = distributed.device_for(identity.detect())
total = torch.ones(4, device=device).sum().item()
print(json.dumps({"before": before, "after": after, "ordinal": context.ordinal, "problem": context.problem,
                  "device": device.index, "count": count.value, "total": total}))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_thread_makes_the_context_of_the_gpu_torch_then_drives_and_no_other():
    local = torch.cuda.device_count() - 1  # the last GPU, so that a context wrongly made on GPU 0 shows
    env = {**os.environ, "RANK": str(local), "WORLD_SIZE": str(local + 1), "LOCAL_RANK": str(local),
           "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["problem"] is None
    assert seen["before"] == [0] * seen["count"]
    assert seen["ordinal"] == seen["device"] == local
    assert seen["after"] == [int(i == local) for i in range(seen["count"])]
    assert seen["total"] == 4.0
