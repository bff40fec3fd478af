"""Checkpoint loads read each tensor's bytes straight into its target where they lie as the target holds
them, and through DCP's torch.load otherwise: the values are exact either way."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from pretrain.hosts import free_port
from pretrain.trainer.shard_reader import ParallelReader, locate_tensor
from tests import helpers


def saved_state() -> dict:
    torch.manual_seed(0)
    return {"f32": torch.randn(33, 7), "bf16": torch.randn(5, 3).to(torch.bfloat16), "i64": torch.arange(10),
            "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4), "note": "not a tensor"}


def test_every_tensor_is_read_as_raw_bytes_into_its_target_exactly(tmp_path):
    state = saved_state()
    with helpers.one_process_group():
        dcp.save(state, checkpoint_id=str(tmp_path))
        into = {k: torch.full_like(v, 7) if isinstance(v, torch.Tensor) else "" for k, v in state.items()}
        reader = ParallelReader(tmp_path, threads=3)
        dcp.load(into, storage_reader=reader)
    for name, value in state.items():
        if isinstance(value, torch.Tensor):
            assert into[name].dtype == value.dtype and torch.equal(into[name], value), name
    assert into["note"] == "not a tensor"
    # four tensors (DCP reads nothing for the empty one), one byte item (the string)
    assert (reader.counts.direct, reader.counts.through_dcp) == (4, 1)
    assert reader.counts.direct_bytes == sum(v.nbytes for v in state.values() if isinstance(v, torch.Tensor))


class RunRecordingReader(ParallelReader):
    """Records the items each reading task was given."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.runs: list[tuple[str, list[str]]] = []

    def _read_run(self, plan, name, items, planner):
        self.runs.append((name, [item.storage_index.fqn for item in items]))
        return super()._read_run(plan, name, items, planner)


def test_a_file_is_shared_by_several_threads_in_runs_of_equal_bytes_when_threads_outnumber_files(tmp_path):
    torch.manual_seed(2)
    state = {f"w{i}": torch.randn(64, 32) for i in range(8)}
    with helpers.one_process_group():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path), thread_count=1))  # one file
        into = {name: torch.zeros_like(value) for name, value in state.items()}
        reader = RunRecordingReader(tmp_path, threads=4)
        dcp.load(into, storage_reader=reader)
    assert all(torch.equal(into[name], value) for name, value in state.items())
    assert len({name for name, _ in reader.runs}) == 1
    assert sorted(len(fqns) for _, fqns in reader.runs) == [2, 2, 2, 2]
    assert sorted(fqn for _, fqns in reader.runs for fqn in fqns) == sorted(state)
    assert reader.counts.direct == 8


def test_a_tensor_of_another_dtype_is_read_and_cast_by_torch_load(tmp_path):
    state = saved_state()
    with helpers.one_process_group():
        dcp.save({"f32": state["f32"]}, checkpoint_id=str(tmp_path))
        into = {"f32": torch.zeros(33, 7, dtype=torch.float64)}
        reader = ParallelReader(tmp_path, threads=1)
        dcp.load(into, storage_reader=reader)
    assert torch.equal(into["f32"], state["f32"].double())
    assert (reader.counts.direct, reader.counts.through_dcp) == (0, 1)


@pytest.mark.parametrize("view, located", [
    (lambda t: t, True),
    (lambda t: t.t(), False),          # the whole storage, in column-major order
    (lambda t: t[2:], False),          # a view from an offset (torch.save writes the whole storage)
])
def test_only_a_tensor_that_is_its_whole_storage_in_row_major_order_is_located(tmp_path, view, located):
    tensor = view(torch.arange(48, dtype=torch.float32).reshape(6, 8))
    file = tmp_path / "item"
    with file.open("wb") as f:
        f.write(b"x" * 100)  # the item need not start the file
        torch.save(tensor, f)
        length = f.tell() - 100
    fd = os.open(file, os.O_RDONLY)
    try:
        stored = locate_tensor(fd, 100, length)
        assert (stored is not None) == located
        if located:
            assert stored.size == (6, 8) and stored.nbytes == tensor.nbytes
            assert os.pread(fd, stored.nbytes, stored.start) == tensor.numpy().tobytes()
        assert locate_tensor(fd, 0, 100) is None  # not an archive
    finally:
        os.close(fd)


def _load_as_shards(rank: int, port: int, folder: str, results: dict) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        into = {"rows": distribute_tensor(torch.zeros(8, 6), mesh, [Shard(0)]),
                "columns": distribute_tensor(torch.zeros(8, 6), mesh, [Shard(1)])}
        reader = ParallelReader(folder, threads=2)
        dcp.load(into, storage_reader=reader)
        results[rank] = ({k: v.to_local().clone() for k, v in into.items()},
                         (reader.counts.direct, reader.counts.through_dcp))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_load_on_more_ranks_reads_row_shards_directly_and_column_shards_through_torch_load(tmp_path):
    torch.manual_seed(1)
    saved = {"rows": torch.randn(8, 6), "columns": torch.randn(8, 6)}
    with helpers.one_process_group():
        dcp.save(saved, checkpoint_id=str(tmp_path))
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_load_as_shards, args=(free_port(), str(tmp_path), results), nprocs=2,
                           start_method="spawn")
        results = dict(results)
    for rank in (0, 1):
        local, counts = results[rank]
        assert torch.equal(local["rows"], saved["rows"][4 * rank:4 * rank + 4])
        assert torch.equal(local["columns"], saved["columns"][:, 3 * rank:3 * rank + 3])
        assert counts == (1, 1)
