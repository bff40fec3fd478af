"""Compiled bytecode for a job's imports, in its run directory, where the interpreter keeps none.

Python imports a module from its cached bytecode (`__pycache__/*.pyc`) when there is one and
otherwise compiles the source again, in every process. Many images keep none: PYTHONDONTWRITEBYTECODE=1
is a common line in container recipes, `pip install --no-compile` writes none, and a read-only image
(Apptainer's SIF) cannot gain any at run time. A job then compiles torch, sympy and triton from source
at every start and in every rank and compile worker: on the GPU machine of bench/NOTES.md, whose
image is such a one, importing the trainer took 8.1 s. Where torch has no bytecode and Python may not
write it, the job keeps its own under RUN_DIR/cache/python (rundir.BYTECODE_CACHE), which every later
process, requeued job and node of the run reads; Python checks each file against its source's time and
size, and writes it atomically, so ranks may share it.

Standard library only: it runs before the trainer imports anything heavy.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

from pretrain import rundir

# The package whose bytecode tells whether this interpreter keeps any: the largest a job imports.
PROBE = "torch"


def has_bytecode(spec: importlib.machinery.ModuleSpec | None) -> bool:
    """Whether the module of `spec` (found, not imported) has the bytecode an import would read; True where
    there is nothing to read it from (a built-in or frozen module, or no such module)."""
    if spec is None or not spec.cached:
        return True
    return Path(spec.cached).is_file()


def writes_none(module: str) -> bool:
    """Whether this interpreter will neither find nor write bytecode for `module`: none is there, and
    bytecode is switched off or its folder is read-only. (Where Python may write it, the first process
    that imports the module does, as usual.)"""
    spec = importlib.util.find_spec(module)
    if has_bytecode(spec):
        return False
    if sys.dont_write_bytecode:
        return True
    # Where it would be written: beside the source, or under a PYTHONPYCACHEPREFIX (made as needed).
    folder = Path(sys.pycache_prefix) if sys.pycache_prefix else Path(spec.origin).parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return not os.access(folder, os.W_OK)


def keep_in_run_dir(argv: list[str], probe: str = PROBE) -> Path | None:
    """Before a job's imports: where the interpreter keeps no bytecode for `probe` and argv names a run
    directory, compile into and read from RUN_DIR/cache/python, in this process and the ones it starts.
    Returns that folder, or None where nothing changed."""
    if len(argv) != 1 or not rundir.is_run_dir(Path(argv[0])) or not writes_none(probe):
        return None
    folder = Path(argv[0]).resolve() / rundir.BYTECODE_CACHE
    folder.mkdir(parents=True, exist_ok=True)
    sys.pycache_prefix = str(folder)
    sys.dont_write_bytecode = False
    os.environ["PYTHONPYCACHEPREFIX"] = str(folder)  # compile workers and other children
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    return folder


def kept_in_run_dir(run_dir: Path) -> bool:
    """Whether this process reads and writes its bytecode under the run directory (keep_in_run_dir)."""
    return sys.pycache_prefix == str(Path(run_dir).resolve() / rundir.BYTECODE_CACHE)
