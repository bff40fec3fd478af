"""Parameter counts, FLOPs per token and peak device throughput, for MFU.

Two accountings of training FLOPs per token; metrics report MFU in both (`mfu`, `mfu_reference`) (forward + backward = 3x forward):
  causal     6 * (matmul parameters) + 6 * layers * dim * seq_len
             matmul parameters exclude the input embedding (a lookup) and the norms; attention
             scores and values cost 2 * 2 * seq * dim per token forward, halved by the causal mask.
  reference  6 * (parameters - input embedding) + 12 * layers * heads * head_dim * seq_len
             torchtitan's count (attention as a full square), as in the performance reference.
"""

from __future__ import annotations

from pretrain.config import ModelConfig

ACCOUNTINGS = ("causal", "reference")
# Dense bf16/fp16 tensor-core peak per GPU, from the vendors' datasheets.
PEAK_FLOPS = {"A100": 312e12, "H100": 989e12, "H200": 989e12, "GH200": 989e12, "B200": 2250e12}


def block_parameter_count(cfg: ModelConfig) -> int:
    """One transformer block: attention (q, k, v, o), the SwiGLU feed-forward and two norms."""
    head_dim = cfg.dim // cfg.n_heads
    attention = cfg.dim * head_dim * (2 * cfg.n_heads + 2 * cfg.kv_heads)
    return attention + 3 * cfg.dim * cfg.ffn_hidden + 2 * cfg.dim


def parameter_count(cfg: ModelConfig) -> int:
    embedding = cfg.vocab_size * cfg.dim
    output = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim
    return embedding + cfg.n_layers * block_parameter_count(cfg) + cfg.dim + output


def flops_per_token(cfg: ModelConfig, seq_len: int, accounting: str = "causal") -> float:
    embedding = cfg.vocab_size * cfg.dim
    total = parameter_count(cfg)
    if accounting == "reference":
        return 6.0 * (total - embedding) + 12.0 * cfg.n_layers * cfg.dim * seq_len
    norms = cfg.n_layers * 2 * cfg.dim + cfg.dim
    # With tied weights the output projection is still a matmul over the shared matrix.
    matmul_params = total - embedding - norms + (embedding if cfg.tie_embeddings else 0)
    return 6.0 * matmul_params + 6.0 * cfg.n_layers * cfg.dim * seq_len


def peak_flops_for(device_name: str) -> float | None:
    """Peak FLOP/s for a GPU name such as 'NVIDIA H200' or 'NVIDIA A100-SXM4-80GB'; None if unknown."""
    upper = device_name.upper()
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):
        if key in upper:
            return PEAK_FLOPS[key]
    return None
