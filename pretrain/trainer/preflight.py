"""Preflight: check every device and the network at the start of each job, before training.

Each rank multiplies two n x n matrices whose product is known exactly (small integers: B is a
permutation plus 64 rows of ones, so every partial sum is an integer below 256 and the product is
exact in bf16, fp16, TF32 or fp32 whatever the summation order) and times the product against a
floor (preflight.min_tflops; by default MIN_PEAK_FRACTION of the GPU's peak). Then all ranks
all-reduce a buffer whose sum is known and report the bus bandwidth as nccl-tests does,
against preflight.min_busbw_gbps when set. Rank 0 logs the result and writes it to metrics.jsonl
(a record with the step the job starts from).

A failure ends the job on every rank with one line naming the node(s), rank(s) and why. Under
Slurm with preflight.exclude_and_requeue, rank 0 also writes the failing nodes to
RUN/.exclude_nodes; the batch script, on the host, then requeues the job with them excluded
(pretrain.launcher.slurm). Only a device check names a node to exclude: a wrong or slow all-reduce cannot
be pinned on one.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from pretrain import flops, rundir
from pretrain.config import Config, PreflightConfig
from pretrain.rundir import EXCLUDE_NODES
from pretrain.trainer import resilience

log = logging.getLogger("pretrain")

# The default rate floor: this fraction of the GPU's dense bf16 peak (healthy GPUs reach 60-85%).
MIN_PEAK_FRACTION = 0.4
# Rows of ones in B: partial sums stay at most 2 * (ONES_ROWS + 1) = 130, exact in bf16.
ONES_ROWS = 64
MATMUL_ITERATIONS = 10
ALLREDUCE_ITERATIONS = 5
# Python's switch interval while the timed kernels are launched (its default is 5 ms): see `device_seconds`.
LAUNCH_SWITCH_INTERVAL_S = 1e-4


@dataclass
class DeviceResult:
    rank: int
    node: str
    tflops: float
    wrong: int
    entries: int
    # The GPU this rank drives (its UUID and PCI bus id), or "cpu": two ranks must never share one.
    device: str = "cpu"
    # CPUs this rank may run on (its affinity): what srun gave the task.
    cpus: int = 0
    # The GPUs the task was given to see (CUDA_VISIBLE_DEVICES; "all" when unset).
    visible: str = "all"
    # torch's threads for work on the CPU: more than `cpus` (or ranks of a node sharing them) oversubscribes.
    threads: int = 0
    problem: str = ""


def node_name() -> str:
    """Slurm's name for this node (what ExcNodeList takes), else the hostname."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def check_dtype(device: torch.device) -> torch.dtype:
    """Tensor-core dtype on GPUs (what training runs in), fp32 on CPUs."""
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def exact_product_operands(n: int, dtype: torch.dtype, device: torch.device,
                           seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A (entries -1, 0, 1), B = permutation + ones in the first ONES_ROWS rows, and A @ B exactly.

    Drawn on the device itself: at the GPUs' n = 8192, drawing on the CPU and copying over took most of
    a second of every job's start."""
    generator = torch.Generator(device=device).manual_seed(seed)
    a = torch.randint(-1, 2, (n, n), generator=generator, device=device).to(dtype)
    perm = torch.randperm(n, generator=generator, device=device)
    b = torch.zeros(n, n, device=device, dtype=dtype)
    b[torch.arange(n, device=device), perm] = 1
    b[:ONES_ROWS] += 1
    expected = torch.empty_like(a)
    expected[:, perm] = a  # (A @ P)[:, perm[i]] = A[:, i]
    expected += a[:, :ONES_ROWS].float().sum(dim=1, keepdim=True).to(dtype)
    return a, b, expected


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_seconds(device: torch.device, work: Callable[[], None]) -> float:
    """Seconds the device takes for `work`: by CUDA events on a GPU, else by the host's clock.

    Other threads of the job run meanwhile (the checkpoint's check, the compiler's imports). Each kernel's
    launch gives up the GIL, and getting it back from a thread that does not give it up waits for Python's
    switch interval, 5 ms: timed on the host, with the wake-up after the last kernel as well, a healthy
    H100's 740 TFLOP/s read 315, below the floor, while the compiler was imported (2026-12-07). Events time
    the GPU, not the host's wake-up, and a short switch interval for these milliseconds keeps the GPU fed.
    """
    synchronize(device)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(LAUNCH_SWITCH_INTERVAL_S)
    try:
        if device.type != "cuda":
            started = time.perf_counter()
            work()
            return time.perf_counter() - started
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream = torch.cuda.current_stream(device)
        start.record(stream)
        work()
        end.record(stream)
    finally:
        sys.setswitchinterval(interval)
    end.synchronize()
    return start.elapsed_time(end) / 1000


def check_device(n: int, device: torch.device, rank: int) -> DeviceResult:
    """The exact product, then MATMUL_ITERATIONS timed products."""
    a, b, expected = exact_product_operands(n, check_dtype(device), device, seed=1234 + rank)
    product = a @ b
    if resilience.fault_active_on("preflight_fail", node_name(), rank):
        product[0, 0] += 1
    wrong = int((product != expected).sum())

    def products() -> None:
        for _ in range(MATMUL_ITERATIONS):
            torch.mm(a, b, out=product)

    tflops = 2 * n**3 * MATMUL_ITERATIONS / device_seconds(device, products) / 1e12
    return DeviceResult(rank, node_name(), tflops, wrong, n * n, device_identity(device),
                        len(os.sched_getaffinity(0)), os.environ.get("CUDA_VISIBLE_DEVICES", "all"),
                        threads=torch.get_num_threads())


def device_identity(device: torch.device) -> str:
    """A GPU's UUID and PCI bus id (what nvidia-smi shows), or "cpu"."""
    if device.type != "cuda":
        return "cpu"
    props = torch.cuda.get_device_properties(device)
    bus = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}" \
        if hasattr(props, "pci_bus_id") else "?"
    return f"GPU-{props.uuid} ({bus})" if hasattr(props, "uuid") else f"{torch.cuda.get_device_name(device)} ({bus})"


def shared_devices(results: list[DeviceResult]) -> list[str]:
    """Problems for GPUs that more than one rank on a node drives (a GPU binding gone wrong)."""
    seen: dict[tuple[str, str], int] = {}
    for r in results:
        if r.device != "cpu":
            seen.setdefault((r.node, r.device), r.rank)
    problems = []
    for r in results:
        first = seen.get((r.node, r.device), r.rank)
        if r.device != "cpu" and first != r.rank:
            problems.append(f"rank {r.rank} drives the same GPU as rank {first} on {r.node} ({r.device})")
    return problems


def rate_floor(cfg: PreflightConfig, device: torch.device) -> float | None:
    """TFLOP/s below which a device fails: preflight.min_tflops, else a fraction of a known GPU's peak."""
    if cfg.min_tflops is not None:
        return cfg.min_tflops
    if device.type != "cuda":
        return None
    peak = flops.peak_flops_for(torch.cuda.get_device_name(device))
    return MIN_PEAK_FRACTION * peak / 1e12 if peak else None


def judge_device(result: DeviceResult, floor: float | None) -> DeviceResult:
    if result.wrong:
        result.problem = f"the matrix product was wrong in {result.wrong:,} of {result.entries:,} entries"
    elif floor is not None and result.tflops < floor:
        result.problem = f"matrix products ran at {result.tflops:.1f} TFLOP/s, below the floor of {floor:.1f}"
    return result


def check_allreduce(mib: int, device: torch.device, rank: int, world: int) -> tuple[bool, float]:
    """Whether the sum came out right on this rank, and the bus bandwidth in GB/s."""
    buffer = torch.full((mib * 2**20 // 4,), float(rank + 1), device=device)
    dist.all_reduce(buffer)
    right = bool((buffer == world * (world + 1) / 2).all())

    def all_reduces() -> None:
        for _ in range(ALLREDUCE_ITERATIONS):
            dist.all_reduce(buffer)

    seconds = device_seconds(device, all_reduces) / ALLREDUCE_ITERATIONS
    return right, buffer.numel() * 4 / seconds * 2 * (world - 1) / world / 1e9


def failure_message(failed: list[DeviceResult]) -> str:
    by_node: dict[str, list[str]] = {}
    for r in failed:
        by_node.setdefault(r.node, []).append(f"rank {r.rank}: {r.problem}")
    return "preflight failed on " + ", ".join(f"{node} ({'; '.join(why)})" for node, why in by_node.items())


def exclusion(cfg: Config, run_dir: Path, nodes: list[str], is_main: bool) -> str:
    """Under Slurm: leave the nodes for the batch script to exclude, where configured. What the message adds."""
    if not resilience.in_slurm_job():
        return ""
    listed = ",".join(nodes)
    if not cfg.preflight.exclude_and_requeue:
        return f"; submit again with {listed} added to cluster.exclude"
    if is_main:
        with (run_dir / EXCLUDE_NODES).open("a") as f:
            f.write("".join(f"{node}\n" for node in nodes))
    return f"; the job is requeued without {listed} (cluster.max_requeues permitting)"


def run(cfg: Config, rank: int, world: int, device: torch.device) -> str | None:
    """Run the checks on every rank (collectively); None if all passed, else the one-line failure."""
    if not cfg.preflight.enabled:
        return None
    started = time.perf_counter()
    record, failure = check_devices(cfg, rank, world, device)
    if failure is None:
        failure = check_network(cfg.preflight, rank, world, device, record)
    record.update({"step": start_step(Path(cfg.run_dir)), "preflight": "failed" if failure else "passed",
                   "message": failure or passed_message(record), "time_s": time.perf_counter() - started,
                   "time": time.time()})
    if rank == 0:
        rundir.MetricsFile(Path(cfg.run_dir) / rundir.METRICS_FILE).write(record)
    (log.error if failure else log.info)("%s (%.1f s)", record["message"], record["time_s"])
    return failure


def start_step(run_dir: Path) -> int:
    """The step this job starts from (the newest complete checkpoint's), for the metrics record."""
    latest = rundir.latest_checkpoint(run_dir / rundir.CHECKPOINTS)
    return rundir.read_manifest(latest)["step"] if latest is not None else 0


def check_devices(cfg: Config, rank: int, world: int, device: torch.device) -> tuple[dict, str | None]:
    """Every rank's device check, gathered: the record so far and the failure, if any."""
    n = cfg.preflight.matmul_size or (8192 if device.type == "cuda" else 512)
    mine = judge_device(check_device(n, device, rank), rate_floor(cfg.preflight, device))
    results: list[DeviceResult] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(results, mine)
    record = {"matmul_n": n, "matmul_dtype": str(check_dtype(device)).removeprefix("torch."),
              "ranks": [asdict(r) for r in results]}
    warn_of_starved_cpus(cfg, results, rank)
    shared = shared_devices(results)
    if shared:
        return record, "preflight failed: " + "; ".join(shared) + ": check the GPU binding (CUDA_VISIBLE_DEVICES)"
    failed = [r for r in results if r.problem]
    if not failed:
        return record, None
    nodes = sorted({r.node for r in failed})
    return record, failure_message(failed) + exclusion(cfg, Path(cfg.run_dir), nodes, rank == 0)


def warn_of_starved_cpus(cfg: Config, results: list[DeviceResult], rank: int) -> None:
    """A rank given fewer CPUs than cluster.cpus_per_task starves its data loading and compile workers."""
    if cfg.cluster is None or rank != 0:
        return
    starved = [r for r in results if 0 < r.cpus < cfg.cluster.cpus_per_task]
    if starved:
        log.warning("ranks %s run on fewer CPUs (%d) than cluster.cpus_per_task=%d: the job step did not get "
                    "--cpus-per-task (srun no longer inherits it from sbatch since Slurm 22.05)",
                    ", ".join(str(r.rank) for r in starved), min(r.cpus for r in starved), cfg.cluster.cpus_per_task)


def check_network(cfg: PreflightConfig, rank: int, world: int, device: torch.device, record: dict) -> str | None:
    """The all-reduce check (none on one rank); adds its figures to the record, returns the failure, if any."""
    if world == 1:
        return None
    mib = cfg.allreduce_mb or (256 if device.type == "cuda" else 16)
    right, busbw = check_allreduce(mib, device, rank, world)
    wrong: list[str | None] = [None] * world
    dist.all_gather_object(wrong, None if right else f"{node_name()} (rank {rank})")
    record.update({"allreduce_mib": mib, "busbw_gbps": busbw})
    if any(wrong):
        return f"preflight failed: the all-reduce sum came out wrong on {', '.join(filter(None, wrong))}"
    if cfg.min_busbw_gbps is not None and busbw < cfg.min_busbw_gbps:
        nodes = sorted({r["node"] for r in record["ranks"]})
        return (f"preflight failed: all-reduce bus bandwidth {busbw:.1f} GB/s across {', '.join(nodes)} is below "
                f"preflight.min_busbw_gbps={cfg.min_busbw_gbps}")
    return None


def passed_message(record: dict) -> str:
    ranks = record["ranks"]
    rates = [r["tflops"] for r in ranks]
    nodes = sorted({r["node"] for r in ranks})
    network = (f"all-reduce of {record['allreduce_mib']} MiB right, bus bandwidth {record['busbw_gbps']:.1f} GB/s"
               if "busbw_gbps" in record else "one rank, no all-reduce")
    n = record["matmul_n"]
    cpus = [r["cpus"] for r in ranks]
    threads = [r["threads"] for r in ranks]
    return (f"preflight passed on {len(ranks)} rank{'s' if len(ranks) > 1 else ''} ({', '.join(nodes)}): "
            f"{n} x {n} {record['matmul_dtype']} products exact, {min(rates):.2f}-{max(rates):.2f} TFLOP/s per device; "
            f"{network}; {min(cpus)}-{max(cpus)} CPUs and {min(threads)}-{max(threads)} threads per rank{gpu_list(ranks)}")


def gpu_list(ranks: list[dict]) -> str:
    """"; GPUs: rank 0 GPU-..., rank 1 ..." for the first ranks on GPUs, "" on CPUs."""
    gpus = [f"rank {r['rank']} {r['node']} {r['device']}" for r in ranks if r["device"] != "cpu"]
    if not gpus:
        return ""
    return "; GPUs: " + ", ".join(gpus[:8]) + (f" and {len(gpus) - 8} more" if len(gpus) > 8 else "")
