"""Composing configs with Hydra: the overrides of one run or of a sweep into typed Configs.

Hydra's compose API is used, not its app runner: a bad config leaves nothing behind, and a sweep
becomes one job array without Hydra's blocking launchers. Errors come out as one ConfigError line
naming the override and what it expects. No torch here (login nodes).
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from pathlib import Path

from pretrain import config
from pretrain.config import Config, ConfigError, WandbConfig

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


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
        raise ConfigError(_hydra_message(err)) from None
    except (AssertionError, AttributeError) as err:  # Hydra/OmegaConf when merging into a null node
        raise ConfigError(f"cannot apply overrides {overrides}: {_one_line(str(err))}; the section is null "
                          "in the composed config: set it in a config file instead") from None


# What a schema type expects, in the words of an error message.
EXPECTED = {int: "an integer", float: "a number", bool: "true or false", str: "text"}


def _hydra_message(err: Exception) -> str:
    """One line: which override failed and why, without Hydra's search-path listing."""
    cause = err.__cause__
    full_key = getattr(cause, "full_key", None)
    if full_key and getattr(cause, "object_type", None) is not None:
        import typing

        field = full_key.rsplit(".", 1)[-1]
        declared = typing.get_type_hints(cause.object_type).get(field)
        wanted = next((EXPECTED[t] for t in (declared, *typing.get_args(declared)) if t in EXPECTED), None)
        given = re.search(r"Error merging override (\S+)", str(err))
        first_line = str(getattr(cause, "msg", cause)).splitlines()[0]
        if wanted and given:
            return f"{given.group(1)}: {full_key} expects {wanted} ({first_line})"
    message = _one_line(str(err).split("\nConfig search path:")[0])
    if getattr(err, "override", None) and err.override not in message:
        message = f"cannot read the override {err.override!r}: {message}; quote a value with spaces or shell " \
                  "characters for Hydra as well, e.g. key='a b'"
    return message.replace(" Available options in ", "; options in ").replace("':, ", "': ")


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
    """The Config of one set of overrides (e.g. for tests and the planner)."""
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


def sweep_points(overrides: list[str]) -> list[Composed]:
    """Every point of a sweep (`-m`), each with its run directory SWEEP_DIR/INDEX_OVERRIDES."""
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


def label_sweep_point(settings: WandbConfig, sweep_name: str, varying: list[str]) -> None:
    """Group a sweep's runs under the sweep's name and name each after the values it varies, unless set."""
    if settings.group is None:
        settings.group = sweep_name
    if settings.name is None and varying:
        settings.name = ",".join(varying)
