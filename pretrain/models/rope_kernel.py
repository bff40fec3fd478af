"""The Triton kernel of pretrain/models/rope.py, in a module of its own: it imports Triton."""

import triton
import triton.language as tl


@triton.jit
def rotate_pairs(x_ptr, freqs_ptr, out_ptr, n_rows, seq, heads, stride_batch, stride_seq, stride_head,
                 freqs_stride, HEAD_DIM: tl.constexpr, PADDED_DIM: tl.constexpr, INVERSE: tl.constexpr,
                 ROWS: tl.constexpr):
    """ROWS heads' vectors of x [batch, seq, heads, HEAD_DIM] (unit stride in the last dimension), each pair of
    channels (a, b) rotated by its position's angle: (a cos - b sin, a sin + b cos), or by minus that angle
    with INVERSE (the rotation's backward). In float32, written contiguous in x's dtype to out.

    A row is one (batch, position, head); rows run heads fastest, so a program's rows share few positions
    and their rotations [cos, sin] (freqs [seq, HEAD_DIM/2, 2], float32 in the model) come from cache. Each row is loaded
    whole and split into its pairs in registers: every load and store is contiguous."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, PADDED_DIM)
    mask = (rows < n_rows)[:, None] & (cols < HEAD_DIM)[None, :]
    head = rows % heads
    position = (rows // heads) % seq
    batch = rows // (heads * seq)
    source = (batch * stride_batch + position * stride_seq + head * stride_head)[:, None] + cols[None, :]
    x = tl.load(x_ptr + source, mask=mask, other=0.0).to(tl.float32)
    rotation = tl.load(freqs_ptr + (position * freqs_stride)[:, None] + cols[None, :], mask=mask, other=0.0)
    a, b = tl.split(tl.reshape(x, (ROWS, PADDED_DIM // 2, 2)))
    cos, sin = tl.split(tl.reshape(rotation, (ROWS, PADDED_DIM // 2, 2)))
    if INVERSE:
        sin = -sin
    rotated = tl.reshape(tl.join(a * cos - b * sin, a * sin + b * cos), (ROWS, PADDED_DIM))
    tl.store(out_ptr + rows[:, None] * HEAD_DIM + cols[None, :], rotated.to(out_ptr.dtype.element_ty), mask=mask)
