"""Triton helpers shared by the ops' kernels."""

import triton
import triton.language as tl


@triton.jit
def mask_if(cond, mask):
    """`mask` where the scalar `cond` holds, else all False: `mask & cond`, spelt so that every interpreter
    keeps it boolean. Triton 3.9's computes `block & scalar` as integers (a load then fails with "mask has
    unsupported dtype"), and triton-ascend 3.2's cannot build the constant of tl.where(cond, mask, False);
    `mask != mask` is False in both, and a compiler folds it (one select on a GPU)."""
    return tl.where(cond, mask, mask != mask)
