"""Running the training inside an Apptainer/Singularity image (`cluster.container`).

The tasks run `RUNTIME exec --nv --env PYTHONNOUSERSITE=1 --bind ... IMAGE python3 ...`: `--nv`
makes the host's NVIDIA driver and GPUs visible; PYTHONNOUSERSITE keeps packages in the user's
~/.local from shadowing the image's; the run directory, the data and `container.binds` are bound at the
same paths. The host environment passes in (Apptainer's default), which carries Slurm's
per-task variables, NCCL and W&B settings and the rendezvous address; secrets reach the job
only that way and are never written into a script.
"""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path

from pretrain.config import Config, ConfigError
from pretrain.data.source import data_paths

RUNTIMES = ("apptainer", "singularity")


def runtime(cfg: Config) -> str:
    """The runtime command: as configured, or (auto) whichever of apptainer/singularity is on PATH."""
    wanted = cfg.cluster.container.runtime
    if wanted != "auto":
        if wanted not in RUNTIMES:
            raise ConfigError(f"cluster.container.runtime={wanted!r}: choose apptainer, singularity or auto")
        return wanted
    for name in RUNTIMES:
        if shutil.which(name):
            return name
    raise ConfigError("neither apptainer nor singularity is on PATH: load the cluster's module (e.g. "
                      "`module load apptainer`) or set cluster.container.image=null to run on the host")


def extra_binds(cfg: Config) -> list[str]:
    """Bind mounts besides the run directories: the data (data.path, or every source of data.mix), the
    weights of model.init_from, and container.binds."""
    weights = [Path(cfg.model.init_from).expanduser()] if cfg.model.init_from is not None else []
    return [str(path.resolve()) for path in [*data_paths(cfg), *weights]] + list(cfg.cluster.container.binds)


def exec_prefix(cfg: Config, run_root: str) -> str:
    """The shell words that run a command inside the image.

    run_root is a shell word already (a quoted path, or "$PRETRAIN_RUN_DIR" in a hand-run script):
    the folder holding the run directories, bound at the same path.
    """
    container = cfg.cluster.container
    # PYTHONNOUSERSITE: packages in the user's ~/.local (visible through the home bind) must not
    # shadow the image's.
    words = [shlex.quote(runtime(cfg)), "exec", "--nv", "--env", "PYTHONNOUSERSITE=1", "--bind", run_root]
    for bind in extra_binds(cfg):
        words += ["--bind", shlex.quote(bind)]
    words += [shlex.quote(w) for w in container.options]
    words.append(shlex.quote(str(Path(container.image).expanduser().resolve())))
    return " ".join(words)


def check(cfg: Config) -> list[str]:
    """Before submission (and in a dry run): the image exists, every bind source exists, a runtime is
    on PATH. Returns what was checked, for the dry run to say."""
    container = cfg.cluster.container
    image = Path(container.image).expanduser()
    if not image.is_file():
        raise ConfigError(f"cluster.container.image={container.image}: no such file; build it with "
                          "singularity/build.sh and copy it to a filesystem the compute nodes see")
    for bind in extra_binds(cfg):
        source = Path(bind.split(":", 1)[0]).expanduser()
        if not source.exists():
            raise ConfigError(f"container bind source {source} does not exist (from cluster.container.binds, "
                              "the data or model.init_from)")
    if shutil.which(runtime(cfg)) is None:
        raise ConfigError(f"cluster.container.runtime={runtime(cfg)} is not on PATH: load its module, or set "
                          "cluster.container.runtime=auto")
    sources = [bind.split(":", 1)[0] for bind in extra_binds(cfg)]
    return [f"image {image}"] + ([f"bind sources {', '.join(sources)}"] if sources else []) + [f"{runtime(cfg)} on PATH"]
