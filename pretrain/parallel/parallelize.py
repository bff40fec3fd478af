"""Apply FP8 matmuls, FSDP2, activation checkpointing and torch.compile to a built model.

The model knows nothing of this; the training loop calls `build_mesh` and `parallelize`.
Sharding strategies map onto FSDP2 (`fully_shard`) as follows:
  full_shard     1-D mesh over all ranks, parameters resharded after forward
  shard_grad_op  1-D mesh, parameters kept gathered between forward and backward
  hybrid_shard   2-D mesh (replicate, shard): replicate across groups, shard within one
  no_shard       2-D mesh (world, 1): every rank holds everything, gradients all-reduced
One process (any strategy) trains without FSDP unless fsdp.wrap_single_rank says otherwise
(pretrain.parallel.master_weights: the same numerics, without FSDP2's copies).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import os
import threading
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pretrain.config import ConfigError, FSDPConfig, mesh_shape, unwrapped
from pretrain.parallel import float8
from pretrain.parallel.compat import prefetch_triton_key, reduce_gloo_gradients_by_sum
from pretrain.parallel.master_weights import MasterWeights

from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


def build_mesh(cfg: FSDPConfig, device: torch.device, world_size: int, local_world_size: int) -> DeviceMesh:
    shape = mesh_shape(cfg.strategy, world_size, cfg.shard_size or local_world_size)
    names = ("dp_shard",) if len(shape) == 1 else ("dp_replicate", "dp_shard")
    return init_device_mesh(device.type, shape, mesh_dim_names=names)


def mixed_precision(param_dtype: torch.dtype) -> MixedPrecisionPolicy:
    """Compute in param_dtype; master weights and gradient reduction stay fp32.

    Forward inputs are not cast: the activations already come in param_dtype from the layer before,
    and the other floating input of each block is RoPE's table, which the model keeps in fp32 (cast
    to bf16, positions near 4096 rotated with errors of about 2^-9)."""
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Wrap each transformer block: 'full' recomputes everything, 'selective' keeps matmul outputs."""
    if mode == "none":
        return
    if mode not in ("selective", "full"):
        raise ConfigError(f"fsdp.activation_checkpointing={mode!r} in the run's config.yaml: the launcher writes "
                          "none, selective or full there (it resolves auto); prepare the run directory with "
                          "python -m pretrain.launch")
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    wrap = partial(checkpoint_wrapper, preserve_rng_state=False)
    if mode == "selective":
        wrap = partial(wrap, context_fn=_save_matmuls_policy)
    for index, block in enumerate(model.layers):
        model.layers[index] = wrap(block)


def _save_matmuls_policy():
    """Selective checkpointing: save matmul and attention outputs, recompute the cheap pointwise ops."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved = {torch.ops.aten.mm.default, torch.ops.aten._scaled_mm.default,
             torch.ops.aten._scaled_dot_product_flash_attention.default,
             torch.ops.aten._scaled_dot_product_efficient_attention.default,
             torch.ops.aten._scaled_dot_product_cudnn_attention.default}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


# AOT autograd's cache keeps no graph whose checkpointing policy it cannot name (a Python function), so a
# requeued job traced every block's joint graph again (1.5-2 s of its first step on an H100). Torch
# versions that read this attribute (2.13; not 2.7) cache such graphs under it: a hash of the policy's
# source, so that an edited policy never loads graphs made under the old one.
_save_matmuls_policy.cache_hash = hashlib.sha256(inspect.getsource(_save_matmuls_policy).encode()).hexdigest()


# What the first torch.compile call imports: Dynamo, then Inductor's compiler (about 600 modules).
COMPILER_MODULES = ("torch._dynamo", "torch._inductor.compile_fx")


def import_compiler_ahead() -> Callable[[], None]:
    """Import torch.compile's modules (1.5 s of Python on the 2-core CPU machine) in a background thread; returns what
    waits for it. Started before the process group and the preflight, whose waits on the network and the
    GPU release the interpreter lock, the import overlaps them instead of opening `apply_compile`. Waited
    for before the model is built, so no import of the main thread runs beside it after that. Start it
    once the compile caches' folder is set (persist_compile_cache): importing Dynamo (torch 2.13) fixes
    the folder of its own cache. An import that fails here fails again, with its error, where the main
    thread compiles."""
    def import_all() -> None:
        for name in COMPILER_MODULES:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - raised again, and reported, by the main thread's own import
                return

    thread = threading.Thread(target=import_all, name="compiler-imports", daemon=True)
    thread.start()
    return thread.join


def apply_compile(model: nn.Module) -> None:
    """Compile each block in place (`Module.compile`: names and state-dict keys stay as they are), as
    one graph (fullgraph=True: a block that would break into pieces fails at its first step instead
    of running slowly). Blocks separately: FSDP2's hooks stay between blocks, and blocks share one
    compiled graph. The final norm too (eager, its float32 steps are half a dozen passes over the
    hidden states each way), and the loss of the logits where the output layer's kernel does not
    compute it (pretrain.models.linear_cross_entropy). Compiling imports Triton, whose install
    Inductor hashes for its cache key: that hash starts now, beside the rest of the start-up, not
    inside the first step."""
    for block in model.layers:
        block.compile(fullgraph=True)
    model.norm.compile(fullgraph=True)
    model.output.logits_loss = torch.compile(model.output.logits_loss)
    prefetch_triton_key()


def persist_compile_cache(folder: Path) -> Path:
    """Keep torch.compile's caches (Inductor's graphs and kernels, Triton's binaries) in `folder`.

    Inductor's default is /tmp, which a requeued job on another node does not have, so every restart
    compiled everything again. TORCHINDUCTOR_CACHE_DIR is set, not defaulted: Inductor writes it into
    the environment of any process that has compiled, so an inherited value says nothing of the user's
    wish (fsdp.compile_cache does). Every rank may share the folder (Inductor writes atomically)."""
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    return folder


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, strategy: str, param_dtype: torch.dtype) -> None:
    """fully_shard per block, the input embedding and the output layer, and at the root.

    The embedding and output layers (a third of the 1B model's parameters with a 128k vocabulary)
    get units of their own, as torchtitan does: the output layer's gradient reduction then
    overlaps the blocks' backward instead of waiting, with the embedding's, for the root's.
    Tied weights are one parameter and must stay in one unit: the root's.
    Unsharded (one rank per shard), resharding after forward would only free the compute-dtype
    copies to cast them again in backward: it is off there.
    """
    reshard = strategy != "shard_grad_op" and mesh.size(mesh.ndim - 1) > 1  # the last dimension shards
    policy = mixed_precision(param_dtype)
    shard = partial(fully_shard, mesh=mesh, mp_policy=policy)
    if not model.cfg.tie_embeddings:
        shard(model.tok_embeddings, reshard_after_forward=reshard)
    last = len(model.layers) - 1
    for index, block in enumerate(model.layers):
        # The last block's parameters are needed again at once by backward: keep them.
        shard(block, reshard_after_forward=reshard and index < last)
    if not model.cfg.tie_embeddings:
        # Backward starts here: resharding would all-gather it again at once.
        shard(model.output, reshard_after_forward=False)
    shard(model, reshard_after_forward=False)
    if mesh.device_type == "cpu":
        reduce_gloo_gradients_by_sum(model)


def sync_gradients(model: nn.Module, mesh: DeviceMesh, last_micro_batch: bool) -> None:
    """Set what the coming micro-batch of a gradient accumulation reduces.

    Every micro-batch reduce-scatters, so accumulated gradients stay sharded: 4P/D bytes, where
    skipping that reduction would hold them whole (4P: 32 GB for the 8B shape, 280 GB for the
    70B) for one reduce-scatter per micro-batch, which overlaps backward. Across the replicate
    dimension of a 2-D mesh (hybrid_shard between nodes, no_shard) gradients are all-reduced
    only after the last micro-batch.
    """
    if mesh.ndim == 2 and isinstance(model, FSDPModule):
        model.set_requires_all_reduce(last_micro_batch)


@dataclass
class Parallelized:
    """A model ready to train. `model` runs forward and backward; `weights` holds the parameters the
    optimizer updates, checkpoints keep, and clipping and finite checks read. Under FSDP2, and unwrapped
    in the weights' own dtype, the two are one module; unwrapped in a lower precision, `weights` is the
    fp32 master model and `model` its compute copy (`master`)."""

    model: nn.Module
    weights: nn.Module
    master: MasterWeights | None = None
    float8_all_gather: bool = False

    def weights_changed(self) -> None:
        """Call after the weights were loaded, or an optimizer that leaves the compute copy alone stepped
        (pretrain.trainer.optim.refreshes_copy): the compute copy, or the FP8 all-gathers' scales, follow."""
        if self.master is not None:
            self.master.refresh()
        if self.float8_all_gather:
            float8.precompute_scales(self.model)


def parallelize(model: nn.Module, cfg: FSDPConfig, mesh: DeviceMesh, param_dtype: torch.dtype,
                float8_recipe: str = "none", float8_all_gather: bool = False) -> Parallelized:
    """In this order: FP8 layers replace nn.Linear before anything wraps them; activation
    checkpointing wraps blocks before compile traces them; FSDP2 shards what compile produced.
    Unwrapped (one process) in a precision below the weights', all of that applies to the compute copy,
    and there is no all-gather to make FP8 (`float8_all_gather` applies only where FSDP2 wraps)."""
    weights, master = model, None
    one_process = unwrapped(cfg, mesh.size())
    if one_process and param_dtype != next(model.parameters()).dtype:
        master = MasterWeights(model, param_dtype)
        model = master.compute
    float8_all_gather = float8_all_gather and not one_process and float8_recipe != "none"
    float8.convert(model, float8_recipe, all_gather=float8_all_gather)
    apply_activation_checkpointing(model, cfg.activation_checkpointing)
    if cfg.compile:
        apply_compile(model)
    if master is not None:
        master.track_gradients()
    elif not one_process:
        apply_fsdp(model, mesh, cfg.strategy, param_dtype)
    return Parallelized(model, weights, master, float8_all_gather)
