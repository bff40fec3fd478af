"""Hugging Face safetensors weights into our model, each rank reading only the rows of its own shards.

The source is first checked against the model (pretrain.hf_format.check_source names the first
config field or tensor that differs). Then each parameter's local part (its rows of FSDP2's dim-0
shards, or the whole tensor when unsharded) is sliced out of the memory-mapped files and copied in:
no rank ever holds a full copy of the model, only its own shards and one tensor's rows at a time.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import torch
from torch import nn

from pretrain import hf_format
from pretrain.config import ModelConfig
from pretrain.hf.layout import our_rows
from pretrain.parallel.compat import local_rows


@torch.no_grad()
def load(model: nn.Module, cfg: ModelConfig, source: Path) -> None:
    """Copy the weights of `source` (a Hugging Face Llama folder or a .safetensors file) into `model`'s
    parameters, sharded (FSDP2) or not; ConfigError (before any copy) if they do not fit the model."""
    from safetensors import safe_open

    stored = hf_format.check_source(cfg, source)
    state = model.state_dict()  # sharing the parameters' storage (DTensors under FSDP2)
    head_dim = cfg.dim // cfg.n_heads
    with ExitStack() as files:
        opened = {file: files.enter_context(safe_open(str(file), framework="pt"))
                  for file in sorted({tensor.file for tensor in stored.values()})}
        for name, tensor in stored.items():
            whole = opened[tensor.file].get_slice(hf_format.hf_name(name))
            local, rows = local_rows(state[name])
            local.copy_(our_rows(name, lambda start, stop: whole[start:stop], rows, head_dim))
