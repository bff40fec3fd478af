"""Checks a composed config before any process starts or anything is submitted.

Each failure is a ConfigError whose message is one line: the key, its value, the reason,
and where useful what would work.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict

from pretrain import config, redaction
from pretrain.config import ClusterConfig, Config, ConfigError
from pretrain.launcher.world import World


def _positive(values: dict[str, float | int | None]) -> None:
    for key, value in values.items():
        if value is not None and value <= 0:
            raise ConfigError(f"{key}={value}: must be greater than 0")


def _one_of(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r}: unknown; choose one of {', '.join(allowed)}")


# Control characters (newlines among them): a value that reaches the batch script must not hold one.
CONTROL_CHARACTER = re.compile(r"[\x00-\x1f\x7f]")


def validate_values(cfg: Config) -> None:
    """Every string free of control characters, every float finite.

    Strings reach the generated batch script (partition, job name, paths, environment, setup):
    a line break there would end the #SBATCH header and run the rest as a command.
    """
    for key, value in config.flat_items(asdict(cfg)):
        if isinstance(value, str) and CONTROL_CHARACTER.search(value):
            found = CONTROL_CHARACTER.search(value).group()
            raise ConfigError(f"{key}={value!r}: holds the control character {found!r}; values are written into "
                              "the batch script, where a line break would end its #SBATCH header and run the rest "
                              "as a command: remove it")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}={value}: must be a finite number")


def _in_range(key: str, value: float | None, low: float, high: float, high_open: bool = False) -> None:
    if value is None:
        return
    if not low <= value <= high or (high_open and value == high):
        bracket = ")" if high_open else "]"
        raise ConfigError(f"{key}={value}: must be in [{low:g}, {high:g}{bracket}")


def validate_model(cfg: Config) -> None:
    m = cfg.model
    _positive({"model.dim": m.dim, "model.n_layers": m.n_layers, "model.n_heads": m.n_heads,
               "model.n_kv_heads": m.n_kv_heads, "model.ffn_hidden": m.ffn_hidden, "model.vocab_size": m.vocab_size,
               "model.max_seq_len": m.max_seq_len, "model.rope_theta": m.rope_theta, "model.init_std": m.init_std,
               "model.norm_eps": m.norm_eps})
    if m.dim % m.n_heads:
        raise ConfigError(f"model.n_heads={m.n_heads} does not divide model.dim={m.dim}")
    if (m.dim // m.n_heads) % 2:
        raise ConfigError(f"model.dim / model.n_heads = {m.dim // m.n_heads}: the head size must be even for RoPE")
    if m.n_heads % m.kv_heads:
        raise ConfigError(f"model.n_kv_heads={m.kv_heads} does not divide model.n_heads={m.n_heads}")


def validate_train(cfg: Config, world_size: int) -> None:
    t, o = cfg.train, cfg.optim
    _positive({"train.steps": t.steps, "train.seq_len": t.seq_len, "train.global_batch": t.global_batch,
               "train.global_batch_tokens": t.global_batch_tokens, "train.micro_batch": t.micro_batch,
               "train.log_every": t.log_every, "train.ckpt_keep": t.ckpt_keep, "train.stop_at_step": t.stop_at_step,
               "train.eval_batches": t.eval_batches, "train.max_bad_steps": t.max_bad_steps,
               "optim.lr": o.lr, "optim.grad_clip": o.grad_clip, "optim.eps": o.eps})
    _positive({"train.collective_timeout_s": t.collective_timeout_s})
    if t.hang_timeout_s < 0:
        raise ConfigError(f"train.hang_timeout_s={t.hang_timeout_s}: must be 0 (off) or more")
    if t.eval_every < 0:
        raise ConfigError(f"train.eval_every={t.eval_every}: must be 0 (no evaluation) or more")
    if t.ckpt_every < 0:
        raise ConfigError(f"train.ckpt_every={t.ckpt_every}: must be 0 (checkpoints only when stopped early) or more")
    _in_range("optim.beta1", o.beta1, 0.0, 1.0, high_open=True)
    _in_range("optim.beta2", o.beta2, 0.0, 1.0, high_open=True)
    if o.weight_decay < 0:
        raise ConfigError(f"optim.weight_decay={o.weight_decay}: must be 0 or more")
    if o.warmup_steps < 0:
        raise ConfigError(f"optim.warmup_steps={o.warmup_steps}: must be 0 or more")
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio={o.min_lr_ratio}: must be between 0 and 1")
    if t.seq_len > cfg.model.max_seq_len:
        raise ConfigError(f"train.seq_len={t.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}")
    if t.global_batch_tokens is not None and t.global_batch_tokens % t.seq_len:
        raise ConfigError(f"train.global_batch_tokens={t.global_batch_tokens} is not a multiple of "
                          f"train.seq_len={t.seq_len}")
    batch = config.global_batch(t, world_size)
    per_step = world_size * t.micro_batch
    if batch % per_step:
        fits = per_step * max(batch // per_step, 1)
        raise ConfigError(f"global batch {batch} sequences does not divide by world size {world_size} x "
                          f"train.micro_batch={t.micro_batch} = {per_step}; e.g. train.global_batch={fits}")


def validate_sampling(cfg: Config) -> None:
    """train.sample_every and its settings (train.sampling), which `python -m pretrain.generate` shares."""
    t, sampling = cfg.train, cfg.train.sampling
    if t.sample_every < 0:
        raise ConfigError(f"train.sample_every={t.sample_every}: must be 0 (no samples) or more")
    if not t.sample_every:
        return
    if cfg.data.synthetic:
        raise ConfigError("train.sample_every with synthetic data: random tokens have no tokenizer to write "
                          "samples with; set train.sample_every=0")
    if not t.sample_prompts or not all(t.sample_prompts):
        raise ConfigError(f"train.sample_prompts={t.sample_prompts}: give one or more non-empty prompts")
    problem = config.sampling_problem(sampling)
    if problem:
        field, must = problem
        raise ConfigError(f"train.sampling.{field}={getattr(sampling, field)}: {must}")
    if sampling.max_new_tokens >= cfg.model.max_seq_len:
        raise ConfigError(f"train.sampling.max_new_tokens={sampling.max_new_tokens} leaves no room for a prompt in "
                          f"model.max_seq_len={cfg.model.max_seq_len}")


def validate_parallel(cfg: Config, world: World) -> None:
    f = cfg.fsdp
    _one_of("fsdp.strategy", f.strategy, config.STRATEGIES)
    _one_of("fsdp.activation_checkpointing", f.activation_checkpointing, config.CHECKPOINTING)
    _positive({"fsdp.shard_size": f.shard_size})
    if f.strategy == "hybrid_shard":
        shard = f.shard_size or world.per_node
        if world.size % shard:
            raise ConfigError(f"fsdp.shard_size={shard} does not divide the world size {world.size}")
        if world.size // shard < 2:
            raise ConfigError(f"fsdp.strategy=hybrid_shard with shard groups of {shard} on {world.size} ranks leaves "
                              "a replicate degree of 1; use full_shard, more nodes, or a smaller fsdp.shard_size")
    if f.strategy in ("hybrid_shard", "no_shard") and world.size > 1 and not world.cuda and not world.cpu_all_reduce:
        raise ConfigError(f"fsdp.strategy={f.strategy} on CPUs needs torch 2.8 or newer: the FSDP2 of the torch "
                          "installed here cannot all-reduce gradients over gloo; use fsdp=full_shard or "
                          "shard_grad_op here (on GPUs every strategy works)")


def validate_precision(cfg: Config, has_cuda: bool) -> None:
    _one_of("precision.name", cfg.precision.name, config.PRECISIONS)
    _positive({"precision.init_scale": cfg.precision.init_scale, "precision.growth_interval": cfg.precision.growth_interval})
    if cfg.precision.name == "fp16" and not has_cuda:
        raise ConfigError("precision=fp16 needs a CUDA GPU (fp16 matmuls and loss scaling) and none is visible "
                          "here; use precision=bf16 or fp32 on CPUs")
    validate_float8(cfg)
    _positive({"metrics.peak_flops": cfg.metrics.peak_flops})


def validate_float8(cfg: Config) -> None:
    recipe = cfg.precision.float8
    _one_of("precision.float8", recipe, config.FLOAT8_RECIPES)
    if cfg.precision.float8_all_gather and recipe != "tensorwise":
        raise ConfigError(f"precision.float8_all_gather=true needs precision.float8=tensorwise (one scale per weight, "
                          f"which FSDP2 can all-gather with it), not {recipe}; set precision.float8_all_gather=false")
    if recipe == "none":
        return
    if cfg.precision.name != "bf16":
        raise ConfigError(f"precision.float8={recipe} runs the other operations in bf16, but "
                          f"precision={cfg.precision.name}; use precision=bf16 with it (or precision=fp8)")
    if cfg.cluster is not None and cfg.cluster.gpu_fp8 is False:
        raise ConfigError(f"precision.float8={recipe} needs FP8 matrix units (H100, H200), which the GPUs "
                          f"of cluster {cfg.cluster.name} lack (cluster.gpu_fp8=false); use precision=bf16 there")


def validate_cluster(cluster: ClusterConfig) -> None:
    for key in ("nodes", "gpus_per_node", "cpus_per_task", "time_min", "signal_delay_s"):
        if getattr(cluster, key) < 1:
            raise ConfigError(f"cluster.{key}={getattr(cluster, key)}: must be at least 1")
    if cluster.max_requeues < 0:
        raise ConfigError(f"cluster.max_requeues={cluster.max_requeues}: must be 0 or more")
    if cluster.mem_gb is not None and cluster.mem_gb < 1:
        raise ConfigError(f"cluster.mem_gb={cluster.mem_gb}: must be at least 1 (or null for the partition default)")
    if cluster.time_min * 60 <= cluster.signal_delay_s:
        raise ConfigError(f"cluster.time_min={cluster.time_min} is not longer than cluster.signal_delay_s="
                          f"{cluster.signal_delay_s} s: the stop signal would come before training starts")
    if cluster.gpu_bind is not None and not re.fullmatch(r"[A-Za-z_]+(:[0-9A-Za-z,x]+)?(,[A-Za-z_]+(:[0-9A-Za-z,x]+)?)*",
                                                        cluster.gpu_bind):
        raise ConfigError(f"cluster.gpu_bind={cluster.gpu_bind!r}: srun's --gpu-bind takes e.g. none, per_task:1, "
                          "closest or map_gpu:0,1 (null: the cluster's default)")
    for key in cluster.env:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ConfigError(f"cluster.env key {key!r} is not a valid environment variable name")


def validate_plan_and_preflight(cfg: Config) -> None:
    if not 0 < cfg.plan.mfu <= 1:
        raise ConfigError(f"plan.mfu={cfg.plan.mfu}: must be above 0 and at most 1")
    if cfg.cluster is not None:
        _positive({"cluster.gpu_mem_gb": cfg.cluster.gpu_mem_gb})
    p = cfg.preflight
    _positive({"preflight.min_tflops": p.min_tflops, "preflight.allreduce_mb": p.allreduce_mb,
               "preflight.min_busbw_gbps": p.min_busbw_gbps})
    if p.matmul_size is not None and p.matmul_size < 64:
        raise ConfigError(f"preflight.matmul_size={p.matmul_size}: must be at least 64")


# Mixture names become metric names (eval_loss/NAME).
MIX_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def validate_data(cfg: Config) -> None:
    """What the data keys say, before any dataset is opened (source.check opens them)."""
    data = cfg.data
    if not data.mix:
        return
    if data.path is not None or data.synthetic:
        other = f"data.path={data.path}" if data.path is not None else "data.synthetic=true"
        raise ConfigError(f"data.mix and {other} both say what to train on; keep one of them")
    for name, source in data.mix.items():
        if not MIX_NAME.fullmatch(name):
            raise ConfigError(f"data.mix.{name}: a source's name must be letters, digits and _.- (it names its "
                              f"metric, eval_loss/NAME)")
        if source.weight <= 0:  # non-finite numbers were refused by validate_values
            raise ConfigError(f"data.mix.{name}.weight={source.weight}: must be a number above 0")


def validate_logging(cfg: Config) -> None:
    _one_of("logging.wandb.mode", cfg.logging.wandb.mode, config.WANDB_MODES)


def validate_no_secrets(cfg: Config) -> None:
    """The config is saved with the run and goes into job scripts: a secret there would leak."""
    found = redaction.find_in_config(asdict(cfg))
    if found:
        raise ConfigError(f"{found[0]} holds a secret; keep keys and tokens out of the config, in your environment "
                          "(e.g. export WANDB_API_KEY=...), where jobs get them from")


def validate(cfg: Config, world: World) -> None:
    """Raise ConfigError for the first setting that cannot work on the world's ranks."""
    validate_values(cfg)
    _positive({"local.nproc": cfg.local.nproc})
    if cfg.cluster is not None:
        validate_cluster(cfg.cluster)
    validate_model(cfg)
    validate_train(cfg, world.size)
    validate_sampling(cfg)
    validate_parallel(cfg, world)
    validate_precision(cfg, world.cuda)
    validate_plan_and_preflight(cfg)
    validate_data(cfg)
    validate_logging(cfg)
    validate_no_secrets(cfg)
