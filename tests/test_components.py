"""The pieces the loop is built from: model, FLOP counts, schedule, loss scaling, metrics file."""

from __future__ import annotations

import json
import math

import pytest
import torch

from pretrain.config import ModelConfig, OptimConfig, PrecisionConfig
from pretrain.flops import flops_per_token, parameter_count, peak_flops_for
from pretrain.compose import compose, expand_sweep, varying
from pretrain.rundir import MetricsFile
from pretrain.models.linear_cross_entropy import cross_entropy
from pretrain.models.llama import Transformer
from pretrain.trainer.optim import lr_factor
from pretrain.trainer.precision import LossScaler
from pretrain.trainer.staging import HostStaging

MODELS = ["tiny", "llama-125m", "llama-1b", "llama-8b", "llama-70b"]


@pytest.mark.parametrize("name", MODELS)
def test_parameter_count_matches_the_built_model(name):
    cfg = compose([f"model={name}"]).model
    with torch.device("meta"):
        model = Transformer(cfg)
    unique = {id(p): p.numel() for p in model.parameters()}
    assert parameter_count(cfg) == sum(unique.values())


def test_llama_1b_is_exactly_the_reference_shape():
    cfg = compose(["model=llama-1b"]).model
    assert parameter_count(cfg) == 1_532_037_120
    # The performance reference: 9.227 GFLOP per token at sequence length 4096.
    assert flops_per_token(cfg, 4096, "reference") == pytest.approx(9.227e9, rel=1e-4)
    # Ours counts causal attention as half the square, so it is lower.
    assert flops_per_token(cfg, 4096, "causal") < flops_per_token(cfg, 4096, "reference")


def test_peak_flops_lookup():
    assert peak_flops_for("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops_for("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops_for("NVIDIA H200") == 989e12
    assert peak_flops_for("NVIDIA GH200 480GB") == 989e12
    assert peak_flops_for("Tesla V100") is None


def small_model(**overrides) -> Transformer:
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=50, max_seq_len=32,
                      **overrides)
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.init_weights()
    return model


def test_model_is_causal():
    model = small_model()
    tokens = torch.randint(0, 50, (2, 16))
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 50
    a, b = model(tokens), model(changed)
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-5)
    assert not torch.allclose(a[:, 10:], b[:, 10:], atol=1e-5)


def test_model_given_targets_returns_the_loss_of_its_logits():
    """On the CPU the output layer computes cross_entropy of the logits it would return (no kernel)."""
    model = small_model()
    tokens = torch.randint(0, 50, (2, 17))
    want = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
    assert torch.equal(model(tokens[:, :-1], targets=tokens[:, 1:]), want)


def test_tied_embeddings_share_one_matrix():
    model = small_model(tie_embeddings=True)
    assert model.output.weight is model.tok_embeddings.weight


def test_model_fits_a_small_batch():
    model = small_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 50, (4, 17))
    first = None
    for _ in range(60):
        loss = model(tokens[:, :-1], targets=tokens[:, 1:])
        first = first if first is not None else loss.item()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < first / 4


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    cfg = OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    factors = [lr_factor(step, cfg, 100) for step in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[10:], factors[11:]))
    assert lr_factor(100, cfg, 100) == pytest.approx(0.1)
    assert lr_factor(55, cfg, 100) == pytest.approx(0.1 + 0.9 * 0.5)


def test_loss_scaler_halves_on_overflow_and_grows_after_good_steps():
    scaler = LossScaler(PrecisionConfig(init_scale=1024.0, growth_interval=3), enabled=True)
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.full((3,), 2048.0)
    scaler.unscale_([param.grad])
    assert torch.equal(param.grad, torch.full((3,), 2.0))
    scaler.update(finite=False)
    assert scaler.scale == 512.0
    for _ in range(3):
        scaler.update(finite=True)
    assert scaler.scale == 1024.0
    restored = LossScaler(PrecisionConfig(), enabled=True)
    restored.load_state_dict(scaler.state_dict())
    assert restored.scale == 1024.0 and restored.good_steps == 0


def test_disabled_loss_scaler_changes_nothing():
    scaler = LossScaler(PrecisionConfig(), enabled=False)
    loss = torch.tensor(2.5)
    assert scaler.scale_loss(loss) is loss
    scaler.update(finite=False)
    assert scaler.scale == 1.0


def test_metrics_truncation_keeps_dropped_records_aside(tmp_path):
    metrics = MetricsFile(tmp_path / "metrics.jsonl")
    for step in range(1, 7):
        metrics.write({"step": step, "loss": 1.0 / step})
    with metrics.path.open("a") as f:
        f.write('{"step": 7, "lo')  # cut short by a crash
    metrics.truncate_after(4)
    assert [r["step"] for r in metrics.records()] == [1, 2, 3, 4]
    discarded = (tmp_path / "metrics.discarded.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in discarded[:2]] == [5, 6] and len(discarded) == 3


def test_sweep_expansion_and_the_names_of_points():
    points = expand_sweep(["optim.lr=1e-4,3e-4", "model=tiny", "train.steps=5,10"])
    assert len(points) == 4
    assert points[0] == ["optim.lr=0.0001", "model=tiny", "train.steps=5"]
    assert varying(points)[3] == ["optim.lr=0.0003", "train.steps=10"]


def test_global_batch_in_tokens_takes_precedence():
    from pretrain.config import global_batch

    cfg = compose(["train.global_batch_tokens=8192", "train.seq_len=256", "train.global_batch=16"])
    assert global_batch(cfg.train, world_size=4) == 32


def test_unset_global_batch_follows_the_world_size():
    from pretrain.config import global_batch, grad_accum_steps

    cfg = compose(["train.micro_batch=4"])
    assert cfg.train.global_batch is None and cfg.train.global_batch_tokens is None
    assert [global_batch(cfg.train, world) for world in (1, 8, 32)] == [4, 32, 128]
    assert grad_accum_steps(cfg.train, 32) == 1
    cfg = compose(["train.micro_batch=4", "train.global_batch=64"])
    assert [global_batch(cfg.train, world) for world in (1, 8)] == [64, 64]
    assert grad_accum_steps(cfg.train, 8) == 2


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_host_staging_keeps_the_saved_state_and_reuses_its_buffers(device):
    staging = HostStaging(torch.device(device))
    weight = torch.randn(1024, 256, device=device)
    saved = weight.clone().cpu()
    host = staging.copy({"model": {"w": weight}, "optim": {"lr": 1e-3}})
    staging.hold_updates()
    weight.add_(1.0)  # the optimizer step after the save (on a GPU, queued behind the copy)
    staging.copied()
    assert torch.equal(host["model"]["w"], saved) and host["optim"]["lr"] == 1e-3
    assert host["model"]["w"].is_pinned() == (device == "cuda")
    buffer = host["model"]["w"].data_ptr()
    again = staging.copy({"model": {"w": weight}, "optim": {"lr": 5e-4}})
    staging.copied()
    assert again["model"]["w"].data_ptr() == buffer  # one allocation for the run, not one per save
    assert torch.equal(again["model"]["w"], weight.cpu()) and again["optim"]["lr"] == 5e-4
    moment = torch.randn(1024, 256, device=device)  # optimizer state that did not exist before
    grown = staging.copy({"model": {"w": weight}, "optim": {"lr": 5e-4, "exp_avg": moment}})
    staging.copied()
    assert torch.equal(grown["optim"]["exp_avg"], moment.cpu()) and torch.equal(grown["model"]["w"], weight.cpu())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_host_buffers_of_sharded_tensors_stay_on_the_host(device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from pretrain.trainer.staging import host_buffers
    from tests.helpers import one_process_group

    with one_process_group("nccl" if device == "cuda" else "gloo"):
        mesh = init_device_mesh(device, (1,))
        sharded = distribute_tensor(torch.randn(64, 32, device=device), mesh, [Shard(0)])
        hosted = host_buffers({"w": sharded}, pin=device == "cuda")["w"]
        assert isinstance(hosted, DTensor) and hosted.placements == sharded.placements
        assert hosted.to_local().device.type == "cpu" and hosted.to_local().is_pinned() == (device == "cuda")
        assert hosted.shape == sharded.shape


@pytest.mark.parametrize("local_rank,count,environ,expected", [
    (1, 2, {"CUDA_VISIBLE_DEVICES": "0,1"}, 1),            # Slurm's default: the job's GPUs of the node
    (1, 1, {"CUDA_VISIBLE_DEVICES": "1"}, 0),              # --gpu-bind=per_task:1: one GPU each
    (1, 8, {"SLURM_JOB_GPUS": "4,5,6,7"}, 5),              # --gpu-bind=none on a shared node: the job's own
    (3, 4, {"SLURM_JOB_GPUS": "0,1,2,3"}, 3),              # --gpu-bind=none, every GPU of the node is the job's
    (1, 2, {}, 1),                                         # torchrun, or no Slurm
])
def test_each_rank_drives_its_own_gpu_whatever_the_binding(local_rank, count, environ, expected):
    from pretrain.trainer.identity import gpu_index

    assert gpu_index(local_rank, count, environ) == expected
