"""The CUDA allocator's settings a job gives torch before it starts (pretrain.trainer.allocator): expandable
segments, in the variable this torch reads without a warning, and never over a setting of the user's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pretrain.trainer import allocator

from .helpers import REPO


@pytest.mark.parametrize("version,name", [
    ("2.7.1", "PYTORCH_CUDA_ALLOC_CONF"), ("2.11.0+cu130", "PYTORCH_CUDA_ALLOC_CONF"),
    ("2.12.0", "PYTORCH_ALLOC_CONF"), ("2.13.0+cpu", "PYTORCH_ALLOC_CONF"), ("3.0.0", "PYTORCH_ALLOC_CONF"),
])
def test_expandable_segments_go_in_the_variable_this_torch_reads(version, name):
    environ: dict[str, str] = {}
    assert allocator.configure(environ, version) == name
    assert environ == {name: "expandable_segments:True"}


@pytest.mark.parametrize("users", ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"])
def test_a_setting_of_the_users_is_left_as_it_is(users):
    environ = {users: "max_split_size_mb:512"}
    assert allocator.configure(environ, "2.13.0") is None
    assert environ == {users: "max_split_size_mb:512"}


def test_without_a_version_given_the_installed_torchs_is_used():
    environ: dict[str, str] = {}
    assert allocator.configure(environ) == allocator.variable_for(torch.__version__)


def test_a_torch_without_package_metadata_gets_the_name_every_version_reads(monkeypatch):
    def not_installed(name: str) -> str:
        raise allocator.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(allocator.metadata, "version", not_installed)
    environ: dict[str, str] = {}
    assert allocator.configure(environ) == "PYTORCH_CUDA_ALLOC_CONF"


PROBE = r"""
import os
from pretrain.trainer import allocator
allocator.configure(os.environ)
import torch
torch.zeros(1, device="cuda")
settings = torch.cuda.memory._snapshot().get("allocator_settings")
print("expandable" if settings is None else settings.get("expandable_segments"))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_torch_takes_expandable_segments():
    env = {k: v for k, v in os.environ.items() if k not in (allocator.NEW_NAME, allocator.OLD_NAME)}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**env, "PYTHONPATH": f"{REPO}:{env.get('PYTHONPATH', '')}"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    if out.stdout.strip() == "expandable":
        pytest.skip("this torch's memory snapshot does not report its allocator settings")
    assert out.stdout.strip() == "True", out.stdout
    if allocator.variable_for(torch.__version__) == allocator.NEW_NAME:
        assert "deprecated" not in out.stderr, out.stderr
