"""The training loop: every process of a job runs `python -m pretrain.train RUN_DIR`.

RUN_DIR holds the resolved config.yaml the launcher wrote (`python -m pretrain.launch`, a batch
script from `write_sbatch`, or `prepare_only=true` for launchers of your own such as torchrun):
the job reads it and never composes configs. Rank and world come from torchrun-style variables or
from Slurm (pretrain.trainer.identity).

`Trainer.fit` reads top to bottom: resume, then per step forward/backward over the micro-batches,
one optimizer step, a report every train.log_every steps, evaluation, and a checkpoint when it is
time or when a stop was requested. What happens around the steps lives in small components:
Checkpointer (saving and resuming), SkippedSteps (non-finite steps), StopRequest and StepWatchdog
(signals and stalls), Progress (logs and metrics), WandbRun.
"""

from __future__ import annotations

import faulthandler
import gc
import hashlib
import json
import logging
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from pretrain import config, flops, rundir
from pretrain.config import Config, ConfigError
from pretrain.data import source
from pretrain.data.errors import DataError
from pretrain.hf import weights as hf_weights
from pretrain.models.llama import Transformer
from pretrain.models.sampling import continue_text
from pretrain.parallel import float8
from pretrain.parallel.parallelize import (Parallelized, build_mesh, import_compiler_ahead, parallelize,
                                           persist_compile_cache, sync_gradients)
from pretrain.rundir import CheckpointError, ExitCode
from pretrain.tracking.wandb_run import WandbRun
from pretrain.trainer import (bytecode, checkpoint, distributed, identity, logs, precision, preflight, resilience,
                             shard_reader)
from pretrain.trainer.startup import StartupClock
from pretrain.trainer.checkpoint import Checkpointer, CheckpointWriteError, Published
from pretrain.trainer.guards import NonFiniteStepsError, SkippedSteps, params_finite
from pretrain.trainer.optim import (build_optimizer, clip_gradients, gradients, lr_factor, refreshes_copy, set_lr,
                                   skips_on_device)
from pretrain.trainer.progress import Progress

log = logging.getLogger("pretrain")

# Models up to this many parameters are initialised at full size on every rank's device (on
# the GPU: seconds rather than the CPU's minutes), which makes the initial weights independent
# of the number of processes; larger ones start on the meta device.
FULL_INIT_MAX_PARAMS = 3_000_000_000


class TrainingError(RuntimeError):
    """Training cannot go on; the message says why and what to do."""


@dataclass
class TrainState:
    """What a checkpoint keeps of the loop besides weights and optimizer: where training is."""

    step: int = 0
    samples: int = 0
    skipped_steps: int = 0
    bad_in_a_row: int = 0
    restarts: int = 0


def build_model(cfg: Config, device: torch.device, mesh) -> Parallelized:
    """The model, initialised and parallelized. Small ones, and any that one process trains whole, are
    initialised at full size on the device; larger ones on the meta device, then shard by shard."""
    torch.manual_seed(cfg.train.seed)
    whole = (flops.parameter_count(cfg.model) <= FULL_INIT_MAX_PARAMS
             or config.unwrapped(cfg.fsdp, mesh.size()))
    with torch.device(device if whole else "meta"):
        model = Transformer(cfg.model)
    if whole:
        model.init_weights()
    parallel = parallelize(model, cfg.fsdp, mesh, precision.compute_dtype(cfg.precision.name, device),
                           cfg.precision.float8, cfg.precision.float8_all_gather)
    if not whole:
        model.to_empty(device=device)
        model.init_weights()
    parallel.model.to(device)  # non-persistent buffers (RoPE) of the fully-initialised path
    return parallel


def config_hash(cfg: Config) -> str:
    """A short fingerprint of the resolved config, recorded in each checkpoint's manifest."""
    return hashlib.sha256(json.dumps(asdict(cfg), sort_keys=True, default=str).encode()).hexdigest()[:16]


class Trainer:
    def __init__(self, cfg: Config, env: identity.DistEnv, device: torch.device,
                 stop: resilience.StopRequest | None = None, clock: StartupClock | None = None,
                 verify_ahead: checkpoint.VerifyAhead | None = None,
                 compiler_ready: Callable[[], None] | None = None) -> None:
        """stop: the signal listener the loop asks at each step boundary (none installed by default);
        clock: the job's start-up so far (a new one by default); verify_ahead: the newest checkpoint's
        check, started at the job's start (none: checked when resuming); compiler_ready: waits for the
        compiler's imports begun at the job's start (`import_compiler_ahead`), before the model is built
        (with FP8, before torchao is imported)."""
        self.cfg, self.env, self.device = cfg, env, device
        self.stop = stop or resilience.StopRequest()
        self.clock = clock or StartupClock()
        self.verify_ahead = verify_ahead
        self.run_dir = Path(cfg.run_dir)
        self.faults = resilience.Faults.from_environment()
        if compiler_ready is not None and cfg.precision.float8 != "none":
            compiler_ready()  # torchao's import, next, then runs alone: no two threads importing torch's compiler
        try:
            float8.require(cfg.precision.float8, device, cfg.fsdp.compile)
        except float8.Float8Unavailable as error:
            raise TrainingError(str(error)) from error
        failure = preflight.run(cfg, env.rank, env.world_size, device)
        if failure:
            raise TrainingError(failure)
        self.clock.mark("preflight")
        self.global_batch = config.global_batch(cfg.train, env.world_size)
        self.accum = config.grad_accum_steps(cfg.train, env.world_size)
        if self.global_batch % (env.world_size * cfg.train.micro_batch):
            raise TrainingError(f"the global batch of {self.global_batch} sequences does not divide over {env.world_size} "
                                f"ranks x train.micro_batch={cfg.train.micro_batch}; prepare the run directory for "
                                "this world size (python -m pretrain.launch ... prepare_only=true)")
        self.mesh = build_mesh(cfg.fsdp, device, env.world_size, env.local_world_size)
        self.precision = precision.resolve(cfg.precision.name, device)
        if self.precision == "fp32" and device.type == "cuda":
            precision.allow_tf32()
        if compiler_ready is not None:
            compiler_ready()
            self.clock.mark("compiler import")  # what the wait for the modules imported ahead left over
        self.parallel = build_model(cfg, device, self.mesh)
        self.model, self.weights = self.parallel.model, self.parallel.weights
        self.clock.mark("model")
        self.optimizer = build_optimizer(self.weights, cfg.optim, device, self.parallel.master, self.accum)
        self.scaler = precision.LossScaler(cfg.precision, enabled=self.precision == "fp16")
        self.skips = SkippedSteps(cfg.train.max_bad_steps, loss_scaled=self.scaler.enabled)
        self.skip_on_device = skips_on_device(self.optimizer) and not self.scaler.enabled
        self.loss_fn = self.faults.poisoned_loss(self.loss, lambda: self.state.step + 1)
        self.data = source.open_train(cfg)
        self.val_data = source.open_val(cfg)
        self.tokenizer = source.tokenizer(cfg) if cfg.train.sample_every else None
        self.checkpointer = Checkpointer(self.run_dir / rundir.CHECKPOINTS, cfg.train.ckpt_keep,
                                         async_save=cfg.train.async_checkpoint, device=self.device)
        self.metrics = rundir.MetricsFile(self.run_dir / rundir.METRICS_FILE)
        self.wandb = WandbRun(cfg, env.is_main)
        self.progress = Progress(cfg, env.world_size, self.global_batch, device, env.is_main, self.metrics, self.wandb)
        self.state = TrainState()
        self.clock.mark("optimizer and data")

    # ---- the loop -----------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        last_checkpoint = self.resume()
        if last_checkpoint is None:
            self.start_from_weights()
        elif self.cfg.model.init_from:
            log.info("model.init_from=%s is not read: the run resumes from its own checkpoint", self.cfg.model.init_from)
        self.clock.mark("checkpoint")
        self.wandb.start(self.state.restarts)
        self.log_start()
        train, loss = self.cfg.train, float("nan")
        if self.state.step >= train.steps:
            log.info("nothing to train: the run is already at step %d of train.steps=%d", self.state.step, train.steps)
            loss = self.last_logged_loss()
        watchdog = resilience.StepWatchdog(train.hang_timeout_s)
        self.progress.start(self.state.step)
        try:
            while self.state.step < train.steps:
                loss_t, grad_norm = self.train_step()
                step = self.state.step
                if step == self.progress.first_step + 1:
                    self.started(step)
                    watchdog.start()  # after the first step: compile and warm-up are bounded by the collective timeout
                    self.checkpointer.prepare(self.weights, self.optimizer)
                watchdog.beat(step)
                self.progress.step_done()
                if step % train.log_every == 0 or step == train.steps:
                    loss = self.report(loss_t, grad_norm)
                if train.eval_every and step % train.eval_every == 0:
                    self.evaluate()
                if train.sample_every and step % train.sample_every == 0:
                    self.sample()
                stopping = self.stop.agreed(self.device)
                planned = step == train.stop_at_step
                if stopping or planned or (train.ckpt_every and (step % train.ckpt_every == 0 or step == train.steps)):
                    last_checkpoint = self.save()
                if stopping or planned:
                    self.log_stop(step, planned and not stopping, last_checkpoint)
                    return self.summary(loss, last_checkpoint, stopped=stopping)
            return self.summary(loss, last_checkpoint, stopped=False)
        finally:
            watchdog.stop()

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward/backward over the accumulation micro-batches and one optimizer step.

        Returns this rank's mean loss and the global gradient norm (device tensors: no host sync).
        A non-finite norm skips the update on every rank alike (SkippedSteps).
        """
        self.skips.settle(keep_newest=1)
        set_lr(self.optimizer, self.cfg.optim.lr * lr_factor(self.state.step, self.cfg.optim, self.cfg.train.steps))
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(self.accum):
            inputs, targets = self.batch(micro)
            sync_gradients(self.model, self.mesh, last_micro_batch=micro == self.accum - 1)
            loss = self.loss_fn(inputs, targets) / self.accum
            self.scaler.scale_loss(loss).backward()
            loss_sum += loss.detach()
        params = [p for p in self.weights.parameters() if p.requires_grad]
        grads = gradients(self.optimizer, params)
        self.faults.after_backward(grads, self.state.step + 1, self.env.is_main)
        self.scaler.unscale_(grads)
        norm = clip_gradients(self.optimizer, params, self.cfg.optim.grad_clip)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        self.checkpointer.wait_for_staging()
        stepped = self.skips.step(self.optimizer, norm, self.state.step + 1, on_device=self.skip_on_device)
        if stepped is not None:
            self.scaler.update(stepped)
        if not refreshes_copy(self.optimizer):
            self.parallel.weights_changed()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.step += 1
        self.state.samples += self.global_batch
        return loss_sum, norm

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The model's mean next-token loss on one micro-batch (its output layer computes it: the logits of a
        GPU's step are never kept, pretrain.models.linear_cross_entropy)."""
        return self.model(inputs, targets=targets)

    def batch(self, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's micro-batch `micro` of the current step, on the device."""
        indices = source.rank_indices(self.state.samples, self.global_batch, self.env.world_size, self.env.rank,
                                      self.cfg.train.micro_batch, micro)
        return self.to_device(*self.data.get_batch(indices, self.cfg.train.seq_len, self.cfg.train.seed))

    def to_device(self, *arrays) -> tuple[torch.Tensor, ...]:
        tensors = [torch.from_numpy(a) for a in arrays]
        if self.device.type != "cuda":
            return tuple(tensors)
        return tuple(t.pin_memory().to(self.device, non_blocking=True) for t in tensors)

    # ---- reports --------------------------------------------------------------------------------
    def started(self, step: int) -> None:
        """The start-up's cost, once its first step has run (on the device too: one synchronisation)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.clock.mark("first step" + (" (compilation)" if self.cfg.fsdp.compile else ""))
        if self.env.is_main:  # metrics.jsonl only: W&B's history is the logged steps'
            log.info("step %d: %s", step, self.clock.line())
            self.metrics.write(self.clock.record(step))

    def log_start(self) -> None:
        train = self.cfg.train
        fp8 = (f" with {self.cfg.precision.float8} FP8 matmuls in {float8.count(self.model)} linear layers"
               if self.cfg.precision.float8 != "none" else "")
        if self.parallel.float8_all_gather:
            fp8 += ", their weights all-gathered in FP8"
        log.info("training %s: %s parameters, world size %d, global batch %d = %d micro-batch%s of %d per rank, "
                 "precision %s%s, fsdp %s, activation checkpointing %s", self.cfg.model.name,
                 f"{flops.parameter_count(self.cfg.model):,}", self.env.world_size, self.global_batch, self.accum,
                 "" if self.accum == 1 else "es", train.micro_batch, self.precision, fp8, self.sharding(),
                 self.cfg.fsdp.activation_checkpointing)

    def sharding(self) -> str:
        """What the start line says of FSDP."""
        if not config.unwrapped(self.cfg.fsdp, self.env.world_size):
            return self.cfg.fsdp.strategy
        if self.parallel.master is None:
            return "off (one process)"
        return f"off (one process: fp32 master weights, a {self.precision} copy computes)"

    def report(self, loss_t: torch.Tensor, grad_norm: torch.Tensor) -> float:
        """The log line and record of this step (every train.log_every); returns the mean loss."""
        loss = self.mean_across_ranks(loss_t)
        self.skips.settle()
        self.checkpoint_done(self.collect_checkpoint(wait=False))
        extra = {"tokens_seen": self.state.samples * self.cfg.train.seq_len, "skipped_steps": self.skips.skipped,
                 "restarts": self.state.restarts}
        if self.scaler.enabled:
            extra["loss_scale"] = self.scaler.scale
        self.progress.report(self.state.step, loss, float(grad_norm), self.optimizer.param_groups[0]["lr"], extra)
        return loss

    def log_stop(self, step: int, planned: bool, last_checkpoint: Path | None) -> None:
        reason = f"train.stop_at_step={step}" if planned else self.stop.reason
        # Every rank says what happens next (all print warnings); rank 0 leaves the note for the batch script.
        batch_script_acts = not planned and resilience.in_slurm_job()
        if batch_script_acts and self.env.is_main:
            resilience.leave_stop_note(self.run_dir, step, self.stop.agreed_kind, reason)
        if batch_script_acts and self.stop.wants_requeue:
            then = "the job will be requeued and"
        elif batch_script_acts:
            then = ("the job will be requeued unless it was cancelled or preempted (then Slurm requeues it, "
                    "or you rerun the same run directory), and will")
        else:
            then = "rerun the same run directory to"
        log.warning("stopping at step %d (%s); %s resume from %s", step, reason, then, last_checkpoint)

    def mean_across_ranks(self, value: torch.Tensor) -> float:
        value = value.detach().clone().float()
        dist.all_reduce(value)
        return value.item() / self.env.world_size

    def last_logged_loss(self) -> float:
        """The loss of the newest logged step (rank 0's metrics.jsonl), shared with every rank."""
        records = [r for r in self.metrics.records() if "loss" in r] if self.env.is_main else []
        value = torch.tensor(records[-1]["loss"] if records else float("nan"), device=self.device)
        dist.broadcast(value, src=0)
        return value.item()

    @torch.no_grad()
    def evaluate(self) -> None:
        """The validation loss over train.eval_batches global batches (the same ones every time) of each
        validation split: one, or each source of a mixture (eval_loss/NAME, and eval_loss their mean
        weighted as the mixture is)."""
        if not self.val_data:
            return
        self.model.eval()
        losses = {name: self.eval_loss(split) for name, split in self.val_data.items()}
        self.model.train()
        record: dict[str, Any] = {"step": self.state.step}
        if set(losses) == {""}:
            record["eval_loss"] = losses[""]
        else:
            weights = {name: self.cfg.data.mix[name].weight for name in losses}
            record["eval_loss"] = sum(losses[n] * weights[n] for n in losses) / sum(weights.values())
            record.update({f"eval_loss/{name}": loss for name, loss in losses.items()})
        if self.env.is_main:
            parts = ", ".join(f"{name} {loss:.4f}" for name, loss in losses.items() if name)
            log.info("step %d | eval loss %.4f%s", self.state.step, record["eval_loss"], f" ({parts})" if parts else "")
        self.progress.write(record)

    def eval_loss(self, split) -> float:
        """The mean loss of the model over train.eval_batches global batches of one validation split."""
        total = torch.zeros((), device=self.device)
        for batch in range(self.cfg.train.eval_batches):
            indices = source.rank_indices(batch * self.global_batch, self.global_batch, self.env.world_size,
                                          self.env.rank, self.cfg.train.micro_batch, 0)
            inputs, targets = self.to_device(*split.get_batch(indices, self.cfg.train.seq_len, self.cfg.train.seed))
            total += self.loss(inputs, targets)
        return self.mean_across_ranks(total / self.cfg.train.eval_batches)

    @torch.no_grad()
    def sample(self) -> None:
        """Continuations of train.sample_prompts, for the log, metrics.jsonl and W&B.

        Every rank runs the (sharded) forwards alike; rank 0 reports what it drew. Compiled blocks run
        eagerly here: generation's shapes change with every token.
        """
        self.model.eval()
        with torch.compiler.set_stance("force_eager"):
            samples = [{"prompt": prompt, "text": continue_text(self.model, self.tokenizer, prompt,
                                                                 self.cfg.train.sampling, self.device)}
                       for prompt in self.cfg.train.sample_prompts]
        self.model.train()
        if self.env.is_main:
            for sample in samples:
                log.info("step %d | sample | %s", self.state.step, json.dumps(sample["prompt"] + sample["text"]))
        self.progress.write({"step": self.state.step, "samples": samples})

    def summary(self, loss: float, last_checkpoint: Path | None, stopped: bool) -> dict[str, Any]:
        self.skips.settle()
        self.checkpoint_done(self.collect_checkpoint(wait=True))
        records = [r for r in self.metrics.records() if "loss" in r] if self.env.is_main else []
        result = {"run_dir": str(self.run_dir), "step": self.state.step, "final_loss": loss,
                  "first_loss": records[0]["loss"] if records else None,
                  "checkpoint": str(last_checkpoint) if last_checkpoint else None,
                  "skipped_steps": self.skips.skipped, "stopped_early": stopped}
        if self.env.is_main:
            first = f"{result['first_loss']:.4f} -> " if result["first_loss"] is not None else ""
            log.info("done: step %d, loss %s%.4f, %d skipped steps\n  run directory: %s\n  checkpoint:    %s\n"
                     "  metrics:       %s", self.state.step, first, loss, self.skips.skipped, self.run_dir,
                     last_checkpoint, self.metrics.path)
        return result

    # ---- checkpoints ----------------------------------------------------------------------------
    def resume(self) -> Path | None:
        """Load the newest intact checkpoint; damaged ones are reported, set aside and skipped.

        When every checkpoint is damaged (now or before: set-aside folders), the run stops rather than
        start again from step 0 over a run that had progress, unless train.start_from_scratch says to.
        """
        root = self.run_dir / rundir.CHECKPOINTS
        if self.env.is_main:
            checkpoint.tidy(root)
            resilience.clear_stop_notes(self.run_dir)
        dist.barrier()
        for path in reversed(rundir.complete_checkpoints(root)):
            rundir.check_checksums_known(path)  # before the check, which would set such a checkpoint aside
            damage = checkpoint.verify(path, self.verify_ahead)
            if damage:
                self.set_aside(path, damage)
                continue
            rundir.check_compatible(path, self.cfg.model)
            self.load(path)
            return path
        if self.verify_ahead is not None:
            self.verify_ahead.registrations(None)  # nothing loaded: the files registered ahead are released
        damaged = rundir.damaged_checkpoints(root)
        if damaged and not self.cfg.train.start_from_scratch:
            raise TrainingError(rundir.all_damaged_message(damaged))
        if damaged:
            log.warning("starting from step 0 (train.start_from_scratch=true): every checkpoint was damaged")
        return None

    def start_from_weights(self) -> None:
        """A fresh run with model.init_from: those weights instead of random ones (the optimizer starts new)."""
        if self.cfg.model.init_from is None:
            return
        started = time.perf_counter()
        hf_weights.load(self.weights, self.cfg.model, Path(self.cfg.model.init_from))
        self.parallel.weights_changed()
        log.info("started from the weights of %s (read in %.1f s)", self.cfg.model.init_from,
                 time.perf_counter() - started)

    def load(self, path: Path) -> None:
        started = time.perf_counter()
        registered = self.verify_ahead.registrations(path) if self.verify_ahead is not None else None
        saved = self.checkpointer.load(path, self.weights, self.optimizer, registered)
        self.parallel.weights_changed()
        seconds = time.perf_counter() - started
        self.state = TrainState(**{k: saved[k] for k in asdict(TrainState()) if k in saved})
        self.state.restarts += 1
        self.skips.skipped, self.skips.in_a_row = self.state.skipped_steps, self.state.bad_in_a_row
        if "scaler" in saved:
            self.scaler.load_state_dict(saved["scaler"])
        if self.env.is_main:
            self.metrics.truncate_after(self.state.step)
            self.metrics.write({"step": self.state.step, "ckpt_load_s": seconds})
        log.info("resumed from %s in %.1f s (step %d, %d samples seen)", path, seconds, self.state.step,
                 self.state.samples)

    def set_aside(self, path: Path, damage: list[str]) -> None:
        """Rename a damaged checkpoint out of the complete ones (rank 0)."""
        if self.env.is_main:
            aside = checkpoint.set_aside(path)
            log.warning("checkpoint %s is damaged (%s); it is kept as %s and an earlier one is tried", path,
                        "; ".join(damage[:3]) + (f"; and {len(damage) - 3} more" if len(damage) > 3 else ""), aside)
        dist.barrier()

    def save(self) -> Path:
        """A checkpoint of this step (never of non-finite weights); returns its folder."""
        self.skips.settle()
        self.checkpoint_done(self.collect_checkpoint(wait=True))
        started = time.perf_counter()
        if not params_finite(self.weights, self.device):
            raise TrainingError(f"parameters are not finite at step {self.state.step}: refusing to write a checkpoint "
                                "(the previous one is intact)")
        checked = time.perf_counter() - started
        self.state.skipped_steps, self.state.bad_in_a_row = self.skips.skipped, self.skips.in_a_row
        extra = {"scaler": self.scaler.state_dict()} if self.scaler.enabled else {}
        try:
            path = self.checkpointer.save(self.state.step, self.weights, self.optimizer,
                                          {**asdict(self.state), **extra}, self.cfg.model, config_hash(self.cfg))
        except CheckpointWriteError as error:
            raise self.save_failed(error) from None
        if self.checkpointer.async_save:
            parts = {"finite check": checked, **self.checkpointer.phases}
            log.info("checkpoint started (%.2f s: %s): %s", time.perf_counter() - started,
                     ", ".join(f"{name} {s:.2f} s" for name, s in parts.items()), path)
        else:
            self.checkpoint_done(self.collect_checkpoint(wait=False))
        return path

    def collect_checkpoint(self, wait: bool) -> Published | None:
        try:
            return self.checkpointer.collect(self.device, wait)
        except CheckpointWriteError as error:
            raise self.save_failed(error) from None

    def checkpoint_done(self, published: Published | None) -> None:
        """Log a checkpoint that is now on disk."""
        if published is None:
            return
        if published.asynchronous:
            log.info("checkpoint published %.1f s after it started; training blocked %.2f s staging it and %.2f s "
                     "waiting for its writes: %s", published.total_s, published.stage_s, published.wait_s,
                     published.path)
        else:
            log.info("checkpoint saved in %.1f s: %s", published.total_s, published.path)
        if self.env.is_main:
            self.metrics.write(published.record())

    def save_failed(self, error: Exception) -> TrainingError:
        """Why training stops when a checkpoint cannot be written, and what is safe."""
        root = self.run_dir / rundir.CHECKPOINTS
        previous = rundir.latest_checkpoint(root)
        safe = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
        return TrainingError(f"the checkpoint of step {self.state.step} could not be written ({error}); {safe}. "
                             f"Training stopped: free space or fix permissions under {root}, then rerun the same "
                             "run directory to resume")


# ---- the job's entry ------------------------------------------------------------------------------
def run(cfg: Config) -> dict[str, Any]:
    """Train in this process as one rank of the job described by the environment."""
    clock = StartupClock()
    env = identity.detect()
    device = distributed.device_for(env)
    lock = rundir.RunLock(Path(cfg.run_dir))
    if env.is_main and os.environ.get(rundir.LOCK_HELD_ENV) != cfg.run_dir:
        lock.acquire()  # released when this process ends, however it ends
    # Listen before the slow start-up: a signal during it must not kill the job uncheckpointed.
    stop = resilience.StopRequest()
    stop.install()
    registered = (shard_reader.RegisteredFiles(device, shard_reader.memory_budget(env.local_world_size))
                  if device.type == "cuda" else None)
    verify_ahead = checkpoint.VerifyAhead(Path(cfg.run_dir) / rundir.CHECKPOINTS, env.rank, env.world_size,
                                          registered)
    if verify_ahead.path is not None and device.type == "cuda" and not verify_ahead.registers_all():
        threading.Thread(target=shard_reader.reserve_pinned_buffers, args=(device, checkpoint.reader_threads()),
                         name="checkpoint-buffers", daemon=True).start()
    compiler_ready = None
    if cfg.fsdp.compile:  # the caches' folder named first: importing Dynamo reads it
        cache = Path(cfg.fsdp.compile_cache or rundir.COMPILE_CACHE).expanduser()
        persist_compile_cache(Path(cfg.run_dir) / cache)  # a relative folder: in the run directory
        compiler_ready = import_compiler_ahead()
    distributed.init_process_group(env, device, cfg.train.collective_timeout_s)
    logs.setup(Path(cfg.run_dir), env.rank)
    if env.is_main and bytecode.kept_in_run_dir(Path(cfg.run_dir)):
        log.info("this Python keeps no bytecode for %s (PYTHONDONTWRITEBYTECODE, or a read-only image): the job "
                 "keeps it in %s, so later starts import in a fraction of the time", bytecode.PROBE, sys.pycache_prefix)
    try:
        if env.is_main:
            source.ensure(cfg)  # the built-in corpus, when the run uses it and it is not there yet
        dist.barrier()
        clock.mark("process group")
        result = _train(Trainer(cfg, env, device, stop, clock, verify_ahead, compiler_ready))
        # The model's sharded tensors hold the process groups: freed here, while the interpreter is whole,
        # not at its shutdown, where gloo's threads could then abort a finished job ("terminate called
        # without an active exception", seen in 2 of 3 two-node Slurm jobs).
        gc.collect()
        return result
    finally:
        dist.destroy_process_group()
        stop.uninstall()
        lock.release()


def _train(trainer: Trainer) -> dict[str, Any]:
    with trainer.wandb:
        return trainer.fit()


USAGE = "usage: python -m pretrain.train RUN_DIR   (RUN_DIR written by python -m pretrain.launch)"


def main(argv: list[str] | None = None) -> int:
    """One rank of a job; returns its ExitCode (rundir)."""
    # A crash in native code (a segfault, an abort) then prints every thread's Python stack to the log.
    faulthandler.enable()
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):
        print(USAGE, file=sys.stderr)
        return ExitCode.REFUSED
    run_dir = Path(argv[0]).resolve()
    if not rundir.is_run_dir(run_dir):
        print(f"error: {run_dir} is not a run directory (no {rundir.MARKER} and {rundir.CONFIG_FILE}); {USAGE}",
              file=sys.stderr)
        return ExitCode.REFUSED
    try:
        result = run(rundir.load_config(run_dir))
    except (ConfigError, CheckpointError, DataError, TrainingError, NonFiniteStepsError, rundir.RunLocked) as err:
        print(f"error: {err}", file=sys.stderr)
        rundir.record_failure(run_dir, str(err))
        return ExitCode.ERROR
    except Exception as err:
        if not distributed.collective_failed(err):
            raise
        # A peer died or a collective timed out: the batch script requeues on this code.
        print(f"pretrain: collective failed: {err}", file=sys.stderr, flush=True)
        return ExitCode.HUNG
    return ExitCode.STOPPED if result["stopped_early"] else ExitCode.OK
