"""Numerics settings the ops take from torch's own, so a fusedops op rounds as torch's ops would."""

from __future__ import annotations

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
