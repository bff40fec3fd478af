"""Time what follows backward in a one-process step of the 1B shape: clipping, AdamW and the compute copy's refresh.

    python bench/optimizer_step.py [--out bench/results] [--name optimizer_step]

The model's parameters as fp32 master weights on the GPU (1.53B for the 1B shape), a bf16 copy of each, random
gradients and AdamW state, then two ways, alternated, each timed with CUDA events around the whole of it
(median of --repeats):
- torch: clip_grad_norm_ (the norm and a multiply of every gradient), fused AdamW, `_foreach_copy_` into the copy;
- master_adamw: the norm, then MasterAdamW (pretrain/parallel/master_adamw.py): clip, update and copy in one pass,
  reading fp32 gradients from the master weights (several micro-batches a step, accumulated there);
- master_adamw_bf16_grads: the same reading the copy's bf16 gradients (one micro-batch a step). Backward's cast
  of each gradient to fp32 (6 bytes a parameter), which the other two ways need, is not in these times.
The bytes each way moves per parameter (42, 30 and 28, plus 4 or 2 for the norm) give its achieved bandwidth.
--sweep also times MasterAdamW's kernel at other block sizes and warps (pretrain/parallel/master_adamw.py's
BLOCK and NUM_WARPS are the choice).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from pretrain import flops  # noqa: E402
from pretrain.config import OptimConfig  # noqa: E402
from pretrain.models.llama import Transformer  # noqa: E402
from pretrain.parallel import master_adamw  # noqa: E402
from pretrain.parallel.master_weights import MasterWeights  # noqa: E402
from pretrain.trainer.optim import build_optimizer, clip_gradients, refreshes_copy  # noqa: E402

# Bytes per parameter: clip's multiply (read + write fp32), fused AdamW (weight, gradient, moments read; weight
# and moments written), the refresh (fp32 read, bf16 written); MasterAdamW reads four fp32 and writes three
# and a bf16. Both first read every gradient for the norm.
BYTES = {"torch": 4 + 8 + 28 + 6, "master_adamw": 4 + 30, "master_adamw_bf16_grads": 2 + 28}
SWEEP = [(1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 8), (4096, 16)]


def setup(way: str) -> tuple[MasterWeights, torch.optim.Optimizer]:
    """The 1B shape's master weights and copy on the GPU, gradients, and the optimizer of `way` after one step."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Transformer(common.shape_1b())
    master = MasterWeights(model, torch.bfloat16)
    master.track_gradients()
    in_copy = way == "master_adamw_bf16_grads"
    optimizer = build_optimizer(model, OptimConfig(), torch.device("cuda"), None if way == "torch" else master,
                                micro_batches=1 if in_copy else 2)
    assert refreshes_copy(optimizer) == (way != "torch")
    for p, copy in master.copies().items():
        grad = torch.randn_like(p) * 1e-3
        if in_copy:
            copy.grad = grad.to(copy.dtype)
        else:
            p.grad = grad
    run(master, optimizer)
    return master, optimizer


def run(master: MasterWeights, optimizer: torch.optim.Optimizer) -> None:
    params = list(master.master.parameters())
    clip_gradients(optimizer, params, max_norm=1.0)  # the random gradients' norm is about 39: every step clips
    optimizer.step()
    if not refreshes_copy(optimizer):
        master.refresh()


def time_ms(master: MasterWeights, optimizer: torch.optim.Optimizer) -> tuple[float, float]:
    """Milliseconds on the GPU, and on the host to launch it all (more than the GPU's: launch-bound)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    host = time.perf_counter()
    run(master, optimizer)
    host = time.perf_counter() - host
    end.record()
    end.synchronize()
    return start.elapsed_time(end), host * 1e3


def timings(way: str, repeats: int, configs: list[tuple[int, int]], host: dict[str, float]) -> dict[str, list[float]]:
    """CUDA-event times of `way`'s steps, under each (BLOCK, NUM_WARPS) of `configs` for master_adamw; the
    median host time of each into `host`."""
    master, optimizer = setup(way)
    times = {}
    for block, warps in configs if way.startswith("master_adamw") else [(None, None)]:
        label = way if block is None else f"{way} {block}/{warps}"
        if block is not None:
            master_adamw.BLOCK, master_adamw.NUM_WARPS = block, warps
        for _ in range(3):
            time_ms(master, optimizer)
        pairs = [time_ms(master, optimizer) for _ in range(repeats)]
        times[label] = [gpu for gpu, _ in pairs]
        host[label] = statistics.median(h for _, h in pairs)
        print(label, f"{statistics.median(times[label]):.2f} ms, host {host[label]:.2f} ms", flush=True)
    del master, optimizer
    torch.cuda.empty_cache()
    return times


def main() -> int:
    args = common.kernel_benchmark_args(__doc__, "optimizer_step")
    chosen = (master_adamw.BLOCK, master_adamw.NUM_WARPS)
    configs = common.kernel_configs(chosen, args.sweep, SWEEP)
    times: dict[str, list[float]] = {}
    host: dict[str, float] = {}
    for way in BYTES:  # one at a time: both would not fit beside each other on an 80 GB card
        times.update(timings(way, args.repeats, configs, host))
    params = flops.parameter_count(common.shape_1b())
    medians = {label: statistics.median(t) for label, t in times.items()}
    result = {**common.stamp(), "parameters": params, "repeats": args.repeats, "chosen": list(chosen), "ms": times,
              "median_ms": medians, "host_median_ms": host}
    rows = ["| way (block/warps) | bytes / parameter | median ms | min-max ms | GB/s | host ms to launch |",
            "|---|---|---|---|---|---|"]
    for label, t in times.items():
        nbytes = BYTES[label.split()[0]]
        rows.append(f"| {label} | {nbytes} | {medians[label]:.2f} | {min(t):.2f}-{max(t):.2f} | "
                    f"{nbytes * params / medians[label] / 1e6:,.0f} | {host[label]:.2f} |")
    at = f"{chosen[0]}/{chosen[1]}"
    rows.append(f"\n{params:,} parameters; at the package's {at}, torch / master_adamw: "
                f"{medians['torch'] / medians['master_adamw ' + at]:.2f}x, master_adamw / master_adamw_bf16_grads: "
                f"{medians['master_adamw ' + at] / medians['master_adamw_bf16_grads ' + at]:.2f}x")
    common.write_result(args.out, args.name, result, "\n".join(rows))
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
