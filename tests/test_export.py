"""`python -m pretrain.export`: a run's checkpoint as a Hugging Face Llama folder that transformers loads,
computing what our model computes; read back by model.init_from's reader to the same weights; the same
from a checkpoint of 2 processes as of 1; the tokenizer with it; and refusals in one line."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pretrain import hf_format, rundir
from pretrain.data.build import prepare
from pretrain.data.tokenizer import ByteTokenizer, HFTokenizer
from pretrain.hf.export import export, main
from pretrain.hf.generate import from_folder
from pretrain.models.llama import Transformer
from tests.helpers import MINI_MODEL, REPO, checkpointed_run, launch, one_process_group, write_tokenizer

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

# The shapes the issue names: tiny (GQA, 4 heads on 2 KV heads; untied), tiny with MHA and tied
# embeddings, and llama-125m (GQA 12 on 4; tied).
SHAPES = {"tiny": ["model=tiny"],
          "tiny-mha-tied": ["model=tiny", "model.n_kv_heads=null", "model.tie_embeddings=true"],
          "llama-125m": ["model=llama-125m"]}
TEXT = "Héllo, wörld! def f(x):\n\treturn x ** 2  # ünïcode 😀 and numbers 12345.\n"


def tokens_for(model: Transformer, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, model.cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", SHAPES)
def test_exported_model_computes_our_logits_in_transformers_and_reads_back_identically(tmp_path, shape):
    ours = checkpointed_run(tmp_path / "run", *SHAPES[shape])
    export(tmp_path / "run", tmp_path / "hf", dtype="fp32")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(theirs).__name__ == "LlamaForCausalLM" and theirs.dtype == torch.float32
    tokens = tokens_for(ours)
    with torch.no_grad():
        expected = ours(tokens)
        gap = (theirs(tokens).logits - expected).abs().max().item()
        assert gap <= 1e-5, gap
        # Read back as model.init_from reads (every rank its rows; here all of them), config.json included.
        again, _ = from_folder(tmp_path / "hf", torch.device("cpu"))
        assert again.cfg == replace(ours.cfg, name="hf", n_kv_heads=ours.cfg.kv_heads)
        assert torch.equal(again(tokens), expected)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["num_key_value_heads"], config["tie_word_embeddings"]) == (ours.cfg.kv_heads, ours.cfg.tie_embeddings)
    assert (config["rope_theta"], config["rms_norm_eps"], config["max_position_embeddings"], config["torch_dtype"]) == \
        (ours.cfg.rope_theta, ours.cfg.norm_eps, ours.cfg.max_seq_len, "float32")


def test_an_export_above_the_shard_size_is_sharded_with_an_index(tmp_path):
    ours = checkpointed_run(tmp_path / "run", "model=tiny")
    done = export(tmp_path / "run", tmp_path / "hf", dtype="fp32", max_shard_gb=0.002)
    index = json.loads((tmp_path / "hf" / hf_format.INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files == sorted(done.files) and not (tmp_path / "hf" / hf_format.WEIGHTS_FILE).exists()
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert set(index["weight_map"]) == {hf_format.hf_name(name) for name in hf_format.parameter_shapes(ours.cfg)}
    sizes = {file: (tmp_path / "hf" / file).stat().st_size for file in files}
    largest_tensor = max(ours.cfg.vocab_size * ours.cfg.dim, ours.cfg.dim * ours.cfg.ffn_hidden) * 4
    assert all(size <= max(2e6, largest_tensor) + 100_000 for size in sizes.values()), sizes  # + the header
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        assert (theirs(tokens_for(ours)).logits - ours(tokens_for(ours))).abs().max() <= 1e-5


def test_the_default_export_is_bf16(tmp_path):
    ours = checkpointed_run(tmp_path / "run", *MINI_MODEL)
    assert main([str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    stored = safetensors.load_file(str(tmp_path / "hf" / hf_format.WEIGHTS_FILE))
    assert {tensor.dtype for tensor in stored.values()} == {torch.bfloat16}
    embedding = ours.tok_embeddings.weight.detach()
    assert torch.equal(stored["model.embed_tokens.weight"], embedding.to(torch.bfloat16))


def test_a_checkpoint_of_two_processes_exports_as_the_same_weights_saved_by_one(tmp_path):
    """Two gloo processes train and checkpoint; the trainer's Checkpointer then loads that checkpoint in one
    process (resharding, as a resume on 1 process does) and saves it again: both export the same tensors."""
    from pretrain.parallel.parallelize import build_mesh
    from pretrain.trainer.checkpoint import Checkpointer
    from pretrain.trainer.loop import build_model
    from pretrain.trainer.optim import build_optimizer

    two, one = tmp_path / "two", tmp_path / "one"
    result = launch(*MINI_MODEL, "local.nproc=2", "train.micro_batch=2", "train.steps=2", "train.log_every=1",
                    "train.eval_every=0", "precision=fp32", f"hydra.run.dir={two}")
    assert result.returncode == 0, result.stderr + result.stdout
    shutil.copytree(two, one, ignore=shutil.ignore_patterns("checkpoints"))
    saved_by_two = rundir.checkpoint_of(two)
    cfg, cpu = rundir.load_config(one), torch.device("cpu")
    with one_process_group():
        model = build_model(cfg, cpu, build_mesh(cfg.fsdp, cpu, 1, 1)).weights
        optimizer = build_optimizer(model, cfg.optim, cpu)
        checkpointer = Checkpointer(one / "checkpoints", keep=1)
        state = checkpointer.load(saved_by_two, model, optimizer)
        checkpointer.save(2, model, optimizer, state, cfg.model, "saved again by one process")
    saved_by_one = rundir.checkpoint_of(one)
    assert [rundir.read_manifest(p)["world_size"] for p in (saved_by_two, saved_by_one)] == [2, 1]
    assert len(list(saved_by_two.glob("*.distcp"))) > len(list(saved_by_one.glob("*.distcp")))
    exported = [safetensors.load_file(str(export(run, tmp_path / f"hf-{run.name}", dtype="fp32").folder
                                          / hf_format.WEIGHTS_FILE)) for run in (two, one)]
    assert exported[0].keys() == exported[1].keys()
    assert all(torch.equal(exported[0][name], exported[1][name]) for name in exported[0])
    assert not torch.equal(exported[0]["model.norm.weight"], torch.ones(cfg.model.dim))  # trained, not initial


def test_autotokenizer_of_an_export_encodes_like_the_byte_level_tokenizer(tmp_path):
    checkpointed_run(tmp_path / "run", *MINI_MODEL)
    export(tmp_path / "run", tmp_path / "hf")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ours = ByteTokenizer()
    assert theirs(TEXT)["input_ids"] == ours.encode(TEXT).tolist()
    assert theirs.decode(ours.encode(TEXT)) == TEXT
    assert (theirs.eos_token, theirs.eos_token_id) == ("<|endoftext|>", 256)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == 256


def test_autotokenizer_of_an_export_encodes_like_the_runs_hugging_face_tokenizer(tmp_path):
    """The data keeps a copy of its tokenizer.json and of the tokenizer_config.json beside it: the export
    takes both (even after the original folder is gone)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "readme.txt").write_text((REPO / "README.md").read_text())
    original = tmp_path / "tokenizer-folder"
    write_tokenizer(original / "tokenizer.json", corpus)
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                        "model_max_length": 77}
    (original / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    prepare([corpus], tmp_path / "data", tokenizer=str(original / "tokenizer.json"))
    ours = HFTokenizer(original / "tokenizer.json")
    shutil.rmtree(original)
    checkpointed_run(tmp_path / "run", *MINI_MODEL, f"data.path={tmp_path / 'data'}", "model.vocab_size=512")
    export(tmp_path / "run", tmp_path / "hf")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert theirs(TEXT, add_special_tokens=False)["input_ids"] == ours.encode(TEXT).tolist()
    assert json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text()) == tokenizer_config
    assert theirs.model_max_length == 77
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == ours.eos_id


def test_export_refuses_in_one_line_and_leaves_the_output_alone(tmp_path, capsys):
    from pretrain.compose import compose
    from pretrain.launcher.preparation import write_run

    def refused(*args: str) -> str:
        assert main([*args]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, err
        return err

    write_run(compose([*MINI_MODEL, f"hydra.run.dir={tmp_path / 'new'}"]))
    assert "has no complete checkpoint yet" in refused(str(tmp_path / "new"), "--out", str(tmp_path / "a"))
    assert "is not a run directory" in refused(str(tmp_path), "--out", str(tmp_path / "a"))
    checkpointed_run(tmp_path / "run", *MINI_MODEL, step=3)
    assert "no complete checkpoint of step 7; its complete checkpoints are of step 3" in \
        refused(str(tmp_path / "run"), "--step", "7", "--out", str(tmp_path / "a"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("keep me")
    assert "exists and is not an empty folder" in refused(str(tmp_path / "run"), "--out", str(tmp_path / "full"))
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["mine.txt"]
    shard = next(rundir.checkpoint_of(tmp_path / "run").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])
    assert "is damaged" in refused(str(tmp_path / "run"), "--out", str(tmp_path / "a"))
    assert not (tmp_path / "a").exists() and not list(tmp_path.glob(".a.*"))  # no partial folder left behind
