"""Time RoPE at the 1B shape: the queries and keys of one micro-batch rotated, forward and backward.

    python bench/rope.py [--out bench/results] [--name rope] [--sweep]

Queries [8, 4096, 16, 128] and keys [8, 4096, 8, 128] (bf16), as one block of the 1B row rotates them, go through
two ways, each timed by the GPU time of the kernels it runs (torch.profiler, CUDA activity only: the host's
dispatch of a few small kernels would otherwise be timed too), over --repeats calls, forward alone and forward
with backward:
- compiled: `rope.rotate`'s tensor operations under torch.compile (the package before attempt 51);
- kernel: the Triton kernel's operator, `rope.rope_rotation` (forward, and the inverse rotation in backward).
Both compute the same rotation; the difference is how the kernels load each pair. --sweep also times the kernel at
other (elements a program, warps) besides the package's (rope.ELEMENTS, rope.NUM_WARPS).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from pretrain.models import rope  # noqa: E402

# (ELEMENTS, NUM_WARPS)
SWEEP = [(1024, 2), (2048, 4), (4096, 8), (8192, 4), (8192, 8), (16384, 8), (16384, 16)]
BATCH, SEQ = 8, 4096


def device_ms(fn, repeats: int) -> float:
    """GPU time of the kernels one call of fn runs, on average over `repeats` calls (ms)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    return sum(common.kernel_times(prof).values()) / repeats


def block_inputs(cfg) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """One block's projections as leaves ([batch, seq, heads * head_dim]), their upstream gradients, the rotations."""
    head_dim = cfg.dim // cfg.n_heads
    leaves, grads = [], []
    for heads in (cfg.n_heads, cfg.kv_heads):
        leaves.append(torch.randn(BATCH, SEQ, heads * head_dim, device="cuda", dtype=torch.bfloat16,
                                  requires_grad=True))
        grads.append(torch.randn(BATCH, SEQ, heads, head_dim, device="cuda", dtype=torch.bfloat16))
    freqs = rope.rope_frequencies(head_dim, cfg.max_seq_len, cfg.rope_theta, torch.device("cuda"))[:SEQ]
    return leaves, grads, freqs


def ways(cfg, leaves, grads, freqs) -> dict[str, object]:
    """Each way's forward, and forward with backward, as functions of nothing."""
    head_dim = cfg.dim // cfg.n_heads
    compiled = torch.compile(rope.rotate, fullgraph=True)
    kernel = lambda x, f: rope.rope_rotation(x, f, False)  # noqa: E731
    out = {}
    for name, fn in (("compiled", compiled), ("kernel", kernel)):
        def forward(fn=fn):
            with torch.no_grad():
                for leaf in leaves:
                    fn(leaf.view(BATCH, SEQ, -1, head_dim), freqs)

        def both(fn=fn):
            for leaf, grad in zip(leaves, grads):
                leaf.grad = None
                fn(leaf.view(BATCH, SEQ, -1, head_dim), freqs).backward(grad)

        out[f"{name} forward"], out[f"{name} forward+backward"] = forward, both
    return out


def main() -> int:
    args = common.kernel_benchmark_args(__doc__, "rope")
    cfg = common.shape_1b()
    leaves, grads, freqs = block_inputs(cfg)
    chosen = (rope.ELEMENTS, rope.NUM_WARPS)
    kernel_ms: dict[str, float] = {}
    for elements, warps in common.kernel_configs(chosen, args.sweep, SWEEP):
        rope.ELEMENTS, rope.NUM_WARPS = elements, warps
        suffix = "" if (elements, warps) == chosen else f" {elements}/{warps}"
        for label, fn in ways(cfg, leaves, grads, freqs).items():
            if suffix and label.startswith("compiled"):
                continue
            for _ in range(3):
                fn()
            kernel_ms[label + suffix] = device_ms(fn, args.repeats)
    rope.ELEMENTS, rope.NUM_WARPS = chosen
    moved = sum(leaf.numel() for leaf in leaves) * 2 * 2  # bf16, read once and written once
    result = {**common.stamp(), "batch": BATCH, "seq": SEQ, "heads": [cfg.n_heads, cfg.kv_heads],
              "head_dim": cfg.dim // cfg.n_heads, "repeats": args.repeats, "chosen": list(chosen),
              "bytes_each_way": moved, "kernel_ms": kernel_ms}
    rows = ["| way | kernels' ms a call | GB/s (q and k read and written once a direction) |", "|---|---|---|"]
    for label, ms in kernel_ms.items():
        directions = 2 if "backward" in label else 1
        rows.append(f"| {label} | {ms:.3f} | {directions * moved / ms / 1e6:,.0f} |")
    saved = kernel_ms["compiled forward+backward"] - kernel_ms["kernel forward+backward"]
    rows.append(f"\nOne block, queries and keys, forward and backward: compiled {kernel_ms['compiled forward+backward']:.3f} "
                f"ms, kernel {kernel_ms['kernel forward+backward']:.3f} ms; {cfg.n_layers} blocks: {saved * cfg.n_layers:+.2f} "
                "ms a micro-batch saved")
    common.write_result(args.out, args.name, result, "\n".join(rows))
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
