"""`python -m pretrain.train RUN_DIR`: one rank of a job, on a run directory the launcher wrote (pretrain.trainer.loop)."""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

from pretrain.trainer import allocator, bytecode, cuda_context


def main(argv: list[str] | None = None) -> int:
    """One rank of a job; returns its ExitCode (rundir). The trainer (torch and all) is imported only
    once the run directory's bytecode cache is in place (pretrain.trainer.bytecode) and the allocator's
    settings are in its environment (pretrain.trainer.allocator), while a thread makes the GPU's CUDA
    context (pretrain.trainer.cuda_context)."""
    argv = sys.argv[1:] if argv is None else argv
    bytecode.keep_in_run_dir(argv)
    allocator.configure(os.environ)
    cuda_context.start_in_background()
    from pretrain.trainer import loop

    return loop.main(argv)


def exit_without_teardown(code: int) -> NoReturn:
    """End the process with `code` once its output is flushed, skipping the interpreter's teardown.

    By then the run is over: its checkpoint is published, its process group destroyed, its lock
    released. What is left is the native teardown of torch's libraries and threads, which takes about
    a second on a CPU and can hang or abort a finished job (gloo's threads once aborted two of three
    two-node jobs there). A job that hangs after its last step holds its GPUs until the time limit.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing left to say to it
            pass
    os._exit(code)


if __name__ == "__main__":
    exit_without_teardown(main())
