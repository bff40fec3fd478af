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
import shlex
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from pretrain import checkpoint, config, runs
from pretrain.choices import CONF_DIR
from pretrain.preemption import EXIT_ABORTED, EXIT_STOPPED
from pretrain.runs import RunLock, RunLocked
from pretrain.config import Config, ConfigError

USER_ERRORS: tuple[type[Exception], ...] = (ConfigError, checkpoint.CheckpointError, RunLocked)


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


def check_run(cfg: Config, world_shape: tuple[int, int, bool] | None = None) -> None:
    """Every check that needs no writing (config, memory, data, checkpoints, the run directory), and
    the world-dependent values settled in `cfg` (see check_config)."""
    check_config(cfg, world_shape)
    check_run_dir(cfg)


def check_config(cfg: Config, world_shape: tuple[int, int, bool] | None = None) -> None:
    """The config, its memory estimate and its data; then settles the values that follow the world
    size and the GPUs (a global batch left unset, activation checkpointing `auto`) in `cfg`, so that
    the run's config.yaml says what it runs. world_shape: (world size, ranks per node, CUDA) of ranks
    already started (torchrun); by default those the launcher will start.
    """
    from pretrain import plan, run_data, validate

    world_shape = world_shape or world_of(cfg)
    validate.validate(cfg, *world_shape)
    if cfg.cluster is None:
        from pretrain import local

        local.check(cfg)
    target = plan.target_of(cfg, world_shape)
    plan.check(cfg, target)
    settle(cfg, target)
    run_data.check(cfg)


def check_run_dir(cfg: Config) -> None:
    """The run directory: ours (or new), not in use, writable, and its checkpoints fit this config."""
    run_dir = Path(cfg.run_dir)
    check_owned(run_dir)
    runs.check_unlocked(run_dir)
    root = run_dir / "checkpoints"
    latest = checkpoint.latest_checkpoint(root)
    if latest is not None:
        checkpoint.check_compatible(latest, cfg.model)
        saved_step = checkpoint.step_of(latest)
        if saved_step > cfg.train.steps:
            raise ConfigError(f"{run_dir} has a checkpoint at step {saved_step}, past train.steps={cfg.train.steps}: "
                              f"set train.steps above {saved_step} to train on, or use a new hydra.run.dir")
    elif checkpoint.damaged_checkpoints(root) and not cfg.train.start_from_scratch:
        raise ConfigError(checkpoint.all_damaged_message(checkpoint.damaged_checkpoints(root)))
    check_writable(run_dir)


def settle(cfg: Config, target) -> None:
    """Write the world-dependent defaults into cfg: the global batch, and `auto` checkpointing."""
    from pretrain import plan

    if not config.global_batch_is_set(cfg.train):
        cfg.train.global_batch = config.global_batch(cfg.train, target.world)
    if cfg.fsdp.activation_checkpointing == "auto":
        cfg.fsdp.activation_checkpointing = plan.resolve_checkpointing(cfg, target)


def check_owned(run_dir: Path) -> None:
    """A run directory is new, empty, or one of ours: a folder of other files is never written into."""
    foreign = runs.foreign_files(run_dir)
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


def write_run(cfg: Config) -> None:
    """Create the run directory with its resolved config.yaml and (built-in corpus) its data."""
    from omegaconf import OmegaConf

    from pretrain import run_data

    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    runs.mark(run_dir)
    text = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    target = run_dir / "config.yaml"
    if target.is_file() and target.read_text() != text:
        # A rerun with changed settings: say what changed, and keep the earlier config beside the new one.
        earlier = run_dir / f"config.{len(list(run_dir.glob('config.*.yaml'))) + 1}.yaml"
        changed = config.changes(OmegaConf.to_container(OmegaConf.load(target)), asdict(cfg))
        print(f"{run_dir}: settings changed since its last launch ({'; '.join(changed) or 'formatting only'}); "
              f"the earlier config is kept as {earlier.name}")
        target.rename(earlier)
    tmp = run_dir / "config.yaml.tmp"
    tmp.write_text(text)
    os.replace(tmp, target)
    run_data.ensure(cfg)


def parse_args(argv: list[str]) -> tuple[bool, bool, list[str]]:
    """(multirun, print the config, overrides). `--cfg` takes Hydra's optional part name: job or all
    print the composed config (this launcher has no Hydra runtime config to show)."""
    args = list(argv)
    multirun = any(a in ("-m", "--multirun") for a in args)
    args = [a for a in args if a not in ("-m", "--multirun")]
    show = "--cfg" in args
    if show:
        at = args.index("--cfg")
        del args[at]
        if at < len(args) and args[at] in ("job", "all", "hydra"):
            if args.pop(at) == "hydra":
                raise ConfigError("--cfg hydra: this launcher composes with Hydra but runs nothing of Hydra's; "
                                  "use --cfg (or --cfg job) for the run's config")
    unknown = [a for a in args if a.startswith("-")]
    if unknown:
        raise ConfigError(f"unknown option {unknown[0]}; options are -m/--multirun, --cfg [job] and -h/--help")
    return multirun, show, args


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

    check_output_file("write_sbatch", Path(cfg.write_sbatch))
    return slurm.write_plain_script(cfg, overrides)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        from pretrain.choices import help_text

        print(__doc__ + "\n" + help_text())
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

        if runs[0].cfg.dry_run:
            return local.dry_run([run.cfg for run in runs])
        for run in runs:
            Path(run.cfg.run_dir).mkdir(parents=True, exist_ok=True)
            with RunLock(run.cfg.run_dir):  # held by this launcher while its ranks train
                write_run(run.cfg)
                code = local.run(run.cfg)
            if code == EXIT_STOPPED:
                print(f"stopped with a checkpoint; to resume: {resume_command(overrides, run.cfg.run_dir)}",
                      file=sys.stderr)
            if code:
                return code
        return 0
    except USER_ERRORS + (DataError,) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted before training started; nothing was trained", file=sys.stderr)
        return EXIT_ABORTED


def resume_command(overrides: list[str], run_dir: str) -> str:
    """The launch command that continues a local run: the same overrides, the same run directory."""
    kept = [o for o in overrides if not o.startswith("hydra.run.dir=")]
    return " ".join(["python -m pretrain.launch", *map(shlex.quote, kept), shlex.quote(f"hydra.run.dir={run_dir}")])


if __name__ == "__main__":
    sys.exit(main())
