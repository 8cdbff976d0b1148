"""Triton helpers shared by the ops' kernels."""

import triton
import triton.language as tl


@triton.jit
def float_arg(hi, lo, F64: tl.constexpr):
    """A float scalar argument as fusedops.numerics.float_args splits it, in the kernel's accumulator type: hi + lo
    in float64, hi in float32."""
    if F64:
        x = tl.cast(hi, tl.float64) + tl.cast(lo, tl.float64)
    else:
        x = tl.cast(hi, tl.float32)
    return x


@triton.jit
def mask_if(cond, mask):
    """`mask` where the scalar `cond` holds, else all False: `mask & cond`, spelt so that every interpreter
    keeps it boolean. Triton 3.9's computes `block & scalar` as integers (a load then fails with "mask has
    unsupported dtype"), and triton-ascend 3.2's cannot build the constant of tl.where(cond, mask, False);
    `mask != mask` is False in both, and a compiler folds it (one select on a GPU)."""
    return tl.where(cond, mask, mask != mask)


@triton.jit
def as_stored(x, ptr):
    """x in the element type of `ptr`, for a store. A float64 value bound for bfloat16 goes through float32:
    Triton 3.7's interpreter casts float64 to bfloat16 as an integer (zeros, denormals, NaN); the two roundings
    can differ from one by a last bfloat16 bit, in rare ties."""
    ty = ptr.dtype.element_ty
    if x.dtype == tl.float64:  # nested, not `and`: triton-ascend 3.2 compiles `and` of two constants as tensors
        if ty == tl.bfloat16:
            x = x.to(tl.float32)
    return x.to(ty)
