"""How fast a rank can check a checkpoint's shard files against their checksums, files in the page cache.

On one GPU a requeued job checks the whole 17 GiB of the 1B shape in a background thread pool from its start,
and its load waits for that check (bench/NOTES.md, attempts 63 and 65): this times the package's check
(`checksums.checksum_of`: since attempt 66 each file mapped and summed in place, `writer_threads()` files at a
time) beside CRC32C read in 16 MiB chunks as the package computed it before (attempt 65), zlib's CRC32 as before
that (16 MiB chunks into one buffer), other chunk sizes, thread counts, and one `zlib.crc32` over a read-only
mapping of each whole file (no copy, one release of the GIL a file).

    python bench/checksum.py CHECKPOINT_FOLDER --name NAME --out DIR
    python bench/checksum.py FOLDER --make-gib 17 ...   # first writes writer_threads() files of 17 GiB in all

Written by this script, the files are in the page cache as a requeued job's shards are after its node read them
(or the save wrote them); their bytes, random, do not change the rate.
"""

import argparse
import mmap
import os
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402
import google_crc32c  # noqa: E402

from pretrain.trainer import checkpoint, checksums  # noqa: E402


def chunked(size: int) -> Callable[[Path], int]:
    """zlib's CRC32 read in chunks of `size` into one buffer (the package's before attempt 65, at 16 MiB)."""
    def crc(path: Path) -> int:
        value, buffer = 0, bytearray(size)
        view = memoryview(buffer)
        with path.open("rb", buffering=0) as f:
            while n := f.readinto(buffer):
                value = zlib.crc32(view[:n], value)
        return value
    return crc


def crc32c_read(path: Path) -> int:
    """CRC32C of 16 MiB chunks read as new objects (the package's from attempt 65 to 66)."""
    value = 0
    with path.open("rb", buffering=0) as f:
        while chunk := f.read(16 << 20):
            value = google_crc32c.extend(value, chunk)
    return value


def mapped(path: Path) -> int:
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapping:
        return zlib.crc32(mapping)


def timed(crc: Callable[[Path], int], files: list[Path], threads: int) -> tuple[float, list[int]]:
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=threads) as pool:
        values = list(pool.map(crc, files))
    return time.perf_counter() - started, values


def make_files(folder: Path, gib: float, count: int) -> None:
    """`count` shard-like files of `gib` GiB in all, of random bytes (one 64 MiB block repeated)."""
    folder.mkdir(parents=True, exist_ok=True)
    block = os.urandom(64 << 20)
    size = int(gib * (1 << 30)) // count
    for index in range(count):
        with (folder / f"__0_{index}.distcp").open("wb") as f:
            for offset in range(0, size, len(block)):
                f.write(block[: min(len(block), size - offset)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--name", default="checksum")
    parser.add_argument("--out", type=Path, default=common.RESULTS)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--make-gib", type=float, help="first write that many GiB of shard-like files into FOLDER")
    args = parser.parse_args()
    package_threads = checkpoint.writer_threads()
    if args.make_gib:
        make_files(args.folder, args.make_gib, package_threads)
    files = sorted(args.folder.glob("*.distcp"))
    if not files:
        sys.exit(f"error: no shard files (*.distcp) in {args.folder}: give a checkpoint's folder, or --make-gib")
    total = sum(f.stat().st_size for f in files)
    package = f"package: {checksums.saved_kind()}, mapped"
    variants = [(package, checksums.checksum_of, package_threads),
                ("crc32c, 16 MiB chunks read", crc32c_read, package_threads)]
    for threads in sorted({package_threads, os.cpu_count() or package_threads}):
        variants += [(f"crc32, {mib} MiB chunks", chunked(mib << 20), threads) for mib in (1, 16, 64)]
        variants.append(("crc32, mapped whole file", mapped, threads))
    timed(checksums.checksum_of, files, package_threads)  # into the page cache, if they were not
    rows, expected = [], {}
    for label, crc, threads in variants:
        runs = [timed(crc, files, threads) for _ in range(args.repeats)]
        kind = label.split(",")[0]
        expected.setdefault(kind, runs[0][1])
        assert all(values == expected[kind] for _, values in runs), f"{label}: other checksums"
        best = min(seconds for seconds, _ in runs)
        rows.append({"variant": label, "threads": threads, "seconds": [round(s, 3) for s, _ in runs],
                     "gb_per_s": round(total / best / 1e9, 2)})
        print(f"{label:34} {threads:3} threads {best:6.2f} s {total / best / 1e9:6.1f} GB/s", flush=True)
    table = ["| variant | threads | seconds | GB/s (best) |", "|---|---|---|---|"]
    table += [f"| {r['variant']} | {r['threads']} | {', '.join(map(str, r['seconds']))} | {r['gb_per_s']} |"
              for r in rows]
    result = {"name": args.name, **common.stamp(), "folder": str(args.folder), "files": len(files), "bytes": total,
              "rows": rows}
    print(common.write_result(args.out, args.name, result, "\n".join(table)).read_text())


if __name__ == "__main__":
    main()
