"""What the training loop reports: a log line every train.log_every steps, and records in
metrics.jsonl and W&B (rank 0 only), with throughput, MFU in both accountings, memory and ETA."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from pretrain import flops
from pretrain.config import Config
from pretrain.rundir import MetricsFile
from pretrain.tracking.wandb_run import WandbRun

log = logging.getLogger("pretrain")


class Progress:
    def __init__(self, cfg: Config, world_size: int, global_batch: int, device: torch.device, is_main: bool,
                 metrics: MetricsFile, wandb: WandbRun) -> None:
        self.cfg = cfg
        self.world_size = world_size
        self.tokens_per_step = global_batch * cfg.train.seq_len
        self.device = device
        self.is_main = is_main
        self.metrics = metrics
        self.wandb = wandb
        self.flops_per_token = {name: flops.flops_per_token(cfg.model, cfg.train.seq_len, name)
                                for name in flops.ACCOUNTINGS}
        self.peak_flops = cfg.metrics.peak_flops or (
            flops.peak_flops_for(torch.cuda.get_device_name(device)) if device.type == "cuda" else None)
        self.start(0)

    def start(self, step: int) -> None:
        """Count time from here, for a job that starts (or resumes) at `step`."""
        self.first_step = step
        self.started = self.window_start = time.perf_counter()
        self.window_steps = 0

    def step_done(self) -> None:
        self.window_steps += 1

    def write(self, record: dict[str, Any]) -> None:
        """A record for metrics.jsonl and W&B (rank 0)."""
        if self.is_main:
            self.metrics.write(record)
            self.wandb.log(record)

    def report(self, step: int, loss: float, grad_norm: float, lr: float, extra: dict[str, Any]) -> None:
        """The step's log line and record, with throughput over the steps since the last report."""
        elapsed = max(time.perf_counter() - self.window_start, 1e-9)
        steps, self.window_steps = max(self.window_steps, 1), 0
        self.window_start = time.perf_counter()
        if not self.is_main:
            return
        tokens_per_s = steps * self.tokens_per_step / elapsed
        per_device = tokens_per_s / self.world_size
        record = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tokens_per_s,
                  "tokens_per_s_per_device": per_device, "step_time_s": elapsed / steps,
                  "mem_gb": memory_gb(self.device), **reserved_memory_gb(self.device), **extra, "time": time.time()}
        if self.peak_flops:
            record["mfu"] = per_device * self.flops_per_token["causal"] / self.peak_flops
            record["mfu_reference"] = per_device * self.flops_per_token["reference"] / self.peak_flops
        self.write(record)
        step_time = (time.perf_counter() - self.started) / max(step - self.first_step, 1)
        eta = human_duration(step_time * (self.cfg.train.steps - step))
        mfu = f"{record['mfu']:.1%}" if "mfu" in record else "-"
        log.info("step %d/%d | loss %.4f | lr %.2e | grad %.2f | %s tok/s | mfu %s | mem %.1f GB | eta %s",
                 step, self.cfg.train.steps, loss, lr, grad_norm, f"{tokens_per_s:,.0f}", mfu, record["mem_gb"], eta)


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


def human_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"
