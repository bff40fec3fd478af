"""What an offline W&B run file holds, read back with wandb's own Record protos (pretrain.wandb_offline)."""

from __future__ import annotations

import json
from pathlib import Path

from pretrain.wandb_offline import read_records


def wandb_history(fragment: Path) -> list[dict]:
    """The history rows, in order: the logged values with W&B's _step, _timestamp and _runtime."""
    return [{_item_key(item): json.loads(item.value_json) for item in record.history.item}
            for record in read_records(fragment) if record.HasField("history")]


def wandb_config(fragment: Path) -> dict:
    """The W&B config: the run's initial config, then every update in order."""
    config: dict = {}
    for record in read_records(fragment):
        kind = record.WhichOneof("record_type")
        if kind in ("run", "config"):
            updates = record.run.config if kind == "run" else record.config
            config.update({_item_key(item): json.loads(item.value_json) for item in updates.update})
            for item in updates.remove:
                config.pop(_item_key(item), None)
    return config


def wandb_run_record(fragment: Path):
    """The run record: id, project, group, display name, ..."""
    return next(record.run for record in read_records(fragment) if record.HasField("run"))


def _item_key(item) -> str:
    return item.key or ".".join(item.nested_key)
