"""Shared helpers: run the real command lines and read what runs wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def launch(*overrides: str, timeout: float = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m pretrain.launch OVERRIDES...` as a user types it; output captured."""
    return subprocess.run([sys.executable, "-m", "pretrain.launch", *overrides], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(run_dir) if "loss" in r}


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under root with its size and mtime: to show that nothing was written or changed."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def wandb_history(fragment: Path) -> list[dict]:
    """The history rows of one offline W&B run file, read with wandb's own Record protos."""
    from pretrain.wandb_offline import read_records

    return [{_item_key(item): json.loads(item.value_json) for item in record.history.item}
            for record in read_records(fragment) if record.HasField("history")]


def wandb_config(fragment: Path) -> dict:
    """The W&B config of one offline W&B run file: the run's initial config, then every update in order."""
    from pretrain.wandb_offline import read_records

    config: dict = {}
    for record in read_records(fragment):
        kind = record.WhichOneof("record_type")
        if kind in ("run", "config"):
            updates = record.run.config if kind == "run" else record.config
            config.update({_item_key(item): json.loads(item.value_json) for item in updates.update})
            for item in updates.remove:
                config.pop(_item_key(item), None)
    return config


def _item_key(item) -> str:
    return item.key or ".".join(item.nested_key)


def wandb_run_record(fragment: Path):
    """The run record (id, project, group, display name, ...) of one offline W&B run file."""
    from pretrain.wandb_offline import read_records

    return next(record.run for record in read_records(fragment) if record.HasField("run"))
