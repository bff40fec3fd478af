"""The training loop: builds the model, parallelizes it, and trains with checkpoints and exact resume.

Run by every process of a job:
    python -m pretrain.train RUN_DIR                  # RUN_DIR/config.yaml written by pretrain.launch
    torchrun --nproc-per-node 2 -m pretrain.train RUN_DIR [overrides...]   # composes conf/ itself
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pretrain import checkpoint, config, distributed, faults, float8, flops, logs, precision, preflight, runs
from pretrain.checkpoint import Checkpointer
from pretrain.config import Config
from pretrain import run_data as source
from pretrain.deferred import DeferredValue
from pretrain.loss import build_loss
from pretrain.models.llama import Transformer
from pretrain.optim import build_optimizer, lr_factor, set_lr, skips_on_device, step_unless
from pretrain.parallelize import build_mesh, parallelize, sync_gradients
from pretrain.watchdog import StepWatchdog
from pretrain import preemption
from pretrain.wandb_run import WandbRun

log = logging.getLogger("pretrain")

# Models up to this many parameters are initialised at full size on every rank's device (on
# the GPU: seconds rather than the CPU's minutes), which makes the initial weights independent
# of the number of processes; larger ones start on the meta device.
FULL_INIT_MAX_PARAMS = 3_000_000_000


class TrainingError(RuntimeError):
    """Training cannot go on; the message says why and what to do."""


@dataclass
class TrainState:
    step: int = 0
    samples: int = 0
    skipped_steps: int = 0
    bad_in_a_row: int = 0
    restarts: int = 0


def build_model(cfg: Config, device: torch.device, mesh) -> torch.nn.Module:
    torch.manual_seed(cfg.train.seed)
    small = flops.parameter_count(cfg.model) <= FULL_INIT_MAX_PARAMS
    with torch.device(device if small else "meta"):
        model = Transformer(cfg.model)
    if small:
        model.init_weights()
    dtype = precision.compute_dtype(cfg.precision.name, device)
    parallelize(model, cfg.fsdp, mesh, dtype, cfg.precision.float8)
    if not small:
        model.to_empty(device=device)
        model.init_weights()
    model.to(device)  # non-persistent buffers (RoPE) of the fully-initialised path
    return model


def config_hash(cfg: Config) -> str:
    """A short fingerprint of the resolved config, recorded in each checkpoint's manifest."""
    return hashlib.sha256(json.dumps(asdict(cfg), sort_keys=True, default=str).encode()).hexdigest()[:16]


def local_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def params_finite(model: torch.nn.Module, device: torch.device) -> bool:
    """True when every parameter shard on every rank is finite."""
    bad = torch.zeros((), device=device)
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        bad += (~torch.isfinite(local)).sum()
    dist.all_reduce(bad)
    return bad.item() == 0


class Trainer:
    def __init__(self, cfg: Config, env: distributed.DistEnv, device: torch.device,
                 stop: preemption.StopRequest | None = None) -> None:
        """stop: the signal listener the loop asks at each step boundary (none installed by default)."""
        self.cfg = cfg
        self.env = env
        self.device = device
        self.stop = stop or preemption.StopRequest()
        self.run_dir = Path(cfg.run_dir)
        try:
            float8.require(cfg.precision.float8, device, cfg.fsdp.compile)
        except float8.Float8Unavailable as error:
            raise TrainingError(str(error)) from error
        failure = preflight.run(cfg, env.rank, env.world_size, device)
        if failure:
            raise TrainingError(failure)
        self.global_batch = config.global_batch(cfg.train, env.world_size)
        self.accum = config.grad_accum_steps(cfg.train, env.world_size)
        self.mesh = build_mesh(cfg.fsdp, device, env.world_size, env.local_world_size)
        self.precision = precision.resolve(cfg.precision.name, device)
        if self.precision == "fp32" and device.type == "cuda":
            precision.allow_tf32()
        self.model = build_model(cfg, device, self.mesh)
        self.optimizer = build_optimizer(self.model, cfg.optim, device)
        self.scaler = precision.LossScaler(cfg.precision, enabled=self.precision == "fp16")
        self.loss_fn = build_loss(cfg.fsdp.compile)
        self.skip_on_device = skips_on_device(self.optimizer) and not self.scaler.enabled
        # Steps whose finite-norm flag is still on the device: (step number, flag).
        self.unsettled: list[tuple[int, DeferredValue]] = []
        self.data = source.open_train(cfg)
        self.val_data = source.open_val(cfg)
        self.checkpointer = Checkpointer(self.run_dir / "checkpoints", cfg.train.ckpt_keep,
                                         async_save=cfg.train.async_checkpoint, device=self.device)
        self.metrics = logs.MetricsFile(self.run_dir / "metrics.jsonl")
        self.wandb = WandbRun(cfg, env.is_main)
        self.state = TrainState()
        self.flops_per_token = {name: flops.flops_per_token(cfg.model, cfg.train.seq_len, name)
                                for name in flops.ACCOUNTINGS}
        self.peak_flops = self._peak_flops()

    def _peak_flops(self) -> float | None:
        if self.cfg.metrics.peak_flops is not None:
            return self.cfg.metrics.peak_flops
        if self.device.type == "cuda":
            return flops.peak_flops_for(torch.cuda.get_device_name(self.device))
        return None

    # ---- resume -------------------------------------------------------------------------------
    def resume(self) -> Path | None:
        """Load the newest intact checkpoint; damaged ones are reported, set aside and skipped.

        When every checkpoint is damaged (now or before: set-aside folders), the run stops rather than
        start again from step 0 over a run that had progress, unless train.start_from_scratch says to.
        """
        root = self.run_dir / "checkpoints"
        if self.env.is_main:
            checkpoint.tidy(root)
            preemption.clear_requeue_request(self.run_dir)
        dist.barrier()
        for path in reversed(checkpoint.complete_checkpoints(root)):
            damage = checkpoint.verify(path)
            if damage:
                self._set_aside(path, damage)
                continue
            checkpoint.check_compatible(path, self.cfg.model)
            started = time.perf_counter()
            saved = self.checkpointer.load(path, self.model, self.optimizer)
            seconds = time.perf_counter() - started
            self.state = TrainState(**{k: saved[k] for k in asdict(TrainState()) if k in saved})
            self.state.restarts += 1
            if "scaler" in saved:
                self.scaler.load_state_dict(saved["scaler"])
            if self.env.is_main:
                self.metrics.truncate_after(self.state.step)
                self.metrics.write({"step": self.state.step, "ckpt_load_s": seconds})
            log.info("resumed from %s in %.1f s (step %d, %d samples seen)", path, seconds, self.state.step,
                     self.state.samples)
            return path
        damaged = checkpoint.damaged_checkpoints(root)
        if damaged and not self.cfg.train.start_from_scratch:
            raise TrainingError(checkpoint.all_damaged_message(damaged))
        if damaged:
            log.warning("starting from step 0 (train.start_from_scratch=true): every checkpoint was damaged")
        return None

    def _set_aside(self, path: Path, damage: list[str]) -> None:
        """Rename a damaged checkpoint out of the complete ones (rank 0)."""
        if self.env.is_main:
            aside = checkpoint.set_aside(path)
            log.warning("checkpoint %s is damaged (%s); it is kept as %s and an earlier one is tried", path,
                        "; ".join(damage[:3]) + (f"; and {len(damage) - 3} more" if len(damage) > 3 else ""), aside)
        dist.barrier()

    # ---- one step -----------------------------------------------------------------------------
    def _batch(self, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        indices = source.rank_indices(self.state.samples, self.global_batch, self.env.world_size, self.env.rank,
                                      self.cfg.train.micro_batch, micro)
        inputs, targets = self.data.get_batch(indices, self.cfg.train.seq_len, self.cfg.train.seed)
        non_blocking = self.device.type == "cuda"
        if non_blocking:
            inputs, targets = inputs.pin_memory(), targets.pin_memory()
        return inputs.to(self.device, non_blocking=non_blocking), targets.to(self.device, non_blocking=non_blocking)

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward/backward over the accumulation micro-batches and one optimizer step.

        Returns this rank's mean loss and the global gradient norm (device tensors: no host sync).
        A non-finite gradient norm (from a non-finite loss or gradient on any rank, or an fp16
        overflow) skips the update on every rank alike, since the norm is all-reduced. With fused
        AdamW and no loss scaling the skip happens on the device and is counted at the next step
        (`settle_skips`); fp16 and the CPU read the norm at once.
        """
        self.settle_skips()
        set_lr(self.optimizer, self.cfg.optim.lr * lr_factor(self.state.step, self.cfg.optim, self.cfg.train.steps))
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(self.accum):
            inputs, targets = self._batch(micro)
            sync_gradients(self.model, self.mesh, last_micro_batch=micro == self.accum - 1)
            loss = self.loss_fn(self.model(inputs), targets) / self.accum
            if faults.active("nan_loss", self.state.step + 1):
                loss = loss * float("nan")
            self.scaler.scale_loss(loss).backward()
            loss_sum += loss.detach()
        params = local_params(self.model)
        if faults.active("nan_grad", self.state.step + 1) and self.env.is_main:
            _poison_one_gradient(params)
        self.scaler.unscale_(params)
        norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.optim.grad_clip, foreach=True)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        step = self.state.step + 1
        self.checkpointer.wait_for_staging()
        if self.skip_on_device:
            finite_t = torch.isfinite(norm)
            step_unless(self.optimizer, found_inf=(~finite_t).float())
            self.unsettled.append((step, DeferredValue(finite_t)))
        else:
            finite = math.isfinite(float(norm))
            if finite:
                self.optimizer.step()
            self.scaler.update(finite)
            self._count(finite, step)
        self.optimizer.zero_grad(set_to_none=True)
        self.state.step = step
        self.state.samples += self.global_batch
        return loss_sum, norm

    def settle_skips(self) -> None:
        """Count the skipped updates whose flags were left on the device."""
        unsettled, self.unsettled = self.unsettled, []
        for step, finite in unsettled:
            self._count(bool(finite.get().item()), step)

    def _count(self, finite: bool, step: int) -> None:
        if finite:
            self.state.bad_in_a_row = 0
            return
        self.state.skipped_steps += 1
        self.state.bad_in_a_row += 1
        what = "gradient overflow (fp16), loss scale lowered" if self.scaler.enabled else "non-finite loss or gradient"
        log.warning("step %d skipped: %s (%d in a row, %d in all)", step, what,
                    self.state.bad_in_a_row, self.state.skipped_steps)
        if self.state.bad_in_a_row >= self.cfg.train.max_bad_steps and not self.scaler.enabled:
            raise TrainingError(
                f"{self.state.bad_in_a_row} steps in a row had a non-finite loss or gradient "
                f"(train.max_bad_steps={self.cfg.train.max_bad_steps}); training stopped at step {step}. "
                "Lower optim.lr, raise optim.warmup_steps or check the data; the last checkpoint is intact."
            )

    def mean_across_ranks(self, value: torch.Tensor) -> float:
        value = value.detach().clone().float()
        dist.all_reduce(value)
        return value.item() / self.env.world_size

    @torch.no_grad()
    def evaluate(self) -> float | None:
        if self.val_data is None:
            return None
        self.model.eval()
        total = torch.zeros((), device=self.device)
        for batch in range(self.cfg.train.eval_batches):
            indices = source.rank_indices(batch * self.global_batch, self.global_batch, self.env.world_size,
                                          self.env.rank, self.cfg.train.micro_batch, 0)
            inputs, targets = self.val_data.get_batch(indices, self.cfg.train.seq_len, self.cfg.train.seed)
            total += self.loss_fn(self.model(inputs.to(self.device)), targets.to(self.device))
        self.model.train()
        return self.mean_across_ranks(total / self.cfg.train.eval_batches)

    def save(self) -> Path:
        self.settle_skips()
        self.finish_pending_save(wait=True)
        started = time.perf_counter()
        finite = params_finite(self.model, self.device)
        checked = time.perf_counter() - started
        if not finite:
            raise TrainingError(f"parameters are not finite at step {self.state.step}: refusing to write a checkpoint "
                                "(the previous one is intact)")
        extra = {"scaler": self.scaler.state_dict()} if self.scaler.enabled else {}
        try:
            path = self.checkpointer.save(self.state.step, self.model, self.optimizer,
                                          {**asdict(self.state), **extra}, self.cfg.model, config_hash(self.cfg))
        except checkpoint.CheckpointWriteError as error:
            raise self.save_failed(error) from None
        seconds = time.perf_counter() - started
        if self.checkpointer.async_save:
            parts = ", ".join(f"{name} {s:.2f} s" for name, s in {"finite check": checked, **self.checkpointer.phases}.items())
            log.info("checkpoint started (%.2f s: %s): %s", seconds, parts, path)
            return path
        log.info("checkpoint saved in %.1f s: %s", seconds, path)
        if self.env.is_main:
            self.metrics.write({"step": self.state.step, "ckpt_save_s": seconds})
        return path

    def save_failed(self, error: Exception) -> TrainingError:
        """Why training stops when a checkpoint cannot be written, and what is safe."""
        previous = checkpoint.latest_checkpoint(self.run_dir / "checkpoints")
        safe = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
        return TrainingError(f"the checkpoint of step {self.state.step} could not be written ({error}); {safe}. "
                             f"Training stopped: free space or fix permissions under {self.run_dir / 'checkpoints'}, "
                             "then rerun the same run directory to resume")

    def finish_pending_save(self, wait: bool) -> None:
        """Publish an asynchronous save whose shards are written (all of them, with wait) and log it."""
        try:
            finished = self.checkpointer.wait() if wait else self.checkpointer.poll(self.device)
        except checkpoint.CheckpointWriteError as error:
            raise self.save_failed(error) from None
        if finished is None:
            return
        log.info("checkpoint published %.1f s after it started; training blocked %.2f s staging it and %.2f s "
                 "waiting for its writes: %s", finished["total_s"], finished["stage_s"], finished["wait_s"],
                 finished["path"])
        if self.env.is_main:
            self.metrics.write({"step": finished["step"], "ckpt_save_s": finished["total_s"],
                                "ckpt_stage_s": finished["stage_s"], "ckpt_wait_s": finished["wait_s"]})

    # ---- the loop -----------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        resumed = self.resume()
        self.wandb.start(self.state.restarts)
        train = self.cfg.train
        log.info("training %s: %s parameters, world size %d, global batch %d = %d micro-batch%s of %d per rank, "
                 "precision %s%s, fsdp %s, activation checkpointing %s", self.cfg.model.name,
                 f"{flops.parameter_count(self.cfg.model):,}", self.env.world_size, self.global_batch, self.accum,
                 "" if self.accum == 1 else "es", train.micro_batch, self.precision, self._float8_note(),
                 self.cfg.fsdp.strategy, self.cfg.fsdp.activation_checkpointing)
        watchdog = StepWatchdog(train.hang_timeout_s)
        try:
            return self._loop(resumed, watchdog)
        finally:
            watchdog.stop()

    def _float8_note(self) -> str:
        if self.cfg.precision.float8 == "none":
            return ""
        return f" with {self.cfg.precision.float8} FP8 matmuls in {float8.count(self.model)} linear layers"

    def _loop(self, last_ckpt: Path | None, watchdog: StepWatchdog) -> dict[str, Any]:
        train = self.cfg.train
        window_start, window_steps, loss = time.perf_counter(), 0, float("nan")
        started, start_step = time.perf_counter(), self.state.step
        if start_step >= train.steps:
            log.info("nothing to train: the run is already at step %d of train.steps=%d", start_step, train.steps)
            loss = self.last_logged_loss()
        while self.state.step < train.steps:
            loss_t, grad_norm = self.train_step()
            if self.state.step == start_step + 1:
                watchdog.start()  # after the first step: compile and warm-up are bounded by the collective timeout
                self.checkpointer.prepare(self.model, self.optimizer)
            watchdog.beat(self.state.step)
            window_steps += 1
            step = self.state.step
            if step % train.log_every == 0 or step == train.steps:
                loss = self.mean_across_ranks(loss_t)
                elapsed = time.perf_counter() - window_start
                self.settle_skips()
                self.finish_pending_save(wait=False)
                self.log_step(loss, float(grad_norm), window_steps, elapsed, (time.perf_counter() - started) / (step - start_step))
                window_start, window_steps = time.perf_counter(), 0
            if train.eval_every and step % train.eval_every == 0:
                eval_loss = self.evaluate()
                if eval_loss is not None and self.env.is_main:
                    log.info("step %d | eval loss %.4f", step, eval_loss)
                    record = {"step": step, "eval_loss": eval_loss}
                    self.metrics.write(record)
                    self.wandb.log(record)
            signalled = self.stop.agreed(self.device)
            planned = step == train.stop_at_step
            periodic = train.ckpt_every and (step % train.ckpt_every == 0 or step == train.steps)
            if periodic or signalled or planned:
                last_ckpt = self.save()
            if signalled or planned:
                reason = self.stop.reason if signalled else f"train.stop_at_step={step}"
                requeue = (signalled and self.stop.wants_requeue and self.env.is_main
                           and preemption.request_requeue(self.run_dir, step))
                then = "the job will be requeued and" if requeue else "rerun the same run directory to"
                log.warning("stopping at step %d (%s); %s resume from %s", step, reason, then, last_ckpt)
                return self.summary(loss, last_ckpt, stopped=signalled)
        return self.summary(loss, last_ckpt, stopped=False)

    def log_step(self, loss: float, grad_norm: float, steps: int, elapsed: float, step_time: float) -> None:
        if not self.env.is_main:
            return
        tokens = steps * self.global_batch * self.cfg.train.seq_len
        tokens_per_s = tokens / max(elapsed, 1e-9)
        per_device = tokens_per_s / self.env.world_size
        record = {
            "step": self.state.step,
            "loss": loss,
            "lr": self.optimizer.param_groups[0]["lr"],
            "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": per_device,
            "tokens_seen": self.state.samples * self.cfg.train.seq_len,
            "step_time_s": elapsed / steps,
            "mem_gb": memory_gb(self.device),
            **reserved_memory_gb(self.device),
            "skipped_steps": self.state.skipped_steps,
            "restarts": self.state.restarts,
            "time": time.time(),
        }
        if self.peak_flops:
            record["mfu"] = per_device * self.flops_per_token["causal"] / self.peak_flops
            record["mfu_reference"] = per_device * self.flops_per_token["reference"] / self.peak_flops
        if self.scaler.enabled:
            record["loss_scale"] = self.scaler.scale
        self.metrics.write(record)
        self.wandb.log(record)
        eta = logs.human_duration(step_time * (self.cfg.train.steps - self.state.step))
        mfu = f"{record['mfu']:.1%}" if "mfu" in record else "-"
        log.info("step %d/%d | loss %.4f | lr %.2e | grad %.2f | %s tok/s | mfu %s | mem %.1f GB | eta %s",
                 self.state.step, self.cfg.train.steps, loss, record["lr"], grad_norm, f"{tokens_per_s:,.0f}",
                 mfu, record["mem_gb"], eta)

    def last_logged_loss(self) -> float:
        """The loss of the newest logged step (rank 0's metrics.jsonl), shared with every rank."""
        records = [r for r in self.metrics.records() if "loss" in r] if self.env.is_main else []
        value = torch.tensor(records[-1]["loss"] if records else float("nan"), device=self.device)
        dist.broadcast(value, src=0)
        return value.item()

    def summary(self, loss: float, last_ckpt: Path | None, stopped: bool) -> dict[str, Any]:
        self.settle_skips()
        self.finish_pending_save(wait=True)
        records = [r for r in self.metrics.records() if "loss" in r] if self.env.is_main else []
        result = {
            "run_dir": str(self.run_dir),
            "step": self.state.step,
            "final_loss": loss,
            "first_loss": records[0]["loss"] if records else None,
            "checkpoint": str(last_ckpt) if last_ckpt else None,
            "skipped_steps": self.state.skipped_steps,
            "stopped_early": stopped,
        }
        if self.env.is_main:
            first = f"{result['first_loss']:.4f} -> " if result["first_loss"] is not None else ""
            log.info("done: step %d, loss %s%.4f, %d skipped steps\n  run directory: %s\n  checkpoint:    %s\n  metrics:       %s",
                     self.state.step, first, loss, self.state.skipped_steps, self.run_dir, last_ckpt,
                     self.run_dir / "metrics.jsonl")
        return result


def _poison_one_gradient(params: list[torch.nn.Parameter]) -> None:
    grad = next(p.grad for p in params if p.grad is not None)
    local = grad.to_local() if hasattr(grad, "to_local") else grad
    local.view(-1)[0] = float("nan")


def memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def reserved_memory_gb(device: torch.device) -> dict[str, float]:
    """Peak memory held by the CUDA caching allocator (what the GPU has to have free); {} elsewhere."""
    if device.type != "cuda":
        return {}
    return {"mem_reserved_gb": torch.cuda.max_memory_reserved(device) / 2**30}


def run(cfg: Config, prepare: bool = False) -> dict[str, Any]:
    """Train in this process as one rank of the job described by the environment.

    prepare: the run directory was not written by `pretrain.launch` (e.g. under torchrun):
    every rank checks the config, rank 0 writes the run directory, the others wait for it.
    """
    env = distributed.detect()
    device = distributed.device_for(env)
    if prepare:
        from pretrain import launch

        launch.check_config(cfg, (env.world_size, env.local_world_size, device.type == "cuda"))
        if env.is_main:
            launch.check_run_dir(cfg)
    lock = runs.RunLock(Path(cfg.run_dir))
    if env.is_main and os.environ.get(runs.LOCK_HELD_ENV) != cfg.run_dir:
        Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
        lock.acquire()  # released when this process ends, however it ends
    if prepare and env.is_main:
        launch.write_run(cfg)
    # Listen before the slow start-up: a signal during it must not kill the job uncheckpointed.
    stop = preemption.StopRequest()
    stop.install()
    distributed.init_process_group(env, device, cfg.train.collective_timeout_s)
    logs.setup(Path(cfg.run_dir), env.rank)
    try:
        trainer = Trainer(cfg, env, device, stop)
        with trainer.wandb:
            return trainer.fit()
    finally:
        dist.destroy_process_group()
        stop.uninstall()
        lock.release()


def load_run_config(run_dir: Path, overrides: list[str]) -> tuple[Config, bool]:
    """The run's saved config, or (under torchrun, with none saved) one composed from conf/.

    Returns the config and whether the run directory still has to be prepared.
    """
    saved = run_dir / "config.yaml"
    if saved.is_file() and not overrides:
        from omegaconf import OmegaConf

        cfg = config.from_container(OmegaConf.load(saved))
        cfg.run_dir = str(run_dir)
        return cfg, False
    from pretrain import launch

    cfg = launch.compose(overrides)
    cfg.run_dir = str(run_dir)
    return cfg, True


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        print("usage: python -m pretrain.train RUN_DIR [overrides...]", file=sys.stderr)
        return 2
    run_dir = Path(argv[0]).resolve()
    from pretrain.data.errors import DataError

    try:
        cfg, prepare = load_run_config(run_dir, argv[1:])
        result = run(cfg, prepare)
    except (config.ConfigError, checkpoint.CheckpointError, DataError, TrainingError, runs.RunLocked) as err:
        print(f"error: {err}", file=sys.stderr)
        runs.record_failure(run_dir, str(err))
        return 1
    return preemption.EXIT_STOPPED if result["stopped_early"] else 0


if __name__ == "__main__":
    sys.exit(main())
