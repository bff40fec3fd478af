"""Shared helpers: run the real command lines and read what runs wrote."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# A model so small that a run is mostly start-up (a 20-step run: 9 s instead of 36 on 2 cores),
# for tests of what happens around training (checkpoints, resume, requeue), not of learning.
MINI_MODEL = ("model.dim=64", "model.n_layers=2", "model.ffn_hidden=192", "train.seq_len=64")


def launch(*overrides: str, timeout: float = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m pretrain.launch OVERRIDES...` as a user types it; output captured.

    Past `timeout` the test fails with where every thread of the ranks was: they get SIGABRT, on
    which a rank's faulthandler prints each thread's stack.
    """
    argv = [sys.executable, "-m", "pretrain.launch", *overrides]
    with subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, **(env or {})}) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stdout, stderr = abort_with_stacks(process)
            pytest.fail(f"`{' '.join(overrides)}` still ran after {timeout:.0f} s; its output, with each thread's "
                        f"stack at the abort:\n{stdout[-4000:]}\n{stderr[-12000:]}", pytrace=False)
    return subprocess.CompletedProcess(argv, process.returncode, stdout, stderr)


def abort_with_stacks(process: subprocess.Popen) -> tuple[str, str]:
    """SIGABRT to the processes a launcher started (its ranks), then to it; returns their output."""
    for pid in [*descendants(process.pid), process.pid]:
        try:
            os.kill(pid, signal.SIGABRT)
        except ProcessLookupError:
            pass
    try:
        return process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.communicate()


def descendants(pid: int) -> list[int]:
    """The processes below `pid`, children first, from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, queue = [], list(children.get(pid, []))
    while queue:
        found.append(queue.pop(0))
        queue += children.get(found[-1], [])
    return found


SLURM_CLIENTS = ("scontrol", "sbatch", "srun", "scancel", "squeue", "sacct", "salloc")


def hidden_slurm_path(tmp_path: Path, hide: tuple[str, ...] = SLURM_CLIENTS) -> str:
    """PATH with the commands `hide` (by default Slurm's clients, as in a container) gone: every PATH
    folder that holds one of them is mirrored without them."""
    folders = []
    for index, folder in enumerate(os.environ["PATH"].split(os.pathsep)):
        if not os.path.isdir(folder):
            continue
        if not any(os.path.exists(os.path.join(folder, c)) for c in hide):
            folders.append(folder)
            continue
        mirror = tmp_path / f"path-without-{hide[0]}-{index}"
        mirror.mkdir()
        for name in os.listdir(folder):
            if not name.startswith(hide):
                (mirror / name).symlink_to(os.path.join(folder, name))
        folders.append(str(mirror))
    return os.pathsep.join(folders)


def metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def last_step_record(run_dir: Path) -> dict:
    """The newest record of a training step (other records carry eval losses or checkpoint timings)."""
    return [r for r in metrics(run_dir) if "loss" in r][-1]


def step_values(run_dir: Path, key: str) -> dict[int, float]:
    """step -> the value of `key` in metrics.jsonl, for the records that have it."""
    return {r["step"]: r[key] for r in metrics(run_dir) if key in r}


def losses(run_dir: Path) -> dict[int, float]:
    return step_values(run_dir, "loss")


def launch_plain_and_wrapped(root: Path, *overrides: str) -> dict[str, subprocess.CompletedProcess]:
    """The same one-process run twice, into root/plain (without FSDP2, the default) and root/wrapped
    (fsdp.wrap_single_rank=true); each must succeed. Returns both results by name."""
    results = {}
    for name, extra in (("plain", ()), ("wrapped", ("fsdp.wrap_single_rank=true",))):
        results[name] = launch(*overrides, *extra, f"hydra.run.dir={Path(root) / name}")
        assert results[name].returncode == 0, results[name].stderr + results[name].stdout
    return results


def optimizer_step_counts(checkpoint: Path) -> set[float]:
    """The step counts AdamW's state holds in a checkpoint folder, one value per parameter's count (DCP's
    files read with DCP's own converter, in this process)."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as folder:
        dcp_to_torch_save(checkpoint, Path(folder) / "state.pt")
        state = torch.load(Path(folder) / "state.pt", weights_only=False)
    return {float(entry["step"]) for entry in state["optim"]["state"].values()}


def assert_same_losses(got: dict[int, float], expected: dict[int, float], steps) -> None:
    """A resumed (or asynchronously checkpointed) run reproduces the uninterrupted one, step by step.

    Bit-identical on CPU in every run we watched but one: in a CI run on a loaded 2-core machine
    one loss differed in its 7th digit. So 1e-6 relative is asserted; what a wrong restore moves
    (optimizer state, data position, learning-rate schedule) moves losses by far more.
    """
    for step in steps:
        assert got[step] == pytest.approx(expected[step], rel=1e-6, abs=0), (step, got[step], expected[step])


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under root with its size and mtime: to show that nothing was written or changed."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def processes_with_env(**wanted: str) -> list[int]:
    """PIDs of this machine's processes whose environment has all the given variables and values."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "environ").read_bytes()
        except OSError:
            continue
        env = dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)
        if all(env.get(k) == v for k, v in wanted.items()):
            pids.append(int(entry.name))
    return pids


def training_processes_of(job: str, node: str) -> list[int]:
    """The python processes of Slurm job `job`'s tasks on `node` (its first attempt's while that runs)."""
    pids = (processes_with_env(SLURM_JOB_ID=job, SLURMD_NODENAME=node, SLURM_RESTART_COUNT="0")
            or processes_with_env(SLURM_JOB_ID=job, SLURMD_NODENAME=node))
    return [p for p in pids if "python" in Path(f"/proc/{p}/cmdline").read_text(errors="replace")]


# torch 2.7's gloo group can deadlock when destroyed right after a collective: a worker thread drops the
# collective's tensors just after the caller got its result and needs the GIL for that, while the thread
# destroying the group joins it holding the GIL (seen in CI: the worker in ~AsyncAllgatherWork waiting for
# the GIL, the main thread in ~ProcessGroupGloo). A barrier before the destroy does not prevent it: the
# worker of an earlier all-gather can still be behind it (two fresh-clone CI runs hung so, in
# test_shard_reader, with the barrier). On that torch a test process keeps its world of one from its
# first use on, and destroys nothing.
KEEP_ONE_PROCESS_GROUP = tuple(int(part) for part in version("torch").split(".")[:2]) < (2, 8)


@contextmanager
def one_process_group(backend: str = "gloo"):
    """A world of one process (this one), for code that calls torch.distributed collectives."""
    import torch.distributed as dist

    from pretrain.hosts import free_port

    if KEEP_ONE_PROCESS_GROUP and dist.is_initialized():
        if dist.get_backend() == backend:  # the one an earlier test kept
            yield
            return
        _destroy_default_group()
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        if not KEEP_ONE_PROCESS_GROUP:
            _destroy_default_group()


def _destroy_default_group() -> None:
    import torch.distributed as dist

    dist.barrier()  # lets gloo's workers finish what they hold first (see KEEP_ONE_PROCESS_GROUP)
    dist.destroy_process_group()


def checkpointed_run(run_dir: Path, *overrides: str, step: int = 1):
    """A run directory (the composed config) whose one checkpoint, of `step`, holds the freshly initialised
    model, written by the trainer's Checkpointer in this process: for what reads checkpoints, without
    training. Returns that model, unsharded."""
    import torch

    from pretrain.compose import compose
    from pretrain.launcher.preparation import write_run
    from pretrain.models.llama import Transformer
    from pretrain.parallel.parallelize import build_mesh
    from pretrain.trainer.checkpoint import Checkpointer
    from pretrain.trainer.loop import build_model
    from pretrain.trainer.optim import build_optimizer

    cfg = compose(["fsdp.activation_checkpointing=none", *overrides, f"hydra.run.dir={run_dir}"])  # as the launcher settles it
    write_run(cfg)
    cpu = torch.device("cpu")
    with one_process_group():
        model = build_model(cfg, cpu, build_mesh(cfg.fsdp, cpu, 1, 1)).weights
        Checkpointer(Path(run_dir) / "checkpoints", keep=1).save(step, model, build_optimizer(model, cfg.optim, cpu),
                                                                 {"step": step}, cfg.model, "test")
        weights = model.state_dict()  # one process: the model is not sharded
    plain = Transformer(cfg.model)
    plain.load_state_dict(weights)
    return plain.eval()


def write_tokenizer(path: Path, corpus: Path) -> None:
    """A byte-level BPE tokenizer.json of 400 tokens (<|endoftext|> among them), trained on corpus/**/*.txt."""
    tokenizers = pytest.importorskip("tokenizers")
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    bpe.train([str(p) for p in corpus.rglob("*.txt")], trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    bpe.save(str(path))
