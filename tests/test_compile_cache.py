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

from pretrain.hosts import free_port

from .helpers import MINI_MODEL, REPO, launch

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


IMPORT_AHEAD = r"""
import json, sys, threading
import pretrain.trainer.loop
from pretrain.parallel.parallelize import import_compiler_ahead, persist_compile_cache
before = "torch._dynamo" in sys.modules
importers = []

class Witness:
    def find_spec(self, name, path=None, target=None):
        if name == "torch._dynamo":
            importers.append(threading.current_thread().name)
        return None

sys.meta_path.insert(0, Witness())
persist_compile_cache(__import__("pathlib").Path(sys.argv[1]))
import_compiler_ahead()()
import torch._dynamo.package as package
cache = getattr(getattr(package, "DynamoCache", None), "_path_prefix", None)
after = all(name in sys.modules for name in ("torch._dynamo", "torch._inductor.compile_fx"))
print(json.dumps({"before": before, "importers": importers, "after": after, "cache": cache}))
"""


def test_the_compilers_modules_are_imported_in_a_thread_of_their_own_after_the_caches_folder_is_set(tmp_path):
    """A job that compiles imports Dynamo in a background thread from its start, overlapping the process group
    and the preflight (loop.run), once the compile caches' folder is named: Dynamo's import fixes its own
    cache's folder (torch 2.13), which must then be the run's, not /tmp's."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    out = subprocess.run([sys.executable, "-c", IMPORT_AHEAD, str(tmp_path / "cache")],
                         env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["before"] is False and seen["after"] is True
    assert seen["importers"] == ["compiler-imports"]
    if seen["cache"] is not None:  # torch versions with Dynamo's own disk cache
        assert seen["cache"].startswith(str(tmp_path / "cache"))


WITNESSED_JOB = r"""
import json, sys, threading, time
events = []

class Witness:
    def find_spec(self, name, path=None, target=None):
        events.append((time.perf_counter(), threading.current_thread().name, name))
        return None

sys.meta_path.insert(0, Witness())
import pretrain.trainer.loop as loop
ahead, window = loop.import_compiler_ahead, {}

def witnessed():
    window["start"], join = time.perf_counter(), ahead()
    def ready():
        join()
        window.setdefault("end", time.perf_counter())
    return ready

loop.import_compiler_ahead = witnessed
code = loop.main(sys.argv[1:])
main = sorted({n for t, th, n in events if th == "MainThread" and window["start"] <= t <= window["end"]})
behind = sorted({n for t, th, n in events if th == "compiler-imports"})
print(json.dumps({"code": int(code), "main": main, "behind": behind}))
"""


def test_a_compiling_jobs_main_thread_imports_nothing_of_the_compilers_while_they_are_imported_behind_it(tmp_path):
    """Two threads importing parts of one module graph can trip importlib's deadlock detection: while the
    compiler's modules are imported in the background, a compiling job's main thread (process group,
    preflight) imports none of them."""
    run_dir = tmp_path / "run"
    prepared = launch(f"run_dir={run_dir}", *MINI_MODEL, "precision=fp32", "data=synthetic", "fsdp.compile=true",
                      "train.steps=1", "train.micro_batch=1", "train.global_batch=1", "prepare_only=true")
    assert prepared.returncode == 0, prepared.stderr
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    out = subprocess.run([sys.executable, "-c", WITNESSED_JOB, str(run_dir)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["code"] == 0
    assert "torch._dynamo" in seen["behind"] and "torch._inductor.compile_fx" in seen["behind"]
    assert not set(seen["main"]) & set(seen["behind"]), seen["main"]
