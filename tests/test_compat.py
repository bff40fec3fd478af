"""The private parts of torch and submitit this package relies on, each in one wrapper
(pretrain.parallel.compat, pretrain.launcher.submitit_script): these tests fail loudly when a
release changes one of them."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch

from pretrain.compose import compose
from pretrain.launcher import slurm, submitit_script
from pretrain.parallel import compat
from tests.helpers import one_process_group


def test_submitit_renders_a_script_from_our_parameters(tmp_path):
    from submitit.slurm.slurm import _make_sbatch_string

    cfg = compose(["+cluster=a100x8", f"hydra.run.dir={tmp_path / 'run'}"])
    executor = slurm.make_executor(cfg, tmp_path / "run", [str(tmp_path / "run")])
    accepted = set(inspect.signature(_make_sbatch_string).parameters)
    assert set(executor.parameters) <= accepted, set(executor.parameters) - accepted
    command = submitit_script.submitted_command(executor)
    assert command.endswith(f"-u -m submitit.core._submit {tmp_path / 'run' / 'slurm'}")
    script = submitit_script.render(executor.parameters, executor.folder, command)
    assert script.startswith("#!/bin/bash") and "#SBATCH --requeue" in script and command in script
    assert script == executor._make_submission_file_text(command, "any")  # what a submission writes


def test_host_dtensor_keeps_the_mesh_and_takes_the_host_shard():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    with one_process_group():
        mesh = init_device_mesh("cpu", (1,))
        sharded = distribute_tensor(torch.arange(12.0).reshape(3, 4), mesh, [Shard(0)])
        host = torch.empty(3, 4)
        hosted = compat.host_dtensor(sharded, host)
        assert hosted.to_local().data_ptr() == host.data_ptr() and hosted.shape == sharded.shape
        assert hosted.placements == sharded.placements and hosted.device_mesh == mesh
        copied = compat.copy_state_dict({"w": sharded, "lr": 0.1}, {"w": hosted, "lr": None})
        assert torch.equal(host, torch.arange(12.0).reshape(3, 4)) and copied["lr"] == 0.1


def test_local_rows_name_where_a_shard_lies():
    """One process here: the whole tensor (tests/test_init_from.py shows 2 ranks reading their own rows)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    params = list(inspect.signature(compute_local_shape_and_global_offset).parameters)
    assert params[:3] == ["global_shape", "mesh", "placements"], params
    with one_process_group():
        sharded = distribute_tensor(torch.arange(12.0).reshape(3, 4), init_device_mesh("cpu", (1,)), [Shard(0)])
        local, rows = compat.local_rows(sharded)
        assert rows == range(3) and local.data_ptr() == sharded.to_local().data_ptr()
    plain = torch.zeros(5, 2)
    assert compat.local_rows(plain)[0] is plain and compat.local_rows(plain)[1] == range(5)


def test_fsdp_gradient_reduction_over_gloo_has_its_switch_or_its_private_factors():
    if compat.CPU_ALL_REDUCE:  # torch >= 2.8: the public switch
        from torch.distributed.fsdp import FSDPModule

        assert callable(FSDPModule.set_force_sum_reduction_for_comms)
        return
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

    params = list(inspect.signature(collectives._get_gradient_divide_factors).parameters)
    assert params[:3] == ["reduce_scatter_group", "all_reduce_group", "reduce_dtype"], params


@pytest.mark.parametrize("name", ["_make_sbatch_string"])
def test_submitit_still_has_what_submitit_script_calls(name):
    from submitit.slurm import slurm as submitit_slurm

    assert callable(getattr(submitit_slurm, name))
    assert isinstance(submitit_slurm.SlurmExecutor._submitit_command_str, property)


def test_tritons_install_is_hashed_by_a_background_thread_once_compiling_has_imported_it():
    """Inductor's cache key hashes Triton's install (libtriton's 500 MB): a requeued job's first step paid
    it until compilation started the hash in the background; here nothing but the prefetch asks for it."""
    pytest.importorskip("triton")
    code = (
        "import time\n"
        "from torch._inductor import codecache  # imported by compiling\n"
        "from pretrain.parallel import compat\n"
        "key = compat._tritons_cached_key()\n"
        "before = key.cache_info().currsize\n"
        "compat.prefetch_triton_key()\n"
        "deadline = time.monotonic() + 120\n"
        "while key.cache_info().currsize == 0 and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
        "filled = key.cache_info().currsize\n"
        "getattr(codecache, 'triton_key', key)()  # what Inductor asks (torch 2.7 asks Triton directly)\n"
        "print(before, filled, key.cache_info().misses)\n"
    )
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == ["0", "1", "1"]  # not there before, then hashed once, by the prefetch alone
