"""The training entry point runs under any launcher that sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT; torchrun is the common one."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import REPO, losses


def test_torchrun_trains_a_run_directory_it_composes_itself(tmp_path):
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-port=29533", "-m",
         "pretrain.train", str(run_dir), "train.steps=6", "train.log_every=1", "train.eval_every=0",
         "precision=fp32", "local.nproc=2"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "world size 2" in (run_dir / "train.log").read_text()
    assert sorted(losses(run_dir)) == [1, 2, 3, 4, 5, 6]
    assert (run_dir / "config.yaml").is_file() and (run_dir / "checkpoints" / "step_00000006").is_dir()
