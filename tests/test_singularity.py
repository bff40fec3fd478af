"""The container definition (singularity/pretrain.def) and its build script, checked without Apptainer,
which cannot be installed here: the definition parses and installs what the jobs need, its NCCL
defaults give way to the job's environment, its %test commands pass against this checkout, and
build.sh calls the runtime it finds with the right arguments or says what to do."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from spython.main.parse.parsers import SingularityParser

from tests.helpers import REPO

DEF = REPO / "singularity" / "pretrain.def"
BUILD = REPO / "singularity" / "build.sh"
BASH = shutil.which("bash")


def sections(text: str) -> dict[str, str]:
    """The definition's sections by name ("header" before the first), split as Apptainer does: at
    every line whose first word starts with %."""
    found, name = {"header": []}, "header"
    for line in text.splitlines():
        words = line.split()
        if words and words[0].startswith("%"):
            name = words[0][1:].lower()
            found[name] = []
        else:
            found[name].append(line)
    return {name: "\n".join(lines) + "\n" for name, lines in found.items()}


@pytest.fixture(scope="module")
def recipe():
    stages = SingularityParser(str(DEF)).recipe
    assert len(stages) == 1, "one build stage"
    return next(iter(stages.values()))


@pytest.fixture(scope="module")
def section():
    return sections(DEF.read_text())


def test_definition_bootstraps_from_the_pytorch_27_cuda_image(recipe, section):
    header = dict(line.split(":", 1) for line in section["header"].splitlines() if ":" in line
                  and not line.lstrip().startswith("#"))
    assert header["Bootstrap"].strip() == "docker"
    assert re.fullmatch(r"pytorch/pytorch:2\.7\.\d+-cuda12\.\d+-cudnn\d+-(devel|runtime)", recipe.fromHeader)
    assert {"files", "post", "environment", "test", "help", "labels"} <= section.keys()


def test_definition_copies_and_installs_the_package(recipe):
    copies = dict(line.split() for line in recipe.files)
    # build.sh runs the build from the repository root, so every source is a path there.
    assert all((REPO / src).exists() for src in copies), copies
    # The Hydra configs sit next to the package, where pretrain.launch looks for them.
    assert copies["pretrain"] == "/opt/pretrain/pretrain" and copies["conf"] == "/opt/pretrain/conf"
    readme = re.search(r'^readme = "(.+)"$', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    assert copies["pyproject.toml"] == "/opt/pretrain/pyproject.toml"
    assert copies[readme] == f"/opt/pretrain/{readme}"

    post = "\n".join(recipe.install)
    pip = [line for line in recipe.install if re.search(r"\bpip install\b", line)]
    assert len(pip) == 1 and re.search(r"(-e|--editable) /opt/pretrain$", pip[0]), pip
    # The base image's CUDA torch stays: pip installs under a constraint pinning its version.
    constraint = re.search(r"(?:-c|--constraint) (\S+)", pip[0]).group(1)
    assert re.search(r"echo \"torch==\$\(python3 -c 'import torch; print\(torch.__version__\)'\)\" > "
                     + re.escape(constraint), post)
    # precision=fp8's torchao, pinned to the release made for the base image's torch 2.7.
    assert " torchao==0.11.0 " in pip[0]


def test_definition_compiles_the_bytecode_of_all_it_installs(section):
    """A SIF image is read-only: bytecode it lacks is compiled again in every process of every job. The
    build compiles the folder the interpreter installs packages into (torch's, asked of this interpreter
    here) and the package."""
    post = section["post"].replace("\\\n", " ")
    line = next(line.strip() for line in post.splitlines() if "-m compileall" in line)
    folder = re.search(r'"\$\((python3 -c .+?)\)"', line).group(1)
    printed = subprocess.run([BASH, "-c", shlex.quote(sys.executable) + folder.removeprefix("python3")],
                             capture_output=True, text=True, check=True).stdout.strip()
    import torch

    assert Path(torch.__file__).parent.parent == Path(printed)
    assert "/opt/pretrain/pretrain" in line


def test_definition_installs_the_infiniband_userspace(recipe):
    apt = " ".join(recipe.install).replace("\\", " ")
    installed = set(re.search(r"apt-get install ([^;&|]*)", apt).group(1).split())
    assert {"rdma-core", "libibverbs1", "ibverbs-providers", "librdmacm1",
            "ibverbs-utils", "infiniband-diags", "perftest"} <= installed


DEFAULTS = {"NCCL_IB_DISABLE": "0", "NCCL_SOCKET_IFNAME": "^lo,docker", "NCCL_DEBUG": "WARN",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "PYTHONUNBUFFERED": "1"}


@pytest.mark.parametrize("shell", ["bash", "sh"])
@pytest.mark.parametrize("preset", [{}, {"NCCL_DEBUG": "INFO", "NCCL_IB_DISABLE": "1"}], ids=["defaults", "preset"])
def test_environment_sets_defaults_that_the_job_environment_overrides(recipe, section, shell, preset):
    assert any(line.startswith("NCCL_IB_DISABLE=") for line in recipe.environ)
    exports = [line.strip() for line in section["environment"].splitlines() if line.strip().startswith("export")]
    for line in exports:
        assert re.fullmatch(r'export (\w+)="\$\{\1:-[^"$]*\}"', line), f"not an overridable default: {line}"
    # Apptainer sources %environment after the host's environment has been passed in.
    out = subprocess.run([shutil.which(shell), "-c", section["environment"] + "env"], capture_output=True,
                         text=True, check=True, env={"PATH": os.environ["PATH"], **preset}).stdout
    env = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    assert {name: env.get(name) for name in DEFAULTS} == {**DEFAULTS, **preset}


def test_test_section_commands_pass_here(section):
    """The %test section's python3 lines, run with this interpreter from the repository root."""
    lines = [line.strip() for line in section["test"].splitlines() if line.strip().startswith("python3 ")]
    assert any("import pretrain, pretrain.train, torch" in line for line in lines)
    assert any(line.startswith("python3 -m pretrain.launch --help") for line in lines)
    for line in lines:
        command = shlex.quote(sys.executable) + line.removeprefix("python3")
        result = subprocess.run([BASH, "-c", command], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"{line}\n{result.stderr}"


def test_definition_holds_no_secrets():
    text = DEF.read_text()
    assert "WANDB_API_KEY" not in text
    assert not re.search(r"(?i)\w*(key|token|secret|passw(or)?d)\w*\s*[=:]", text)
    assert not re.search(r"\b[0-9a-f]{40}\b", text), "a 40-hex-digit string (the form of a W&B API key)"


def stand_in(bin_dir: Path, name: str, body: str) -> None:
    """A script named NAME in bin_dir; it replaces the link to the real tool, never writes through it."""
    path = bin_dir / name
    path.unlink(missing_ok=True)
    path.write_text(f"#!{BASH}\n{body}\n")
    path.chmod(0o755)


@pytest.fixture
def bin_dir(tmp_path):
    """A PATH holding only the tools build.sh uses, so no real apptainer or singularity is found.

    The real tools are links here; the fixture checks on the way out that no stand-in reached them
    (run as root, a write through the link to /usr/bin/id once replaced the machine's own)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    real = {tool: Path(shutil.which(tool)) for tool in ("realpath", "dirname", "cat", "id")}
    before = {tool: path.read_bytes() for tool, path in real.items()}
    for tool, path in real.items():
        (bin_dir / tool).symlink_to(path)
    yield bin_dir
    assert {tool: path.read_bytes() for tool, path in real.items()} == before


def test_build_without_a_runtime_says_what_to_do(bin_dir, tmp_path):
    result = subprocess.run([BASH, BUILD], cwd=tmp_path, capture_output=True, text=True, env={"PATH": str(bin_dir)})
    assert result.returncode != 0
    assert "neither apptainer nor singularity" in result.stderr
    assert "module load apptainer" in result.stderr
    assert "https://apptainer.org/docs/admin/main/installation.html" in result.stderr


@pytest.mark.parametrize("runtime, uid, args, image", [
    ("apptainer", "0", [], REPO / "pretrain.sif"),
    ("apptainer", "1000", ["images/p.sif"], "images/p.sif"),     # relative to where it is called
    ("singularity", "1000", [], REPO / "pretrain.sif"),
])
def test_build_calls_the_runtime_from_the_repository_root(bin_dir, tmp_path, runtime, uid, args, image):
    record = tmp_path / "record"
    stand_in(bin_dir, runtime, f'{{ pwd; printf "%s\\n" "$@"; }} > {shlex.quote(str(record))}')
    # `id -u` as a non-root user or as root, whoever runs the tests.
    stand_in(bin_dir, "id", f'[ "$1" = -u ] && echo {uid}')
    result = subprocess.run([BASH, BUILD, *args], cwd=tmp_path, capture_output=True, text=True,
                            env={"PATH": str(bin_dir)})
    assert result.returncode == 0, result.stderr
    cwd, *called = record.read_text().splitlines()
    assert Path(cwd).resolve() == REPO.resolve()
    fakeroot = ["--fakeroot"] if uid != "0" else []
    assert called == ["build", *fakeroot, str((tmp_path / image).resolve()), "singularity/pretrain.def"]
