"""Where the interpreter keeps no bytecode (PYTHONDONTWRITEBYTECODE=1, as the GPU machine's image sets),
a job compiles its imports once into the run directory and later processes read them from there.

A stand-in package without bytecode plays torch in the first tests (the test venv's torch has its own
bytecode); the last one trains for real with torch's bytecode hidden behind an empty PYTHONPYCACHEPREFIX.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pretrain import rundir
from pretrain.hosts import free_port
from tests.helpers import MINI_MODEL, REPO, launch


def prepared_run(tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    done = launch(*MINI_MODEL, "data=synthetic", "train.steps=1", "prepare_only=true", f"hydra.run.dir={run_dir}")
    assert done.returncode == 0, done.stderr
    return run_dir


def stand_in(tmp_path: Path) -> Path:
    """A package `heavy` with no bytecode, on a folder of its own."""
    site = tmp_path / "site"
    (site / "heavy").mkdir(parents=True)
    (site / "heavy" / "__init__.py").write_text("VALUE = 42\n")
    return site


def python(code: str, site: Path, *, flags: tuple[str, ...] = (), **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
    return subprocess.run([sys.executable, *flags, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**clean, "PYTHONPATH": f"{REPO}:{site}", **env})


KEEP_AND_IMPORT = ("import sys\nfrom pretrain.trainer import bytecode\n"
                   "print(bytecode.keep_in_run_dir(sys.argv[1:], probe='heavy'))\nimport heavy\n"
                   "import subprocess\nsubprocess.run([sys.executable, '-c', 'import sys; print(sys.pycache_prefix, "
                   "sys.flags.dont_write_bytecode)'])\n")


def test_without_bytecode_a_job_keeps_it_in_the_run_directory_for_itself_and_its_children(tmp_path):
    run_dir, site = prepared_run(tmp_path), stand_in(tmp_path)
    first = python(KEEP_AND_IMPORT.replace("sys.argv[1:]", repr([str(run_dir)])), site, PYTHONDONTWRITEBYTECODE="1")
    assert first.returncode == 0, first.stderr
    cache = run_dir / rundir.BYTECODE_CACHE
    said, child = first.stdout.splitlines()
    assert said == str(cache)
    assert child == f"{cache} 0"  # a compile worker started by the job compiles into the same folder
    written = list(cache.rglob("heavy/__init__.*.pyc"))
    assert len(written) == 1 and written[0].is_relative_to(cache)
    assert not (site / "heavy" / "__pycache__").exists()  # the installation is left as it was

    # A later process of the run (a requeued job) reads what the first one wrote.
    again = python(KEEP_AND_IMPORT.replace("sys.argv[1:]", repr([str(run_dir)])), site, flags=("-v",),
                   PYTHONDONTWRITEBYTECODE="1")
    assert again.returncode == 0, again.stderr
    assert f"code object from '{written[0]}'" in again.stderr


def test_an_interpreter_that_keeps_bytecode_is_left_alone(tmp_path):
    run_dir, site = prepared_run(tmp_path), stand_in(tmp_path)
    done = python(KEEP_AND_IMPORT.replace("sys.argv[1:]", repr([str(run_dir)])), site)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["None", "None 0"]
    assert not (run_dir / rundir.BYTECODE_CACHE).exists()
    assert list((site / "heavy" / "__pycache__").glob("__init__.*.pyc"))  # Python wrote it beside the source


def test_without_a_run_directory_nothing_changes(tmp_path):
    site = stand_in(tmp_path)
    for argv in ([], [str(tmp_path)], [str(tmp_path), "extra"]):
        done = python(KEEP_AND_IMPORT.replace("sys.argv[1:]", repr(argv)), site, PYTHONDONTWRITEBYTECODE="1")
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines() == ["None", "None 1"], argv


def test_a_job_without_torch_bytecode_compiles_it_once_into_the_run_directory(tmp_path):
    """The real job: torch's own bytecode is out of reach behind an empty PYTHONPYCACHEPREFIX with writes
    off, as in an image that has none; the job says so and keeps torch's bytecode in the run directory."""
    run_dir = prepared_run(tmp_path)
    env = {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": str(tmp_path / "empty")}
    done = subprocess.run([sys.executable, "-m", "pretrain.train", str(run_dir)], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env={**os.environ, **env, "RANK": "0", "WORLD_SIZE": "1",
                                                       "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                                                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    assert done.returncode == 0, done.stderr[-3000:]
    cache = run_dir / rundir.BYTECODE_CACHE
    assert f"keeps it in {cache}" in (run_dir / "train.log").read_text()
    torch_init = list(cache.rglob("torch/__init__.*.pyc"))
    assert len(torch_init) == 1
