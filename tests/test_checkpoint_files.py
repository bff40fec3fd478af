"""What a save writes: several shard files per rank, each in the manifest with its digest, and
for asynchronous saves the digests are computed off the training thread."""

from __future__ import annotations

import json
import logging
import threading
import time
import zlib

import google_crc32c
import pytest
import torch

from pretrain.trainer import checkpoint, shard_reader
from pretrain.rundir import read_manifest
from pretrain.trainer.checkpoint import Checkpointer, problems
from pretrain.trainer.checksums import checksum_of
from pretrain.config import ModelConfig
from tests import helpers


@pytest.fixture
def one_process_group():
    with helpers.one_process_group():
        yield


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(6)))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("async_save", [False, True])
def test_shards_are_written_by_several_threads_and_digested_off_the_training_thread(
        tmp_path, one_process_group, monkeypatch, async_save):
    monkeypatch.setattr(checkpoint, "writer_threads", lambda: 3)
    digesting_threads = []
    digest = checkpoint.digest
    monkeypatch.setattr(checkpoint, "digest", lambda *a: digesting_threads.append(threading.current_thread()) or digest(*a))
    model, optimizer = model_and_optimizer()
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    saver = Checkpointer(tmp_path, keep=2, async_save=async_save)
    path = saver.save(7, model, optimizer, {"step": 7}, ModelConfig(), "hash")
    published = saver.collect(torch.device("cpu"), wait=True)
    assert published.path == path and published.step == 7 and published.asynchronous == async_save

    shards = sorted(p.name for p in path.glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__0_1.distcp", "__0_2.distcp"]
    files = read_manifest(path)["files"]
    assert set(shards) <= set(files) and ".metadata" in files
    assert all(set(files[name]) == {"size", "crc32c"} for name in files)  # the compiled CRC32C: the fast one
    assert all(files[name]["crc32c"] == checksum_of(path / name, "crc32c") for name in files)
    assert problems(path) == []
    assert (threading.main_thread() in digesting_threads) != async_save

    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    saver.load(path, model, optimizer)
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_tidy_publishes_finished_saves_and_removes_the_rest(tmp_path, one_process_group):
    model, optimizer = model_and_optimizer()
    saved = Checkpointer(tmp_path, keep=5).save(3, model, optimizer, {"step": 3}, ModelConfig(), "hash")
    finished = saved.rename(saved.with_name(saved.name + ".partial"))  # killed between the manifest and the rename
    unfinished = tmp_path / "step_00000005.partial"
    (unfinished / "rng").mkdir(parents=True)
    half_deleted = tmp_path / "step_00000001.removing"
    half_deleted.mkdir()
    (half_deleted / "manifest.json").write_text("{}")

    checkpoint.tidy(tmp_path)

    assert [p.name for p in tmp_path.iterdir()] == ["step_00000003"]
    assert not finished.exists() and problems(saved) == []


def test_the_same_step_saved_again_replaces_the_first(tmp_path, one_process_group):
    model, optimizer = model_and_optimizer()
    saver = Checkpointer(tmp_path, keep=5)
    saver.save(3, model, optimizer, {"step": 3}, ModelConfig(), "first")
    path = saver.save(3, model, optimizer, {"step": 3}, ModelConfig(), "second")
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000003"]
    assert read_manifest(path)["config_hash"] == "second" and problems(path) == []


def test_a_step_damaged_twice_is_kept_twice(tmp_path):
    for _ in range(2):
        (tmp_path / "step_00000004").mkdir()
        checkpoint.set_aside(tmp_path / "step_00000004")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004.damaged", "step_00000004.damaged-2"]


def damage(path) -> None:
    """Flip the first byte of a file, keeping its size."""
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))


def test_each_rank_checks_the_files_it_wrote_and_rank_0_the_others(tmp_path):
    names = ["__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__1_1.distcp", ".metadata", "rng/rank0.pt",
             "rng/rank1.pt", "extra.bin"]
    (tmp_path / "rng").mkdir()
    for index, name in enumerate(names):
        (tmp_path / name).write_bytes(bytes([index]) * 100)
    manifest = {"world_size": 2, "files": checkpoint.digest(tmp_path, names)}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    damage(tmp_path / "__1_0.distcp")
    damage(tmp_path / "extra.bin")

    assert problems(tmp_path, 0, 2) == ["extra.bin fails its checksum"]
    assert problems(tmp_path, 1, 2) == ["__1_0.distcp fails its checksum"]
    # Checked by another number of ranks than wrote it: every file is still someone's.
    assert sorted(p for rank in range(3) for p in problems(tmp_path, rank, 3)) == [
        "__1_0.distcp fails its checksum", "extra.bin fails its checksum"]


def test_a_manifest_of_crc32s_as_saves_wrote_before_crc32c_is_still_checked(tmp_path):
    """Checkpoints of runs begun with an older package record zlib's CRC32: they load, and damage is found."""
    names = ["__0_0.distcp", "__0_1.distcp", ".metadata", "rng/rank0.pt"]
    (tmp_path / "rng").mkdir()
    for index, name in enumerate(names):
        (tmp_path / name).write_bytes(bytes([index]) * 100_000)
    files = {name: {"size": 100_000, "crc32": zlib.crc32((tmp_path / name).read_bytes())} for name in names}
    files["unsummed.bin"] = {"size": 1}
    (tmp_path / "unsummed.bin").write_bytes(b"x")
    (tmp_path / "manifest.json").write_text(json.dumps({"world_size": 1, "files": files}))
    assert checksum_of(tmp_path / "__0_0.distcp", "crc32") == files["__0_0.distcp"]["crc32"]
    assert checksum_of(tmp_path / "__0_0.distcp", "crc32c") != files["__0_0.distcp"]["crc32"]
    assert problems(tmp_path) == ["unsummed.bin has no checksum in the manifest"]
    damage(tmp_path / "__0_1.distcp")
    assert problems(tmp_path) == ["__0_1.distcp fails its checksum", "unsummed.bin has no checksum in the manifest"]


def test_a_save_records_zlibs_crc32_where_google_crc32c_has_only_its_python_fallback(tmp_path, monkeypatch):
    """The fallback sums 7 MB a second on the CPU machine: 17 GiB of shards would take most of an hour."""
    (tmp_path / "__0_0.distcp").write_bytes(b"shard" * 1000)
    assert set(checkpoint.digest(tmp_path, ["__0_0.distcp"])["__0_0.distcp"]) == {"size", "crc32c"}
    monkeypatch.setattr(google_crc32c, "implementation", "python")
    files = checkpoint.digest(tmp_path, ["__0_0.distcp"])
    assert files == {"__0_0.distcp": {"size": 5000, "crc32": zlib.crc32(b"shard" * 1000)}}
    (tmp_path / "manifest.json").write_text(json.dumps({"world_size": 1, "files": files}))
    assert problems(tmp_path) == []


def test_the_shard_files_that_pass_their_check_are_handed_on_and_no_others(tmp_path):
    """What a requeued job registers with CUDA for its load: each DCP shard file of its share that passed."""
    names = ["__0_0.distcp", "__0_1.distcp", ".metadata", "rng/rank0.pt"]
    (tmp_path / "rng").mkdir()
    for index, name in enumerate(names):
        (tmp_path / name).write_bytes(bytes([index]) * 100)
    (tmp_path / "manifest.json").write_text(json.dumps({"world_size": 1, "files": checkpoint.digest(tmp_path, names)}))
    damage(tmp_path / "__0_1.distcp")
    passed = []
    assert problems(tmp_path, 0, 1, passed.append) == ["__0_1.distcp fails its checksum"]
    assert passed == [tmp_path / "__0_0.distcp"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA registers the file here: tests/test_gpu.py loads through it")
def test_a_file_cuda_cannot_register_is_left_to_the_pinned_buffers_and_beyond_the_budget_none_is_tried(tmp_path):
    """Where registering fails (here: no CUDA), the failure names the file and why, and a load takes nothing, so
    it reads every file as before; a file beyond the memory budget is not even tried."""
    from pretrain.trainer.shard_reader import RegisteredFiles

    big, small = tmp_path / "__0_0.distcp", tmp_path / "__0_1.distcp"
    big.write_bytes(b"x" * 200)
    small.write_bytes(b"y" * 50)
    registered = RegisteredFiles(torch.device("cuda", 0), budget=100, threads=1)
    registered.add(big)
    registered.add(small)
    deadline = time.monotonic() + 10
    while registered.failure is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert registered.failure is not None and registered.failure.startswith("__0_1.distcp: ")
    assert registered.take() == {}
    assert registered.timing(time.perf_counter()) == "none registered in time"


def test_the_log_says_how_long_registering_took_and_when_against_the_load():
    """What a requeued GPU job logs at its load, to set against its start-up's phases (attempt 65: the registering
    moved into the model's build); 2 GiB then 1 GiB, overlapping, the load at 12.0."""
    spans = [(10.0, 10.5, 2 << 30), (10.25, 11.0, 1 << 30)]
    assert shard_reader.registering_summary(spans, now=12.0) == (
        "2 files (3.0 GiB), 1.25 s of registering (longest 0.75 s), begun 2.00 s and done 1.00 s before the load")


def test_a_check_ahead_is_summarised_with_whether_the_load_waited_for_it():
    """What a requeued job logs when its load asks for the check begun at its start: 3 GiB in 1.5 s, then asked
    for half a second after it ended, or a quarter second before."""
    assert checkpoint.check_summary((2, 3 << 30), began=10.0, ended=11.5, asked=12.0) == (
        "2 files (3.0 GiB) in 1.50 s, done 0.50 s before the load asked for it")
    assert checkpoint.check_summary((2, 3 << 30), began=10.0, ended=11.5, asked=11.25) == (
        "2 files (3.0 GiB) in 1.50 s, the load waited 0.25 s for it")


def test_the_newest_checkpoint_is_checked_ahead_in_the_background_and_others_when_asked(
        tmp_path, one_process_group, monkeypatch, caplog):
    model, optimizer = model_and_optimizer()
    saver = Checkpointer(tmp_path, keep=5)
    older = saver.save(3, model, optimizer, {"step": 3}, ModelConfig(), "hash")
    newest = saver.save(6, model, optimizer, {"step": 6}, ModelConfig(), "hash")
    damage(newest / "__0_0.distcp")
    checking_threads = []
    check = checkpoint.problems
    monkeypatch.setattr(checkpoint, "problems", lambda *a: checking_threads.append(threading.current_thread()) or check(*a))

    caplog.set_level(logging.INFO, logger=checkpoint.__name__)
    ahead = checkpoint.VerifyAhead(tmp_path, rank=0, world_size=1)
    assert ahead.path == newest
    assert checkpoint.verify(newest, ahead) == ["__0_0.distcp fails its checksum"]
    assert checking_threads[0].name.startswith("checkpoint-verify") and len(checking_threads) == 1
    files = read_manifest(newest)["files"]
    size = sum(entry["size"] for entry in files.values())
    summary = f"checkpoint {newest.name} checked ahead: {len(files)} files ({size / 2**30:.1f} GiB) in "
    assert any(r.getMessage().startswith(summary) for r in caplog.records), caplog.text
    assert ahead.problems_of(older) is None and checkpoint.verify(older, ahead) == []
    assert checking_threads[1] is threading.main_thread()
    assert checkpoint.VerifyAhead(tmp_path / "none", rank=0, world_size=1).path is None


def test_pinned_buffers_are_reserved_ahead_only_where_a_load_reads_a_file_unregistered(tmp_path, one_process_group):
    """A requeued GPU job reserves pinned buffers from its first moments only for a load that will read
    some file through them: one whose shard files do not all fit the registration budget, or that this
    job's ranks did not write (a resharding load reads pieces of files no rank registered)."""
    model, optimizer = model_and_optimizer()
    path = Checkpointer(tmp_path, keep=2).save(3, model, optimizer, {"step": 3}, ModelConfig(), "hash")
    shards = sum(f.stat().st_size for f in path.glob("*.distcp"))

    def registers_all(budget: int, world_size: int = 1) -> bool:
        registered = shard_reader.RegisteredFiles(torch.device("cpu"), budget)  # registers nothing: no CUDA
        return checkpoint.VerifyAhead(tmp_path, rank=0, world_size=world_size, registered=registered).registers_all()

    assert registers_all(shards)
    assert not registers_all(shards - 1)
    assert not registers_all(10 * shards, world_size=2)
    assert not checkpoint.VerifyAhead(tmp_path, rank=0, world_size=1).registers_all()  # a CPU job registers none


def test_a_load_that_would_leave_saved_entries_unread_is_refused(tmp_path, one_process_group):
    """An optimizer without state asks DCP for no moments, and DCP loads the weights alone without a word
    (torch's get_state_dict makes the state by a step on zero gradients, except where gradients are already
    there, or where the optimizer ignores them, as MasterAdamW reading its copies' did): the load is refused."""
    model, optimizer = model_and_optimizer()
    path = Checkpointer(tmp_path, keep=2).save(3, model, optimizer, {"step": 3}, ModelConfig(), "hash")
    fresh_model, fresh = model_and_optimizer()
    fresh.state.clear()
    with pytest.raises(checkpoint.CheckpointError, match=r"entries that this job's model and optimizer do not take "
                                                          r"\(optim\.state\..*exp_avg"):
        Checkpointer(tmp_path, keep=2).load(path, fresh_model, fresh)
    with_state_model, with_state = model_and_optimizer()
    Checkpointer(tmp_path, keep=2).load(path, with_state_model, with_state)  # the same load with state: accepted
    assert all(torch.equal(a, b) for a, b in zip(with_state_model.parameters(), model.parameters()))


def test_the_registration_budget_stays_within_the_jobs_memory_cgroup(tmp_path):
    """Registered pages cannot be reclaimed: under Slurm's --mem (a cgroup limit, v2 or v1) each rank may pin
    half of what the tightest limit above it leaves, shared among the node's ranks, not half of the node's."""
    from pretrain.trainer.shard_reader import memory_budget

    gib = 1 << 30
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: {200 * gib // 1024} kB\nMemAvailable: {100 * gib // 1024} kB\n")
    v2 = tmp_path / "cgroup2"
    job = v2 / "system.slice" / "slurmstepd.scope" / "job_7"
    task = job / "step_0" / "user" / "task_0"
    task.mkdir(parents=True)
    (proc / "self" / "cgroup").write_text("0::/system.slice/slurmstepd.scope/job_7/step_0/user/task_0\n")
    (job / "memory.max").write_text(f"{10 * gib}\n")
    (job / "memory.current").write_text(f"{4 * gib}\n")
    (task / "memory.max").write_text("max\n")
    (task / "memory.current").write_text(f"{3 * gib}\n")
    assert memory_budget(2, proc, v2) == 6 * gib // 4
    (job / "memory.max").write_text("max\n")
    assert memory_budget(2, proc, v2) == 100 * gib // 4  # no limit: the node's free memory

    v1 = tmp_path / "cgroup1"
    step = v1 / "memory" / "slurm" / "uid_1" / "job_7" / "step_0"
    step.mkdir(parents=True)
    (proc / "self" / "cgroup").write_text("5:cpuset:/slurm/uid_1/job_7/step_0\n12:memory:/slurm/uid_1/job_7/step_0\n")
    (step.parent / "memory.limit_in_bytes").write_text(f"{8 * gib}\n")
    (step.parent / "memory.usage_in_bytes").write_text(f"{2 * gib}\n")
    (step / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    (step / "memory.usage_in_bytes").write_text(f"{1 * gib}\n")
    assert memory_budget(1, proc, v1) == 6 * gib // 2
    (proc / "meminfo").unlink()
    assert memory_budget(1, proc, v1) == 0  # the node's free memory unknown: nothing is registered
