"""The Triton kernel of pretrain/models/linear_cross_entropy.py, in a module of its own: it imports Triton."""

import triton
import triton.language as tl


@triton.jit
def cross_entropy_rows(logits_ptr, targets_ptr, losses_ptr, row_stride, inv_rows,
                       N_COLS: tl.constexpr, WRITE_GRAD: tl.constexpr, BLOCK: tl.constexpr):
    """One row of logits: its loss, log-sum-exp minus the target's logit, in float32 at losses_ptr; with
    WRITE_GRAD, the row itself overwritten by the gradient of the mean loss over the rows, (softmax - one
    hot) * inv_rows, in the logits' dtype.

    The first pass reads the row for its running maximum and sum of exponentials, the second reads it again
    and writes the gradient over it. The vocabulary, N_COLS, is a compile-time constant: one model has one."""
    row = tl.program_id(0).to(tl.int64)  # rows x columns can pass 2^31
    base = logits_ptr + row * row_stride
    running_max = tl.full((), -float("inf"), tl.float32)
    running_sum = tl.zeros((), tl.float32)
    for start in range(0, N_COLS, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < N_COLS, other=-float("inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, 0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), 0)
        running_max = new_max
    log_sum_exp = running_max + tl.log(running_sum)
    target = tl.load(targets_ptr + row)
    tl.store(losses_ptr + row, log_sum_exp - tl.load(base + target).to(tl.float32))
    if WRITE_GRAD:
        for start in range(0, N_COLS, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < N_COLS
            x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            grad = tl.exp(x - log_sum_exp) - tl.where(cols == target, 1.0, 0.0)
            tl.store(base + cols, (grad * inv_rows).to(logits_ptr.dtype.element_ty), mask=mask)


@triton.jit
def scale_by(x_ptr, scale_ptr, n_elements, BLOCK: tl.constexpr):
    """x[:n_elements] (contiguous) multiplied in place by the float32 scalar at scale_ptr, in float32, rounded
    once to x's dtype."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    scale = tl.load(scale_ptr)
    x = tl.load(x_ptr + offsets, mask=mask)
    tl.store(x_ptr + offsets, (x.to(tl.float32) * scale).to(x_ptr.dtype.element_ty), mask=mask)
