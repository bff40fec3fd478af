"""`python -m pretrain.train RUN_DIR`: one rank of a job, on a run directory the launcher wrote (pretrain.trainer.loop)."""

from __future__ import annotations

import sys

from pretrain.trainer import bytecode


def main(argv: list[str] | None = None) -> int:
    """One rank of a job; returns its ExitCode (rundir). The trainer (torch and all) is imported only
    once the run directory's bytecode cache is in place (pretrain.trainer.bytecode)."""
    argv = sys.argv[1:] if argv is None else argv
    bytecode.keep_in_run_dir(argv)
    from pretrain.trainer import loop

    return loop.main(argv)


if __name__ == "__main__":
    sys.exit(main())
