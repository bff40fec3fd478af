"""Continuing a prompt: greedy at temperature 0 (deterministic), else nucleus (top-p) sampling.

The prompt goes through the model once, filling a KVCache; each new token then costs one forward of
one position. Any Transformer will do, sharded or not: every rank of a sharded model calls this alike
(the same prompt and settings), since its forward gathers the weights; each rank gets its own draw.
"""

from __future__ import annotations

from typing import Sequence

import torch

from pretrain.config import SamplingConfig
from pretrain.data.tokenizer import Tokenizer
from pretrain.models.llama import KVCache, Transformer


@torch.no_grad()
def generate(model: Transformer, prompt: Sequence[int], sampling: SamplingConfig, device: torch.device,
             generator: torch.Generator | None = None) -> list[int]:
    """sampling.max_new_tokens token ids that continue `prompt` (ids); `generator` (on the CPU) draws them."""
    total = len(prompt) + sampling.max_new_tokens
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token to continue")
    if total > model.cfg.max_seq_len:
        raise ValueError(f"the prompt's {len(prompt)} tokens and {sampling.max_new_tokens} new ones exceed the "
                         f"model's max_seq_len={model.cfg.max_seq_len}: shorten the prompt or ask for fewer tokens")
    cache = KVCache(total)
    tokens = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    new: list[int] = []
    for _ in range(sampling.max_new_tokens):
        logits = model(tokens, cache)[0, -1].float().cpu()
        new.append(choose(logits, sampling.temperature, sampling.top_p, generator))
        tokens = torch.tensor([new[-1:]], dtype=torch.long, device=device)
    return new


def choose(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """The next token: the most likely at temperature 0; else drawn from the smallest set of the most
    likely tokens whose probabilities (at this temperature) reach top_p."""
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / temperature, dim=-1)
    ranked, order = probs.sort(descending=True)
    ranked[ranked.cumsum(0) - ranked >= top_p] = 0.0  # the first token always stays
    return int(order[torch.multinomial(ranked, 1, generator=generator)])


def continue_text(model: Transformer, tokenizer: Tokenizer, prompt: str, sampling: SamplingConfig,
                  device: torch.device) -> str:
    """The text that follows `prompt`, drawn with sampling.seed."""
    generator = torch.Generator().manual_seed(sampling.seed)
    return tokenizer.decode(generate(model, tokenizer.encode(prompt).tolist(), sampling, device, generator))
