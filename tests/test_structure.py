"""The package's structure holds: a torch-free core, three wings, no import circle.

Every import of every module under pretrain/ is read with `ast` (imports inside functions count:
they run too), and each module's imports are checked against the rules of its room:

  core      config, compose, rundir, flops, redaction, hosts, hf_format, data/
  launcher  the login node: may use the core and tracking, never the trainer, parallel, models, hf or torch
  tracking  W&B, sync, report: the core only, and no torch
  trainer, parallel, models, hf   the job side (hf: export, init_from's reading, generate): anything but the launcher

and the module graph must have no cycle. Then the commands of the login node are started for real
and must not load torch.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

PACKAGE = REPO / "pretrain"
CORE = {"pretrain", "pretrain.config", "pretrain.compose", "pretrain.rundir", "pretrain.flops",
        "pretrain.redaction", "pretrain.hosts", "pretrain.hf_format"}
# The entry points (`python -m pretrain.X`): each only hands over to its wing.
ENTRIES = {"pretrain.launch": "pretrain.launcher", "pretrain.plan": "pretrain.launcher",
           "pretrain.status": "pretrain.launcher", "pretrain.sync": "pretrain.tracking",
           "pretrain.report": "pretrain.tracking", "pretrain.train": "pretrain.trainer",
           "pretrain.export": "pretrain.hf", "pretrain.generate": "pretrain.hf",
           "pretrain.data.prepare": "pretrain.launcher"}
JOB_SIDE = ("pretrain.trainer", "pretrain.parallel", "pretrain.models", "pretrain.hf")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports, anywhere in it (absolute names)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}
GRAPH = {name: {m for m in imports_of(path) if m in MODULES and m != name} for name, path in MODULES.items()}


def within(name: str, *packages: str) -> bool:
    """Whether module `name` is one of the packages or inside one (pretrain.hf_format is not inside pretrain.hf)."""
    return any(name == package or name.startswith(package + ".") for package in packages)


def room(name: str) -> str:
    if name in ENTRIES:
        return "entry"
    if name in CORE or within(name, "pretrain.data"):
        return "core"
    for wing in ("launcher", "tracking", "trainer", "parallel", "models", "hf"):
        if within(name, f"pretrain.{wing}"):
            return wing
    return "unknown"


def forbidden(name: str, imported: str) -> bool:
    kind = room(name)
    top = imported.split(".")[0]
    if kind in ("core", "launcher", "tracking") and (top in ("torch", "torchao") or within(imported, *JOB_SIDE)):
        return True
    if kind == "core" and within(imported, "pretrain.launcher", "pretrain.tracking"):
        return True
    if kind == "tracking" and within(imported, "pretrain.launcher"):
        return True
    if kind in ("trainer", "parallel", "models", "hf") and within(imported, "pretrain.launcher"):
        return True
    if kind == "entry":
        return imported.startswith("pretrain.") and not within(imported, ENTRIES[name])
    return False


def test_every_module_has_a_room():
    assert [name for name in MODULES if room(name) == "unknown"] == []


def test_no_module_imports_what_its_room_forbids():
    broken = sorted(f"{name} imports {imported}" for name, path in MODULES.items() for imported in imports_of(path)
                    if forbidden(name, imported))
    assert broken == []


def test_the_rules_catch_a_login_module_that_imports_torch():
    """The checker itself: a rule that let this through would guard nothing."""
    assert forbidden("pretrain.launcher.cli", "torch")
    assert forbidden("pretrain.rundir", "pretrain.trainer.checkpoint")
    assert forbidden("pretrain.tracking.report", "pretrain.launcher.status")
    assert forbidden("pretrain.trainer.loop", "pretrain.launcher.preparation")
    assert forbidden("pretrain.launcher.preparation", "pretrain.hf.weights")
    assert forbidden("pretrain.hf.export", "pretrain.launcher.cli")
    assert not forbidden("pretrain.launcher.preparation", "pretrain.hf_format")
    assert forbidden("pretrain.export", "pretrain.hf_format")  # an entry hands over to its wing only
    assert not forbidden("pretrain.trainer.loop", "torch")


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the graph, as a path that returns to its start, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_import_graph_has_no_cycle():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the finder finds them
    # A package imports its own __init__ implicitly; that is no cycle.
    graph = {name: {m for m in deps if not name.startswith(m + ".")} for name, deps in GRAPH.items()}
    assert cycle(graph) is None


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A run directory as a finished run leaves it (config, mark, metrics), without training one."""
    from pretrain import rundir
    from pretrain.compose import compose
    from pretrain.launcher.preparation import write_run

    run_dir = tmp_path_factory.mktemp("structure") / "run"
    cfg = compose(["train.steps=2", f"hydra.run.dir={run_dir}"])
    write_run(cfg)
    metrics = rundir.MetricsFile(run_dir / rundir.METRICS_FILE)
    for step in (1, 2):
        metrics.write({"step": step, "loss": 5.0 - step, "tokens_per_s": 1000.0, "time": 1.0e9 + step})
    return run_dir


@pytest.mark.parametrize("command", [
    ["pretrain.launch", "--help"], ["pretrain.plan", "+cluster=a100x8", "model=llama-8b", "train=pretrain"],
    ["pretrain.launch", "+cluster=a100x8", "dry_run=true"], ["pretrain.status", "RUN"],
    ["pretrain.report", "RUN", "--out", "REPORT"], ["pretrain.sync", "RUN", "--dry-run"],
    ["pretrain.data.prepare", "RUN/config.yaml", "--out", "REPORT"],
    ["pretrain.data.prepare", "RUN/config.yaml", "--out", "REPORT", "+cluster=a100x8", "dry_run=true"]],
    ids=lambda c: " ".join(c[:2]))
def test_login_commands_load_no_torch(tmp_path, finished_run, command):
    """Started for real: the modules they load include no torch (nor wandb: only a job or an upload needs
    it; report may draw with matplotlib)."""
    program = ("import runpy, sys\nsys.argv = sys.argv[1:]\ntry:\n    runpy.run_module(sys.argv[0], run_name='__main__')\n"
               "except SystemExit as end:\n    assert not end.code, end.code\n"
               "print('LOADED', *sorted({m.split('.')[0] for m in sys.modules}))")
    args = [a.replace("RUN", str(finished_run)) if a.startswith("RUN") else str(tmp_path / "report") if a == "REPORT"
            else a for a in command]
    if command[0] == "pretrain.launch" and "--help" not in command:
        args.append(f"hydra.run.dir={tmp_path / 'run'}")
    result = subprocess.run([sys.executable, "-c", program, *args], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    assert result.returncode == 0 or command[0] == "pretrain.plan", result.stderr[-2000:]
    loaded = next(line for line in result.stdout.splitlines() if line.startswith("LOADED")).split()[1:]
    assert {"torch", "torchao", "wandb"} & set(loaded) == set(), command
