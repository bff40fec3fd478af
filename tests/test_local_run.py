"""End-to-end local runs through `python -m pretrain.launch`, on CPU with real torch.distributed (gloo)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pretrain.parallel.compat import CPU_ALL_REDUCE
from tests.helpers import MINI_MODEL, REPO, last_step_record, launch, losses, metrics, step_values

# The mini model with a higher learning rate: learning shows within 16 steps (5.9 -> 4.0), in seconds.
SHORT = (*MINI_MODEL, "optim.lr=3e-3", "optim.warmup_steps=4", "train.micro_batch=8", "train.steps=16",
         "train.log_every=4", "train.ckpt_every=8", "train.eval_every=8", "train.eval_batches=2")
# torch 2.7's FSDP2 cannot all-reduce over gloo: the launcher refuses these there (see test_bad_input).
needs_cpu_all_reduce = pytest.mark.skipif(not CPU_ALL_REDUCE, reason="FSDP2 all-reduce over gloo needs torch >= 2.8")


def assert_learns(run_dir, drop: float) -> None:
    curve = losses(run_dir)
    first, last = curve[min(curve)], curve[max(curve)]
    assert last < first - drop, f"loss did not fall enough: {curve}"


def test_default_run_learns_and_reports(tmp_path):
    run_dir = tmp_path / "run"
    result = launch("train.steps=60", "train.log_every=5", f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr + result.stdout
    # Progress lines and the closing summary a user reads.
    assert "step 60/60 | loss" in result.stdout and "tok/s" in result.stdout and "eta" in result.stdout
    assert f"run directory: {run_dir}" in result.stdout
    assert "checkpoint:    " + str(run_dir / "checkpoints" / "step_00000060") in result.stdout
    # The built-in corpus starts near ln(257) = 5.55 nats per byte; 60 steps take it well below.
    curve = losses(run_dir)
    assert curve[5] > 5.0 and curve[60] < 3.2, curve
    record = last_step_record(run_dir)
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "mem_gb"):
        assert key in record
    for written in ("config.yaml", "train.log", "metrics.jsonl", "data/builtin/index.json"):
        assert (run_dir / written).is_file(), written
    assert any("eval_loss" in r for r in metrics(run_dir)) is False  # eval_every=100 > 60 steps


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs, to give the launch one of them")
def test_a_rank_gets_a_thread_per_cpu_the_launch_may_use_not_per_cpu_of_the_machine(tmp_path):
    """Inside an salloc allocation, a cgroup or taskset a launch may use fewer CPUs than the machine has:
    a thread for each of the machine's would oversubscribe the few it has."""
    run_dir, one_cpu = tmp_path / "run", min(os.sched_getaffinity(0))
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # the launcher's own choice
    result = subprocess.run([sys.executable, "-m", "pretrain.launch", *MINI_MODEL, "train.steps=1", "local.nproc=1",
                             f"hydra.run.dir={run_dir}"], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=300, preexec_fn=lambda: os.sched_setaffinity(0, {one_cpu}))
    assert result.returncode == 0, result.stderr + result.stdout
    assert [(r["cpus"], r["threads"]) for r in metrics(run_dir)[0]["ranks"]] == [(1, 1)]
    assert "1-1 CPUs and 1-1 threads per rank" in result.stdout


# Every strategy and both CPU precisions with two processes (the 4-process hybrid case is below).
@pytest.mark.parametrize("strategy,precision", [("full_shard", "bf16"), ("full_shard", "fp32"),
                                                ("shard_grad_op", "fp32"),
                                                pytest.param("no_shard", "bf16", marks=needs_cpu_all_reduce)])
def test_two_process_strategies_learn(tmp_path, strategy, precision):
    run_dir = tmp_path / "run"
    result = launch("local.nproc=2", f"fsdp={strategy}", f"precision={precision}", *SHORT, f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr + result.stdout
    assert "world size 2" in result.stdout
    assert_learns(run_dir, drop=0.8)
    assert any("eval_loss" in r for r in metrics(run_dir))


@needs_cpu_all_reduce
def test_hybrid_shard_on_a_2x2_mesh(tmp_path):
    run_dir = tmp_path / "run"
    result = launch("local.nproc=4", "fsdp=hybrid_shard", "fsdp.shard_size=2", *SHORT, "train.micro_batch=4",
                    f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr + result.stdout
    assert "world size 4" in result.stdout
    assert_learns(run_dir, drop=0.8)


EXACT = ("train.steps=3", "train.log_every=1", "precision=fp32", "train.micro_batch=4", "train.global_batch=16")


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    """3 fp32 steps in one process: the reference every world size must reproduce."""
    run_dir = tmp_path_factory.mktemp("one") / "run"
    result = launch(*EXACT, f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr + result.stdout
    return run_dir


@pytest.mark.parametrize("overrides", [("local.nproc=2",), ("local.nproc=2", "fsdp=shard_grad_op"),
                                       pytest.param(("local.nproc=2", "fsdp=no_shard"), marks=needs_cpu_all_reduce),
                                       pytest.param(("local.nproc=4", "fsdp=hybrid_shard", "fsdp.shard_size=2",
                                                     "train.micro_batch=2"), marks=needs_cpu_all_reduce)],
                         ids=lambda o: " ".join(o))
def test_every_strategy_reproduces_one_process(tmp_path, one_process_run, overrides):
    """Same data (sampling by global sample index) and averaged, not summed, gradients at any world size.

    The reference accumulates 4 micro-batches; 2 processes accumulate 2 each (reduce-scattering
    every micro-batch), and the 2 x 2 hybrid mesh 2 each (all-reducing across its replicas once).

    Losses alone would miss a summed gradient (AdamW hardly sees its scale); the gradient norm does not.
    """
    run_dir = tmp_path / "run"
    result = launch(*EXACT, *overrides, f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr + result.stdout
    for key in ("loss", "grad_norm"):
        assert step_values(run_dir, key) == pytest.approx(step_values(one_process_run, key), rel=1e-4), key
