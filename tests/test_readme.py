"""The README is executable: every `python -m pretrain...` line of its code blocks runs here.

Each command runs as a user types it (through bash, from an empty folder), with its example paths
pointing at real files (a prepared dataset for /data/mycorpus, text files for /data/raw, a trained
tokenizer, an image file for the .sif, a run with a checkpoint for RUN_DIR, the folder its export
writes for EXPORT_DIR) and a stand-in `apptainer` on PATH. Launches run first as
written with `dry_run=true` (every check a real launch makes, nothing started); local ones then
train for real, shortened to a couple of steps. `pretrain.sync` gets `--dry-run` (no W&B server is
reachable from tests). A README example that stops working fails here.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.helpers import REPO, checkpointed_run, write_tokenizer

README = REPO / "README.md"
# Appended to local training commands: a couple of tiny steps, whatever the model preset says.
SHORT = ("train.steps=2", "train.log_every=1", "train.eval_every=0", "train.ckpt_every=0", "train.seq_len=64",
         "train.micro_batch=1", "train.global_batch=null", "train.global_batch_tokens=null")


def readme_commands(text: str) -> list[str]:
    """The `python -m pretrain...` lines of the README's bash blocks, comments and `...` removed."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line.startswith("python -m pretrain"):
                commands.append(" ".join(word for word in line.split() if word != "..."))
    return commands


def is_launch(command: str) -> bool:
    return command.split()[2] in ("pretrain.launch",)


def is_slurm(command: str) -> bool:
    return "+cluster=" in command


def write_corpus_files(data: Path, texts: list[str]) -> None:
    """Corpora as they ship: FineWeb-style parquet files with a "text" column, a .jsonl.zst with "content"."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    zstandard = pytest.importorskip("zstandard")
    (data / "fineweb").mkdir(parents=True)
    for part in range(2):
        pq.write_table(pa.table({"text": texts[part::2]}), data / "fineweb" / f"{part:03d}.parquet")
    lines = "".join(json.dumps({"content": text}) + "\n" for text in texts)
    (data / "code.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))


@pytest.fixture
def world(tmp_path: Path) -> dict[str, Path]:
    """The files the README's example paths stand for, under tmp_path."""
    raw = tmp_path / "data" / "raw"
    (raw / "more").mkdir(parents=True)
    for name in ("a.txt", "b.txt"):  # enough for a validation split of one 4096-token sequence
        (raw / name).write_text((REPO / "README.md").read_text() * 100)
    (raw / "more" / "c.md").write_text((REPO / "singularity" / "pretrain.def").read_text())
    write_corpus_files(tmp_path / "data", [(REPO / "README.md").read_text()] * 100)
    write_tokenizer(tmp_path / "path" / "to" / "tokenizer.json", raw)
    scratch = tmp_path / "scratch" / os.environ.get("USER", "root")
    scratch.mkdir(parents=True)
    (scratch / "pretrain.sif").write_text("stand-in image")
    home = tmp_path / "home"
    home.mkdir()
    cwd = tmp_path / "work"
    cwd.mkdir()
    checkpointed_run(tmp_path / "trained", "model=tiny")
    return {"root": tmp_path, "cwd": cwd, "home": home}


def substituted(command: str, root: Path, cwd: Path) -> str:
    command = command.replace("/data/", f"{root}/data/").replace("/path/to/", f"{root}/path/to/")
    command = command.replace("/scratch/", f"{root}/scratch/")
    command = command.replace("EXPORT_DIR", shlex.quote(str(root / "export")))
    if "RUN_OR_SWEEP_DIR" not in command:
        command = command.replace("RUN_DIR", shlex.quote(str(root / "trained")))
    if "RUN_OR_SWEEP_DIR" in command:
        runs = list((cwd / "runs").glob("*/*/config.yaml"))
        assert runs, f"no run directory under {cwd / 'runs'} for: {command}"
        newest = max(runs, key=lambda p: p.stat().st_mtime).parent
        command = command.replace("RUN_OR_SWEEP_DIR", shlex.quote(str(newest)))
    return command


def run(command: str, world: dict[str, Path]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update({"HOME": str(world["home"]), "USER": os.environ.get("USER", "root"),
                "PATH": f"{REPO / 'tests' / 'fake_container'}{os.pathsep}{os.environ['PATH']}",
                "FAKE_CONTAINER_RECORD": str(world["root"] / "container.jsonl"), "PYTHONWARNINGS": "ignore"})
    return subprocess.run(["bash", "-c", command], cwd=world["cwd"], env=env, capture_output=True, text=True,
                           timeout=600)


def runs_of(command: str) -> list[str]:
    """What the test runs for one README line: as written (launches as dry runs), then shortened for real."""
    if command.split()[2] == "pretrain.sync":
        return [command + " --dry-run"]
    if command.split()[2] == "pretrain.data.prepare" and is_slurm(command):
        return [command + " dry_run=true"]  # as for a submission: every check, the batch script printed
    if not is_launch(command) or "dry_run=true" in command or "--cfg" in command:
        return [command]
    checked = command + " dry_run=true"
    if is_slurm(command):
        return [checked]
    return [checked, command + " " + " ".join(SHORT)]


def test_readme_lists_the_commands_it_promises():
    commands = readme_commands(README.read_text())
    assert "python -m pretrain.launch" in commands
    assert "python -m pretrain.launch +cluster=a100x8" in commands
    assert any(c.startswith("python -m pretrain.launch -m ") for c in commands)
    for module in ("plan", "status", "sync", "report", "data.prepare", "export", "generate"):
        assert any(c.startswith(f"python -m pretrain.{module} ") for c in commands), module


def test_every_readme_command_works(world):
    commands = readme_commands(README.read_text())
    # The data is prepared, and the run exported, before the commands that use them, wherever the README shows them.
    first = ("python -m pretrain.data.prepare", "python -m pretrain.export")
    ordered = sorted(commands, key=lambda c: next((i for i, f in enumerate(first) if c.startswith(f)), len(first)))
    failures = []
    for command in ordered:
        for attempt in runs_of(command):
            result = run(substituted(attempt, world["root"], world["cwd"]), world)
            expected = 1 if "model=llama-70b" in command and command.split()[2] == "pretrain.plan" else 0
            if result.returncode != expected:
                failures.append(f"{attempt}\n  exit {result.returncode}: {(result.stderr or result.stdout)[-800:]}")
            elif "model=llama-70b" in command and command.split()[2] == "pretrain.plan":
                assert "smallest node count that fits: cluster.nodes=4" in result.stdout
    assert not failures, "README commands that failed:\n" + "\n".join(failures)


def test_help_names_every_option_of_every_group(capsys):
    """`python -m pretrain.launch --help` lists each config group under conf/ with all of its options."""
    from pretrain import launch

    assert launch.main(["--help"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")}
    groups = [d for d in (REPO / "conf").iterdir() if d.is_dir()]
    assert len(groups) >= 7
    for group in groups:
        listed = lines[group.name].split(None, 1)[1].replace(" (default)", "").split(", ")
        assert sorted(listed) == sorted(p.stem for p in group.glob("*.yaml")), group.name
