"""Checkpoints survive crashes and damage: kill -9 at random moments (during saves too), corrupted
or truncated files, NaN losses and gradients."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys

import pytest

from pretrain.hosts import free_port
from pretrain.rundir import CHECKSUM_KINDS, MANIFEST, complete_checkpoints, read_manifest
from pretrain.trainer.checkpoint import problems
from tests.helpers import MINI_MODEL, REPO, assert_same_losses, last_step_record, launch, losses, snapshot

SETTINGS = ("precision=fp32", "train.log_every=1", "train.eval_every=0")
RUN = (*SETTINGS, *MINI_MODEL)


def assert_every_complete_checkpoint_is_intact(root) -> None:
    for path in complete_checkpoints(root):
        assert problems(path) == [], path


def test_kill_9_at_random_moments_never_leaves_a_broken_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    # The default model: its steps are slow enough that the kills land inside training and saves.
    args = [sys.executable, "-m", "pretrain.launch", *SETTINGS, "train.steps=40", "train.ckpt_every=2",
            "train.ckpt_keep=3", f"hydra.run.dir={run_dir}"]
    rng = random.Random(7)
    kills_in_save = 0
    for attempt in range(9):
        done = max(losses(run_dir), default=0) if (run_dir / "metrics.jsonl").exists() else 0
        env = None
        if attempt % 3 == 2:  # a kill in the middle of a save: shards written, not yet published
            env = {"PRETRAIN_FAULTS": f"kill_in_save@{done - done % 2 + 4}"}
            kills_in_save += 1
        proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})}, start_new_session=True)
        try:
            proc.wait(timeout=rng.uniform(4.0, 9.0))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its training process, as a power cut would
            proc.wait()
        assert_every_complete_checkpoint_is_intact(run_dir / "checkpoints")
    assert kills_in_save == 3
    final = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert final.returncode == 0, final.stderr
    assert sorted(losses(run_dir)) == list(range(1, 41))
    assert_every_complete_checkpoint_is_intact(run_dir / "checkpoints")
    assert not list((run_dir / "checkpoints").glob("*.partial"))


def test_kill_while_pruning_leaves_no_checkpoint_that_looks_complete(tmp_path):
    run_dir = tmp_path / "run"
    args = (*RUN, "train.steps=10", "train.ckpt_every=2", "train.ckpt_keep=2", f"hydra.run.dir={run_dir}")
    killed = launch(*args, env={"PRETRAIN_FAULTS": "kill_in_remove@2"})  # step 2 is pruned when step 6 is published
    assert killed.returncode == 1 and f"error: rank 0 exited with code {-signal.SIGKILL}" in killed.stderr
    root = run_dir / "checkpoints"
    assert_every_complete_checkpoint_is_intact(root)
    assert [p.name for p in complete_checkpoints(root)] == ["step_00000004", "step_00000006"]
    assert (root / "step_00000002.removing").is_dir()  # killed with its files half deleted
    resumed = launch(*args)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout and "step_00000006" in resumed.stdout
    assert sorted(p.name for p in root.iterdir()) == ["step_00000008", "step_00000010"]


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path, damage):
    whole, run_dir = tmp_path / "whole", tmp_path / "run"
    assert launch(*RUN, "train.steps=15", "train.ckpt_every=5", f"hydra.run.dir={whole}").returncode == 0
    first = launch(*RUN, "train.steps=15", "train.ckpt_every=5", "train.stop_at_step=10", f"hydra.run.dir={run_dir}")
    assert first.returncode == 0, first.stderr
    shard = next((run_dir / "checkpoints" / "step_00000010").glob("__0_*.distcp"))
    data = bytearray(shard.read_bytes())
    if damage == "truncate":
        shard.write_bytes(data[: len(data) // 2])
    else:
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(data)
    result = launch(*RUN, "train.steps=15", "train.ckpt_every=5", f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr
    assert "step_00000010 is damaged" in result.stdout and "an earlier one is tried" in result.stdout
    assert "resumed from" in result.stdout and "step_00000005" in result.stdout
    assert (run_dir / "checkpoints" / "step_00000010.damaged").is_dir()  # kept, not deleted
    assert_same_losses(losses(run_dir), losses(whole), [15])


def test_damaged_only_checkpoint_stops_the_run_instead_of_restarting_from_step_0(tmp_path):
    run_dir = tmp_path / "run"
    args = (*RUN, "train.steps=8", "train.ckpt_every=4", "train.ckpt_keep=1", f"hydra.run.dir={run_dir}")
    assert launch(*args, "train.stop_at_step=4").returncode == 0
    shard = next((run_dir / "checkpoints" / "step_00000004").glob("__0_*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    before = losses(run_dir)
    refused = launch(*args)
    assert refused.returncode == 1
    aside = run_dir / "checkpoints" / "step_00000004.damaged"
    assert f"error: every checkpoint of this run is damaged (set aside as {aside}); nothing was trained. " \
           "To start this run directory again from step 0, rerun with train.start_from_scratch=true" in refused.stderr
    assert "an earlier one is tried" in refused.stdout and "previous one is used" not in refused.stdout
    assert losses(run_dir) == before and aside.is_dir()  # nothing trained, nothing overwritten
    # Rerun as it was: now refused before anything starts (the launcher sees the set-aside checkpoint).
    refused_again = launch(*args)
    assert refused_again.returncode == 2 and "every checkpoint of this run is damaged" in refused_again.stderr
    assert losses(run_dir) == before
    again = launch(*args, "train.start_from_scratch=true")
    assert again.returncode == 0, again.stderr
    assert "starting from step 0 (train.start_from_scratch=true)" in again.stdout
    assert sorted(losses(run_dir)) == list(range(1, 9)) and aside.is_dir()


def test_nan_steps_are_skipped_and_counted(tmp_path):
    run_dir = tmp_path / "run"
    result = launch(*RUN, "train.steps=8", f"hydra.run.dir={run_dir}",
                    env={"PRETRAIN_FAULTS": "nan_loss@3,nan_grad@6"})
    assert result.returncode == 0, result.stderr
    assert "step 3 skipped: non-finite loss or gradient" in result.stdout
    assert "step 6 skipped" in result.stdout
    assert last_step_record(run_dir)["skipped_steps"] == 2


def test_too_many_nan_steps_stop_the_run_with_finite_checkpoints(tmp_path):
    run_dir = tmp_path / "run"
    result = launch(*RUN, "train.steps=20", "train.ckpt_every=2", "train.max_bad_steps=3", f"hydra.run.dir={run_dir}",
                    env={"PRETRAIN_FAULTS": "nan_loss@5-20"})
    assert result.returncode == 1
    message = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert message == ["error: 3 steps in a row had a non-finite loss or gradient (train.max_bad_steps=3); training "
                       "stopped at step 7. Lower optim.lr, raise optim.warmup_steps or check the data; the last "
                       "checkpoint is intact."]
    # The checkpoints written while steps were being skipped hold the last good weights: resuming trains on.
    resumed = launch(*RUN, "train.steps=10", "train.ckpt_every=2", f"hydra.run.dir={run_dir}")
    assert resumed.returncode == 0, resumed.stderr
    curve = losses(run_dir)
    assert all(curve[step] == curve[step] for step in range(8, 11))  # finite, not NaN


def test_a_checkpoint_a_newer_pretrain_wrote_is_refused_and_never_set_aside(tmp_path):
    """A requeued job whose container brings an older pretrain than the one that saved: checksums of a kind
    it cannot compute are not damage. The launcher refuses before anything starts, and the job itself (as a
    requeue starts it, without the launcher) stops with the same error, leaving the checkpoint where it is."""
    run_dir = tmp_path / "run"
    args = (*RUN, "train.steps=8", "train.ckpt_every=4", f"hydra.run.dir={run_dir}")
    assert launch(*args, "train.stop_at_step=4").returncode == 0
    newest = complete_checkpoints(run_dir / "checkpoints")[-1]
    manifest = read_manifest(newest)
    for entry in manifest["files"].values():
        entry["xxh3"] = entry.pop(next(kind for kind in CHECKSUM_KINDS if kind in entry))
    (newest / MANIFEST).write_text(json.dumps(manifest))
    before = snapshot(run_dir)
    expected = (f"error: checkpoint {newest} records checksums of a kind this version of pretrain cannot check "
                f"(xxh3; it checks {', '.join(CHECKSUM_KINDS)}): a newer pretrain wrote it.")

    refused = launch(*args)
    assert refused.returncode == 2 and expected in refused.stderr, refused.stderr
    assert snapshot(run_dir) == before

    identity = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    job = subprocess.run([sys.executable, "-m", "pretrain.train", str(run_dir)], cwd=REPO, capture_output=True,
                         text=True, timeout=600, env={**os.environ, **identity})
    assert job.returncode == 1 and expected in job.stderr, job.stderr[-3000:]
    assert complete_checkpoints(run_dir / "checkpoints")[-1] == newest and read_manifest(newest) == manifest
    assert not list((run_dir / "checkpoints").glob("*.damaged*"))
