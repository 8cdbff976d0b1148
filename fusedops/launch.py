"""Launching Triton kernels from op bodies.

`launch` goes through `wrap_triton` wherever torch.compile or export may be tracing. In eager calls
on CUDA (wrap_triton's tracing switched off, as in the direct path and triton_op's own eager kernel)
it reuses the compiled kernel of an earlier launch with the same specialisation, skipping Triton's
per-call binding and specialisation of every argument: that costs ~50 us of host time for a kernel
with ~45 arguments on the H100 host (bench/NOTES.md), more than the kernels of a small problem run.

The cache key holds everything Triton specialises on: the kernel, the grid, every scalar argument's
value, the constexpr/launch options, and each tensor's dtype, device and 16-byte alignment.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch
from torch.library import wrap_triton

try:
    from torch._library.triton import is_wrap_triton_enabled
except ImportError:  # pragma: no cover - torch < 2.6 always traces through wrap_triton
    def is_wrap_triton_enabled() -> bool:
        return True

_CACHE: dict[tuple, tuple[Callable, tuple]] = {}
_CACHE_LIMIT = 4096


def _tensor_key(tensors: Sequence[torch.Tensor]) -> tuple:
    return tuple((t.dtype, t.get_device(), t.data_ptr() % 16 == 0) for t in tensors)


def device_switch(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """A context making `t`'s device the current one when another device of its kind is current:
    Triton launches on the current device and stream, so tensors on cuda:1 while cuda:0 is current (a
    model spread over GPUs) would otherwise run on the wrong GPU."""
    index = t.device.index
    module = getattr(torch, t.device.type, None) if t.device.type != "cpu" else None
    current = getattr(module, "current_device", None)
    if index is None or current is None or not hasattr(module, "device") or current() == index:
        return contextlib.nullcontext()
    return module.device(index)


def launch(kernel, grid: tuple[int, ...], tensors: Sequence[torch.Tensor], scalars: tuple, meta: dict) -> None:
    """kernel[grid](*tensors, *scalars, **meta) on the first tensor's device, the tensors being the
    kernel's leading parameters. meta may hold `maxnreg` (a per-thread register cap), honoured on
    direct CUDA launches only: the interpreter has no registers and torch.compile's wrap_triton would
    take it for a kernel argument."""
    if is_wrap_triton_enabled():  # traced: the generated code sets the device itself
        _launch_wrapped(kernel, grid, tensors, scalars, meta)
        return
    with device_switch(tensors[0]):
        if tensors[0].is_cuda:
            _launch_cached(kernel, grid, tensors, scalars, meta)
        else:
            _launch_wrapped(kernel, grid, tensors, scalars, meta)


def _launch_wrapped(kernel, grid, tensors, scalars, meta) -> None:
    meta = {k: v for k, v in meta.items() if k != "maxnreg"}
    wrap_triton(kernel)[grid](*tensors, *scalars, **meta)


def _launch_cached(kernel, grid, tensors, scalars, meta) -> None:
    key = (kernel, grid, scalars, tuple(meta.items()), _tensor_key(tensors))
    entry = _CACHE.get(key)
    if entry is not None:
        runner, constexprs = entry
        runner(*tensors, *scalars, *constexprs)
        return
    compiled = kernel[grid](*tensors, *scalars, **meta)
    # A compiled kernel's runner takes every parameter positionally, constexprs included.
    names = kernel.arg_names[len(tensors) + len(scalars):]
    if compiled is None or not hasattr(compiled, "__getitem__") or any(n not in meta for n in names):
        return  # an unexpected Triton: keep launching through kernel[grid]
    if len(_CACHE) >= _CACHE_LIMIT:
        _CACHE.clear()
    grid3 = tuple(grid) + (1,) * (3 - len(grid))
    _CACHE[key] = (compiled[grid3], tuple(meta[n] for n in names))
