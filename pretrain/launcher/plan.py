"""`python -m pretrain.plan [overrides]`: will this run fit on its GPUs, and how long will it take?

    python -m pretrain.plan +cluster=a100x8 model=llama-8b train=pretrain
    python -m pretrain.plan model=llama-1b train.micro_batch=4       # this machine's GPUs

Estimates the memory of one GPU at its peak from the model, sharding, precision, activation
checkpointing, micro-batch, sequence length and the number of GPUs, and the speed from the
FLOPs per token and an assumed MFU (plan.mfu). The launcher runs the same estimate (`check`)
before anything is started or submitted and refuses a run that will not fit, naming settings
that would (found by re-running the estimate over candidates), unless plan.force=true.

The memory model follows what the code keeps alive, per GPU, in bytes (P parameters, D ranks a
parameter is sharded over, c bytes per value of the compute dtype, T tokens per micro-batch):
  held throughout     fp32 parameters 4P/D and AdamW's two moments 8P/D
  forward/backward    the compute-dtype copies FSDP all-gathers (all of them where nothing is
                      resharded after forward: shard_grad_op, or one rank per shard; else the
                      output layer, kept for backward, and two blocks), fp32
                      sharded gradients 4P/D between the micro-batches of an accumulation,
                      every block's saved activations, and at the end of forward the logits
                      and loss buffers (eager cross-entropy: 12 TV bytes; compiled: 2 cTV; the
                      output layer's kernel on GPUs in bf16 or fp32: cTV, the logits overwritten
                      by their gradient)
                      or, with activation checkpointing, one block's recomputation
  optimizer step      fp32 sharded gradients 4P/D (+ 4P/D of temporaries for foreach AdamW)
Peak = held + the larger of the last two. On GPUs an allowance is added for what PyTorch's
allocator does not count: the CUDA context, cuBLAS and NCCL buffers (CONTEXT_GIB) and the
caching allocator's fragmentation (FRAGMENTATION of the peak).
"""

from __future__ import annotations

import itertools
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from pretrain import config, flops, hosts
from pretrain.config import Config, ConfigError, ModelConfig, resolved_precision
from pretrain.launcher import validate
from pretrain.launcher.world import World, world_of

GIB = 2**30
# Per GPU, outside PyTorch's allocator: CUDA context, cuBLAS workspaces, NCCL's buffers.
CONTEXT_GIB = 1.5
# The caching allocator's reserved memory over its peak allocation, with the expandable segments every
# job asks for (pretrain.trainer.allocator); 4-27% with the default fixed segments.
FRAGMENTATION = 0.03
COMPUTE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# Activation checkpointing modes from the most memory to the least.
CHECKPOINTING_ORDER = ("none", "selective", "full")
# fp32 d-wide vectors per token the compiled blocks keep around their norms (fitted to H200 peaks).
COMPILED_NORM_FP32 = 3
# Full checkpointing runs each block's forward twice: 8 instead of 6 FLOPs per parameter and token.
FULL_RECOMPUTE_COST = 8 / 6
# Node counts tried for a run that does not fit, up to this many (or 4x the configured count).
MAX_SUGGESTED_NODES = 64


@dataclass(frozen=True)
class Target:
    """Where a run trains: its ranks, their device, memory (GiB) and peak FLOP/s."""

    world: int
    per_node: int
    device: str
    precision: str
    memory_gib: float | None
    peak_flops: float | None
    where: str
    cpu_all_reduce: bool | None = True  # None: not known yet (see World)


@dataclass(frozen=True)
class Part:
    name: str
    detail: str
    bytes: float


@dataclass(frozen=True)
class Estimate:
    """Per-GPU memory at the peak of a step, and the speed, of one configuration on one target."""

    held: list[Part]
    forward_backward: list[Part]
    optimizer_step: list[Part]
    allowance: float
    capacity: float | None
    tokens_per_s: float | None

    @property
    def peak_phase(self) -> list[Part]:
        fb, opt = (sum(p.bytes for p in parts) for parts in (self.forward_backward, self.optimizer_step))
        return self.forward_backward if fb >= opt else self.optimizer_step

    @property
    def allocated(self) -> float:
        """What PyTorch's allocator holds at the peak (torch.cuda.max_memory_allocated)."""
        return sum(p.bytes for p in self.held + self.peak_phase)

    @property
    def total(self) -> float:
        return self.allocated + self.allowance

    @property
    def fits(self) -> bool:
        return self.capacity is None or self.total <= self.capacity


# ---- where the run goes ----------------------------------------------------------------------
def target_of(cfg: Config, world: World | None = None) -> Target:
    """The GPUs (or CPU processes) of `world` (by default those the run would have) as the estimate
    needs them."""
    world = world or world_of(cfg)
    precision = resolved_precision(cfg.precision.name, world.cuda, world.bf16)
    if cfg.cluster is not None:
        c = cfg.cluster
        peak = cfg.metrics.peak_flops or flops.peak_flops_for(c.name)
        where = f"cluster {c.name}: {c.nodes} node{'s' if c.nodes > 1 else ''} x {c.gpus_per_node} GPUs"
        return Target(world.size, world.per_node, "cuda", precision, c.gpu_mem_gb, peak, where)
    if world.cuda:
        peak = cfg.metrics.peak_flops or flops.peak_flops_for(world.gpu_name or "")
        return Target(world.size, world.per_node, "cuda", precision, world.gpu_memory_gib, peak,
                      f"this machine: {world.size} x {world.gpu_name}")
    return Target(world.size, world.per_node, "cpu", precision, available_memory_gib() / world.size,
                  cfg.metrics.peak_flops, f"this machine: {world.size} CPU process{'es' if world.size > 1 else ''}",
                  world.known_cpu_all_reduce)


def available_memory_gib(proc: Path = Path("/proc"), cgroups: Path = Path("/sys/fs/cgroup")) -> float:
    """Memory the CPU processes of a local run may use: what the kernel counts as available now, within what
    the memory cgroups above this process leave (an salloc allocation's --mem, a container's limit), where
    going over gets the run killed instead of refused."""
    left = hosts.memory_left(proc, cgroups)
    if left is None:  # no /proc to read (not Linux): the machine's memory
        left = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return left / GIB


def shard_degree(cfg: Config, target: Target) -> int:
    """Ranks each parameter is split over."""
    return config.shard_degree(cfg.fsdp, target.world, target.per_node)


# ---- the memory model (bytes) ----------------------------------------------------------------
def norm_activations(m: ModelConfig, c: int) -> float:
    """Saved per token by RMSNorm: two fp32 copies of its input (one when that is fp32) and its output."""
    return 8 * m.dim + (c * m.dim if c < 4 else 0)


def eager_block_activations(m: ModelConfig, c: int) -> float:
    """Saved per token by one block without checkpointing, as autograd keeps them:
    two norms; attention's input, q, k and v as SDPA sees them (GQA repeats k and v to n_heads),
    its output and log-sum-exp, wo's input; the feed-forward's input, w1 and w3 outputs, silu's
    output and the product (w2's input)."""
    d, h = m.dim, m.ffn_hidden
    attention = c * d * 6 + 4 * m.n_heads
    feed_forward = c * d + 4 * c * h
    return 2 * norm_activations(m, c) + attention + feed_forward


def saved_matmul_outputs(m: ModelConfig, c: int) -> float:
    """Per token: the block's input and its matmul outputs (wq, wk, wv, wo, w1, w3, w2)."""
    kv = m.kv_heads * (m.dim // m.n_heads)
    return c * (m.dim + 3 * m.dim + 2 * kv + 2 * m.ffn_hidden)


def block_activations(m: ModelConfig, c: int, checkpointing: str, compiled: bool, device: str) -> float:
    """Bytes per token one block keeps for backward.

    selective saves matmul outputs, plus the attention kernel's outputs where the selective policy
    lists the kernel (the CUDA SDPA kernels; the CPU one is recomputed). Compiled without
    checkpointing, the partitioner keeps the block input, q, k, v, the attention output and
    residual, the w1 and w3 outputs, and (calibrated on H200 runs of the 125M, 1B and 8B shapes,
    bench/results/memory-plan-vs-measured.md) about three fp32 d-wide vectors around the norms.
    """
    if checkpointing == "full":
        return c * m.dim
    attention_out = c * m.dim + 4 * m.n_heads
    if checkpointing == "selective":
        return saved_matmul_outputs(m, c) + (attention_out if device == "cuda" else 0)
    if compiled:
        kv = m.kv_heads * (m.dim // m.n_heads)
        return c * (3 * m.dim + 2 * kv + 2 * m.ffn_hidden) + attention_out + COMPILED_NORM_FP32 * 4 * m.dim
    return eager_block_activations(m, c)


def recompute_transient(m: ModelConfig, c: int, checkpointing: str, compiled: bool, device: str) -> float:
    """Bytes per token of one block in backward: what it recomputes plus its gradient temporaries."""
    gradients = c * (3 * m.ffn_hidden + 2 * m.dim)
    if checkpointing == "none":
        return gradients
    whole = block_activations(m, c, "none", compiled, device)
    return whole - block_activations(m, c, checkpointing, compiled, device) + gradients


def loss_buffers(tokens: int, m: ModelConfig, c: int, compiled: bool, fused: bool) -> float:
    """The logits and loss at the turn from forward to backward.

    The output layer's kernel (`fused`): the compute-dtype logits, overwritten by their gradient.
    Eager: fp32 log-softmax output (saved), the gradient nll_loss scatters into and
    log-softmax's gradient, 4 TV bytes each (the fp32 copy of bf16 logits is gone by then).
    Compiled: the compute-dtype logits (saved) and their gradient, fused.
    """
    if fused:
        return c * tokens * m.vocab_size
    if compiled:
        return 2 * c * tokens * m.vocab_size
    return 12 * tokens * m.vocab_size


def gathered_parameters(m: ModelConfig, strategy: str, degree: int, c: int) -> tuple[float, str]:
    """Compute-dtype copies FSDP all-gathers that are alive at the end of forward."""
    if strategy == "shard_grad_op" or degree == 1:
        return flops.parameter_count(m) * c, "every unit kept gathered"
    # The output layer (or the tied embedding at the root) is never resharded after forward;
    # the last block is kept for backward and one more is in flight (prefetch).
    return (m.vocab_size * m.dim + m.dim + 2 * flops.block_parameter_count(m)) * c, "output layer and two blocks"


def turn_of_backward(m: ModelConfig, c: int, tokens: int, checkpointing: str, compiled: bool, device: str,
                     fused: bool) -> Part:
    """The largest working set on top of the saved activations: the loss at the end of forward,
    the output layer's gradients, or one block's recomputation in backward."""
    loss = loss_buffers(tokens, m, c, compiled, fused)
    output_layer = m.vocab_size * m.dim * (c + (4 if c < 4 else 0)) + c * tokens * m.vocab_size
    recompute = recompute_transient(m, c, checkpointing, compiled, device) * tokens
    if recompute > max(loss, output_layer):
        what = "gradients in flight" + ("" if checkpointing == "none" else f" and its recomputation ({checkpointing})")
        return Part("block backward", f"one block's {what}", recompute)
    kind = "the output layer's kernel" if fused else "compiled" if compiled else "eager"
    return Part("logits and loss", f"{tokens:,} tokens x {m.vocab_size:,} vocabulary, {kind} cross-entropy",
                max(loss, output_layer))


def estimate(cfg: Config, target: Target) -> Estimate:
    """The one estimate behind `python -m pretrain.plan` and the launcher's check."""
    if cfg.fsdp.activation_checkpointing == "auto":
        cfg = with_checkpointing(cfg, resolve_checkpointing(cfg, target))
    m, train = cfg.model, cfg.train
    c = COMPUTE_BYTES[target.precision]
    degree = shard_degree(cfg, target)
    params = flops.parameter_count(m)
    shard = params / degree
    tokens = train.micro_batch * train.seq_len
    accumulation = config.grad_accum_steps(train, target.world)
    ac, compiled = cfg.fsdp.activation_checkpointing, cfg.fsdp.compile
    split = f"1/{degree} each" if degree > 1 else "unsharded"

    held = [Part("parameters", f"fp32 master weights, {split}", 4 * shard),
            Part("optimizer state", f"AdamW moments, 2 x fp32, {split}", 8 * shard)]
    per_block = block_activations(m, c, ac, compiled, target.device)
    final_norm = norm_activations(m, c) + c * m.dim
    forward_backward = []
    if not config.unwrapped(cfg.fsdp, target.world):
        gathered, which = gathered_parameters(m, cfg.fsdp.strategy, degree, c)
        forward_backward.append(Part("gathered parameters", f"{target.precision} copies FSDP all-gathers ({which})",
                                     gathered))
    elif c < 4:  # one process without FSDP: its compute copy lives through the optimizer step too
        held.append(Part("compute copy", f"{target.precision} weights forward and backward run on (no FSDP)",
                         params * c))
    forward_backward += [
        Part("accumulated gradients", f"fp32, {split}, summed over {accumulation} micro-batches" if accumulation > 1
             else "none: one micro-batch per step", 4 * shard if accumulation > 1 else 0),
        Part("activations", f"{m.n_layers} layers x {tokens:,} tokens, checkpointing {ac}"
             + (", compiled" if compiled else ""), (m.n_layers * per_block + final_norm) * tokens),
        turn_of_backward(m, c, tokens, ac, compiled, target.device,
                         fused=target.device == "cuda" and target.precision in config.FUSED_LOSS_PRECISIONS),
    ]
    foreach = not config.uses_fused_adamw(cfg.optim, target.device == "cuda")
    optimizer_step = [Part("gradients", f"fp32, {split}", 4 * shard)]
    if foreach:
        optimizer_step.append(Part("optimizer temporaries", "foreach AdamW's sqrt of the second moment", 4 * shard))
    partial = Estimate(held, forward_backward, optimizer_step, 0.0, None, None)
    allowance = (CONTEXT_GIB * GIB + FRAGMENTATION * partial.allocated) if target.device == "cuda" else 0.0
    capacity = target.memory_gib * GIB if target.memory_gib is not None else None
    return replace(partial, allowance=allowance, capacity=capacity, tokens_per_s=tokens_per_second(cfg, target))


def tokens_per_second(cfg: Config, target: Target) -> float | None:
    """All ranks together, at plan.mfu of the peak; None when the device's peak is unknown."""
    if target.peak_flops is None:
        return None
    work = flops.flops_per_token(cfg.model, cfg.train.seq_len, "causal")
    if cfg.fsdp.activation_checkpointing == "full":
        work *= FULL_RECOMPUTE_COST
    return target.world * cfg.plan.mfu * target.peak_flops / work


# ---- activation checkpointing: auto -----------------------------------------------------------
def with_checkpointing(cfg: Config, mode: str) -> Config:
    return replace(cfg, fsdp=replace(cfg.fsdp, activation_checkpointing=mode))


def resolve_checkpointing(cfg: Config, target: Target) -> str:
    """fsdp.activation_checkpointing as the run will use it: a set mode as it is; `auto` as the least
    checkpointing (none, selective, full) whose estimate fits the target's memory, none where the
    memory is unknown (CPUs, a cluster file without gpu_mem_gb), and full when nothing fits (the
    check then refuses the run)."""
    wanted = cfg.fsdp.activation_checkpointing
    if wanted != "auto":
        return wanted
    if target.memory_gib is None:
        return CHECKPOINTING_ORDER[0]
    for mode in CHECKPOINTING_ORDER:
        if estimate(with_checkpointing(cfg, mode), target).fits:
            return mode
    return CHECKPOINTING_ORDER[-1]


# ---- settings that would fit -----------------------------------------------------------------
@dataclass(frozen=True)
class Suggestion:
    overrides: list[str]
    estimate: Estimate
    world: int


def _variant(cfg: Config, checkpointing: str, strategy: str, nodes: int | None) -> Config:
    fsdp = replace(cfg.fsdp, activation_checkpointing=checkpointing, strategy=strategy)
    cluster = replace(cfg.cluster, nodes=nodes) if cfg.cluster is not None and nodes is not None else cfg.cluster
    return replace(cfg, fsdp=fsdp, cluster=cluster)


def _retarget(target: Target, cfg: Config) -> Target:
    if cfg.cluster is None or cfg.cluster.nodes * target.per_node == target.world:
        return target
    c = cfg.cluster
    return replace(target, world=c.nodes * c.gpus_per_node,
                   where=f"cluster {c.name}: {c.nodes} nodes x {c.gpus_per_node} GPUs")


def node_counts(cfg: Config) -> list[int | None]:
    """Node counts to try, smallest first: from the configured one up to 64 nodes (or 4x, if more)."""
    if cfg.cluster is None:
        return [None]
    return list(range(cfg.cluster.nodes, max(MAX_SUGGESTED_NODES, 4 * cfg.cluster.nodes) + 1))


def micro_batches(cfg: Config, world: int) -> list[int]:
    """Micro-batches up to the configured one that divide each rank's share of the global batch, largest first."""
    per_rank = config.global_batch(cfg.train, world) // world
    return [m for m in range(min(cfg.train.micro_batch, per_rank), 0, -1) if per_rank % m == 0]


def _runnable(cfg: Config, target: Target) -> bool:
    """The global batch divides over the target's ranks and the sharding is valid there."""
    return config.global_batch(cfg.train, target.world) % target.world == 0 and _valid(cfg, target)


def _first_fit(cfg: Config, target: Target, micro_batch_choices: list[int]) -> tuple[Config, Estimate] | None:
    for micro in micro_batch_choices:
        candidate = replace(cfg, train=replace(cfg.train, micro_batch=micro))
        result = estimate(candidate, target)
        if result.fits:
            return candidate, result
    return None


def suggestions(cfg: Config, target: Target, limit: int = 3) -> list[Suggestion]:
    """Settings that fit, by re-running the estimate over candidates: stronger activation
    checkpointing (with `auto`, left to auto), full sharding, and the smallest node count that fits,
    each with the largest micro-batch that fits. Fewest changes first, then the fastest per GPU."""
    current = cfg.fsdp.activation_checkpointing
    modes = [current] if current == "auto" else CHECKPOINTING_ORDER[CHECKPOINTING_ORDER.index(current):]
    strategies = dict.fromkeys([cfg.fsdp.strategy, "full_shard"])
    found = []
    for checkpointing, strategy in itertools.product(modes, strategies):
        for node_count in node_counts(cfg):
            base = _variant(cfg, checkpointing, strategy, node_count)
            base_target = _retarget(target, base)
            if not _runnable(base, base_target):
                continue
            fit = _first_fit(base, base_target, micro_batches(base, base_target.world))
            if fit is not None:
                changes = _changes(cfg, fit[0])
                if changes:
                    found.append(Suggestion(changes, fit[1], base_target.world))
                break  # more nodes than the fewest that fit is no better suggestion
    # A change on top of settings that already fit is no suggestion.
    found = [s for s in found if not any(set(o.overrides) < set(s.overrides) for o in found)]
    found.sort(key=lambda s: (len(s.overrides), -(s.estimate.tokens_per_s or 0) / s.world, s.world, s.estimate.total))
    return found[:limit]


def smallest_node_count(cfg: Config, target: Target) -> tuple[int, Estimate] | None:
    """The fewest nodes on which this config fits as it is (micro-batch and sharding unchanged)."""
    for node_count in node_counts(cfg)[1:]:
        base = _variant(cfg, cfg.fsdp.activation_checkpointing, cfg.fsdp.strategy, node_count)
        base_target = _retarget(target, base)
        if _runnable(base, base_target) and cfg.train.micro_batch in micro_batches(base, base_target.world):
            result = estimate(base, base_target)
            if result.fits:
                return node_count, result
    return None


def _valid(cfg: Config, target: Target) -> bool:
    try:
        validate.validate_parallel(cfg, World(target.world, target.per_node, target.device == "cuda",
                                              known_cpu_all_reduce=target.cpu_all_reduce))
    except ConfigError:
        return False
    return True


def _changes(before: Config, after: Config) -> list[str]:
    pairs = [("fsdp.activation_checkpointing", before.fsdp.activation_checkpointing,
              after.fsdp.activation_checkpointing),
             ("fsdp.strategy", before.fsdp.strategy, after.fsdp.strategy),
             ("cluster.nodes", before.cluster and before.cluster.nodes, after.cluster and after.cluster.nodes),
             ("train.micro_batch", before.train.micro_batch, after.train.micro_batch)]
    return [f"{key}={new}" for key, old, new in pairs if old != new]


# ---- the check and the report ----------------------------------------------------------------
def gib(value: float) -> str:
    return f"{value / GIB:.2f}"


def refusal(cfg: Config, target: Target, result: Estimate) -> str:
    """One line: the estimate, its largest parts, and settings that would fit."""
    parts = [p for p in result.held + result.peak_phase if p.bytes > 0]
    parts += [Part("allowance", "", result.allowance)] if result.allowance else []
    breakdown = " + ".join(f"{p.name} {gib(p.bytes)}" for p in parts)
    fixes = suggestions(cfg, target)
    if fixes:
        remedy = "fits with: " + " | ".join(f"{' '.join(s.overrides)} ({gib(s.estimate.total)} GiB)" for s in fixes)
    else:
        remedy = (f"no smaller micro-batch, activation checkpointing, full sharding or up to {MAX_SUGGESTED_NODES} "
                  "nodes fits: use a smaller model or GPUs with more memory")
    per = per_device(target)
    return (f"{cfg.model.name} will not fit: about {gib(result.total)} GiB {per} ({breakdown}) but {target.where} "
            f"has {target.memory_gib:.1f} GiB {per}; {remedy}")


def per_device(target: Target) -> str:
    return "per GPU" if target.device == "cuda" else "per process (of the memory available now)"


def check(cfg: Config, target: Target) -> Estimate | None:
    """The launcher's check: raise ConfigError if the run will not fit its GPUs (or, on CPUs, the memory
    available now), unless plan.force. Skipped (None) for a cluster file without gpu_mem_gb.
    """
    if target.memory_gib is None:
        return None
    result = estimate(cfg, target)
    if result.fits:
        return result
    message = refusal(cfg, target, result)
    if cfg.plan.force:
        print(f"warning: {message}; plan.force=true: going ahead", file=sys.stderr)
        return result
    raise ConfigError(f"{message}; or plan.force=true to run anyway (python -m pretrain.plan shows the estimate)")


def human_time(seconds: float) -> str:
    if seconds >= 2 * 86400:
        return f"{seconds / 86400:.1f} days"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min"


def si(value: float) -> str:
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= factor:
            return f"{value / factor:.3g} {prefix}"
    return f"{value:.3g} "


def report(cfg: Config, target: Target, result: Estimate) -> str:
    """What `python -m pretrain.plan` prints."""
    m, train = cfg.model, cfg.train
    accumulation = config.grad_accum_steps(train, target.world)
    checkpointing = resolve_checkpointing(cfg, target)
    if cfg.fsdp.activation_checkpointing == "auto":
        checkpointing += " (auto: the least that fits)" if target.memory_gib is not None else " (auto; memory unknown)"
    lines = [
        f"{m.name} on {target.where}",
        f"  {cfg.fsdp.strategy} (parameters split over {shard_degree(cfg, target)}), {target.precision}, "
        f"activation checkpointing {checkpointing}{', compiled' if cfg.fsdp.compile else ''}, "
        f"micro-batch {train.micro_batch} x {train.seq_len} tokens, gradient accumulation {accumulation}",
        f"parameters       {flops.parameter_count(m):,}",
        f"FLOPs per token  {si(flops.flops_per_token(m, train.seq_len, 'causal'))}FLOP (causal attention), "
        f"{si(flops.flops_per_token(m, train.seq_len, 'reference'))}FLOP (reference, torchtitan's)",
        "",
        f"memory per {'GPU' if target.device == 'cuda' else 'process'}, estimated".ljust(88) + "GiB",
    ]
    peak = result.peak_phase
    row = "  {:<24}{:<62}{:>7}"
    lines += [row.format(p.name, p.detail, gib(p.bytes)) for p in result.held]
    for title, parts in (("forward and backward", result.forward_backward), ("optimizer step", result.optimizer_step)):
        lines.append(f"  {title}{' (the peak)' if parts is peak else ' (not the peak)'}:")
        lines += [row.format("  " + p.name, p.detail, gib(p.bytes)) for p in parts]
    if target.device == "cuda":
        lines.append(row.format("allowance", f"CUDA context etc. {CONTEXT_GIB} GiB + {FRAGMENTATION:.0%} fragmentation",
                                gib(result.allowance)))
    lines.append(row.format("total", "", gib(result.total)))
    lines.append(verdict(target, result))
    lines += [""] + speed_lines(cfg, target, result)
    return "\n".join(lines)


def verdict(target: Target, result: Estimate) -> str:
    if result.capacity is None:
        return "  not checked: the GPU memory is unknown (a cluster file without gpu_mem_gb)"
    if result.fits:
        return (f"  fits in {target.memory_gib:.1f} GiB {per_device(target)} "
                f"({1 - result.total / result.capacity:.0%} to spare)")
    return f"  does NOT fit in {target.memory_gib:.1f} GiB {per_device(target)}"


def speed_lines(cfg: Config, target: Target, result: Estimate) -> list[str]:
    train = cfg.train
    per_step = config.global_batch(train, target.world) * train.seq_len
    tokens = train.steps * per_step
    budget = f"token budget     {train.steps:,} steps x {per_step:,} tokens = {si(tokens)}tokens"
    if result.tokens_per_s is None:
        return [budget, "speed            unknown peak FLOP/s: set metrics.peak_flops (or name the cluster file after "
                        "its GPU, e.g. a100x8) for a time estimate"]
    seconds = tokens / result.tokens_per_s
    lines = [
        f"speed            {result.tokens_per_s / target.world:,.0f} tokens/s per GPU, "
        f"{result.tokens_per_s:,.0f} in all "
        f"(assumed MFU {cfg.plan.mfu:.0%} of {target.peak_flops / 1e12:.0f} TFLOP/s"
        + (", full checkpointing recomputes the forward" if cfg.fsdp.activation_checkpointing == "full" else "") + ")",
        budget,
        f"time             {human_time(seconds)} on {target.world} GPUs = "
        f"{seconds * target.world / 3600:,.0f} GPU-hours",
    ]
    if cfg.cluster is not None:
        jobs = -(-seconds // (cfg.cluster.time_min * 60))
        lines.append(f"                 about {jobs:.0f} allocation{'s' if jobs > 1 else ''} of cluster.time_min="
                     f"{cfg.cluster.time_min} min (requeued or resubmitted)")
    return lines
