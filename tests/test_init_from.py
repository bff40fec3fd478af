"""`model.init_from`: a fresh run starts from Hugging Face weights, each of 2 gloo processes reading only
its own shards; a resume takes its checkpoint instead; a source of another shape is refused before
anything starts, naming the first field or tensor that differs."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pretrain import config, hf_format, launch as launch_command, rundir
from pretrain.config import ConfigError, ModelConfig
from pretrain.data import source
from pretrain.hf import weights
from pretrain.hf.export import export
from pretrain.models.linear_cross_entropy import cross_entropy
from tests.helpers import MINI_MODEL, checkpointed_run, launch, launch_plain_and_wrapped, losses, snapshot

pytest.importorskip("safetensors")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A freshly initialised MINI_MODEL (GQA, untied) exported in fp32, and that model."""
    root = tmp_path_factory.mktemp("init_from")
    model = checkpointed_run(root / "source", *MINI_MODEL)
    export(root / "source", root / "hf", dtype="fp32")
    return root / "hf", model


def test_a_two_process_run_from_an_export_starts_at_its_loss_and_a_resume_ignores_it(tmp_path, exported):
    folder, model = exported
    run_dir = tmp_path / "run"
    run = (*MINI_MODEL, "local.nproc=2", "train.micro_batch=2", "train.steps=4", "train.log_every=1",
           "train.eval_every=0", "precision=fp32", f"model.init_from={folder}", f"hydra.run.dir={run_dir}")
    first = launch(*run, "train.stop_at_step=2")
    assert first.returncode == 0, first.stderr + first.stdout
    assert f"started from the weights of {folder}" in first.stdout
    # Step 1's loss is that of the initial weights on the first global batch, averaged over the 2 ranks.
    cfg = rundir.load_config(run_dir)
    inputs, targets = source.open_train(cfg).get_batch(range(config.global_batch(cfg.train, 2)), cfg.train.seq_len,
                                                       cfg.train.seed)
    with torch.no_grad():
        expected = cross_entropy(model(torch.from_numpy(inputs)), torch.from_numpy(targets)).item()
    assert losses(run_dir)[1] == pytest.approx(expected, abs=1e-5)
    second = launch(*run)
    assert second.returncode == 0, second.stderr + second.stdout
    assert "resumed from" in second.stdout and f"model.init_from={folder} is not read" in second.stdout
    assert "started from the weights" not in second.stdout and sorted(losses(run_dir)) == [1, 2, 3, 4]


def test_weights_are_read_as_safetensors_files_without_a_config(tmp_path, exported):
    folder, model = exported
    bare = tmp_path / "weights.safetensors"
    shutil.copyfile(folder / hf_format.WEIGHTS_FILE, bare)
    again = type(model)(model.cfg)
    weights.load(again, model.cfg, bare)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 32))
    with torch.no_grad():
        assert torch.equal(again(tokens), model(tokens))


MISMATCHES = [  # MINI_MODEL: dim 64, 2 layers, 4 heads on 2 KV heads, vocabulary 320
    ("model.vocab_size=512", "its config.json has vocab_size=320, but model.vocab_size=512 here; to start from it set "
                             "model.vocab_size=320"),
    ("model.n_heads=2", "has num_attention_heads=4, but model.n_heads=2 here"),
    ("model.n_kv_heads=4", "has num_key_value_heads=2, but model.n_kv_heads=4 here; to start from it set "
                           "model.n_kv_heads=2"),
    ("model.dim=128", "has hidden_size=64, but model.dim=128 here"),
    ("model.n_layers=3", "has num_hidden_layers=2, but model.n_layers=3 here"),
    ("model.tie_embeddings=true", "has tie_word_embeddings=False, but model.tie_embeddings=True here"),
]


@pytest.mark.parametrize("override,message", MISMATCHES, ids=[m[0] for m in MISMATCHES])
def test_a_source_of_another_shape_is_refused_before_anything_is_written(tmp_path, capsys, exported, override,
                                                                        message):
    run_dir = tmp_path / "run"
    code = launch_command.main([*MINI_MODEL, override, f"model.init_from={exported[0]}", f"hydra.run.dir={run_dir}"])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert err.startswith(f"error: model.init_from={exported[0]}: ") and err.count("\n") == 1, err
    assert snapshot(run_dir) == {}


def test_without_a_config_the_first_mismatching_tensor_is_named(tmp_path, exported):
    bare = tmp_path / "weights.safetensors"
    shutil.copyfile(exported[0] / hf_format.WEIGHTS_FILE, bare)
    mini = ModelConfig(dim=64, n_layers=2, ffn_hidden=192)
    with pytest.raises(ConfigError, match=r"model.embed_tokens.weight has shape \[320, 64\], but the model's "
                                          r"tok_embeddings.weight has \[512, 64\]"):
        hf_format.check_source(ModelConfig(dim=64, n_layers=2, ffn_hidden=192, vocab_size=512), bare)
    with pytest.raises(ConfigError, match="no tensor model.layers.2.input_layernorm.weight"):
        hf_format.check_source(ModelConfig(dim=64, n_layers=3, ffn_hidden=192), bare)
    with pytest.raises(ConfigError, match="lm_head.weight is not a tensor of this model"):
        hf_format.check_source(ModelConfig(dim=64, n_layers=2, ffn_hidden=192, tie_embeddings=True), bare)
    hf_format.check_source(mini, bare)  # the right shape passes


def test_what_this_llama_cannot_be_is_refused(tmp_path, exported):
    folder = tmp_path / "llama31"
    shutil.copytree(exported[0], folder)
    hf = json.loads((folder / "config.json").read_text())
    mini = ModelConfig(dim=64, n_layers=2, ffn_hidden=192)
    for change, message in [({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "RoPE scaling 'llama3'"),
                            ({"model_type": "mistral"}, "model_type 'mistral' is not 'llama'"),
                            ({"mlp_bias": True}, "biases in the attention or MLP layers")]:
        (folder / "config.json").write_text(json.dumps({**hf, **change}))
        with pytest.raises(ConfigError, match=message):
            hf_format.check_source(mini, folder)
    # transformers 5 writes rope_parameters instead of rope_theta
    legacy_free = {k: v for k, v in hf.items() if k != "rope_theta"}
    (folder / "config.json").write_text(json.dumps({**legacy_free, "rope_parameters": {"rope_type": "default",
                                                                                        "rope_theta": 500000.0}}))
    with pytest.raises(ConfigError, match="has rope_theta=500000.0, but model.rope_theta=10000.0 here"):
        hf_format.check_source(mini, folder)


def test_parameter_shapes_are_the_models():
    from pretrain.models.llama import Transformer

    for cfg in (ModelConfig(), ModelConfig(n_kv_heads=None, tie_embeddings=True)):
        built = {name: tuple(t.shape) for name, t in Transformer(cfg).state_dict().items()}
        if cfg.tie_embeddings:
            del built["output.weight"]
        assert hf_format.parameter_shapes(cfg) == built


def test_init_from_is_made_absolute_and_bound_into_the_container(tmp_path, exported, monkeypatch):
    """The job may start in another folder, and in a container that sees only what is bound."""
    from pretrain.compose import compose
    from pretrain.launcher import container, preparation
    from pretrain.launcher.world import world_of

    monkeypatch.chdir(exported[0].parent)
    cfg = compose(["+cluster=a100x8", *MINI_MODEL, f"model.init_from={exported[0].name}",
                   f"hydra.run.dir={tmp_path / 'run'}"])
    preparation.check_config(cfg, world_of(cfg))
    assert cfg.model.init_from == str(exported[0].resolve())
    assert cfg.model.init_from in container.extra_binds(cfg)


def test_one_bf16_process_computes_its_first_step_with_the_weights_it_started_from(tmp_path, exported):
    """Unwrapped (one process), the weights go into the fp32 masters and the bf16 copy must follow them:
    step 1's loss is the exported model's in bf16, as FSDP2 at one rank computes it. (Another seed than the
    export's, so that the run's own random weights differ from those it starts from.)"""
    folder, model = exported
    run = (*MINI_MODEL, "train.micro_batch=4", "train.steps=1", "train.log_every=1", "train.eval_every=0",
           "train.seed=7", "precision=bf16", f"model.init_from={folder}")
    launch_plain_and_wrapped(tmp_path, *run)
    first_losses = [losses(tmp_path / name)[1] for name in ("plain", "wrapped")]
    cfg = rundir.load_config(tmp_path / "plain")
    inputs, targets = source.open_train(cfg).get_batch(range(config.global_batch(cfg.train, 1)), cfg.train.seq_len,
                                                       cfg.train.seed)
    with torch.no_grad():
        fp32 = cross_entropy(model(torch.from_numpy(inputs)), torch.from_numpy(targets)).item()
    assert first_losses[0] == first_losses[1]
    assert first_losses[0] == pytest.approx(fp32, abs=2e-2)  # bf16 against fp32: close, not equal
