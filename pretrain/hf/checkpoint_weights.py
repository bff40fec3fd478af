"""The model weights of a DCP checkpoint, read on the CPU in one process with no process group,
whatever world size wrote it: DCP puts every tensor together from the shards of all ranks.

Only the tensors asked for are read (an export reads one output shard at a time), so the memory
needed stays bounded whatever the model's size, and the optimizer state in the same files is never read.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Iterable

import torch
import torch.distributed.checkpoint as dcp

from pretrain.trainer.checkpoint import MODEL_STATE

PREFIX = MODEL_STATE + "."


class CheckpointWeights:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        metadata = dcp.FileSystemReader(str(self.path)).read_metadata().state_dict_metadata
        self.stored = {key[len(PREFIX):]: item for key, item in metadata.items() if key.startswith(PREFIX)}

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.stored[name].size)

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The named tensors (our parameter names), whole, in the dtype they were saved in."""
        state = {PREFIX + name: torch.empty(self.shape(name), dtype=self.stored[name].properties.dtype)
                 for name in names}
        with warnings.catch_warnings():
            # No process group is what we mean: DCP says it assumes so, once per call.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(self.path))
        return {key[len(PREFIX):]: tensor for key, tensor in state.items()}
