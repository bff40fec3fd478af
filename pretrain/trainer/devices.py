"""What this machine's torch sees, for the local launcher: `python -m pretrain.trainer.devices [RECIPE]`.

The launcher imports no torch (it starts in a fraction of a second on a login node), so before a
local run it asks this module, in a process of its own, what the trainer will find: the GPUs
(count, name, memory, bf16, compute capability), whether gloo can all-reduce the gradients of a
2-D mesh on CPUs with this torch, and whether FP8 matmuls (precision.float8=RECIPE) can run here.
It prints one JSON object.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from pretrain.parallel import compat, float8


def describe(float8_recipe: str = "none") -> dict[str, Any]:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    found: dict[str, Any] = {"gpus": gpus, "torch": torch.__version__, "cpu_all_reduce": compat.CPU_ALL_REDUCE,
                             "gpu_name": None, "gpu_memory_gib": None, "bf16": False, "float8_problem": None}
    if gpus:
        props = torch.cuda.get_device_properties(0)
        found.update(gpu_name=props.name, gpu_memory_gib=props.total_memory / 2**30,
                     bf16=torch.cuda.is_bf16_supported())
    device = torch.device("cuda", 0) if gpus else torch.device("cpu")
    try:
        float8.check_available(float8_recipe, device)
    except float8.Float8Unavailable as problem:
        found["float8_problem"] = str(problem)
    return found


if __name__ == "__main__":
    print(json.dumps(describe(*sys.argv[1:2])))
