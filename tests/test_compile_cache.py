"""A requeued job's compiled blocks come from the compile cache it kept, with selective activation
checkpointing too: AOT autograd's cache skips a graph whose checkpointing policy it cannot name, and then
every requeued job traced each block's forward and backward again (pretrain.parallel.parallelize)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from torch._functorch._aot_autograd import autograd_cache

from .helpers import REPO

PROBE = r"""
import json, sys
import torch
from torch._dynamo.utils import counters
from pretrain.config import ModelConfig
from pretrain.models.llama import Transformer
from pretrain.parallel.parallelize import apply_activation_checkpointing, apply_compile
torch.manual_seed(0)
model = Transformer(ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=256))
apply_activation_checkpointing(model, sys.argv[1])
apply_compile(model)
model(torch.randint(0, 256, (2, 32))).float().sum().backward()
print(json.dumps(dict(counters["aot_autograd"])))
"""


def compiled_in_a_new_process(mode: str, cache: str) -> dict[str, int]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not hasattr(autograd_cache, "_get_context_fn_cache_hash"),
                    reason="this torch's AOT autograd cache keeps no graph with a checkpointing policy")
@pytest.mark.parametrize("mode", ["selective", "none"])
def test_a_second_process_loads_the_blocks_joint_graph_from_the_cache(tmp_path, mode):
    first = compiled_in_a_new_process(mode, str(tmp_path / "cache"))
    # Two graphs: the blocks' (one for both) and the final norm's.
    assert first.get("autograd_cache_saved") == 2 and not first.get("autograd_cache_bypass"), first
    second = compiled_in_a_new_process(mode, str(tmp_path / "cache"))
    assert second.get("autograd_cache_hit") == 2 and not second.get("autograd_cache_miss"), second
