"""Check and time scaled_dot_product_attention's kernels on the model's attention shapes.

    python bench/attention_check.py [--out bench/results]

For the 1B (16 heads, seq 4096) and 8B (32 heads, seq 8192) shapes, causal, bf16, in the
model's layout ([batch, seq, heads, 128] viewed as [batch, heads, seq, 128]): each backend's
output and input gradients against the math backend in fp32 on upcast inputs
(||x - ref|| / ||ref||; bf16 lands between 1e-3 and 1e-2), and forward+backward time with
CUDA events (triton.testing.do_bench, median). Decides whether fsdp.attention=auto may prefer cuDNN.

The model's grouped-query shapes (8 key/value heads) are timed both ways: K and V repeated to every
query head before the call (the repeat and its backward included), and SDPA's own `enable_gqa`, for
each backend and for the backend SDPA picks by itself ("auto").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

SHAPES = {"1b": (2, 16, 4096, 128), "8b": (1, 32, 8192, 128)}
KV_HEADS = 8
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def inputs(batch: int, heads: int, seq: int, head_dim: int) -> list[torch.Tensor]:
    """Fresh random q, k, v in the model's layout, and an output gradient."""
    made = [torch.randn(batch, seq, heads, head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
            for _ in range(4)]
    for t in made[:3]:
        t.requires_grad_(True)
    return made


def forward_backward(backend: SDPBackend, q, k, v, grad) -> list[torch.Tensor]:
    with sdpa_kernel([backend]):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return [out, *torch.autograd.grad(out, (q, k, v), grad)]


def reference(run, q, k, v, grad) -> list[torch.Tensor]:
    """What `run(backend, q, k, v, grad)` gives with the math backend in fp32, on upcast inputs."""
    up = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    return run(SDPBackend.MATH, *up, grad.float())


def relative_errors(got: list[torch.Tensor], ref: list[torch.Tensor]) -> dict[str, float]:
    names = ("out", "dq", "dk", "dv")
    return {n: float((g.float() - r).norm() / r.norm()) for n, g, r in zip(names, got, ref)}


def causal_flops(batch: int, heads: int, seq: int, head_dim: int) -> float:
    """The real work of causal attention's forward and backward (backward = 2.5 x forward)."""
    return 3.5 * 4 * batch * heads * seq * seq * head_dim / 2


def measure(run, ref, flops: float) -> dict:
    """Errors of `run()` (output and input gradients) against `ref()`, and its median time with CUDA events."""
    from triton.testing import do_bench

    try:
        errors = relative_errors(run(), ref())
        ms = do_bench(run, warmup=100, rep=500, return_mode="median")
    except RuntimeError as err:
        return {"ok": False, "error": str(err).splitlines()[0]}
    return {"rel_error": errors, "ok": all(e < 2e-2 for e in errors.values()), "fwd_bwd_ms": ms,
            "tflops": flops / ms / 1e9}


def check_shape(name: str, shape: tuple[int, int, int, int]) -> dict:
    batch, heads, seq, head_dim = shape
    result = {"shape": {"batch": batch, "heads": heads, "seq": seq, "head_dim": head_dim}, "backends": {}}
    for backend_name, backend in BACKENDS.items():
        q, k, v, grad = inputs(*shape)
        entry = measure(lambda: forward_backward(backend, q, k, v, grad),
                        lambda: reference(forward_backward, q, k, v, grad), causal_flops(*shape))
        result["backends"][backend_name] = entry
        print(name, backend_name, entry, flush=True)
    return result


def gqa_inputs(batch: int, heads: int, seq: int, head_dim: int) -> list[torch.Tensor]:
    """q and the output gradient with every head, k and v with KV_HEADS, in the model's layout."""
    def make(n: int, grad: bool) -> torch.Tensor:
        t = torch.randn(batch, seq, n, head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        return t.requires_grad_(grad)
    return [make(heads, True), make(KV_HEADS, True), make(KV_HEADS, True), make(heads, False)]


def gqa_forward_backward(way: str, backend: SDPBackend | None, q, k, v, grad) -> list[torch.Tensor]:
    """Attention of grouped heads, `way` = "repeat" (K, V repeated first) or "enable_gqa"."""
    with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
        if way == "repeat":
            repeat = q.shape[1] // k.shape[1]
            out = F.scaled_dot_product_attention(q, k.repeat_interleave(repeat, dim=1),
                                                 v.repeat_interleave(repeat, dim=1), is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return [out, *torch.autograd.grad(out, (q, k, v), grad)]


def check_gqa(name: str, shape: tuple[int, int, int, int]) -> dict:
    """Repeated K/V against enable_gqa, per backend and for SDPA's own choice."""
    heads = shape[1]
    result = {}
    q, k, v, _ = gqa_inputs(*shape)
    for way, kv in (("repeat", k.repeat_interleave(heads // KV_HEADS, dim=1)), ("enable_gqa", k)):
        choice = torch._fused_sdp_choice(q, kv, kv, is_causal=True, enable_gqa=way == "enable_gqa")
        result[f"auto {way} picks"] = SDPBackend(choice).name
        print(name, "gqa: SDPA picks", SDPBackend(choice).name, "for", way, flush=True)
    for backend_name, backend in {"auto": None, **BACKENDS}.items():
        q, k, v, grad = gqa_inputs(*shape)
        ref = reference(partial(gqa_forward_backward, "repeat"), q, k, v, grad)
        for way in ("repeat", "enable_gqa"):
            entry = measure(lambda: gqa_forward_backward(way, backend, q, k, v, grad), lambda: ref,
                            causal_flops(*shape))
            result[f"{backend_name} {way}"] = entry
            print(name, "gqa", backend_name, way, entry, flush=True)
    return result


def table_row(shape: str, label: str, e: dict) -> str:
    """One measured kernel's row of the markdown table."""
    if "error" in e:
        return f"| {shape} | {label} | - | - | {e['error']} | no |"
    return (f"| {shape} | {label} | {e['fwd_bwd_ms']:.2f} | {e['tflops']:.0f} | "
            f"{max(e['rel_error'].values()):.1e} | {e['ok']} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=common.RESULTS)
    parser.add_argument("--name", default="attention_check")
    args = parser.parse_args()
    torch.manual_seed(0)
    result = {**common.stamp(), "shapes": {name: check_shape(name, shape) for name, shape in SHAPES.items()},
              "gqa": {name: check_gqa(name, shape) for name, shape in SHAPES.items()}}
    rows = ["| shape | backend | fwd+bwd ms | TFLOP/s | max rel. error | ok |", "|---|---|---|---|---|---|"]
    rows += [table_row(name, backend, e) for name, shape in result["shapes"].items()
             for backend, e in shape["backends"].items()]
    rows += ["", f"Grouped heads ({KV_HEADS} key/value heads): K, V repeated first vs enable_gqa", "",
             "| shape | backend and way | fwd+bwd ms | TFLOP/s | max rel. error | ok |", "|---|---|---|---|---|---|"]
    rows += [f"| {name} | {way} {e} | | | | |" if isinstance(e, str) else table_row(name, way, e)
             for name, entries in result["gqa"].items() for way, e in entries.items()]
    common.write_result(args.out, args.name, result, "\n".join(rows))
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
