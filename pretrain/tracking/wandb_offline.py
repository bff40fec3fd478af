"""A run's offline W&B data on disk: its fragments, and which are finished or uploaded.

W&B writes an offline run to RUN/wandb/offline-run-DATE_TIME-ID/run-ID.wandb. Each attempt of
a requeued or resumed job opens the same W&B run again and writes a new folder: a fragment of
the run. `wandb sync` uploads the fragments of one run in order and, once one is uploaded,
leaves a `run-ID.wandb.synced` marker beside it. Whether an attempt ended cleanly is what rank 0
recorded in RUN/wandb_run.json when W&B's finish returned: the .wandb format itself is private
to wandb, and nothing here reads it.
"""

from __future__ import annotations

from pathlib import Path

from pretrain.tracking import wandb_run

def fragments(run_dir: Path) -> list[Path]:
    """The run's offline .wandb files, oldest attempt first (folder names start with the start time)."""
    return sorted((Path(run_dir) / "wandb").glob("offline-run-*/run-*.wandb"), key=lambda p: p.parent.name)


def is_synced(fragment: Path) -> bool:
    return fragment.with_name(fragment.name + ".synced").exists()


def mark_synced(fragment: Path) -> None:
    """Write the marker `wandb sync` leaves, so that it skips this fragment from now on."""
    fragment.with_name(fragment.name + ".synced").touch()


def run_id(fragment: Path) -> str:
    """The W&B run id, from the folder name offline-run-DATE_TIME-ID."""
    return fragment.parent.name.split("-", 3)[3]


def is_closed(fragment: Path) -> bool:
    """Whether the attempt that wrote this fragment ended cleanly (recorded by rank 0 in wandb_run.json)."""
    run_dir = fragment.parents[2]
    return fragment.parent.name in wandb_run.read_state(run_dir)["ended"]
