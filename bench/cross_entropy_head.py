"""Time the model's head at the 1B shape: final norm, output layer and loss, forward and backward.

    python bench/cross_entropy_head.py [--out bench/results] [--name cross_entropy_head] [--sweep]

Hidden states of one micro-batch of the 1B row (8 x 4096 tokens, dim 2048, a 128,256 vocabulary, bf16) go
through two heads, alternated, each timed with CUDA events from the norm's forward to the end of backward
(median of --repeats):
- logits: the norm eager, nn.Linear's logits kept for backward, a compiled cross_entropy on them (the package
  before attempt 49);
- fused: the norm compiled, the output layer's Triton kernel writing the logits' gradient over them in forward
  (pretrain/models/linear_cross_entropy.py).
Both compute the same loss and gradients; the difference is the memory traffic around the logits. --sweep also
times the kernel alone at other block sizes and warps (linear_cross_entropy's BLOCK and NUM_WARPS are the choice).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from pretrain.config import ModelConfig  # noqa: E402
from pretrain.models import linear_cross_entropy as lce  # noqa: E402
from pretrain.models.llama import OutputLayer, RMSNorm  # noqa: E402

# (BLOCK, NUM_WARPS)
SWEEP = [(2048, 4), (2048, 8), (4096, 8), (8192, 16), (8192, 32), (16384, 16), (16384, 32)]
TOKENS = 8 * 4096


def heads(cfg: ModelConfig):
    """The two heads as functions of (hidden, targets) that run forward and backward."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        norm, output = RMSNorm(cfg.dim, cfg.norm_eps).bfloat16(), OutputLayer(cfg.dim, cfg.vocab_size).bfloat16()
    compiled_loss = torch.compile(lce.cross_entropy)
    compiled_norm = torch.compile(norm, fullgraph=True)

    def logits_head(hidden, targets):
        logits = F.linear(norm(hidden), output.weight)
        compiled_loss(logits.unsqueeze(0), targets.unsqueeze(0)).backward()

    def fused_head(hidden, targets):
        output(compiled_norm(hidden), targets).backward()

    return {"logits": logits_head, "fused": fused_head}, (norm, output)


def time_ms(fn, *args) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(*args)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def head_times(cfg: ModelConfig, repeats: int) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Each head's times, alternated, and its peak memory beyond the inputs (GiB)."""
    ways, modules = heads(cfg)
    hidden = torch.randn(TOKENS, cfg.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, cfg.vocab_size, (TOKENS,), device="cuda")
    for fn in ways.values():
        for _ in range(3):
            fn(hidden, targets)
    peak = {}
    for name, fn in ways.items():
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn(hidden, targets)
        peak[name] = (torch.cuda.max_memory_allocated() - base) / 2**30
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(repeats):
        for name, fn in ways.items():
            hidden.grad = None
            for module in modules:
                module.zero_grad(set_to_none=True)
            times[name].append(time_ms(fn, hidden, targets))
    return times, peak


def kernel_times(cfg: ModelConfig, repeats: int, configs: list[tuple[int, int]]) -> dict[str, list[float]]:
    """The kernel alone on a logits buffer, writing the gradient, under each (BLOCK, NUM_WARPS)."""
    logits = torch.randn(TOKENS, cfg.vocab_size, device="cuda", dtype=torch.bfloat16)
    targets = torch.randint(0, cfg.vocab_size, (TOKENS,), device="cuda")
    times = {}
    for block, warps in configs:
        lce.BLOCK, lce.NUM_WARPS = block, warps
        for _ in range(2):
            lce.losses_and_gradient(logits, targets, write_grad=True)
        times[f"kernel {block}/{warps}"] = [time_ms(lce.losses_and_gradient, logits, targets, True)
                                            for _ in range(repeats)]
    return times


def main() -> int:
    args = common.kernel_benchmark_args(__doc__, "cross_entropy_head")
    cfg = common.shape_1b()
    chosen = (lce.BLOCK, lce.NUM_WARPS)
    times, peak = head_times(cfg, args.repeats)
    times.update(kernel_times(cfg, args.repeats, common.kernel_configs(chosen, args.sweep, SWEEP)))
    lce.BLOCK, lce.NUM_WARPS = chosen
    medians = {label: statistics.median(t) for label, t in times.items()}
    logits_bytes = TOKENS * cfg.vocab_size * 2
    result = {**common.stamp(), "tokens": TOKENS, "dim": cfg.dim, "vocab": cfg.vocab_size, "repeats": args.repeats,
              "chosen": list(chosen), "ms": times, "median_ms": medians, "peak_gib_beyond_inputs": peak}
    rows = ["| way | median ms | min-max ms | note |", "|---|---|---|---|"]
    for label, t in times.items():
        note = (f"peak {peak[label]:.1f} GiB beyond the inputs" if label in peak else
                f"{2 * logits_bytes / medians[label] / 1e6:,.0f} GB/s counting one read and one write of the logits")
        rows.append(f"| {label} | {medians[label]:.2f} | {min(t):.2f}-{max(t):.2f} | {note} |")
    rows.append(f"\n{TOKENS:,} tokens x {cfg.vocab_size:,} logits (bf16, {logits_bytes / 1e9:.1f} GB); head, forward "
                f"and backward: logits {medians['logits']:.2f} ms, fused {medians['fused']:.2f} ms "
                f"({medians['logits'] - medians['fused']:+.2f} ms a micro-batch)")
    common.write_result(args.out, args.name, result, "\n".join(rows))
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
