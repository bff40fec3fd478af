"""Before anything starts: every check that needs no writing, the world-dependent values settled,
then the run directory written (its mark and resolved config.yaml: the one way into the job)."""

from __future__ import annotations

import os
import tempfile
from dataclasses import asdict
from pathlib import Path

from pretrain import config, hf_format, rundir
from pretrain.config import Config, ConfigError
from pretrain.data import source
from pretrain.launcher import local, plan, validate
from pretrain.launcher.world import World


def check_config(cfg: Config, world: World) -> None:
    """The config, the weights of model.init_from (their shapes against the model's, from their headers),
    its memory estimate and its data; then settles the values that follow the world size and the GPUs (a
    global batch left unset, activation checkpointing `auto`) in `cfg`, so that the run's config.yaml says
    what it runs."""
    validate.validate(cfg, world)
    if cfg.model.init_from is not None:
        cfg.model.init_from = str(Path(cfg.model.init_from).expanduser().resolve())  # the job may start elsewhere
        hf_format.check_source(cfg.model, Path(cfg.model.init_from))
    if cfg.cluster is None:
        local.check(cfg, local.devices(cfg))
    target = plan.target_of(cfg, world)
    plan.check(cfg, target)
    settle(cfg, target)
    source.check(cfg)


def check_run_dir(cfg: Config) -> None:
    """The run directory: ours (or new), not in use, writable, and its checkpoints fit this config."""
    run_dir = Path(cfg.run_dir)
    check_owned(run_dir)
    rundir.RunLock(run_dir).check_free()
    root = run_dir / rundir.CHECKPOINTS
    latest = rundir.latest_checkpoint(root)
    if latest is not None:
        rundir.check_compatible(latest, cfg.model)
        saved_step = rundir.step_of(latest)
        if saved_step > cfg.train.steps:
            raise ConfigError(f"{run_dir} has a checkpoint at step {saved_step}, past train.steps={cfg.train.steps}: "
                              f"set train.steps above {saved_step} to train on, or use a new hydra.run.dir")
    elif rundir.damaged_checkpoints(root) and not cfg.train.start_from_scratch:
        raise ConfigError(rundir.all_damaged_message(rundir.damaged_checkpoints(root)))
    check_writable(run_dir)


def settle(cfg: Config, target: plan.Target) -> None:
    """Write the world-dependent defaults into cfg: the global batch, and `auto` checkpointing."""
    if not config.global_batch_is_set(cfg.train):
        cfg.train.global_batch = config.global_batch(cfg.train, target.world)
    if cfg.fsdp.activation_checkpointing == "auto":
        cfg.fsdp.activation_checkpointing = plan.resolve_checkpointing(cfg, target)


def check_owned(run_dir: Path) -> None:
    """A run directory is new, empty, or one of ours: a folder of other files is never written into."""
    foreign = rundir.foreign_files(run_dir)
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise ConfigError(f"hydra.run.dir={run_dir} is a folder of other files ({shown}), not a run directory of "
                          "pretrain: choose a new or empty folder (nothing in it was changed)")


def check_writable(run_dir: Path) -> None:
    """The run directory can be made and written: tried with a probe folder in its nearest existing
    parent (permissions alone do not tell, e.g. for root under /proc), which is removed at once."""
    existing = run_dir
    while not existing.exists():
        existing = existing.parent
    problem = "not a folder" if not existing.is_dir() else None
    if problem is None:
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".pretrain-probe-", dir=existing))
        except OSError as error:
            problem = error.strerror or str(error)
    if problem:
        raise ConfigError(f"run directory {run_dir}: {existing} is not a writable folder ({problem}); "
                          "set hydra.run.dir to a folder you can write")


def check_output_file(key: str, path: Path) -> None:
    """A file the launcher will write: its folder exists and it is not itself a folder."""
    if path.is_dir():
        raise ConfigError(f"{key}={path} is a folder; give the path of a file to write, e.g. {path}/job.sh")
    if not path.parent.is_dir():
        raise ConfigError(f"{key}={path}: the folder {path.parent} does not exist; create it first")


def config_text(cfg: Config) -> str:
    """The run's config.yaml."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def write_run(cfg: Config) -> None:
    """Create (or update) the run directory with its mark and resolved config.yaml."""
    from omegaconf import OmegaConf

    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    rundir.mark(run_dir)
    text = config_text(cfg)
    target = run_dir / rundir.CONFIG_FILE
    if target.is_file() and target.read_text() != text:
        # A rerun with changed settings: say what changed, and keep the earlier config beside the new one.
        earlier = run_dir / f"config.{len(list(run_dir.glob('config.*.yaml'))) + 1}.yaml"
        changed = config.changes(OmegaConf.to_container(OmegaConf.load(target)), asdict(cfg))
        print(f"{run_dir}: settings changed since its last launch ({'; '.join(changed) or 'formatting only'}); "
              f"the earlier config is kept as {earlier.name}")
        target.rename(earlier)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, target)
