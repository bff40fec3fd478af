"""Samples: generation with a KV cache computes what recomputing the whole sequence computes;
`python -m pretrain.generate` continues a trained checkpoint (and its export alike), the requested number
of tokens, deterministically at temperature 0; train.sample_every writes samples during training."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from pretrain.config import ModelConfig, SamplingConfig
from pretrain.hf import generate as generate_command
from pretrain.hf.export import export
from pretrain.models.llama import KVCache, Transformer
from pretrain.models.sampling import choose, generate
from tests.helpers import MINI_MODEL, REPO, launch, metrics
from tests.test_wandb import OFFLINE, only_fragment
from tests.wandb_records import wandb_history

CPU = torch.device("cpu")
GREEDY = SamplingConfig(max_new_tokens=24, temperature=0.0)


def random_model(**fields) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(dim=64, n_layers=2, ffn_hidden=192, max_seq_len=64, **fields))
    model.init_weights()
    return model.eval()


@pytest.mark.parametrize("kv_heads", [2, None], ids=["gqa", "mha"])
def test_kv_cache_generation_equals_recomputing_the_whole_sequence(kv_heads):
    model = random_model(n_kv_heads=kv_heads)
    prompt = [5, 17, 42, 99, 3, 250]
    sequence = list(prompt)
    with torch.no_grad():
        for _ in range(GREEDY.max_new_tokens):  # no cache: the whole sequence again for every token
            sequence.append(int(model(torch.tensor([sequence]))[0, -1].argmax()))
        assert generate(model, prompt, GREEDY, CPU) == sequence[len(prompt):]
        tokens = torch.tensor([sequence])
        cache = KVCache(tokens.shape[1])
        pieces = [model(tokens[:, :7], cache), model(tokens[:, 7:8], cache), model(tokens[:, 8:], cache)]
        gap = (torch.cat(pieces, dim=1) - model(tokens)).abs().max().item()
        assert gap <= 1e-5 and cache.length == tokens.shape[1], gap


def test_sampling_draws_from_the_nucleus_and_repeats_with_its_seed():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9, -1.0])
    draws = {choose(logits, 1.0, 1e-6, torch.Generator().manual_seed(seed)) for seed in range(20)}
    assert draws == {1}  # a nucleus this small holds only the most likely token
    draws = {choose(logits, 1.0, 0.6, torch.Generator().manual_seed(seed)) for seed in range(50)}
    assert draws == {1, 3}  # 0.47 + 0.43 reach 0.6; the others are never drawn
    model, sampling = random_model(), SamplingConfig(max_new_tokens=16, temperature=1.0, top_p=1.0)
    runs = [generate(model, [1, 2, 3], sampling, CPU, torch.Generator().manual_seed(seed)) for seed in (7, 7, 8)]
    assert runs[0] == runs[1] != runs[2]


def test_a_prompt_too_long_for_the_model_is_refused():
    with pytest.raises(ValueError, match="the prompt's 60 tokens and 24 new ones exceed the model's max_seq_len=64"):
        generate(random_model(), list(range(60)), GREEDY, CPU)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("generate") / "run"
    result = launch(*MINI_MODEL, "train.steps=30", "train.micro_batch=8", "train.log_every=10", "train.eval_every=0",
                    "precision=fp32", f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr + result.stdout
    return run_dir


def generate_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pretrain.generate", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def test_generate_continues_a_trained_checkpoint_deterministically_at_temperature_0(trained_run, tmp_path):
    model, tokenizer = generate_command.load(trained_run, None, CPU)
    new = generate(model, tokenizer.encode("The ").tolist(), SamplingConfig(max_new_tokens=40, temperature=0.0), CPU)
    assert len(new) == 40
    greedy = ("--prompt", "The ", "--temperature", "0", "--max-new-tokens", "40")
    first, second = generate_cli(str(trained_run), *greedy), generate_cli(str(trained_run), *greedy)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout == "The " + tokenizer.decode(new) + "\n"
    export(trained_run, tmp_path / "hf", dtype="fp32")
    assert generate_cli(str(tmp_path / "hf"), *greedy).stdout == first.stdout  # the export says the same
    sampled = generate_cli(str(trained_run), "--prompt", "The ", "--seed", "3")
    assert sampled.returncode == 0 and sampled.stdout.startswith("The ") and sampled.stdout != first.stdout


def test_generate_refuses_in_one_line(trained_run, tmp_path):
    for args, message in [((str(trained_run), "--max-new-tokens", "5000"), "exceed the model's max_seq_len=1024"),
                          ((str(tmp_path),), "is neither a run directory nor a Hugging Face model folder"),
                          ((str(trained_run), "--step", "3"), "no complete checkpoint of step 3")]:
        result = generate_cli(*args, "--prompt", "The ")
        assert result.returncode == 1 and result.stderr.startswith("error: ") and message in result.stderr, \
            result.stderr
        assert result.stderr.count("\n") == 1, result.stderr


def test_sample_every_writes_samples_to_the_log_metrics_and_wandb(tmp_path):
    """Two processes with selective activation checkpointing: every rank runs the sharded forwards."""
    run_dir = tmp_path / "run"
    result = launch(*MINI_MODEL, "local.nproc=2", "train.micro_batch=2", "train.steps=4", "train.log_every=2",
                    "train.eval_every=0", "train.sample_every=2", "train.sampling.max_new_tokens=8",
                    "fsdp.activation_checkpointing=selective", OFFLINE, f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr + result.stdout
    records = [r for r in metrics(run_dir) if "samples" in r]
    assert [r["step"] for r in records] == [2, 4]
    assert [s["prompt"] for s in records[0]["samples"]] == ["The ", "In the ", "def "]
    assert all(isinstance(s["text"], str) for r in records for s in r["samples"])
    logged = [line for line in (run_dir / "train.log").read_text().splitlines() if "| sample |" in line]
    assert len(logged) == 6 and json.loads(logged[0].split("| sample | ", 1)[1]).startswith("The ")
    tables = {row["_step"]: (row["samples._type"], row["samples.nrows"])
              for row in wandb_history(only_fragment(run_dir)) if "samples._type" in row}
    assert tables == {2: ("table-file", 3), 4: ("table-file", 3)}  # a table of the 3 prompts at each
