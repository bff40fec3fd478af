"""Exact resume and resharding of checkpoints across world sizes."""

from __future__ import annotations

import shutil

import pytest

from tests.helpers import (MINI_MODEL, assert_same_losses, last_step_record, launch, losses, metrics,
                           optimizer_step_counts)

RUN = ("train.steps=20", "train.log_every=1", "train.ckpt_every=5", "train.eval_every=0", "precision=fp32", *MINI_MODEL)


def test_stopped_at_step_10_and_resumed_matches_uninterrupted(tmp_path):
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert launch(*RUN, f"hydra.run.dir={whole}").returncode == 0
    first = launch(*RUN, "train.stop_at_step=10", f"hydra.run.dir={split}")
    assert first.returncode == 0, first.stderr
    assert max(losses(split)) == 10
    second = launch(*RUN, f"hydra.run.dir={split}")
    assert second.returncode == 0, second.stderr
    assert "resumed from" in second.stdout and "step_00000010" in second.stdout
    resumed, uninterrupted = losses(split), losses(whole)
    assert sorted(resumed) == list(range(1, 21))
    assert_same_losses(resumed, uninterrupted, range(11, 21))
    assert last_step_record(split)["restarts"] == 1
    # the optimizer's state was resumed too, not started again at step 11
    assert optimizer_step_counts(split / "checkpoints" / "step_00000020") == {20.0}


def test_checkpoint_from_two_processes_loads_with_one_and_four(tmp_path):
    base = tmp_path / "two"
    run = RUN + ("train.global_batch=16", "train.micro_batch=4")
    assert launch(*run, "local.nproc=2", f"hydra.run.dir={base}").returncode == 0
    reference = losses(base)
    for nproc in (1, 4):
        target = tmp_path / f"as{nproc}"
        assert launch(*run, "local.nproc=2", "train.stop_at_step=10", f"hydra.run.dir={target}").returncode == 0
        result = launch(*run, f"local.nproc={nproc}", f"hydra.run.dir={target}")
        assert result.returncode == 0, result.stderr + result.stdout
        assert "resumed from" in result.stdout
        after = losses(target)
        # Same data and weights; only the order of floating-point reductions differs.
        for step in range(11, 21):
            assert after[step] == pytest.approx(reference[step], abs=2e-3), (nproc, step)


def test_asynchronous_checkpoints_resume_exactly(tmp_path):
    """Asynchronous saves reuse one host copy of the state, written while training goes on.

    Resuming from the second one (steps 11-14 ran while it was written) must continue exactly
    as the uninterrupted run; and saving asynchronously must change nothing of the training itself.
    """
    run = RUN + ("local.nproc=2", "train.global_batch=16", "train.micro_batch=4", "train.ckpt_keep=4")
    whole, run_dir = tmp_path / "whole", tmp_path / "async"
    assert launch(*run, f"hydra.run.dir={whole}").returncode == 0
    result = launch(*run, "train.async_checkpoint=true", f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr + result.stdout
    uninterrupted = losses(whole)
    assert sorted(losses(run_dir)) == sorted(uninterrupted)
    assert_same_losses(losses(run_dir), uninterrupted, uninterrupted)
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [f"step_{s:08d}" for s in (5, 10, 15, 20)]
    for later in (15, 20):
        shutil.rmtree(checkpoints / f"step_{later:08d}")
    resumed = launch(*run, "train.async_checkpoint=true", f"hydra.run.dir={run_dir}")
    assert resumed.returncode == 0, resumed.stderr + resumed.stdout
    assert "resumed from" in resumed.stdout and "step_00000010" in resumed.stdout
    assert_same_losses(losses(run_dir), uninterrupted, range(11, 21))


def test_rerun_of_a_finished_run_does_nothing_more(tmp_path):
    run_dir = tmp_path / "run"
    assert launch(*RUN, "train.steps=5", f"hydra.run.dir={run_dir}").returncode == 0
    again = launch(*RUN, "train.steps=5", f"hydra.run.dir={run_dir}")
    assert again.returncode == 0
    assert "resumed from" in again.stdout
    assert sorted(losses(run_dir)) == [1, 2, 3, 4, 5]


def test_unfinished_checkpoint_is_ignored_and_removed(tmp_path):
    run_dir = tmp_path / "run"
    assert launch(*RUN, "train.stop_at_step=10", f"hydra.run.dir={run_dir}").returncode == 0
    ckpts = run_dir / "checkpoints"
    # A save that died half way: shards present, no manifest, still named .partial.
    shutil.copytree(ckpts / "step_00000010", ckpts / "step_00000015.partial")
    (ckpts / "step_00000015.partial" / "manifest.json").unlink()
    result = launch(*RUN, f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr
    assert "step_00000010" in result.stdout
    assert not (ckpts / "step_00000015.partial").exists()
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000015", "step_00000020"]  # ckpt_keep=2


def start_in_terminal(*overrides: str):
    """`python -m pretrain.launch` in a process group of its own, as a shell runs a foreground command."""
    import subprocess
    import sys

    from tests.helpers import REPO

    return subprocess.Popen([sys.executable, "-m", "pretrain.launch", *overrides], cwd=REPO, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def ctrl_c(proc) -> None:
    """What a terminal does on Ctrl-C: SIGINT to the whole foreground process group."""
    import os
    import signal

    os.killpg(proc.pid, signal.SIGINT)


def wait_for_step(run_dir, step: int, timeout: float = 120) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not ((run_dir / "metrics.jsonl").is_file() and max(losses(run_dir), default=0) >= step):
        assert time.monotonic() < deadline, f"{run_dir} did not reach step {step}"
        time.sleep(0.1)


@pytest.mark.parametrize("nproc", [1, 2])
def test_ctrl_c_checkpoints_and_says_how_to_resume(tmp_path, nproc):
    from pretrain.rundir import complete_checkpoints

    run_dir = tmp_path / "run"
    args = (*RUN, "train.steps=500", f"local.nproc={nproc}", "train.global_batch=16", "train.micro_batch=8")
    proc = start_in_terminal(*args, f"hydra.run.dir={run_dir}")
    wait_for_step(run_dir, 3)
    ctrl_c(proc)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err
    assert "(SIGINT); rerun the same run directory to resume from" in out
    assert f"stopped with a checkpoint; to resume: python -m pretrain.launch " in err
    assert f"hydra.run.dir={run_dir}" in err
    saved = complete_checkpoints(run_dir / "checkpoints")
    assert saved and int(saved[-1].name.removeprefix("step_")) == max(losses(run_dir))


def test_a_second_ctrl_c_aborts_at_once(tmp_path):
    import time

    run_dir = tmp_path / "run"
    proc = start_in_terminal("train.steps=500", "train.log_every=1", "train.eval_every=0", "local.nproc=2",
                             f"hydra.run.dir={run_dir}")  # the tiny model: a step takes long enough for two Ctrl-Cs
    wait_for_step(run_dir, 2)
    ctrl_c(proc)
    time.sleep(0.2)
    ctrl_c(proc)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "second Ctrl-C: aborting now, without a checkpoint (the last one is intact)" in err
    assert "Traceback" not in out + err


def test_two_process_resume_ends_cleanly_every_time(tmp_path):
    """Once in three such runs a rank used to abort at exit ("terminate called without an active
    exception", exit -6) after its final checkpoint, and the launcher reported a finished run as failed."""
    args = (*RUN, "local.nproc=2", "train.global_batch=16", "train.micro_batch=8", "train.stop_at_step=10")
    for attempt in range(3):
        run_dir = tmp_path / f"run{attempt}"
        for leg in ("first", "resumed"):
            result = launch(*args, f"hydra.run.dir={run_dir}")
            logs = "".join(p.read_text() for p in (run_dir / "logs").glob("*.log"))
            assert result.returncode == 0, (attempt, leg, result.stderr[-2000:], logs[-2000:])
            assert "terminate called" not in result.stderr + logs
        assert max(losses(run_dir)) == 20


def test_compiled_blocks_train_like_eager_ones_and_share_their_checkpoints(tmp_path):
    """fsdp.compile=true compiles each block in place as one graph (fullgraph), under selective activation
    checkpointing: the same losses as eager, and checkpoints that load either way."""
    run = (*RUN, "train.steps=4", "train.ckpt_every=2", "fsdp.activation_checkpointing=selective")
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    assert launch(*run, f"hydra.run.dir={eager}").returncode == 0
    # Inductor writes TORCHINDUCTOR_CACHE_DIR into the environment of any process that compiled: inherited,
    # it must not take the caches away from the run directory.
    inherited = tmp_path / "inherited-inductor-cache"
    result = launch(*run, "fsdp.compile=true", "train.stop_at_step=2", f"hydra.run.dir={compiled}",
                    env={"TORCHINDUCTOR_CACHE_DIR": str(inherited)})
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = launch(*run, f"hydra.run.dir={compiled}")  # the compiled run's checkpoint, resumed eager
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-3000:]
    for step in (1, 2, 3, 4):
        assert losses(compiled)[step] == pytest.approx(losses(eager)[step], rel=1e-4), step
    # Each job records its start-up by phase; the compiled one kept its compile caches in the run directory.
    startups = [r for r in metrics(compiled) if "startup_s" in r]
    assert [r["step"] for r in startups] == [1, 3], startups
    assert "first step (compilation)" in startups[0]["startup"] and "checkpoint" in startups[1]["startup"]
    assert list(startups[0]["startup"])[3:5] == ["compiler import", "model"]  # the wait for the import ahead, apart
    assert sum(startups[0]["startup"].values()) == pytest.approx(startups[0]["startup_s"], abs=0.1)
    assert any((compiled / "cache" / "compile").rglob("*.py")), "Inductor wrote nothing to the run's cache"
    assert not inherited.exists()
    assert "s from process start to the first step: process start and imports" in resumed.stdout
