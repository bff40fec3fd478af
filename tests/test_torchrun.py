"""The training entry point runs under any launcher that sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT; torchrun is the common one. Like every job, it starts from a run directory the launcher
wrote (prepare_only=true writes one and starts nothing)."""

from __future__ import annotations

import subprocess
import sys

from pretrain.hosts import free_port
from tests.helpers import MINI_MODEL, REPO, launch, losses


def test_torchrun_trains_a_run_directory_the_launcher_prepared(tmp_path):
    run_dir = tmp_path / "run"
    prepared = launch(*MINI_MODEL, "train.steps=6", "train.log_every=1", "train.eval_every=0", "precision=fp32",
                      "local.nproc=2", "prepare_only=true", f"hydra.run.dir={run_dir}")
    assert prepared.returncode == 0, prepared.stderr
    assert f"torchrun --nproc-per-node 2 -m pretrain.train {run_dir}" in prepared.stdout
    assert (run_dir / "config.yaml").is_file() and not (run_dir / "metrics.jsonl").exists()  # nothing started
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}", "-m",
         "pretrain.train", str(run_dir)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "world size 2" in (run_dir / "train.log").read_text()
    assert sorted(losses(run_dir)) == [1, 2, 3, 4, 5, 6]
    assert (run_dir / "checkpoints" / "step_00000006").is_dir()


def test_the_job_refuses_a_folder_that_is_not_a_run_directory(tmp_path):
    result = subprocess.run([sys.executable, "-m", "pretrain.train", str(tmp_path), "model=tiny"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "usage: python -m pretrain.train RUN_DIR" in result.stderr
    result = subprocess.run([sys.executable, "-m", "pretrain.train", str(tmp_path)], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and f"{tmp_path} is not a run directory" in result.stderr
