"""The checksums of a checkpoint's files: computed when a rank has written them, checked before a load.

The manifest of a checkpoint lists each of its files with its size and CRC32 (`digest`); `problems` says
what is wrong with a rank's share of them. A requeued job checks its newest checkpoint from its first
moments (`VerifyAhead`), in a process of its own: 17 GiB of CRC32 in threads of the training process
contended for its interpreter lock with the imports and the model build of the start-up, whose
phases then took about a second longer than a cold start's (bench/NOTES.md, attempt 30). The check
also leaves the rank's files in the node's page cache for the load.

Standard library only: the checking process starts in a fraction of a second, without torch.
`python -m pretrain.trainer.integrity CHECKPOINT RANK WORLD_SIZE` prints that rank's problems as JSON.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pretrain.rundir import complete_checkpoints, read_manifest


def crc32_of(path: Path) -> int:
    """The CRC32 of a file, read in 16 MiB pieces into one buffer (zlib and the reads release the GIL)."""
    crc, buffer = 0, bytearray(1 << 24)
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as f:
        while got := f.readinto(buffer):
            crc = zlib.crc32(view[:got], crc)
    return crc


def writer_threads() -> int:
    """Threads (and files) per rank for writing and digesting shards: up to 8, within the CPUs the
    rank may use (under Slurm, its task's)."""
    return max(1, min(8, len(os.sched_getaffinity(0))))


def digest(folder: Path, names: list[str]) -> dict[str, dict[str, int]]:
    """Size and CRC32 of each file, several files at a time."""
    with ThreadPoolExecutor(max_workers=writer_threads()) as pool:
        crcs = list(pool.map(crc32_of, [folder / name for name in names]))
    return {name: {"size": (folder / name).stat().st_size, "crc32": crc} for name, crc in zip(names, crcs)}


def written_by(folder: Path, rank: int) -> list[str]:
    """The files of a checkpoint folder that `rank` wrote: its DCP shards and its RNG state
    (rank 0 also wrote DCP's .metadata)."""
    names = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    return [name for name in names if writer_of(name) == rank]


def writer_of(name: str) -> int | None:
    """The rank that wrote a checkpoint file (`__R_I.distcp`, `rng/rankR.pt`; rank 0 `.metadata`)."""
    if name == ".metadata":
        return 0
    match = _WRITER.fullmatch(name)
    return int(match.group(1) or match.group(2)) if match else None


_WRITER = re.compile(r"__(\d+)_\d+\.distcp|rng/rank(\d+)\.pt")


def problems(path: Path, rank: int = 0, world_size: int = 1) -> list[str]:
    """What is wrong with a checkpoint folder's files: with world_size ranks checking, rank's share.

    Written by as many ranks as check it, each rank checks the files it wrote, which are those it will
    load (on a node of its own, the read leaves them in that node's page cache); otherwise every
    world_size-th file from rank.
    """
    try:
        manifest = read_manifest(path)
        files = manifest["files"]
    except (OSError, ValueError, KeyError) as err:
        return [f"unreadable manifest ({err})"]
    if manifest.get("world_size") == world_size:
        writers = {name: writer_of(name) for name in files}
        share = sorted(name for name, writer in writers.items()
                       if writer == rank or (rank == 0 and (writer is None or writer >= world_size)))
    else:
        share = sorted(files)[rank::world_size]

    def problem(name: str) -> str | None:
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != files[name]["size"]:
            return f"{name} has {file.stat().st_size} bytes, not {files[name]['size']}"
        if crc32_of(file) != files[name]["crc32"]:
            return f"{name} fails its checksum"
        return None

    # Several files at a time, as they were written: one after the other, a resume of the 1B shape
    # spent 12 s on its 17 GiB of checksums.
    with ThreadPoolExecutor(max_workers=writer_threads()) as pool:
        return [p for p in pool.map(problem, share) if p]


class VerifyAhead:
    """This rank's share of the newest complete checkpoint's check (`problems`), in a process of its own
    started before the process group exists: a requeued job's start-up then overlaps it.

    `problems_of` takes its result for that folder; any other folder (an older one after a damaged newest,
    or one published meanwhile) is checked when asked. Should the checking process fail (killed, say),
    the folder is checked again in this one. `close` ends the process if it still runs.
    """

    def __init__(self, root: Path, rank: int, world_size: int) -> None:
        found = complete_checkpoints(root)
        self.path: Path | None = found[-1] if found else None
        self.rank, self.world_size = rank, world_size
        self._process: subprocess.Popen | None = None
        if self.path is not None:
            self._process = subprocess.Popen(
                [sys.executable, "-m", __name__, str(self.path), str(rank), str(world_size)],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)

    def problems_of(self, path: Path) -> list[str] | None:
        """This rank's problems with `path` if it is being checked ahead (waiting for the check), else None."""
        if self._process is None or path != self.path:
            return None
        out, _ = self._process.communicate()
        if self._process.returncode != 0:
            return problems(path, self.rank, self.world_size)
        return json.loads(out)

    def close(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()


def main(argv: list[str]) -> int:
    path, rank, world_size = Path(argv[0]), int(argv[1]), int(argv[2])
    print(json.dumps(problems(path, rank, world_size)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
