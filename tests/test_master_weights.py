"""One process trains without FSDP (pretrain/parallel/master_weights.py): the numerics stay FSDP2's."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from tests.helpers import (MINI_MODEL, assert_same_losses, launch, launch_plain_and_wrapped, losses, one_process_group,
                           step_values)

# bf16 compute over fp32 master weights; 4 micro-batches a step, so gradients accumulate.
BF16 = (*MINI_MODEL, "precision=bf16", "train.micro_batch=4", "train.global_batch=16", "train.log_every=1",
        "train.eval_every=0")


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied embeddings"])
def test_one_process_trains_unwrapped_exactly_as_fsdp_at_one_rank(tmp_path, tied):
    """The same losses and gradient norms, bit for bit, as FSDP2 with MixedPrecisionPolicy(bf16, fp32).

    Twice, in full CI runs on the loaded 2-core machine, one run of the tied-embeddings pair gave its 4th
    loss 3 units in the last place off, the same value both times (5.7238936 for 5.7238951); in over 40
    runs of the pair alone none did: under load, on 1 to 8 intra-op threads, with glibc's MALLOC_PERTURB_,
    with other hash seeds, beside the Slurm tests (the values were the same in all). A third time the
    retry below caught it (in the FSDP2 run): step 3's gradient norm was 1.4238721 for 1.4239026, its
    loss the same. The cause is not known. So a pair that differs is run again, into new folders, up
    to twice, and one pair must agree bit for bit: a difference in the numerics (autocast's, a gradient
    summed in bf16) is there in every run.
    """
    run = (*BF16, "train.steps=4", f"model.tie_embeddings={str(tied).lower()}")
    for attempt in range(3):
        plain, wrapped = trained_pair(tmp_path / f"attempt{attempt}", run)
        if plain == wrapped:
            break
        warnings.warn(f"attempt {attempt}: the unwrapped and FSDP2 runs differed ({plain} != {wrapped})")
    assert plain == wrapped
    assert len(plain["loss"]) == 4


def trained_pair(root: Path, run: tuple[str, ...]) -> tuple[dict, dict]:
    """The losses and gradient norms by step of `run` without FSDP2 and with it at one rank."""
    results = launch_plain_and_wrapped(root, *run)
    assert "fsdp off (one process: fp32 master weights, a bf16 copy computes)" in results["plain"].stdout
    assert "fsdp full_shard" in results["wrapped"].stdout
    return tuple({key: step_values(root / name, key) for key in ("loss", "grad_norm")} for name in ("plain", "wrapped"))


def test_an_unwrapped_run_resumes_exactly_and_on_two_processes(tmp_path):
    """A resumed run computes with the loaded weights (the compute copy follows them), and what one process
    saved without FSDP is what two FSDP2 processes load."""
    run = (*BF16, "train.steps=8", "train.ckpt_every=4")
    whole, split, two = tmp_path / "whole", tmp_path / "split", tmp_path / "two"
    assert launch(*run, f"hydra.run.dir={whole}").returncode == 0
    for folder in (split, two):
        stopped = launch(*run, "train.stop_at_step=4", f"hydra.run.dir={folder}")
        assert stopped.returncode == 0, stopped.stderr + stopped.stdout
    resumed = launch(*run, f"hydra.run.dir={split}")
    assert resumed.returncode == 0, resumed.stderr + resumed.stdout
    assert_same_losses(losses(split), losses(whole), range(5, 9))
    on_two = launch(*run, "local.nproc=2", f"hydra.run.dir={two}")
    assert on_two.returncode == 0, on_two.stderr + on_two.stdout
    assert "resumed from" in on_two.stdout and "fsdp full_shard" in on_two.stdout
    # Same weights, optimizer state and data; bf16 products summed in another order on two ranks.
    for step in range(5, 9):
        assert losses(two)[step] == pytest.approx(losses(whole)[step], abs=2e-2), step


def test_gradients_reach_the_master_weights_in_fp32_and_the_copy_follows_them():
    from pretrain.compose import compose
    from pretrain.parallel.parallelize import build_mesh
    from pretrain.trainer.loop import build_model

    cfg = compose([*MINI_MODEL, "precision=bf16", "model.tie_embeddings=true", "fsdp.activation_checkpointing=full"])
    cpu = torch.device("cpu")
    with one_process_group():
        parallel = build_model(cfg, cpu, build_mesh(cfg.fsdp, cpu, 1, 1))
    compute, master = parallel.model, parallel.weights
    assert compute.output.weight is compute.tok_embeddings.weight  # still tied in the copy
    assert {p.dtype for p in compute.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in master.parameters()} == {torch.float32}
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 16))
    for _ in range(2):  # two micro-batches: the second adds to the first
        compute(tokens).float().square().mean().backward()
    assert all(p.grad is None for p in compute.parameters())  # handed over, not kept twice
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in master.parameters())
    with torch.no_grad():
        for p in master.parameters():
            p.add_(1.0)
    parallel.weights_changed()
    for (name, c), m in zip(compute.state_dict().items(), master.state_dict().values()):
        assert torch.equal(c, m.to(torch.bfloat16)), name
