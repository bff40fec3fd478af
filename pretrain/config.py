"""The configuration schema: every key, its type and its default, defined once.

Hydra composes the YAML files under conf/ on top of these dataclasses (registered in the
ConfigStore as `base_config`), so a misspelt key or a wrong type fails at composition.
`validate()` then checks what types cannot: sizes, divisibility, names, files.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

PRECISIONS = ("auto", "bf16", "fp16", "fp32")
# Precisions whose loss a GPU computes with the output layer's kernel, the logits overwritten by their
# gradient (pretrain.models.linear_cross_entropy; pretrain.plan counts one logits-sized buffer for them).
# fp16 keeps the loss of the logits: its range would flush the gradient's small probabilities unscaled.
FUSED_LOSS_PRECISIONS = ("bf16", "fp32")
FLOAT8_RECIPES = ("none", "tensorwise", "rowwise")
STRATEGIES = ("full_shard", "shard_grad_op", "hybrid_shard", "no_shard")
# auto: the least checkpointing that fits the GPUs' memory by the planner's estimate (pretrain/plan.py).
CHECKPOINTING = ("auto", "none", "selective", "full")


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the key and the reason."""


@dataclass
class ModelConfig:
    # The defaults are the `tiny` preset (conf/model/tiny.yaml): about 3M parameters.
    name: str = "tiny"
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    # Key/value heads for grouped-query attention; null means one per query head.
    n_kv_heads: Optional[int] = 2
    ffn_hidden: int = 768
    vocab_size: int = 320
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    # A Hugging Face Llama folder (or .safetensors files) whose weights a fresh run starts from instead of
    # random ones (each rank reads its own shards); a run resuming from its checkpoint ignores it.
    init_from: Optional[str] = None

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads


@dataclass
class FSDPConfig:
    strategy: str = "full_shard"
    # hybrid_shard: ranks per shard group; null means the GPUs of one node.
    shard_size: Optional[int] = None
    # auto: none if the run fits the GPUs' memory by the planner's estimate, else selective, else
    # full; resolved by the launcher into the run's config.yaml (none where the memory is unknown).
    activation_checkpointing: str = "auto"
    # Compile each transformer block and the loss.
    compile: bool = False
    # Where torch.compile keeps its caches (Inductor's graphs, Triton's kernels), so that a requeued job
    # compiles in seconds: null is the run directory's cache/compile; a folder (relative: to the run
    # directory) to share one between runs, or to keep the small files off a parallel filesystem.
    compile_cache: Optional[str] = None
    # One process trains the model without FSDP (fp32 master weights and a compute-dtype copy: FSDP2's
    # numerics without its copies, pretrain/parallel/master_weights.py); true wraps it in FSDP2 anyway.
    wrap_single_rank: bool = False


@dataclass
class PrecisionConfig:
    # auto: bf16 on a GPU that has it, fp32 elsewhere.
    name: str = "auto"
    # FP8 matmuls in the blocks' linear layers (pretrain/float8.py): none, tensorwise or rowwise.
    # Needs bf16, torchao and an H100/H200-class GPU.
    float8: str = "none"
    # tensorwise only, where FSDP2 shards the model (not one process): FSDP2 all-gathers the converted
    # layers' weights in FP8, half of bf16's bytes, each cast from the fp32 shard with a scale that one
    # all-reduce after each optimizer step computes for every layer (torchao's FP8 all-gather). Numbers
    # as close to bf16 all-gathers as FP8 allows (the weight is rounded once, from fp32, not via bf16).
    # Off by default until measured on GPUs (bench/NOTES.md).
    float8_all_gather: bool = False
    # fp16 only: dynamic loss scaling.
    init_scale: float = 65536.0
    growth_interval: int = 1000


@dataclass
class MixSourceConfig:
    # A folder written by `python -m pretrain.data.prepare`.
    path: str = "???"
    # Relative share of the samples (the weights of a mixture need not add up to 1 or 100).
    weight: float = 1.0


@dataclass
class DataConfig:
    # A folder written by `python -m pretrain.data.prepare`; null means the built-in corpus.
    path: Optional[str] = None
    # Instead of path, a mixture: NAME -> {path, weight}, every source prepared with the same tokenizer,
    # sampled by weight; the validation loss is reported per source (eval_loss/NAME). See pretrain/data/mixture.py.
    mix: dict[str, MixSourceConfig] = field(default_factory=dict)
    # Random tokens instead of a dataset, for throughput benchmarks.
    synthetic: bool = False


@dataclass
class OptimConfig:
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    # null: fused AdamW where the device supports it.
    fused: Optional[bool] = None


@dataclass
class SamplingConfig:
    """How prompts are continued: by `python -m pretrain.generate` (its defaults) and train.sample_every."""

    max_new_tokens: int = 64
    # 0: greedy, the most likely token each time (deterministic).
    temperature: float = 0.8
    # Nucleus sampling: draw from the most likely tokens that together hold this much probability.
    top_p: float = 0.95
    seed: int = 0


@dataclass
class TrainConfig:
    steps: int = 200
    seq_len: int = 256
    # Global batch in sequences; global_batch_tokens, when set, takes precedence. With neither set,
    # the global batch follows the world size: world size x micro_batch (no gradient accumulation),
    # resolved by the launcher into the run's config.yaml.
    global_batch: Optional[int] = None
    global_batch_tokens: Optional[int] = None
    micro_batch: int = 16
    seed: int = 1234
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 4
    # 0: no checkpoints except when stopped early (benchmarks).
    ckpt_every: int = 100
    ckpt_keep: int = 2
    # End this job after this step (with a checkpoint) while keeping the schedule of `steps`:
    # for splitting one run over several allocations. Rerun the same run directory to continue.
    stop_at_step: Optional[int] = None
    # A step taking longer than this ends the job (a rank died or stalled); 0 disables the watchdog.
    hang_timeout_s: float = 900.0
    # Timeout of every collective (NCCL/gloo), also bounding the first step and checkpoint saves.
    collective_timeout_s: float = 1800.0
    # Write checkpoints in the background; training blocks only while the state is staged.
    async_checkpoint: bool = False
    # Stop after this many consecutive steps with a non-finite loss or gradient.
    max_bad_steps: int = 5
    # Accept starting again from step 0 in a run directory whose checkpoints are all damaged (they are
    # kept, set aside); without it such a run stops instead of silently losing its progress.
    start_from_scratch: bool = False
    # Every this many steps (0: never), continuations of sample_prompts go to the log, metrics.jsonl and W&B.
    sample_every: int = 0
    sample_prompts: list[str] = field(default_factory=lambda: ["The ", "In the ", "def "])
    sampling: SamplingConfig = field(default_factory=SamplingConfig)


@dataclass
class MetricsConfig:
    # Peak FLOP/s of one device for MFU; null looks it up from the GPU's name.
    peak_flops: Optional[float] = None


WANDB_MODES = ("online", "offline", "disabled")


@dataclass
class WandbConfig:
    # disabled: W&B is never imported. online: falls back to offline, with a notice, when there is
    # no API key or the server cannot be reached. offline: RUN/wandb/, uploaded by `pretrain.sync`.
    # There is deliberately no api_key here: the key reaches jobs only through the environment
    # (WANDB_API_KEY or ~/.netrc), never through a file a run writes.
    mode: str = "disabled"
    project: str = "pretrain"
    entity: Optional[str] = None
    # null: none for a single run; a sweep's runs are grouped under the sweep directory's name.
    group: Optional[str] = None
    # null: the run directory's name; a sweep point is named after the values it varies.
    name: Optional[str] = None
    tags: list[str] = field(default_factory=list)


@dataclass
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class LocalConfig:
    # Processes on this machine; null means one per visible GPU, or 1 without GPUs.
    nproc: Optional[int] = None


@dataclass
class ContainerConfig:
    # The .sif image built from singularity/pretrain.def, on a filesystem the nodes see; null runs the
    # tasks on the host.
    image: Optional[str] = None
    # apptainer, singularity, or auto (whichever the login node has).
    runtime: str = "auto"
    # Extra bind mounts, "SRC[:DST[:OPTS]]"; the run directory and data.path are bound already.
    binds: list[str] = field(default_factory=list)
    # Extra flags for `exec`, e.g. ["--writable-tmpfs"].
    options: list[str] = field(default_factory=list)


@dataclass
class ClusterConfig:
    name: str = "???"
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    nodes: int = 1
    gpus_per_node: int = 8
    cpus_per_task: int = 8
    mem_gb: Optional[int] = None
    time_min: int = 60 * 24
    constraint: Optional[str] = None
    exclude: Optional[str] = None
    max_requeues: int = 10
    signal_delay_s: int = 120
    # Memory of one GPU in GiB (nvidia-smi's MiB / 1024); null skips the launcher's memory check.
    gpu_mem_gb: Optional[float] = None
    # Whether the GPUs have FP8 matrix units (H100, H200: true; A100: false), for precision=fp8;
    # null: not known before the job starts, which then checks the GPU itself.
    gpu_fp8: Optional[bool] = None
    # srun's --gpu-bind: null keeps the cluster's default (Slurm gives each task the job's GPUs of its
    # node and each rank takes the one of its local rank); per_task:1 makes each task see one GPU;
    # none lets every task see the node's GPUs (the job's own are then found from SLURM_JOB_GPUS).
    gpu_bind: Optional[str] = None
    env: dict[str, str] = field(default_factory=dict)
    setup: list[str] = field(default_factory=list)
    # Present in every cluster file unless set to null (image null, or container null: on the host),
    # so `cluster.container.image=...` works on the command line for any cluster file.
    container: Optional[ContainerConfig] = field(default_factory=ContainerConfig)

    @property
    def uses_container(self) -> bool:
        return self.container is not None and self.container.image is not None


@dataclass
class PlanConfig:
    # Submit even when the memory estimate (python -m pretrain.plan) says the run will not fit.
    force: bool = False
    # Model FLOP utilisation assumed for the time estimate, in the causal accounting (pretrain/flops.py).
    mfu: float = 0.45


@dataclass
class PreflightConfig:
    # Check every device and the network at the start of each job, before training.
    enabled: bool = True
    # n of the n x n matrix product each rank checks and times (at least 64); null: 8192 on GPUs, 512 on CPUs.
    matmul_size: Optional[int] = None
    # Slowest acceptable matrix-product rate per device (TFLOP/s; bf16 on GPUs, fp32 on CPUs); null:
    # 40% of the GPU's peak (pretrain/flops.py), no floor on CPUs or unknown GPUs.
    min_tflops: Optional[float] = None
    # Size of the all-reduce bandwidth test in MiB; null: 256 on GPUs, 16 on CPUs.
    allreduce_mb: Optional[int] = None
    # Slowest acceptable all-reduce bus bandwidth (GB/s, as nccl-tests reports it); null: no floor.
    min_busbw_gbps: Optional[float] = None
    # Under Slurm: requeue the job with the failing nodes excluded (at most cluster.max_requeues times).
    exclude_and_requeue: bool = True


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    local: LocalConfig = field(default_factory=LocalConfig)
    cluster: Optional[ClusterConfig] = None
    plan: PlanConfig = field(default_factory=PlanConfig)
    preflight: PreflightConfig = field(default_factory=PreflightConfig)
    # With +cluster: print the sbatch script and submit nothing.
    dry_run: bool = False
    # With +cluster: write a standalone sbatch script to this path (for `sbatch` by hand) and submit nothing.
    write_sbatch: Optional[str] = None
    # Check and write the run directory, start nothing: for launchers of your own, e.g.
    # `torchrun --nproc-per-node N -m pretrain.train RUN_DIR` (with local.nproc=N for the world size).
    prepare_only: bool = False
    # Filled in by the launcher: where the run lives.
    run_dir: str = "???"


def sampling_problem(sampling: SamplingConfig) -> tuple[str, str] | None:
    """The first sampling setting that cannot work, as (field, what it must be), or None: for
    train.sampling and python -m pretrain.generate's options alike, which name the field their way."""
    if sampling.max_new_tokens < 1:
        return "max_new_tokens", "must be at least 1"
    if sampling.temperature < 0:
        return "temperature", "must be 0 (greedy) or more"
    if not 0 < sampling.top_p <= 1:
        return "top_p", "must be above 0 and at most 1 (1: every token)"
    return None


def flat_items(data: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) for every value of nested dicts/lists, e.g. ("cluster.setup[0]", "module load x")."""
    if isinstance(data, dict):
        for key, value in data.items():
            yield from flat_items(value, f"{path}.{key}" if path else str(key))
    elif isinstance(data, (list, tuple)):
        for index, item in enumerate(data):
            yield from flat_items(item, f"{path}[{index}]")
    else:
        yield path, data


def changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """`key: old -> new` for every setting that differs between two configs (as plain dicts)."""
    old, new = dict(flat_items(before)), dict(flat_items(after))
    return [f"{key}: {old.get(key, '(unset)')} -> {new.get(key, '(unset)')}"
            for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)]


def register() -> None:
    """Make the schema known to Hydra; conf/config.yaml lists `base_config` first in its defaults."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(name="base_config", node=Config)


def from_container(data: Any) -> Config:
    """A typed Config from a dict or DictConfig (e.g. a run's saved config.yaml)."""
    from omegaconf import OmegaConf

    merged = OmegaConf.merge(OmegaConf.structured(Config), data)
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def global_batch_is_set(train: TrainConfig) -> bool:
    return train.global_batch is not None or train.global_batch_tokens is not None


def global_batch(train: TrainConfig, world_size: int) -> int:
    """The global batch in sequences: global_batch_tokens, else global_batch, else one micro-batch per rank."""
    if train.global_batch_tokens is not None:
        return train.global_batch_tokens // train.seq_len
    if train.global_batch is not None:
        return train.global_batch
    return world_size * train.micro_batch


def grad_accum_steps(train: TrainConfig, world_size: int) -> int:
    return global_batch(train, world_size) // (world_size * train.micro_batch)


def mesh_shape(strategy: str, world_size: int, shard_size: int) -> tuple[int, ...]:
    """The device-mesh shape of a sharding strategy; shard_size only matters for hybrid_shard.
    The last dimension is the one parameters are sharded over."""
    if strategy in ("full_shard", "shard_grad_op"):
        return (world_size,)
    if strategy == "hybrid_shard":
        return (world_size // shard_size, shard_size)
    if strategy == "no_shard":
        return (world_size, 1)
    raise ValueError(f"unknown sharding strategy {strategy!r}")


def shard_degree(fsdp: FSDPConfig, world_size: int, ranks_per_node: int) -> int:
    """Ranks each parameter is split over."""
    return mesh_shape(fsdp.strategy, world_size, fsdp.shard_size or ranks_per_node)[-1]


def unwrapped(fsdp: FSDPConfig, world_size: int) -> bool:
    """Whether the model trains without FSDP: one process, unless fsdp.wrap_single_rank."""
    return world_size == 1 and not fsdp.wrap_single_rank


def resolved_precision(name: str, cuda: bool, bf16_supported: bool = True) -> str:
    """precision=auto as a run resolves it: bf16 on a GPU that has it, fp32 elsewhere."""
    if name != "auto":
        return name
    return "bf16" if cuda and bf16_supported else "fp32"


def uses_fused_adamw(optim: OptimConfig, cuda: bool) -> bool:
    """Fused AdamW (no full-size temporaries) where optim.fused says so, or by default on GPUs: on CPUs
    it is not there on every torch, nor for DTensor parameters, so foreach AdamW runs there."""
    return cuda if optim.fused is None else optim.fused
