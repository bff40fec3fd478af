"""GPU-only checks of the fast paths (compiled loss, device-side step skipping, deferred reads).

Skipped without CUDA. Throughput is measured by bench/, never here.
"""

import re
import sys
import threading

import pytest
import torch

from pretrain.config import PreflightConfig
from pretrain.parallel import float8
from pretrain.trainer.deferred import DeferredValue
from pretrain.models.linear_cross_entropy import cross_entropy
from pretrain.trainer import preflight
from pretrain.trainer.optim import skips_on_device, step_unless

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_compiled_loss_matches_eager_on_fp16_logits():
    """The output layer's loss where its kernel does not apply (fp16), compiled as parallelize compiles it."""
    torch.manual_seed(0)
    logits = torch.randn(2, 64, 1000, device="cuda", dtype=torch.float16, requires_grad=True)
    targets = torch.randint(0, 1000, (2, 64), device="cuda")
    eager = cross_entropy(logits, targets)
    (eager_grad,) = torch.autograd.grad(eager, logits)
    compiled = torch.compile(cross_entropy)(logits, targets)
    (compiled_grad,) = torch.autograd.grad(compiled, logits)
    assert torch.allclose(compiled, eager, rtol=1e-4, atol=1e-4)
    assert torch.allclose(compiled_grad.float(), eager_grad.float(), rtol=1e-2, atol=1e-4)


def test_fused_adamw_skips_on_device_when_found_inf():
    param = torch.nn.Parameter(torch.randn(16, device="cuda"))
    param.grad = torch.randn(16, device="cuda")
    optimizer = torch.optim.AdamW([param], fused=True)
    assert skips_on_device(optimizer)
    before = param.detach().clone()
    step_unless(optimizer, found_inf=torch.ones((), device="cuda"))
    assert torch.equal(param.detach(), before)
    assert optimizer.state[param]["step"].item() == 0
    step_unless(optimizer, found_inf=torch.zeros((), device="cuda"))
    assert not torch.equal(param.detach(), before)
    assert optimizer.state[param]["step"].item() == 1


def test_preflight_rates_a_healthy_gpu_above_its_floor_while_another_thread_holds_the_gil():
    """A starting job's other threads (the compiler's imports) hold the GIL between the products' launches:
    timed on the host, a healthy H100 read 315 TFLOP/s against a floor of 396 (2026-12-07)."""
    device = torch.device("cuda")
    floor = preflight.rate_floor(PreflightConfig(), device)
    if floor is None:
        pytest.skip(f"no known peak for {torch.cuda.get_device_name()}, hence no default floor")
    preflight.check_device(8192, device, rank=0)  # cuBLAS's start, outside the measurement
    interval, stop = sys.getswitchinterval(), threading.Event()

    def hold_the_gil() -> None:
        while not stop.is_set():
            pass

    holder = threading.Thread(target=hold_the_gil)
    holder.start()
    try:
        results = [preflight.check_device(8192, device, rank=0) for _ in range(3)]
    finally:
        stop.set()
        holder.join()
    assert all(not r.wrong for r in results)
    assert min(r.tflops for r in results) > floor, [round(r.tflops) for r in results]
    assert sys.getswitchinterval() == interval


def test_deferred_value_reads_what_the_device_computed():
    value = torch.full((1,), 3.0, device="cuda") * 2
    deferred = DeferredValue(value)
    value.zero_()  # later device work must not change what was taken
    assert deferred.get().item() == 6.0


def _fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= float8.MIN_CAPABILITY


@pytest.mark.skipif(not _fp8_gpu(), reason="needs a GPU with FP8 matrix units (compute capability 8.9+)")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_model_computes_what_bf16_computes_within_fp8_rounding(recipe):
    pytest.importorskip("torchao.float8")
    from pretrain.config import ModelConfig
    from pretrain.models.llama import Transformer

    torch.manual_seed(0)
    cfg = ModelConfig(name="t", dim=256, n_layers=2, n_heads=4, ffn_hidden=768, vocab_size=512, max_seq_len=128)
    with torch.device("cuda"):
        reference = Transformer(cfg)
        reference.init_weights()
    model = Transformer(cfg).cuda()
    model.load_state_dict(reference.state_dict())
    float8.require(recipe, torch.device("cuda"), compiled=True)
    assert float8.convert(model, recipe) == 2 * 7  # q, k, v, o, w1, w2, w3 per block; not the output layer
    tokens = torch.randint(0, 512, (4, 128), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        expected = reference(tokens).float()
        compiled = torch.compile(model)
        got = compiled(tokens).float()
    error = ((got - expected).norm() / expected.norm()).item()
    assert 1e-4 < error < 0.1  # FP8's 3 mantissa bits: a few percent, never bitwise bf16
    got.logsumexp(-1).mean().backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_a_checkpoint_loads_into_the_gpu_exactly_from_several_files_at_once(tmp_path, monkeypatch):
    """ParallelReader's threads, two to a file, read the files' tensors as raw bytes into the GPU side by
    side, through pinned buffers smaller than a weight (so each weight takes several turns of the two):
    every weight and optimizer value arrives, and training's stream sees them."""
    from pretrain.config import ModelConfig
    from pretrain.trainer import checkpoint, shard_reader
    from tests import helpers

    monkeypatch.setattr(checkpoint, "writer_threads", lambda: 4)
    monkeypatch.setattr(checkpoint, "reader_threads", lambda: 8)
    monkeypatch.setattr(shard_reader, "CHUNK_BYTES", 1 << 20)  # a 1024 x 1024 fp32 weight: 4 chunks
    readers = []
    monkeypatch.setattr(checkpoint, "ParallelReader",
                        lambda *a, **k: readers.append(shard_reader.ParallelReader(*a, **k)) or readers[-1])
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(8))).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    model(torch.randn(4, 1024, device="cuda")).sum().backward()
    optimizer.step()
    with helpers.one_process_group():
        saver = checkpoint.Checkpointer(tmp_path, keep=1, device=torch.device("cuda"))
        path = saver.save(1, model, optimizer, {"step": 1}, ModelConfig(), "hash")
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        moments = [optimizer.state[p]["exp_avg_sq"].clone() for p in model.parameters()]
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
                optimizer.state[p]["exp_avg_sq"].zero_()
        saver.load(path, model, optimizer)
        summed = sum(p.sum() for p in model.parameters())  # on training's stream, right after the load
        assert summed == sum(v.sum() for v in expected.values())
    assert len(list(path.glob("*.distcp"))) == 4
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name
    for p, moment in zip(model.parameters(), moments):
        assert torch.equal(optimizer.state[p]["exp_avg_sq"], moment)
    tensors = [*model.parameters(), *(v for p in model.parameters() for v in optimizer.state[p].values())]
    assert readers[0].counts.direct == len(tensors)  # weights, both moments and the step counts: all raw
    assert readers[0].counts.direct_bytes == sum(t.nbytes for t in tensors)


def test_a_checkpoint_registered_with_cuda_loads_exactly_by_copies_training_waits_for(tmp_path, monkeypatch):
    """Files registered with CUDA (mapped read-only, their page-cache pages locked) go into the GPU by one
    asynchronous copy a tensor: every weight and optimizer value arrives, training's stream sees them without
    the host waiting, and the registrations are released once the copies are done."""
    import time

    from pretrain.config import ModelConfig
    from pretrain.trainer import checkpoint, shard_reader
    from tests import helpers

    monkeypatch.setattr(checkpoint, "writer_threads", lambda: 4)
    readers, released = [], []
    monkeypatch.setattr(checkpoint, "ParallelReader",
                        lambda *a, **k: readers.append(shard_reader.ParallelReader(*a, **k)) or readers[-1])
    release = shard_reader.Registration.release
    monkeypatch.setattr(shard_reader.Registration, "release", lambda self: released.append(self) or release(self))
    torch.manual_seed(0)
    device = torch.device("cuda", torch.cuda.current_device())
    model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(8))).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    model(torch.randn(4, 1024, device="cuda")).sum().backward()
    optimizer.step()
    with helpers.one_process_group():
        saver = checkpoint.Checkpointer(tmp_path, keep=1, device=device)
        path = saver.save(1, model, optimizer, {"step": 1}, ModelConfig(), "hash")
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        moments = [optimizer.state[p]["exp_avg_sq"].clone() for p in model.parameters()]
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
                optimizer.state[p]["exp_avg_sq"].zero_()
        files = sorted(path.glob("*.distcp"))
        registered = {str(f.resolve()): shard_reader.Registration(f, device) for f in files}
        saver.load(path, model, optimizer, registered)
        summed = sum(p.sum() for p in model.parameters())  # on training's stream, right after the load
        assert summed == sum(v.sum() for v in expected.values())
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name
    for p, moment in zip(model.parameters(), moments):
        assert torch.equal(optimizer.state[p]["exp_avg_sq"], moment)
    gpu_tensors = [*model.parameters(), *(v for p in model.parameters() for v in optimizer.state[p].values()
                                          if v.is_cuda)]
    assert readers[0].counts.registered == len(gpu_tensors)
    deadline = time.monotonic() + 10
    while len(released) < len(files) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(map(id, released)) == sorted(map(id, registered.values()))


@pytest.mark.skipif(not _fp8_gpu(), reason="needs a GPU with FP8 matrix units (compute capability 8.9+)")
def test_fp8_all_gathers_train_compiled_as_fp8_with_bf16_all_gathers_does(tmp_path):
    """FSDP2 all-gathering the FP8 layers' weights in FP8 (on one GPU as one FSDP2 rank, or two), compiled:
    the losses of FP8 matmuls with bf16 all-gathers, within what rounding the weights once instead of
    twice moves."""
    pytest.importorskip("torchao.float8")
    from tests.helpers import MINI_MODEL, launch, losses

    ranks = min(torch.cuda.device_count(), 2)
    common = (*MINI_MODEL, "precision=fp8", "fsdp.compile=true", "fsdp.wrap_single_rank=true", f"local.nproc={ranks}",
              "train.steps=6", "train.log_every=1", "train.micro_batch=4", f"train.global_batch={4 * ranks}",
              "train.eval_every=0")
    curves = {}
    for gathered in ("false", "true"):
        result = launch(*common, f"precision.float8_all_gather={gathered}", f"hydra.run.dir={tmp_path / gathered}")
        assert result.returncode == 0, result.stderr[-3000:]
        curves[gathered] = [losses(tmp_path / gathered)[step] for step in range(1, 7)]
    assert "their weights all-gathered in FP8" in result.stdout
    assert curves["true"] == pytest.approx(curves["false"], rel=1e-2)


@pytest.mark.parametrize("micro_batch", [4, 8])
def test_one_gpu_trains_compiled_and_unwrapped_as_fsdp_does(tmp_path, micro_batch):
    """The unwrapped one-process path (master weights, a bf16 copy; two micro-batches accumulated by gradient
    hooks in fp32, or one whose bf16 gradients MasterAdamW reads from the copy) under torch.compile on a GPU:
    the same first loss as FSDP2 at one rank, and the same curve within GPU nondeterminism (atomics in the
    embedding's and attention's backward)."""
    from tests.helpers import MINI_MODEL, launch_plain_and_wrapped, losses

    launch_plain_and_wrapped(tmp_path, *MINI_MODEL, "precision=bf16", "fsdp.compile=true", "train.steps=6",
                             "train.log_every=1", f"train.micro_batch={micro_batch}", "train.global_batch=8",
                             "train.eval_every=0")
    plain, wrapped = losses(tmp_path / "plain"), losses(tmp_path / "wrapped")
    assert plain[1] == wrapped[1]
    assert [plain[s] for s in range(2, 7)] == pytest.approx([wrapped[s] for s in range(2, 7)], abs=2e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pinned_buffers_reserved_at_the_start_are_the_ones_a_load_reads_through(monkeypatch):
    """reserve_pinned_buffers, in a thread of its own as a requeued job runs it, leaves pinned memory in torch's
    cache: the buffers a load then takes are made without pinning any more host memory."""
    import threading

    from pretrain.trainer import shard_reader

    monkeypatch.setattr(shard_reader, "CHUNK_BYTES", 3 << 20)  # a size nothing else in this process pins
    device = torch.device("cuda", torch.cuda.current_device())  # as the job passes it: with its index
    reserving = threading.Thread(target=shard_reader.reserve_pinned_buffers, args=(device, 2))
    reserving.start()
    reserving.join()
    pinned = torch.cuda.host_memory_stats()["num_host_alloc"]
    buffers = [torch.empty(shard_reader.CHUNK_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(4)]
    assert all(b.is_pinned() for b in buffers)
    assert torch.cuda.host_memory_stats()["num_host_alloc"] == pinned


@pytest.mark.parametrize("micro_batch", [4, 8])
def test_one_gpu_resumes_its_optimizer_state(tmp_path, micro_batch):
    """A one-GPU bf16 run stopped and resumed (master weights; with one micro-batch a step MasterAdamW reads the
    bf16 copy's gradients): its last checkpoint counts every step in the optimizer's state. From 3166f26 to
    0ac435d the resumed job loaded the weights alone and its optimizer counted from zero again."""
    from tests.helpers import MINI_MODEL, launch, optimizer_step_counts

    run = (*MINI_MODEL, "precision=bf16", "train.steps=8", "train.log_every=1", "train.ckpt_every=4",
           f"train.micro_batch={micro_batch}", "train.global_batch=8", "train.eval_every=0",
           f"hydra.run.dir={tmp_path}")
    first = launch(*run, "train.stop_at_step=4")
    assert first.returncode == 0, first.stderr[-3000:]
    second = launch(*run)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout and "fp32 master weights" in second.stdout
    copied = re.search(r"read as raw bytes, (\d+) of them copied by the GPU from the page cache", second.stdout)
    assert copied and int(copied.group(1)) > 0  # registered with CUDA while the job started
    timing = re.search(r"checkpoint files registered with CUDA ahead: (\d+) files \([\d.]+ GiB\), [\d.]+ s of "
                       r"registering \(longest [\d.]+ s\), begun [\d.]+ s and done -?[\d.]+ s before the load",
                       second.stdout)
    assert timing and int(timing.group(1)) > 0, second.stdout[-3000:]  # and when, for the start-up's phases
    assert optimizer_step_counts(tmp_path / "checkpoints" / "step_00000008") == {8.0}
