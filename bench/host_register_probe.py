"""Can a requeued job's checkpoint reach the GPU straight from the page cache? A probe of cudaHostRegister.

A requeued job's checkpoint phase copies 17 GiB from the page cache into pinned buffers with 16 threads, then
into the GPU (bench/NOTES.md, attempts 29-47). Registering the file's mapping with CUDA would let the GPU's
copy engine read the page cache itself: no CPU copy, one asynchronous copy per tensor, the host free to trace
the first step meanwhile. This probe measures what that depends on, for one file of --size-gib GiB in the page
cache: whether the device takes read-only registrations, how long registering takes (in pieces, in a
background thread), how much it slows a Python loop and CUDA allocations on the main thread meanwhile, the
copy's rate and how long the host spends issuing it, that the bytes arrive intact, and unregistering.

    python bench/host_register_probe.py --size-gib 8 --out bench/results

Writes NAME.json and NAME.md under --out.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

READ_ONLY = 0x08  # cudaHostRegisterReadOnly
ATTR_HOST_REGISTER, ATTR_READ_ONLY_HOST_REGISTER = 99, 113
PIECE = 1 << 30


def device_attributes() -> dict[str, int]:
    cuda = ctypes.CDLL("libcuda.so.1")
    out = {}
    for name, attr in (("host_register_supported", ATTR_HOST_REGISTER),
                       ("read_only_host_register_supported", ATTR_READ_ONLY_HOST_REGISTER)):
        value = ctypes.c_int(-1)
        cuda.cuDeviceGetAttribute(ctypes.byref(value), attr, torch.cuda.current_device())
        out[name] = value.value
    return out


def make_file(path: Path, nbytes: int) -> None:
    block = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8).numpy().tobytes()
    with path.open("wb") as f:
        for i in range(nbytes // len(block)):
            f.write(bytes([i % 256]) + block[1:])


def warm(path: Path) -> float:
    start, buffer = time.perf_counter(), bytearray(64 << 20)
    with path.open("rb", buffering=0) as f:
        while f.readinto(buffer):
            pass
    return time.perf_counter() - start


def python_loop() -> float:
    """A fixed piece of interpreter-bound work, like the imports and tracing of a job's start."""
    start, table = time.perf_counter(), {}
    for i in range(400_000):
        table[str(i)] = len(table) % 7
        if i % 1000 == 0:
            compile("x = 1", "<probe>", "exec")
    return time.perf_counter() - start


def cuda_allocations() -> float:
    """Allocations the driver serves (no caching allocator), like the process group's and the model's."""
    start = time.perf_counter()
    for _ in range(50):
        ptr = torch.cuda.caching_allocator_alloc(64 << 20)
        torch.cuda.caching_allocator_delete(ptr)
        torch.cuda.empty_cache()
    return time.perf_counter() - start


def register(base: int, nbytes: int, flags: int, times: list[float], errors: list[int]) -> None:
    cudart = torch.cuda.cudart()
    for offset in range(0, nbytes, PIECE):
        start = time.perf_counter()
        code = int(cudart.cudaHostRegister(base + offset, min(PIECE, nbytes - offset), flags))
        times.append(time.perf_counter() - start)
        if code:
            errors.append(code)
            return


def unregister(base: int, nbytes: int, pieces: int) -> float:
    start, cudart = time.perf_counter(), torch.cuda.cudart()
    for offset in range(0, min(nbytes, pieces * PIECE), PIECE):
        cudart.cudaHostUnregister(base + offset)
    return time.perf_counter() - start


def probe_mode(path: Path, nbytes: int, name: str, private: bool, flags: int, baseline: dict[str, float]) -> dict:
    fd = os.open(path, os.O_RDONLY)
    mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE if private else mmap.MAP_SHARED,
                        prot=mmap.PROT_READ | (mmap.PROT_WRITE if private else 0))
    os.close(fd)
    host = torch.frombuffer(mapping, dtype=torch.uint8)
    base = host.data_ptr()
    times: list[float] = []
    errors: list[int] = []
    result: dict = {"mode": name, "flags": flags}
    worker = threading.Thread(target=register, args=(base, nbytes, flags, times, errors))
    start = time.perf_counter()
    worker.start()
    loops, allocations = [], []
    while worker.is_alive():  # the main thread's work, timed again and again while the registration runs
        loops.append(python_loop())
        allocations.append(cuda_allocations())
    worker.join()
    result["python_loop_during_s"] = statistics.median(loops) if loops else None
    result["cuda_allocations_during_s"] = statistics.median(allocations) if allocations else None
    result["main_thread_rounds"] = len(loops)
    result["register_s"] = round(time.perf_counter() - start, 3)
    result["register_pieces_s"] = [round(t, 3) for t in times]
    result["register_gbps"] = round(len(times) * PIECE / sum(times) / 1e9, 2) if times and not errors else None
    result["error"] = errors[0] if errors else None
    result.update({f"{k}_alone_s": v for k, v in baseline.items()})
    if not errors:
        result["is_pinned"] = bool(host.is_pinned())
        result.update(copy_to_gpu(host, nbytes))
    result["unregister_s"] = round(unregister(base, nbytes, len(times) - len(errors)), 3)
    del host
    try:
        mapping.close()
    except BufferError:
        pass
    return result


def copy_to_gpu(host: torch.Tensor, nbytes: int, streams: int = 4, chunk: int = 256 << 20) -> dict:
    target = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pool = [torch.cuda.Stream() for _ in range(streams)]
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i, offset in enumerate(range(0, nbytes, chunk)):
        with torch.cuda.stream(pool[i % streams]):
            target[offset:offset + chunk].copy_(host[offset:offset + chunk], non_blocking=True)
    issued = time.perf_counter() - start
    torch.cuda.synchronize()
    total = time.perf_counter() - start
    step = 1 << 20  # one byte of every MiB compared, and the first and last MiB whole
    intact = (torch.equal(target[::step].cpu(), host[::step]) and torch.equal(target[:step].cpu(), host[:step])
              and torch.equal(target[-step:].cpu(), host[-step:]))
    del target
    torch.cuda.empty_cache()
    return {"copy_issue_s": round(issued, 4), "copy_s": round(total, 3), "copy_gbps": round(nbytes / total / 1e9, 1),
            "intact": intact}


def pinned_copy_rate(nbytes: int = 4 << 30) -> float:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return copy_to_gpu(host, nbytes)["copy_gbps"]


def _seconds(value: float | None) -> str:
    return "none" if value is None else f"{value:.3f}"


def table(report: dict) -> str:
    rows = ["| mode | error | register (s) | GB/s | Python loop during / alone (s) | CUDA allocations during / alone (s) "
            "| copy (s) | copy GB/s | host issuing (s) | intact | unregister (s) |", "|---" * 11 + "|"]
    for m in report["modes"]:
        rows.append(f"| {m['mode']} | {m['error']} | {m['register_s']} | {m['register_gbps']} "
                    f"| {_seconds(m['python_loop_during_s'])} / {_seconds(m['python_loop_alone_s'])} "
                    f"| {_seconds(m['cuda_allocations_during_s'])} / {_seconds(m['cuda_allocations_alone_s'])} "
                    f"| {m.get('copy_s')} | {m.get('copy_gbps')} | {m.get('copy_issue_s')} | {m.get('intact')} "
                    f"| {m['unregister_s']} |")
    return (f"A file of {report['size_gib']} GiB in the page cache, registered in 1 GiB pieces by a background thread; "
            f"kernel {report['kernel']}; device attributes {report['attributes']}; the same bytes from a pinned buffer: "
            f"{report['pinned_buffer_copy_gbps']} GB/s.\n\n" + "\n".join(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=int, default=8)
    parser.add_argument("--dir", default="/tmp")
    parser.add_argument("--name", default="host-register-probe")
    parser.add_argument("--out", type=Path, default=common.RESULTS)
    args = parser.parse_args()
    nbytes = args.size_gib << 30
    torch.cuda.init()
    path = Path(args.dir) / "host-register-probe.bin"
    make_file(path, nbytes)
    report = {**common.stamp(), "size_gib": args.size_gib, "kernel": os.uname().release,
              "attributes": device_attributes()}
    report["warm_read_s"] = round(warm(path), 2)
    report["pinned_buffer_copy_gbps"] = pinned_copy_rate()
    python_loop(), cuda_allocations()  # once first: their own first-call costs out of the baseline
    baseline = {"python_loop": python_loop(), "cuda_allocations": cuda_allocations()}
    report["modes"] = []
    for name, private, flags in (("shared-read-only", False, READ_ONLY), ("shared-no-flag", False, 0),
                                 ("private-copy-on-write", True, 0)):
        warm(path)
        report["modes"].append(probe_mode(path, nbytes, name, private, flags, baseline))
        print(json.dumps(report["modes"][-1]), flush=True)
    path.unlink()
    print(common.write_result(args.out, args.name, report, table(report)).read_text())


if __name__ == "__main__":
    main()
