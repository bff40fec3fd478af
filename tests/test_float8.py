"""FP8 matmuls (precision=fp8): the package's path through torchao, on CPUs.

Recent torch (2.13 here) emulates FP8 matmuls on CPUs (hundreds of times slower than bf16), enough for a model of
a few layers; the GPU kernels' numbers are checked in tests/test_gpu.py and their speed in bench/.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from pretrain.parallel import float8
from tests.helpers import MINI_MODEL, launch, losses

pytest.importorskip("torchao.float8")
if not float8.cpu_has_fp8_matmul():
    pytest.skip("this torch has no FP8 matmul on CPUs", allow_module_level=True)

RUN = (*MINI_MODEL, "train.micro_batch=2", "train.global_batch=2", "train.log_every=1", "train.eval_every=0",
       "train.ckpt_every=2")


def test_fp8_run_computes_nearly_what_bf16_does_and_its_checkpoint_resumes_in_bf16(tmp_path):
    bf16, fp8 = tmp_path / "bf16", tmp_path / "fp8"
    assert launch(*RUN, "precision=bf16", "train.steps=4", f"hydra.run.dir={bf16}").returncode == 0
    first = launch(*RUN, "precision=fp8", "train.steps=4", f"hydra.run.dir={fp8}")
    assert first.returncode == 0, first.stderr
    output = first.stderr + first.stdout
    assert "precision bf16 with tensorwise FP8 matmuls in 14 linear layers" in output
    assert "FP8 matmuls are emulated there" in output and "precision.float8 without fsdp.compile" in output
    got, expected = losses(fp8), losses(bf16)
    for step in range(1, 5):
        # FP8 rounding moves the loss, but only slightly: not the same numbers, not another function.
        assert got[step] != expected[step]
        assert got[step] == pytest.approx(expected[step], rel=1e-3)
    # The checkpoint holds plain weights: a bf16 run goes on from it.
    second = launch(*RUN, "precision=bf16", "train.steps=6", f"hydra.run.dir={fp8}")
    assert second.returncode == 0, second.stderr
    assert "resumed from" in second.stdout and "step_00000004" in second.stdout
    assert sorted(losses(fp8)) == list(range(1, 7))


def test_fp8_all_gathers_train_as_fp8_does_resume_exactly_and_leave_checkpoints_plain(tmp_path):
    """Two ranks under FSDP2: the weights travel in FP8, rounded once from fp32 instead of via bf16."""
    two = (*RUN, "local.nproc=2", "train.global_batch=4", "precision=fp8")
    gathered = (*two, "precision.float8_all_gather=true")
    whole, bf16_gathers, resumed = tmp_path / "whole", tmp_path / "bf16-gathers", tmp_path / "resumed"
    assert launch(*two, "train.steps=4", f"hydra.run.dir={bf16_gathers}").returncode == 0
    first = launch(*gathered, "train.steps=4", f"hydra.run.dir={whole}")
    assert first.returncode == 0, first.stderr
    assert "tensorwise FP8 matmuls in 14 linear layers, their weights all-gathered in FP8" in first.stdout
    got, expected = losses(whole), losses(bf16_gathers)
    assert any(got[step] != expected[step] for step in range(1, 5))
    assert all(got[step] == pytest.approx(expected[step], rel=1e-4) for step in range(1, 5))
    # Stopped at step 2 and resumed: the same losses as the run that went through.
    assert launch(*gathered, "train.steps=4", "train.stop_at_step=2", f"hydra.run.dir={resumed}").returncode == 0
    again = launch(*gathered, "train.steps=4", f"hydra.run.dir={resumed}")
    assert again.returncode == 0, again.stderr
    assert "resumed from" in again.stdout
    assert losses(resumed) == got
    # The checkpoint holds plain tensors (no class of torchao's, which a reader would need to import),
    # so a run without FP8 goes on from it.
    shards = list((whole / "checkpoints").glob("step_*/*.distcp"))
    assert shards and not any(b"torchao" in shard.read_bytes() for shard in shards)
    bf16 = launch(*two, "precision=bf16", "train.steps=6", f"hydra.run.dir={whole}")
    assert bf16.returncode == 0, bf16.stderr
    assert "resumed from" in bf16.stdout and sorted(losses(whole)) == list(range(1, 7))


def test_only_block_layers_with_sizes_multiple_of_16_are_converted():
    model = nn.ModuleDict({"wq": nn.Linear(64, 64), "odd": nn.Linear(64, 24), "output": nn.Linear(64, 128)})
    assert float8.convert(model, "rowwise") == 1
    assert type(model["wq"]).__name__ == "Float8Linear"
    assert type(model["odd"]) is nn.Linear and type(model["output"]) is nn.Linear
    assert float8.convert(nn.Linear(64, 64), "none") == 0


def test_missing_torchao_is_refused_with_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(float8.Float8Unavailable, match=r"needs torchao.*pip install 'pretrain\[fp8\]'"):
        float8.require("tensorwise", torch.device("cpu"), compiled=True)
