"""Time every matrix product of a training step alone, at the model's shapes, on one GPU.

    python bench/gemm_shapes.py [--out bench/results]

For the 1B shape (micro-batch 8 x 4096 tokens) and the 8B shape (1 and 2 x 8192 tokens), each
linear layer's three products (forward x @ W^T, input gradient dY @ W, weight gradient
dY^T @ x) in bf16 on random data, median time with CUDA events (triton.testing.do_bench).
Two layouts: the model's (separate q/k/v and w1/w3 projections) and fused ones (one qkv and one
w1|w3 matrix), to see what fusing would buy. Summed over the layers and the output layer, this
is the matmul time of a step if each product ran as fast as it does alone: against the profile's
matmul time it tells what the GEMMs themselves cost and what running them inside the step costs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

CEILING_N = 8192  # the square product whose rate is the card's practical ceiling


def model_config(model: str):
    from pretrain.compose import compose

    return compose([f"model={model}"]).model


def linears(cfg, fused: bool) -> list[tuple[str, int, int]]:
    """(name, in_features, out_features) of one block's linear layers."""
    head_dim = cfg.dim // cfg.n_heads
    q, kv, hidden = cfg.n_heads * head_dim, cfg.kv_heads * head_dim, cfg.ffn_hidden
    attention = [("wqkv", cfg.dim, q + 2 * kv)] if fused else [("wq", cfg.dim, q), ("wk", cfg.dim, kv), ("wv", cfg.dim, kv)]
    mlp = [("w13", cfg.dim, 2 * hidden)] if fused else [("w1", cfg.dim, hidden), ("w3", cfg.dim, hidden)]
    return attention + [("wo", q, cfg.dim)] + mlp + [("w2", hidden, cfg.dim)]


def time_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def products(tokens: int, in_f: int, out_f: int) -> dict[str, float]:
    """Median ms of the forward, input-gradient and weight-gradient products of one linear layer."""
    x = torch.randn(tokens, in_f, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(tokens, out_f, device="cuda", dtype=torch.bfloat16)
    return {"forward": time_ms(lambda: torch.nn.functional.linear(x, w)),
            "input_grad": time_ms(lambda: torch.mm(dy, w)),
            "weight_grad": time_ms(lambda: torch.mm(dy.t(), x))}


def measure(model: str, tokens: int, fused: bool) -> dict:
    cfg = model_config(model)
    layers = [(*shape, cfg.n_layers) for shape in linears(cfg, fused)] + [("output", cfg.dim, cfg.vocab_size, 1)]
    rows, total_ms, total_flop = [], 0.0, 0.0
    for name, in_f, out_f, count in layers:
        times = products(tokens, in_f, out_f)
        flop = 2 * tokens * in_f * out_f
        for kind, ms in times.items():
            rows.append({"layer": name, "product": kind, "m_n_k": _mnk(kind, tokens, in_f, out_f), "ms": ms,
                         "tflops": flop / ms / 1e9})
            total_ms += ms * count
            total_flop += flop * count
    return {"model": model, "tokens": tokens, "fused": fused, "rows": rows, "step_matmul_ms": total_ms,
            "step_matmul_tflop": total_flop / 1e12, "tflops": total_flop / total_ms / 1e9}


def _mnk(kind: str, tokens: int, in_f: int, out_f: int) -> str:
    m, n, k = {"forward": (tokens, out_f, in_f), "input_grad": (tokens, in_f, out_f),
               "weight_grad": (out_f, in_f, tokens)}[kind]
    return f"{m}x{n}x{k}"


def ceiling() -> float:
    a, b = (torch.randn(CEILING_N, CEILING_N, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return 2 * CEILING_N**3 / time_ms(lambda: a @ b) / 1e9


def table(result: dict) -> str:
    lines = [f"{CEILING_N}^3 bf16 product: {result['ceiling_tflops']:.0f} TFLOP/s", "",
             "| model | tokens | layout | matmul ms/step (each product alone) | TFLOP | TFLOP/s |", "|---|---|---|---|---|---|"]
    for r in result["runs"]:
        lines.append(f"| {r['model']} | {r['tokens']} | {'fused qkv, w1/w3' if r['fused'] else 'separate'} | "
                     f"{r['step_matmul_ms']:.1f} | {r['step_matmul_tflop']:.1f} | {r['tflops']:.0f} |")
    lines += ["", "| model | tokens | layer | product | M x N x K | ms | TFLOP/s |", "|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        for row in r["rows"]:
            lines.append(f"| {r['model']} | {r['tokens']} | {row['layer']} | {row['product']} | {row['m_n_k']} | "
                         f"{row['ms']:.3f} | {row['tflops']:.0f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=common.RESULTS)
    parser.add_argument("--name", default="gemm_shapes")
    args = parser.parse_args()
    runs = [measure(model, tokens, fused) for model, tokens in (("llama-1b", 8 * 4096), ("llama-8b", 8192),
                                                                 ("llama-8b", 2 * 8192)) for fused in (False, True)]
    result = {**common.stamp(), "ceiling_tflops": ceiling(), "runs": runs}
    print(common.write_result(args.out, args.name, result, table(result)).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
