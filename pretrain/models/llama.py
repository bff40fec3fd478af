"""A Llama-style decoder: RMSNorm, RoPE, SwiGLU, grouped-query attention.

Plain PyTorch in the spirit of nanoGPT. Nothing here knows about processes, meshes or
precision policies; `pretrain.parallel.parallelize` applies those to a built model. For generation,
`forward` takes a KVCache: each call then feeds only the new tokens; training never passes one. Given
the targets, `forward` returns the mean next-token loss instead of the logits (OutputLayer).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.config import ModelConfig
from pretrain.models.linear_cross_entropy import LossFn, cross_entropy, linear_cross_entropy
from pretrain.models.rope import apply_rope, rope_frequencies


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the compute dtype: bf16 variance loses too much.
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class KVCache:
    """The keys and values of every position so far, layer by layer, for generating token by token.

    Buffers of max_len positions are made at the first call, in the dtype and on the device of the
    keys. `forward` hands each block its layer's view (LayerCache) and then advances `length`.
    """

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.length = 0  # positions cached
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def layer(self, index: int) -> LayerCache:
        return LayerCache(self, index)


class LayerCache:
    """One layer's part of a KVCache, during one forward that adds positions from `cache.length` on."""

    def __init__(self, cache: KVCache, index: int) -> None:
        self.cache, self.index = cache, index

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new positions' k, v [batch, kv_heads, new, head_dim]; return those of all positions so far."""
        cache, start = self.cache, self.cache.length
        end = start + k.shape[2]
        if end > cache.max_len:
            raise ValueError(f"{end} positions exceed the cache's {cache.max_len} (the model's max_seq_len)")
        if self.index == len(cache.keys):
            shape = (*k.shape[:2], cache.max_len, k.shape[3])
            cache.keys.append(k.new_zeros(shape))
            cache.values.append(v.new_zeros(shape))
        keys, values = cache.keys[self.index], cache.values[self.index]
        keys[:, :, start:end] = k
        values[:, :, start:end] = v
        return keys[:, :, :end], values[:, :, :end]

    def mask(self, new: int, device: torch.device) -> torch.Tensor:
        """Which positions each new query attends to: [new, length + new], causal from the cached ones on."""
        start = self.cache.length
        return torch.ones(new, start + new, dtype=torch.bool, device=device).tril(start)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        """freqs: the rotations of x's positions (from the first one on: position 0, or the cache's length)."""
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.n_heads, self.head_dim)
        k = self.wk(x).view(batch, seq, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(batch, seq, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, freqs), apply_rope(k, freqs)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        mask = None
        if cache is not None:
            mask = cache.mask(seq, x.device)
            k, v = cache.extend(k, v)
        # Grouped heads go to SDPA as they are: its kernels read each key/value head for its group of
        # query heads, where repeating K and V first would write and keep copies of them.
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                             enable_gqa=self.n_kv_heads != self.n_heads)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), freqs, cache)
        return x + self.feed_forward(self.ffn_norm(x))


class OutputLayer(nn.Linear):
    """The output layer: logits, or with targets the mean cross-entropy of its logits, which on a GPU are
    then never kept (pretrain.models.linear_cross_entropy). `logits_loss` computes that loss where the
    fused kernel does not; `pretrain.parallel.parallelize` compiles it with the blocks."""

    def __init__(self, dim: int, vocab_size: int) -> None:
        super().__init__(dim, vocab_size, bias=False)
        self.logits_loss: LossFn = cross_entropy

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            return super().forward(x)
        return linear_cross_entropy(x, self.weight, targets, self.logits_loss)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = OutputLayer(cfg.dim, cfg.vocab_size)
        self.tie_weights()
        # A buffer, not a parameter: recomputed after loading, never checkpointed.
        self.register_buffer("freqs", self._freqs(), persistent=False)

    def _freqs(self, device: torch.device | None = None) -> torch.Tensor:
        return rope_frequencies(self.cfg.dim // self.cfg.n_heads, self.cfg.max_seq_len, self.cfg.rope_theta, device)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every weight; also valid after `to_empty()` from the meta device.

        Residual projections (wo, w2) are scaled by 1/sqrt(2*n_layers), as in GPT-2 and torchtitan,
        so the residual stream's variance does not grow with depth.
        """
        std = self.cfg.init_std
        residual_std = std / math.sqrt(2 * self.cfg.n_layers)
        nn.init.normal_(self.tok_embeddings.weight, std=1.0 if not self.cfg.tie_embeddings else std)
        for block in self.layers:
            for linear in (block.attention.wq, block.attention.wk, block.attention.wv, block.feed_forward.w1, block.feed_forward.w3):
                nn.init.trunc_normal_(linear.weight, std=std, a=-3 * std, b=3 * std)
            for linear in (block.attention.wo, block.feed_forward.w2):
                nn.init.trunc_normal_(linear.weight, std=residual_std, a=-3 * residual_std, b=3 * residual_std)
            block.attention_norm.reset_parameters()
            block.ffn_norm.reset_parameters()
        self.norm.reset_parameters()
        if not self.cfg.tie_embeddings:
            out_std = self.cfg.dim**-0.5
            nn.init.trunc_normal_(self.output.weight, std=out_std, a=-3 * out_std, b=3 * out_std)
        self.init_buffers()

    def tie_weights(self) -> None:
        """With tied embeddings, make the output layer's weight the embedding's (again after `to_empty()`,
        which gives each module a tensor of its own)."""
        if self.cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def init_buffers(self) -> None:
        """Compute the RoPE rotations, which are never saved: after `to_empty()` from the meta device."""
        self.freqs = self._freqs(self.freqs.device)

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None, *,
                targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [batch, seq, vocab] for token ids [batch, seq]; with a cache, of positions from its
        length on, attending to the cached ones too (and added to it). With targets [batch, seq], the
        mean cross-entropy of those logits instead (a float32 scalar)."""
        h = self.tok_embeddings(tokens)
        if cache is None:
            for block in self.layers:
                h = block(h, self.freqs)
        else:
            freqs = self.freqs[cache.length:]
            for index, block in enumerate(self.layers):
                h = block(h, freqs, cache.layer(index))
            cache.length += tokens.shape[1]
        return self.output(self.norm(h), targets)
