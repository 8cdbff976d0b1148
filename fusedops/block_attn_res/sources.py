"""Depth sources given as a list or tuple of N tensors, turned into the [N, *batch, D] tensor the ops take.

Where the N tensors are equally spaced views of one storage with the same shape, strides and dtype (the
slots of a preallocated bank, e.g. `[bank[:, i] for i in range(n)]` of a token-major `[tokens, N_max, D]`
bank), the result is a strided view of that storage: no copy, and the kernels read the bank in place.
Autograd sees a view op whose backward hands each tensor its slice of the gradient. Anything else (separately
allocated tensors, different strides, tracing under torch.compile or export, tensor subclasses) is stacked:
one copy, differentiable as torch.stack is.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from fusedops.registry import direct_call_ok


class _SourcesView(torch.autograd.Function):
    """[N, *shape] as_strided view over the storage of N equally spaced tensors; backward: unbind."""

    @staticmethod
    def forward(ctx, step: int, *tensors: Tensor) -> Tensor:
        first = tensors[0]
        return first.as_strided((len(tensors), *first.shape), (step, *first.stride()), first.storage_offset())

    @staticmethod
    def backward(ctx, grad: Tensor):
        return (None, *grad.unbind(0))


def _common_step(tensors: Sequence[Tensor]) -> int | None:
    """The element distance between consecutive tensors when they are equally spaced (>= 0) views of one
    storage with one shape, dtype, device and strides, else None."""
    first = tensors[0]
    if len(tensors) == 1:
        return 0
    storage = first.untyped_storage().data_ptr()
    for t in tensors[1:]:
        if (t.shape != first.shape or t.stride() != first.stride() or t.dtype != first.dtype
                or t.device != first.device or t.untyped_storage().data_ptr() != storage):
            return None
    step = tensors[1].storage_offset() - first.storage_offset()
    if step < 0:
        return None
    for a, b in zip(tensors[1:], tensors[2:]):
        if b.storage_offset() - a.storage_offset() != step:
            return None
    return step


def stack_sources(name: str, values) -> Tensor:
    """values itself when it is a tensor; for a list or tuple of N >= 1 tensors, the [N, *batch, D] view of
    their storage where they are equally spaced slots of one (see the module), else torch.stack of them.
    Raises ValueError naming `name[i]` for an element that is not a tensor or does not match the first's
    shape, dtype or device."""
    if isinstance(values, Tensor) or not isinstance(values, (list, tuple)):
        return values
    if len(values) == 0:
        raise ValueError(f"{name} must hold at least one source (N >= 1), got an empty {type(values).__name__}")
    first = values[0]
    for i, t in enumerate(values):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name}[{i}] must be a tensor, got {type(t).__name__}")
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise ValueError(f"{name}[{i}] must match {name}[0] ({first.dtype} of shape {tuple(first.shape)} on "
                             f"{first.device}), got {t.dtype} of shape {tuple(t.shape)} on {t.device}")
    if direct_call_ok(*values) and first.device.type != "meta":
        step = _common_step(values)
        if step is not None:
            return _SourcesView.apply(step, *values)
    return torch.stack(list(values))
