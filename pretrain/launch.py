"""`python -m pretrain.launch`: compose the config, check it, then train here or submit to Slurm.

    python -m pretrain.launch                              # train the tiny default locally
    python -m pretrain.launch model=llama-125m local.nproc=2
    python -m pretrain.launch +cluster=a100x8 cluster.nodes=4 model=llama-8b
    python -m pretrain.launch -m +cluster=a100x8 optim.lr=1e-4,3e-4,1e-3   # a sweep: one job array
    python -m pretrain.launch --cfg [overrides]            # print the composed config and exit

Overrides use Hydra's syntax and the config groups under conf/. Everything is checked before
any process starts or anything is submitted; a bad setting ends with one line naming it.
Hydra's own launchers are not used: its submitit launcher waits for the jobs, and the login
node must get its prompt back at once.
"""

from __future__ import annotations

import itertools
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from pretrain import checkpoint, config
from pretrain.config import Config, ConfigError

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
USER_ERRORS: tuple[type[Exception], ...] = (ConfigError, checkpoint.CheckpointError)


@dataclass
class Composed:
    cfg: Config
    run_dir: Path
    sweep_dir: Path


def _compose_raw(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    config.register()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return hydra_compose("config", overrides=overrides, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError(_one_line(str(err))) from None
    except (AssertionError, AttributeError) as err:  # Hydra/OmegaConf when merging into a null node
        hint = "; set it in a cluster file instead" if any("container" in o for o in overrides) else ""
        raise ConfigError(f"cannot apply overrides {overrides}: {_one_line(str(err))}{hint}") from None


def _one_line(message: str) -> str:
    return re.sub(r"\s+", " ", message.replace("\n\t", ", ")).strip()


def compose_point(overrides: list[str]) -> Composed:
    """Compose one configuration and the run directory it names (hydra.run.dir)."""
    from omegaconf import OmegaConf, open_dict

    raw = _compose_raw(overrides)
    hydra_cfg = raw.hydra
    run_dir = Path(hydra_cfg.run.dir)
    sweep_dir = Path(hydra_cfg.sweep.dir)
    with open_dict(raw):
        del raw["hydra"]
    if OmegaConf.is_missing(raw, "run_dir"):
        raw.run_dir = str(run_dir.resolve())
    try:
        cfg = config.from_container(OmegaConf.to_container(raw, resolve=True))
    except Exception as err:  # interpolation or type errors surface here
        raise ConfigError(_one_line(str(err))) from None
    return Composed(cfg, Path(cfg.run_dir), sweep_dir)


def compose(overrides: list[str]) -> Config:
    return compose_point(overrides).cfg


def expand_sweep(overrides: list[str]) -> list[list[str]]:
    """Hydra sweep syntax (a=1,2 b=x,y) to the list of override lists of each point, in order."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as err:
        raise ConfigError(_one_line(str(err))) from None
    choices = []
    for override in parsed:
        if override.is_sweep_override():
            prefix = override.input_line.split("=", 1)[0]
            choices.append([f"{prefix}={value}" for value in override.sweep_string_iterator()])
        else:
            choices.append([override.input_line])
    return [list(point) for point in itertools.product(*choices)]


def varying(points: list[list[str]]) -> list[list[str]]:
    """For each point, the overrides that differ between points (they name its run directory)."""
    columns = list(zip(*points)) if points else []
    varies = [len(set(column)) > 1 for column in columns]
    return [[o for o, v in zip(point, varies) if v] for point in points]


def dir_name(overrides: list[str]) -> str:
    return re.sub(r"[^A-Za-z0-9._=,+-]", "_", ",".join(overrides)) or "run"


def world_of(cfg: Config) -> tuple[int, int, bool]:
    """World size, ranks per node, and whether the ranks have CUDA."""
    if cfg.cluster is not None:
        return cfg.cluster.nodes * cfg.cluster.gpus_per_node, cfg.cluster.gpus_per_node, True
    from pretrain import local

    nproc = local.nproc(cfg)
    return nproc, nproc, local.has_cuda()


def check_run(cfg: Config) -> None:
    """Every check that needs no writing: config, memory, data, an existing run's checkpoints, permissions."""
    from pretrain import plan, run_data, validate

    world, per_node, has_cuda = world_of(cfg)
    validate.validate(cfg, world, per_node, has_cuda)
    plan.check(cfg)
    run_data.check(cfg)
    run_dir = Path(cfg.run_dir)
    latest = checkpoint.latest_checkpoint(run_dir / "checkpoints")
    if latest is not None:
        checkpoint.check_compatible(latest, cfg.model)
    check_writable(run_dir)


def check_writable(run_dir: Path) -> None:
    existing = run_dir
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"run directory {run_dir}: {existing} is not a writable folder; "
                          "set hydra.run.dir to a folder you can write")


def write_run(cfg: Config) -> None:
    """Create the run directory with its resolved config.yaml and (built-in corpus) its data."""
    from omegaconf import OmegaConf

    from pretrain import run_data

    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    text = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    target = run_dir / "config.yaml"
    if target.is_file() and target.read_text() != text:
        # A rerun with changed settings: keep the earlier config beside the new one.
        earlier = sorted(run_dir.glob("config.*.yaml"))
        target.rename(run_dir / f"config.{len(earlier) + 1}.yaml")
    tmp = run_dir / "config.yaml.tmp"
    tmp.write_text(text)
    os.replace(tmp, target)
    run_data.ensure(cfg)


def parse_args(argv: list[str]) -> tuple[bool, bool, list[str]]:
    multirun = any(a in ("-m", "--multirun") for a in argv)
    show = "--cfg" in argv
    overrides = [a for a in argv if a not in ("-m", "--multirun", "--cfg")]
    unknown = [a for a in overrides if a.startswith("-")]
    if unknown:
        raise ConfigError(f"unknown option {unknown[0]}; options are -m/--multirun, --cfg and -h/--help")
    return multirun, show, overrides


def sweep_points(overrides: list[str]) -> list[Composed]:
    from pretrain.wandb_run import label_sweep_point

    points = expand_sweep(overrides)
    names = varying(points)
    first = compose_point(points[0])
    composed = []
    for index, (point, name) in enumerate(zip(points, names)):
        point_cfg = compose_point(point)
        point_cfg.run_dir = (first.sweep_dir / f"{index}_{dir_name(name)}").resolve()
        point_cfg.cfg.run_dir = str(point_cfg.run_dir)
        label_sweep_point(point_cfg.cfg.logging.wandb, first.sweep_dir.name, name)
        composed.append(point_cfg)
    return composed


def write_sbatch(runs: list[Composed], overrides: list[str], multirun: bool) -> int:
    cfg = runs[0].cfg
    if cfg.cluster is None or multirun:
        raise ConfigError(f"write_sbatch={cfg.write_sbatch}: needs +cluster=NAME and a single run (no -m)")
    from pretrain import slurm

    return slurm.write_plain_script(cfg, overrides)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    from pretrain.data.errors import DataError

    try:
        multirun, show, overrides = parse_args(argv)
        runs = sweep_points(overrides) if multirun else [compose_point(overrides)]
        if show:
            from omegaconf import OmegaConf

            for run in runs:
                print(OmegaConf.to_yaml(OmegaConf.structured(run.cfg)))
            return 0
        for run in runs:
            check_run(run.cfg)
        if runs[0].cfg.write_sbatch is not None:
            return write_sbatch(runs, overrides, multirun)
        if runs[0].cfg.cluster is not None:
            from pretrain import slurm

            return slurm.submit([run.cfg for run in runs], sweep_dir=runs[0].sweep_dir if multirun else None)
        from pretrain import local

        for run in runs:
            write_run(run.cfg)
            code = local.run(run.cfg)
            if code:
                return code
        return 0
    except USER_ERRORS + (DataError,) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
