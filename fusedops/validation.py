"""Argument checks shared by every op. Each raises ValueError naming the argument, and none of them
reads tensor data, so no check costs a device synchronisation."""

from __future__ import annotations

import math
import operator
from typing import Iterable, Optional, Sequence

import torch

# float64 runs in float64 throughout (fusedops.numerics.accumulate_dtype): what torch.autograd.gradcheck needs.
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
FP32 = torch.finfo(torch.float32)  # the kernels' arithmetic: float arguments are cast to it in the kernel


def checks_in_wrapper() -> bool:
    """Whether a public wrapper validates the op's arguments itself: not while torch.compile (or export)
    traces it. There the registered op's fake kernel runs the same checks, and dynamo reports a ValueError
    raised in a fake kernel with its message ("Dynamo failed to run FX node with fake tensors: ... got
    ValueError('...')", the ValueError chained as the cause), where one raised in traced Python code
    comes out as an "Observed exception" graph break, its message only in the debug context."""
    return not torch.compiler.is_compiling()


def check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, float16, bfloat16 or float64, got {t.dtype}")


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


def check_positive_int(name: str, value) -> int:
    """value as a Python int (see as_int), which must be positive (a size: a module's dim, heads)."""
    value = as_int(name, value)
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


def check_tensor(name: str, t, dtype: torch.dtype, shape: Sequence[int], optional: bool = False) -> None:
    """t is a tensor of exactly this dtype and shape (a backward op's incoming gradient or saved output),
    or None where optional; its device is check_same_device's business."""
    if t is None and optional:
        return
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype != dtype or tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must be {dtype} of shape {tuple(shape)}, got {t.dtype} of shape {tuple(t.shape)}")


def check_min_dim(name: str, t: torch.Tensor, ndim: int) -> None:
    if t.dim() < ndim:
        raise ValueError(f"{name} must have at least {ndim} dims, got shape {tuple(t.shape)}")


def check_sources(values: torch.Tensor) -> int:
    """values [N, *batch, D] of the AttnRes ops: floating, N >= 1 sources, D >= 1 features. Returns D."""
    check_float("values", values)
    check_min_dim("values", values, 2)
    if values.shape[0] == 0:
        raise ValueError("values must hold at least one source (N >= 1), got N = 0")
    if values.shape[-1] == 0:
        raise ValueError("values must have a feature dim D >= 1, got D = 0")
    return values.shape[-1]


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


def check_fp32_normal(name: str, value: float, high: float = FP32.max) -> None:
    """check_positive_finite, and value a normal float32 number at most `high`: the kernels compute with
    it in float32, where a value below FP32.tiny (~1.2e-38) is subnormal or rounds to 0 and one above
    FP32.max overflows, though both are fine float64 numbers. Symbolic floats compare (and guard) too."""
    check_positive_finite(name, value)
    if not FP32.tiny <= value <= high:
        raise ValueError(f"{name} must be in [{FP32.tiny:.4g}, {high:.4g}] (the kernels compute in float32), "
                         f"got {value}")
