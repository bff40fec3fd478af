"""What can be chosen on the command line: the config groups under conf/ with their options, and the
keys people set most, each with its default from the schema (pretrain/config.py). `--help` prints it."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

from pretrain.config import Config

from pretrain.compose import CONF_DIR

# The keys set most often, and what they do; their defaults come from the schema.
MAIN_KEYS = {
    "train.steps": "optimizer steps",
    "train.seq_len": "tokens per sequence",
    "train.micro_batch": "sequences per rank and forward pass",
    "train.global_batch": "sequences per step (null: world size x micro_batch)",
    "train.global_batch_tokens": "tokens per step, instead of train.global_batch",
    "optim.lr": "peak learning rate",
    "data.path": "a folder from `python -m pretrain.data.prepare` (null: the built-in corpus)",
    "model.init_from": "a Hugging Face Llama folder to start from (null: random weights)",
    "train.sample_every": "steps between samples of the model's text in the log (0: none)",
    "fsdp.activation_checkpointing": "auto, none, selective or full",
    "fsdp.compile": "torch.compile the blocks and the loss",
    "local.nproc": "processes on this machine (null: one per GPU, or 1)",
    "cluster.nodes": "nodes of the Slurm job (with +cluster=NAME)",
    "cluster.partition": "Slurm partition",
    "cluster.container.image": "an Apptainer .sif to run the tasks in (null: on the host)",
    "logging.wandb.mode": "disabled, offline or online",
    "hydra.run.dir": "the run directory (rerun it to resume)",
    "dry_run": "with +cluster: print the sbatch script, submit nothing",
    "write_sbatch": "with +cluster: write a standalone sbatch script to this path",
}


def group_options(conf_dir: Path = CONF_DIR) -> dict[str, list[str]]:
    """Each config group (a folder of conf/) and its options (the YAML files in it)."""
    return {folder.name: sorted(p.stem for p in folder.glob("*.yaml"))
            for folder in sorted(conf_dir.iterdir()) if folder.is_dir()}


def default_options(conf_dir: Path = CONF_DIR) -> dict[str, str]:
    """The option each group takes when none is given, from conf/config.yaml's defaults list."""
    from omegaconf import OmegaConf

    defaults = OmegaConf.to_container(OmegaConf.load(conf_dir / "config.yaml"))["defaults"]
    return {group: option for entry in defaults if isinstance(entry, dict) for group, option in entry.items()}


def schema_default(key: str) -> object:
    """A key's default in the schema, e.g. schema_default("train.steps") -> 200; inside an optional
    section such as `cluster`, the default it has once the section is there."""
    section, value = Config, None
    for part in key.split("."):
        field = {f.name: f for f in dataclasses.fields(section)}[part]
        value = field.default_factory() if field.default is dataclasses.MISSING else field.default
        declared = typing.get_type_hints(section)[part]
        section = next((t for t in (declared, *typing.get_args(declared)) if dataclasses.is_dataclass(t)), None)
    return value


def _shown(value: object) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def help_text(conf_dir: Path = CONF_DIR) -> str:
    defaults = default_options(conf_dir)
    lines = ["config groups (choose with GROUP=OPTION; cluster with +cluster=NAME):"]
    for group, options in group_options(conf_dir).items():
        shown = [f"{o} (default)" if defaults.get(group) == o else o for o in options]
        lines.append(f"  {group:<10} {', '.join(shown)}")
    lines += ["", "main keys (KEY=VALUE; `--cfg` prints every key of the composed config):"]
    for key, meaning in MAIN_KEYS.items():
        default = "" if key.startswith("hydra.") else f" [default: {_shown(schema_default(key))}]"
        lines.append(f"  {key:<31} {meaning}{default}")
    return "\n".join(lines)
