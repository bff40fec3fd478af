"""MasterAdamW's Triton kernel (pretrain/parallel/master_adamw.py), in a module of its own: it imports Triton."""

import triton
import triton.language as tl


@triton.jit
def master_adamw(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, copy_ptr, step_ptr, clip_ptr, found_inf_ptr,
                 n, lr, lr_wd, beta1, one_minus_beta1, beta2, one_minus_beta2, log2_beta1, log2_beta2, eps,
                 BLOCK: tl.constexpr):
    """One block of a parameter: its gradient scaled by *clip_ptr, AdamW's update of weight and moments
    (the step count at *step_ptr already advanced), the weight also stored into the copy's dtype; where
    *found_inf_ptr is not 0, everything stays as it was."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    # Bounds alone in the mask, so loads and stores stay vectorised (n is specialised as a multiple of 16);
    # a skipped step stores back what it loaded.
    mask = offsets < n
    skip = tl.load(found_inf_ptr) != 0
    grad = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32) * tl.load(clip_ptr)
    old_param = tl.load(param_ptr + offsets, mask=mask)
    old_exp_avg = tl.load(exp_avg_ptr + offsets, mask=mask)
    old_exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=mask)
    step = tl.load(step_ptr)
    # torch's fused AdamW (aten/src/ATen/native/cuda/fused_adam_utils.cuh), term for term.
    param = old_param - lr_wd * old_param
    exp_avg = beta1 * old_exp_avg + one_minus_beta1 * grad
    exp_avg_sq = beta2 * old_exp_avg_sq + one_minus_beta2 * grad * grad
    step_size = lr / (1 - tl.exp2(step * log2_beta1))
    bias_correction2_sqrt = tl.sqrt(1 - tl.exp2(step * log2_beta2))
    denom = tl.sqrt(exp_avg_sq) / bias_correction2_sqrt + eps
    param = param - step_size * exp_avg / denom
    param = tl.where(skip, old_param, param)
    tl.store(param_ptr + offsets, param, mask=mask)
    tl.store(exp_avg_ptr + offsets, tl.where(skip, old_exp_avg, exp_avg), mask=mask)
    tl.store(exp_avg_sq_ptr + offsets, tl.where(skip, old_exp_avg_sq, exp_avg_sq), mask=mask)
    tl.store(copy_ptr + offsets, param.to(copy_ptr.dtype.element_ty), mask=mask)
