"""What the reading threads cost a load that has no bytes worth them: DCP shards of many small tensors.

    python bench/read_threads.py                       # 588 tensors (the 1B job's count) in 8 files; 16, 4, 1 threads
    python bench/read_threads.py --tensors 588 --threads 16 1 --repeats 20

A requeued job's load from files registered with CUDA reads no bytes (the GPU copies them), so what is
left per tensor is Python: locating it in its zip record (several small preads) and issuing its copy
(bench/NOTES.md, attempt 59). Small tensors on the CPU leave the same: each load here times
`ParallelReader.read_data` (the reading) and the whole `dcp.load` (DCP's planning too) with each thread
count in turn, repeated, in a gloo group of this one process. Writes NAME.json and NAME.md under --out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402


def timed_loads(folder: Path, state: dict, threads: list[int], repeats: int) -> dict[int, dict[str, list[float]]]:
    import torch.distributed.checkpoint as dcp

    from pretrain.trainer.shard_reader import ParallelReader

    class TimedReader(ParallelReader):
        def read_data(self, plan, planner):
            start = time.perf_counter()
            try:
                return super().read_data(plan, planner)
            finally:
                self.read_s = time.perf_counter() - start

    times: dict[int, dict[str, list[float]]] = {n: {"read_s": [], "load_s": []} for n in threads}
    dcp.load(state, storage_reader=ParallelReader(folder, threads=threads[0]))  # first-call costs out of the figures
    for _ in range(repeats):
        for n in threads:
            reader = TimedReader(folder, threads=n)
            start = time.perf_counter()
            dcp.load(state, storage_reader=reader)
            times[n]["load_s"].append(time.perf_counter() - start)
            times[n]["read_s"].append(reader.read_s)
    return times


def table(result: dict) -> str:
    rows = ["| reading threads | read_data median (s) | range | dcp.load median (s) | range |", "|---|---|---|---|---|"]
    for row in result["rows"]:
        rows.append(f"| {row['threads']} | {row['read_s']:.3f} | {row['read_min_s']:.3f}-{row['read_max_s']:.3f} "
                    f"| {row['load_s']:.3f} | {row['load_min_s']:.3f}-{row['load_max_s']:.3f} |")
    return (f"{result['tensors']} tensors of {result['elements']} float32 elements in {result['files']} shard files, "
            f"{result['repeats']} loads with each thread count, in turn; {result['cpus']} CPUs.\n\n" + "\n".join(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=588)
    parser.add_argument("--elements", type=int, default=256)
    parser.add_argument("--files", type=int, default=8, help="shard files (a job writes up to 8 per rank)")
    parser.add_argument("--threads", type=int, nargs="+", default=[16, 4, 1])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--name", default="read-threads-cpu")
    parser.add_argument("--out", type=Path, default=common.RESULTS)
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from pretrain.hosts import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with tempfile.TemporaryDirectory() as folder:
            state = {f"layers.{i}.weight": torch.randn(args.elements) for i in range(args.tensors)}
            dcp.save(state, storage_writer=dcp.FileSystemWriter(folder, thread_count=args.files))
            files = len(list(Path(folder).glob("*.distcp")))
            times = timed_loads(Path(folder), state, args.threads, args.repeats)
    finally:
        dist.destroy_process_group()
    rows = [{"threads": n, "read_s": statistics.median(t["read_s"]), "read_min_s": min(t["read_s"]),
             "read_max_s": max(t["read_s"]), "load_s": statistics.median(t["load_s"]), "load_min_s": min(t["load_s"]),
             "load_max_s": max(t["load_s"]), "read_all_s": [round(x, 4) for x in t["read_s"]]}
            for n, t in times.items()]
    result = {**common.stamp(), "tensors": args.tensors, "elements": args.elements, "files": files,
              "repeats": args.repeats, "cpus": os.cpu_count(), "rows": rows}
    print(common.write_result(args.out, args.name, result, table(result)).read_text())


if __name__ == "__main__":
    main()
