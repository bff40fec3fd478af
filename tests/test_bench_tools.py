"""The benchmark tools that drive the package's own classes still run against them.

bench/profile_step.py builds the Trainer and calls its step directly, not through the launcher, so a change
to the Trainer can break it without any other test noticing (it did: it called a method since removed, found
only on a GPU machine). Here it runs on the CPU with a tiny model; its kernel tables are empty there.
"""

import json
import subprocess
import sys

import pytest

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


def _speedscope(threads: dict[str, list[tuple[list[tuple[str, str]], float]]]) -> dict:
    """A record laid out as py-spy writes it with --threads --subprocesses: one profile per thread, each sample
    a stack of frame indices, outermost first, under a frame naming the process and one naming the thread."""
    frames: list[dict] = []

    def index(name: str, file: str) -> int:
        frame = {"name": name, "file": file, "line": 1, "col": None}
        if frame not in frames:
            frames.append(frame)
        return frames.index(frame)

    profiles = []
    for thread, samples in threads.items():
        head = [index(f"process {thread.split()[1]}", ""), index(f"thread: {thread}", "")]
        profiles.append({"type": "sampled", "name": thread, "unit": "seconds", "startValue": 0.0,
                         "endValue": sum(w for _, w in samples), "weights": [w for _, w in samples],
                         "samples": [head + [index(n, f"/site/{f}") for n, f in stack] for stack, _ in samples]})
    return {"shared": {"frames": frames}, "profiles": profiles}


@pytest.mark.parametrize("qualified", [True, False])
def test_startup_profile_ends_at_the_first_step_and_tables_the_reading_threads(tmp_path, qualified):
    """py-spy names methods with their class in some versions and without it in others: the window ends at the
    first sample after a step either way, and the checkpoint-reading threads of the rank's process are summed
    (not its registering threads, nor another process's)."""
    loop, reader = "pretrain/trainer/loop.py", "pretrain/trainer/shard_reader.py"
    method = (lambda name: f"Trainer.{name}") if qualified else (lambda name: name)
    entry = ("<module>", "pretrain/train.py")
    record = _speedscope({
        'Process 10 Thread 10 ""': [
            ([entry, ("main", loop), ("load", loop)], 0.5),
            ([entry, ("fit", loop), (method("train_step"), loop), ("forward", "pretrain/models/llama.py")], 1.0),
            ([entry, ("fit", loop), (method("started"), loop)], 0.01),
            ([entry, ("fit", loop), (method("save"), loop)], 5.0)],
        'Process 10 Thread 11 "checkpoint-read_0"': [([("_read_run", reader), ("_copy_registered", reader)], 0.3)],
        'Process 10 Thread 12 "checkpoint-read_1"': [([("_read_run", reader), ("locate", reader)], 0.2)],
        'Process 10 Thread 13 "checkpoint-register_0"': [([("_register", reader)], 0.4)],
        'Process 99 Thread 20 "checkpoint-read_0"': [([("_read_run", reader)], 1.0)]})
    path = tmp_path / "job.speedscope.json"
    path.write_text(json.dumps(record))
    done = subprocess.run([sys.executable, "bench/startup_profile.py", str(path), "--name", "p", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "p.json").read_text())["records"][0]
    assert summary["seconds"] == 1.5  # the save after the first step is not start-up
    assert dict(summary["first_step"]) == {"forward (pretrain/models/llama.py)": 1.0}
    assert summary["reading_threads"] == 2
    reading = dict(summary["reading"])
    assert reading[f"_read_run ({reader})"] == 0.5 and reading[f"_copy_registered ({reader})"] == 0.3
    assert f"_register ({reader})" not in reading
    assert "summed over 2 threads" in (tmp_path / "p.md").read_text()


def test_read_threads_times_loads_of_small_tensors_at_each_thread_count(tmp_path):
    argv = [sys.executable, "bench/read_threads.py", "--tensors", "24", "--files", "2", "--threads", "3", "1",
            "--repeats", "2", "--name", "rt", "--out", str(tmp_path)]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "rt.json").read_text())
    assert result["files"] == 2 and [row["threads"] for row in result["rows"]] == [3, 1]
    assert all(len(row["read_all_s"]) == 2 and 0 < row["read_s"] <= row["load_s"] for row in result["rows"])
