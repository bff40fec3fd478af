"""The benchmark tools that drive the package's own classes still run against them.

bench/profile_step.py builds the Trainer and calls its step directly, not through the launcher, so a change
to the Trainer can break it without any other test noticing (it did: it called a method since removed, found
only on a GPU machine). Here it runs on the CPU with a tiny model; its kernel tables are empty there.
"""

import json
import subprocess
import sys

from tests.helpers import REPO


def test_profile_step_profiles_the_trainers_steps_on_a_cpu(tmp_path):
    out = tmp_path / "results"
    argv = [sys.executable, "bench/profile_step.py", "model=tiny", "train.seq_len=64", "train.micro_batch=2",
            "train.global_batch=2", "fsdp.compile=false", "--warmup", "2", "--steps", "2", "--name", "tiny",
            "--out", str(out), "--runs", str(tmp_path / "runs")]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "tiny.json").read_text())
    assert result["steps"] == 2
    assert result["wall_ms_per_step"] > 0
    assert "model=tiny" in result["overrides"] and "precision=bf16" in result["overrides"]
    assert (tmp_path / "runs" / "tiny" / "config.yaml").exists()
    assert "ms/step" in (out / "tiny.md").read_text()


def test_profile_step_finds_the_devices_idle_gaps_across_streams():
    """Two streams overlap: only time where neither runs counts; gaps land in their size's bucket."""
    spans = [(0, 100, "a"), (50, 300, "b"), (303, 400, "c"), (2400, 2500, "d"), (2420, 2430, "e"), (2530, 2600, "f")]
    code = ("import json, sys; sys.path.insert(0, 'bench'); import profile_step; "
            f"print(json.dumps(profile_step.idle_gaps({spans!r}, steps=1, largest=2)))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    idle = json.loads(done.stdout)
    assert idle["span_ms_per_step"] == 2.6
    assert abs(idle["idle_ms_per_step"] - (3 + 2000 + 30) / 1000) < 1e-9
    assert [b["count_per_step"] for b in idle["buckets"]] == [1, 1, 0, 1]
    assert idle["largest"] == [{"us": 2000, "after": "c", "before": "d"}, {"us": 30, "after": "d", "before": "f"}]
