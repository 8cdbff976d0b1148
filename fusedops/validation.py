"""Argument checks shared by every op. Each raises ValueError naming the argument, and none of them
reads tensor data, so no check costs a device synchronisation."""

from __future__ import annotations

import math
import operator
from typing import Iterable, Optional

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def as_int(name: str, value) -> int:
    """value as a Python int: any integer type (numpy's too, as torch's ops take them), not a bool;
    symbolic ints (torch.compile) pass through."""
    if isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool):
        return value
    try:
        if isinstance(value, bool) or getattr(value, "dtype", None) == torch.bool:
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {value!r}") from None


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


def check_min_dim(name: str, t: torch.Tensor, ndim: int) -> None:
    if t.dim() < ndim:
        raise ValueError(f"{name} must have at least {ndim} dims, got shape {tuple(t.shape)}")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have stride 1 in its last dim, got strides {tuple(t.stride())}")


def check_same_device(named: Iterable[tuple[str, Optional[torch.Tensor]]]) -> None:
    named = [(n, t) for n, t in named if t is not None]
    first_name, first = named[0]
    for name, t in named[1:]:
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}")


def check_positive_finite(name: str, value: float) -> None:
    """value: a Python number, or a symbolic one (torch.compile with dynamic shapes traces floats as
    torch.SymFloat, which math.isfinite cannot take; comparisons guard on it instead)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, torch.SymInt, torch.SymFloat)):
        raise ValueError(f"{name} must be a float, got {type(value).__name__}")
    if not 0 < value < math.inf:  # NaN fails both comparisons
        raise ValueError(f"{name} must be positive and finite, got {value}")
