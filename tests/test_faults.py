"""Fault injection on local multi-process runs: a rank that dies or stalls ends the run quickly, and a
rerun resumes from the last complete checkpoint; a rank that has finished ends even where its
interpreter's teardown would hang."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from pretrain.rundir import complete_checkpoints
from tests.helpers import MINI_MODEL, REPO, launch, losses, processes_with_env

RUN = ("local.nproc=2", "precision=fp32", "train.steps=40", "train.log_every=1", "train.ckpt_every=5",
       "train.eval_every=0")


def start(run_dir, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pretrain.launch", *RUN, *extra, f"hydra.run.dir={run_dir}"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_step(run_dir, step: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run_dir / "metrics.jsonl").is_file() and any(s >= step for s in losses(run_dir)):
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    raise TimeoutError(f"no step {step} in {run_dir}")


def rank_pid(run_dir, rank: int) -> int:
    pids = [p for p in processes_with_env(RANK=str(rank), WORLD_SIZE="2")
            if str(run_dir) in open(f"/proc/{p}/cmdline").read().replace("\0", " ")]
    assert len(pids) == 1, pids
    return pids[0]


def test_killed_rank_ends_the_run_and_a_rerun_resumes(tmp_path):
    run_dir = tmp_path / "run"
    proc = start(run_dir, *MINI_MODEL)
    wait_for_step(run_dir, 12, proc)
    killed_at = time.monotonic()
    os.kill(rank_pid(run_dir, 1), signal.SIGKILL)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert time.monotonic() - killed_at < 30
    assert "rank 1 exited with code -9" in err and str(run_dir / "logs" / "rank1.log") in err
    rerun = subprocess.run([sys.executable, "-m", "pretrain.launch", *RUN, *MINI_MODEL, f"hydra.run.dir={run_dir}"],
                           cwd=REPO, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr
    assert "resumed from" in rerun.stdout
    assert sorted(losses(run_dir)) == list(range(1, 41))


@pytest.mark.parametrize("writes", ["blocking", "async"])
def test_a_rank_dying_during_a_save_is_requeued_not_taken_for_a_write_error(tmp_path, writes):
    """Rank 1 dies as the step-10 checkpoint's shards are written; rank 0's save then fails in DCP's
    collectives (in its writer thread, where saves are asynchronous). That is a broken job, which the batch
    script requeues, not a disk that cannot be written: no `.failed` (which would stop the requeues), and
    the rerun resumes from step 5 and finishes."""
    run_dir = tmp_path / "run"
    result = launch(*RUN, *MINI_MODEL, f"train.async_checkpoint={writes == 'async'}", f"hydra.run.dir={run_dir}",
                    env={"PRETRAIN_FAULTS": "peer_dies_in_save@10"})
    assert result.returncode != 0
    assert "rank 1 exited with code -9" in result.stderr, result.stderr
    assert "pretrain: collective failed" in result.stderr and "could not be written" not in result.stderr, \
        result.stderr
    assert not (run_dir / ".failed").exists(), (run_dir / ".failed").read_text()
    assert [p.name for p in complete_checkpoints(run_dir / "checkpoints")] == ["step_00000005"]
    rerun = launch(*RUN, *MINI_MODEL, f"hydra.run.dir={run_dir}")
    assert rerun.returncode == 0, rerun.stderr
    assert "resumed from" in rerun.stdout and "step_00000005" in rerun.stdout
    assert sorted(losses(run_dir)) == list(range(1, 41))


def test_stalled_rank_is_caught_by_the_watchdog(tmp_path):
    run_dir = tmp_path / "run"
    # 15 s: on a loaded 2-core CI machine the watchdog once fired at 5 s, before the test stalled a rank
    proc = start(run_dir, "train.hang_timeout_s=15")
    wait_for_step(run_dir, 8, proc)
    stalled = rank_pid(run_dir, 1)
    os.kill(stalled, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        out, err = proc.communicate(timeout=90)
    finally:
        try:
            os.kill(stalled, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert time.monotonic() - stopped_at < 60
    assert "rank 0 exited with code 124" in err
    assert "no training step completed for" in out + err
    # ... with where rank 0 waited: its threads' stacks, the training loop's among them
    assert "most recent call first" in err and "pretrain/trainer/loop.py" in err


# Imported by every Python process of the run below: each rank's interpreter teardown would then wait an hour.
HANGING_TEARDOWN = '''
import atexit, os, sys, time
atexit.register(lambda: os.path.basename(sys.argv[0]) == "train.py" and time.sleep(3600))
'''


def test_a_finished_rank_ends_at_once_even_where_teardown_would_hang(tmp_path):
    """A rank that has trained and checkpointed exits with its code without the interpreter's teardown,
    where torch's native threads can hang or abort a finished job (and a hung job holds its GPUs)."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(HANGING_TEARDOWN)
    run_dir = tmp_path / "run"
    started = time.monotonic()
    result = launch(*RUN, *MINI_MODEL, "train.steps=4", f"hydra.run.dir={run_dir}", timeout=300,
                    env={"PYTHONPATH": str(tmp_path / "site")})
    assert result.returncode == 0, result.stderr + result.stdout
    assert time.monotonic() - started < 120
    assert "done: step 4" in result.stdout and str(run_dir / "checkpoints" / "step_00000004") in result.stdout
    assert (run_dir / "logs" / "rank1.log").is_file() and sorted(losses(run_dir)) == [1, 2, 3, 4]


def test_the_launcher_blames_the_killed_rank_not_the_one_that_failed_after_it(tmp_path, capsys):
    """Both ended by the launcher's first look: rank 1 killed, rank 0 failing with an error because of it
    (as its checkpoint write did in a CI run, exiting before rank 1 was seen gone)."""
    from pretrain.launcher.local import _watch

    killed = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    failed = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    killed.wait(), failed.wait()
    assert _watch([failed, killed], tmp_path) == 1
    assert f"error: rank 1 exited with code -9; see {tmp_path / 'logs' / 'rank1.log'}" in capsys.readouterr().err
