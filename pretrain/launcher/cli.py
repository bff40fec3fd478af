"""`python -m pretrain.launch`: compose the config, check it, then train here or submit to Slurm.

    python -m pretrain.launch                              # train the tiny default locally
    python -m pretrain.launch model=llama-125m local.nproc=2
    python -m pretrain.launch +cluster=a100x8 cluster.nodes=4 model=llama-8b
    python -m pretrain.launch -m +cluster=a100x8 optim.lr=1e-4,3e-4,1e-3   # a sweep: one job array
    python -m pretrain.launch --cfg [overrides]            # print the composed config and exit
    python -m pretrain.launch ... prepare_only=true        # write the run directory for torchrun etc.

Overrides use Hydra's syntax and the config groups under conf/. Everything is checked before
any process starts or anything is submitted; a bad setting ends with one line naming it.
Hydra's own launchers are not used: its submitit launcher waits for the jobs, and the login
node must get its prompt back at once.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from pretrain import compose
from pretrain.config import Config, ConfigError
from pretrain.data.errors import DataError
from pretrain.launcher import local, plan, preparation, validate
from pretrain.launcher.choices import help_text
from pretrain.launcher.world import world_of
from pretrain.rundir import CheckpointError, ExitCode, RunLock, RunLocked

USER_ERRORS: tuple[type[Exception], ...] = (ConfigError, CheckpointError, RunLocked, DataError)


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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__ + "\n" + help_text())
        return 0
    try:
        multirun, show, overrides = parse_args(argv)
        runs = compose.sweep_points(overrides) if multirun else [compose.compose_point(overrides)]
        if show:
            for run in runs:
                print(preparation.config_text(run.cfg))
            return 0
        first = runs[0].cfg
        world = world_of(first)
        for run in runs:
            preparation.check_config(run.cfg, world)
            if first.write_sbatch is None:  # a hand-run script's run directory is made when the job runs
                preparation.check_run_dir(run.cfg)
        if first.write_sbatch is not None:
            return write_sbatch(runs, overrides, multirun)
        if first.cluster is not None and not first.prepare_only:
            from pretrain.launcher import slurm

            return slurm.submit([run.cfg for run in runs], sweep_dir=runs[0].sweep_dir if multirun else None)
        if first.dry_run:
            return local.dry_run([run.cfg for run in runs], local.devices(first))
        if first.prepare_only:
            return prepare_only([run.cfg for run in runs], world.size)
        return train_here([run.cfg for run in runs], overrides, world.size)
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return ExitCode.REFUSED
    except KeyboardInterrupt:
        print("interrupted before training started; nothing was trained", file=sys.stderr)
        return ExitCode.ABORTED


def train_here(cfgs: list[Config], overrides: list[str], world: int) -> int:
    """Each run in turn on this machine, its lock held by this launcher while its ranks train."""
    for cfg in cfgs:
        Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
        with RunLock(cfg.run_dir):
            preparation.write_run(cfg)
            code = local.run(cfg, world)
        if code == ExitCode.STOPPED:
            print(f"stopped with a checkpoint; to resume: {resume_command(overrides, cfg.run_dir)}", file=sys.stderr)
        if code:
            return code
    return ExitCode.OK


def prepare_only(cfgs: list[Config], world: int) -> int:
    """Write the run directories and start nothing: for launchers of your own, such as torchrun."""
    for cfg in cfgs:
        preparation.write_run(cfg)
        print(f"wrote {cfg.run_dir} for {world} ranks; start it with a launcher of your own, e.g.\n"
              f"  torchrun --nproc-per-node {world} -m pretrain.train {shlex.quote(cfg.run_dir)}")
    return ExitCode.OK


def write_sbatch(runs: list[compose.Composed], overrides: list[str], multirun: bool) -> int:
    cfg = runs[0].cfg
    if cfg.cluster is None or multirun:
        raise ConfigError(f"write_sbatch={cfg.write_sbatch}: needs +cluster=NAME and a single run (no -m)")
    from pretrain.launcher import slurm

    preparation.check_output_file("write_sbatch", Path(cfg.write_sbatch))
    return slurm.write_plain_script(cfg, overrides)


def resume_command(overrides: list[str], run_dir: str) -> str:
    """The launch command that continues a local run: the same overrides, the same run directory."""
    kept = [o for o in overrides if not o.startswith("hydra.run.dir=")]
    return " ".join(["python -m pretrain.launch", *map(shlex.quote, kept), shlex.quote(f"hydra.run.dir={run_dir}")])


def plan_main(argv: list[str] | None = None) -> int:
    """`python -m pretrain.plan [overrides]`: the estimate of pretrain.launcher.plan, printed; exits 1
    when the run will not fit, naming the smallest node count and other settings that would."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(plan.__doc__ + "\n" + help_text())
        return 0
    try:
        if any(a.startswith("-") for a in argv):
            raise ConfigError(f"unknown option {next(a for a in argv if a.startswith('-'))}; only overrides and -h")
        cfg = compose.compose(argv)
        world = world_of(cfg)
        validate.validate(cfg, world)
        target = plan.target_of(cfg, world)
        result = plan.estimate(cfg, target)
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return ExitCode.REFUSED
    print(plan.report(cfg, target, result))
    if result.fits:
        return 0
    fewest = plan.smallest_node_count(cfg, target) if cfg.cluster is not None else None
    if fewest is not None:
        print(f"\nsmallest node count that fits: cluster.nodes={fewest[0]} ({plan.gib(fewest[1].total)} GiB per GPU)")
    fixes = plan.suggestions(cfg, target)
    print("\nwould fit:" if fixes else "\nno candidate setting fits (smaller micro-batch, activation checkpointing, "
          f"full sharding, up to {plan.MAX_SUGGESTED_NODES} nodes)")
    for s in fixes:
        print(f"  {' '.join(s.overrides):<70} {plan.gib(s.estimate.total)} GiB")
    return 1

