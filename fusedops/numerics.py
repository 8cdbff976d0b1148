"""Numerics settings the ops take from torch's own, so a fusedops op rounds as torch's ops would."""

from __future__ import annotations

import struct

import torch


def tf32_allowed() -> bool:
    """Whether float32 matrix products may run in TF32 on CUDA: torch.backends.cuda.matmul.fp32_precision
    == "tf32", or, where that is unset, torch.set_float32_matmul_precision("high" or "medium"). The same
    rule as torch's matmuls and FlexAttention; the default ("highest") keeps float32 dots exact."""
    setting = getattr(torch.backends.cuda.matmul, "fp32_precision", "none")  # torch >= 2.9
    if setting != "none":
        return setting == "tf32"
    return torch.get_float32_matmul_precision() != "highest"


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the ops compute and accumulate in for inputs of `dtype`, and that of the softmax statistics
    they return (lse): float64 for float64 inputs, float32 for the others."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def split_float32(x) -> tuple:
    """x as hi + lo, each exact in float32. Triton hands a Python float argument to a kernel as float32 (Inductor's
    generated code as float64): x alone would reach a float64 kernel rounded to float32 (a relative 6e-8, which
    put float64 results off by ~1e-8), where hi + lo is within 2^-48 of x (for |x| >= 2^-102); float32 kernels
    read hi, x rounded. A symbolic x (traced) or one past float32's range goes whole as hi."""
    if not isinstance(x, float) or not abs(x) <= FLOAT32_MAX:
        return x, 0.0
    hi = _float32(x)
    return hi, _float32(x - hi)


FLOAT32_MAX = torch.finfo(torch.float32).max


def _float32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def float_args(**values) -> dict:
    """Kernel arguments `name`, `name_lo` (split_float32's hi and lo) of each float scalar; a kernel reads them
    back with fusedops.tl_helpers.float_arg."""
    args = {}
    for name, x in values.items():
        args[name], args[f"{name}_lo"] = split_float32(x)
    return args
