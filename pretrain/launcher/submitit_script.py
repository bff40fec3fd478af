"""The batch script submitit writes, rendered without submitting: for dry runs and `write_sbatch`.

submitit has no public call for this. Its SlurmExecutor renders the script it submits with the
private `_make_sbatch_string(command=..., folder=..., **executor.parameters)`, the command being its
private `_submitit_command_str`. This module is the one place that calls them, so that a dry run
prints exactly what a submission submits; tests/test_compat.py fails if a submitit release
changes either (and a test on the local Slurm cluster compares a submitted script with the dry run).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def render(parameters: dict[str, Any], folder: Path | str, command: str) -> str:
    """The sbatch script for these executor parameters, log folder and task command."""
    from submitit.slurm.slurm import _make_sbatch_string

    return _make_sbatch_string(command=command, folder=folder, **parameters)


def submitted_command(executor: Any) -> str:
    """The command submitit's script runs in each task (`python -u -m submitit.core._submit FOLDER`)."""
    return executor._submitit_command_str
