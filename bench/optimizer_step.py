"""Time what follows backward in a one-process step of the 1B shape: clipping, AdamW and the compute copy's refresh.

    python bench/optimizer_step.py [--out bench/results] [--name optimizer_step]

The model's parameters as fp32 master weights on the GPU (1.53B for the 1B shape), a bf16 copy of each, random
gradients and AdamW state, then two ways, alternated, each timed with CUDA events around the whole of it
(median of --repeats):
- torch: clip_grad_norm_ (the norm and a multiply of every gradient), fused AdamW, `_foreach_copy_` into the copy;
- master_adamw: the norm, then MasterAdamW (pretrain/parallel/master_adamw.py): clip, update and copy in one pass.
The bytes each way moves per parameter (42 and 30, plus 4 for the norm) give its achieved bandwidth.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from pretrain.config import ModelConfig, OptimConfig  # noqa: E402
from pretrain.models.llama import Transformer  # noqa: E402
from pretrain.parallel.master_weights import MasterWeights  # noqa: E402
from pretrain.trainer.optim import build_optimizer, clip_gradients, refreshes_copy  # noqa: E402

# Bytes per parameter: clip's multiply (read + write fp32), fused AdamW (weight, gradient, moments read; weight
# and moments written), the refresh (fp32 read, bf16 written); MasterAdamW reads four fp32 and writes three
# and a bf16. Both first read every gradient for the norm.
BYTES = {"torch": 4 + 8 + 28 + 6, "master_adamw": 4 + 30}


def setup(way: str) -> tuple[MasterWeights, torch.optim.Optimizer]:
    """The 1B shape's master weights and copy on the GPU, gradients, and the optimizer of `way` after one step."""
    torch.manual_seed(0)
    shape = yaml.safe_load((common.REPO / "conf" / "model" / "llama-1b.yaml").read_text())
    with torch.device("cuda"):
        model = Transformer(ModelConfig(**shape))
    master = MasterWeights(model, torch.bfloat16)
    master.track_gradients()
    optimizer = build_optimizer(model, OptimConfig(), torch.device("cuda"), master if way == "master_adamw" else None)
    assert refreshes_copy(optimizer) == (way == "master_adamw")
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    run(master, optimizer)
    return master, optimizer


def run(master: MasterWeights, optimizer: torch.optim.Optimizer) -> None:
    params = [p for p in master.master.parameters() if p.grad is not None]
    clip_gradients(optimizer, params, max_norm=1.0)  # the random gradients' norm is about 39: every step clips
    optimizer.step()
    if not refreshes_copy(optimizer):
        master.refresh()


def time_ms(master: MasterWeights, optimizer: torch.optim.Optimizer) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run(master, optimizer)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=common.RESULTS)
    parser.add_argument("--name", default="optimizer_step")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    times: dict[str, list[float]] = {way: [] for way in BYTES}
    counts = {}
    for way in BYTES:  # one at a time: both would not fit beside each other on an 80 GB card
        master, optimizer = setup(way)
        counts[way] = sum(p.numel() for p in master.master.parameters())
        for _ in range(3):
            time_ms(master, optimizer)
        times[way] = [time_ms(master, optimizer) for _ in range(args.repeats)]
        del master, optimizer
        torch.cuda.empty_cache()
    params = counts["torch"]
    result = {**common.stamp(), "parameters": params, "repeats": args.repeats, "ms": times,
              "median_ms": {way: statistics.median(t) for way, t in times.items()}}
    rows = ["| way | bytes / parameter | median ms | min-max ms | GB/s |", "|---|---|---|---|---|"]
    for way, t in times.items():
        median = statistics.median(t)
        rows.append(f"| {way} | {BYTES[way]} | {median:.2f} | {min(t):.2f}-{max(t):.2f} | "
                    f"{BYTES[way] * params / median / 1e6:,.0f} |")
    rows.append(f"\n{params:,} parameters; torch / master_adamw: "
                f"{result['median_ms']['torch'] / result['median_ms']['master_adamw']:.2f}x")
    common.write_result(args.out, args.name, result, "\n".join(rows))
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
