"""The row order of the query and key projections, ours and Hugging Face's.

Our RoPE rotates the channel pairs (2i, 2i+1) of each head; Hugging Face's Llama rotates the pairs
(i, i + head_dim/2). The two are the same model when the rows of wq and wk are permuted within each
head, as Meta-to-Hugging Face converters do. The names are in pretrain.hf_format.
"""

from __future__ import annotations

import torch

from pretrain.hf_format import is_rotated


def hf_rows(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Where our rows (indices into a query or key projection) are in Hugging Face's: ours[r] = theirs[hf_rows(r)]."""
    head, channel = rows // head_dim, rows % head_dim
    return head * head_dim + (channel % 2) * (head_dim // 2) + channel // 2


def to_hf(name: str, tensor: torch.Tensor, head_dim: int) -> torch.Tensor:
    """One of our parameters (by our name) in Hugging Face's layout."""
    if not is_rotated(name):
        return tensor
    theirs = torch.empty_like(tensor)
    theirs[hf_rows(torch.arange(tensor.shape[0]), head_dim)] = tensor
    return theirs


def our_rows(name: str, read_rows, rows: range, head_dim: int) -> torch.Tensor:
    """Rows `rows` of one of our parameters, from the Hugging Face tensor that `read_rows(start, stop)` slices.

    A query or key projection's rows come from the contiguous block of Hugging Face's rows that holds
    them (within the same heads), reordered.
    """
    if not is_rotated(name) or not rows:
        return read_rows(rows.start, rows.stop)
    wanted = hf_rows(torch.arange(rows.start, rows.stop), head_dim)
    first, last = int(wanted.min()), int(wanted.max())
    return read_rows(first, last + 1)[wanted - first]
