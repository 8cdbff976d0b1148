"""Launching Triton kernels from op bodies.

`launch` goes through `wrap_triton` wherever torch.compile or export may be tracing. In eager calls
on CUDA (wrap_triton's tracing switched off, as in the direct path and triton_op's own eager kernel)
it reuses the compiled kernel of an earlier launch with the same specialisation and hands the
arguments straight to Triton's launcher (`CompiledKernel.run`, which the runner of `compiled[grid]`
calls too), skipping Triton's per-call binding and specialisation of every argument and the runner's
device, stream and launch-metadata look-ups. On the H100 host one launch of the embedding backward
kernel (12 arguments) costs 15-28 us through kernel[grid](...), 8-12 through the runner, 10-13 through
this cache (22-27 when it called the runner); a fusedops step makes three to six launches
(bench/NOTES.md, embedding run 15).

The cache key holds everything Triton specialises on: the kernel, the grid, every scalar argument's
value, the constexpr/launch options, the device, and each tensor's dtype and 16-byte alignment.
Pointers go to the launcher as integers (the tensors were checked to be on one CUDA device), which
also spares it a data_ptr() call and a pointer-attribute query per tensor. Launch hooks (Triton's
profilers) see every launch: while any is set, launches go through the runner.

Kernels are launched by name: `launch(kernel, grid, dict(x_ptr=x, stride_x=..., N=n), dict(BLOCK=64, num_warps=4))`.
The names are bound to the kernel's parameter positions once per kernel (`bind`, from its `arg_names`); a
missing or unknown name raises TypeError naming it, so a swapped pair of strides cannot go unnoticed as it
could positionally. After binding, every path launches positionally as before (the fast path unchanged).
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.library import wrap_triton

try:
    from triton.runtime.interpreter import InterpretedFunction as _InterpretedFunction
except ImportError:  # pragma: no cover - a Triton without the interpreter (triton-ascend's has it)
    class _InterpretedFunction:  # noqa: N801 - never instantiated: isinstance() is always False
        pass

from fusedops import internals
from fusedops.internals import is_wrap_triton_enabled

_CACHE: dict[tuple, "_Compiled"] = {}
_CACHE_LIMIT = 4096
# Triton's interpreter runs a kernel by patching triton.language's module state for the launch, so two
# threads launching at once break each other (InterpreterError): CPU launches take turns.
_INTERPRETER_LOCK = threading.RLock()


class _Compiled:
    """A compiled kernel and what its launcher needs besides the arguments."""

    __slots__ = ("kernel", "grid", "constexprs", "runner", "run", "function", "metadata")

    def __init__(self, kernel, grid3: tuple, compiled, constexprs: tuple):
        self.kernel, self.grid, self.constexprs = kernel, grid3, constexprs
        self.runner = compiled[grid3]  # also loads the module (the function handle) once
        self.run, self.function, self.metadata = internals.launcher_of(compiled) or (None, None, None)

    def __call__(self, device: int, pointers: list, scalars: tuple) -> None:
        if self.run is None or internals.launch_hooks_set():
            self.runner(*pointers, *scalars, *self.constexprs)
            return
        gx, gy, gz = self.grid
        # What the runner passes, less the launch metadata only hooks read, and its look-ups.
        self.run(gx, gy, gz, internals.raw_stream(device), self.function, self.metadata,
                 None, None, None, *pointers, *scalars, *self.constexprs)


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


_BINDINGS: dict[int, tuple] = {}
_LAUNCH_OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas", "maxnreg", "sanitize_overflow"})


def _binding(kernel) -> tuple:
    """(kernel, runtime parameter names in order, constexpr names) of a kernel, computed once."""
    entry = _BINDINGS.get(id(kernel))
    if entry is not None and entry[0] is kernel:
        return entry
    names = list(kernel.arg_names)
    params = getattr(kernel, "params", None)
    if params is not None:
        constexpr = {p.name for p in params if p.is_constexpr}
    elif hasattr(kernel, "fn"):  # the interpreter's InterpretedFunction: the parameters annotated tl.constexpr
        import inspect

        sig = inspect.signature(kernel.fn)
        constexpr = {n for n, p in sig.parameters.items() if "constexpr" in str(p.annotation)}
    else:  # an object that only names its parameters: nothing to check the meta keys against
        entry = (kernel, tuple(names), None)
        _BINDINGS[id(kernel)] = entry
        return entry
    entry = (kernel, tuple(n for n in names if n not in constexpr), frozenset(constexpr))
    _BINDINGS[id(kernel)] = entry
    return entry


def bind(kernel, args: dict) -> list:
    """The kernel's runtime arguments in parameter order, from `args` by name (TypeError naming what is
    missing or unknown)."""
    _, names, _ = _binding(kernel)
    try:
        values = [args[n] for n in names]
    except KeyError:
        values = None
    if values is None or len(args) != len(names):
        missing = [n for n in names if n not in args]
        unknown = [n for n in args if n not in names]
        kname = getattr(getattr(kernel, "fn", kernel), "__name__", kernel)
        raise TypeError(f"launch of {kname}: missing arguments {missing}, unknown arguments {unknown}")
    return values


def check_meta(kernel, meta: dict) -> None:
    """TypeError naming a meta key that is neither a constexpr parameter of the kernel nor a launch option."""
    _, _, constexpr = _binding(kernel)
    if constexpr is None:
        return
    unknown = [k for k in meta if k not in constexpr and k not in _LAUNCH_OPTIONS]
    if unknown:
        kname = getattr(getattr(kernel, "fn", kernel), "__name__", kernel)
        raise TypeError(f"launch of {kname}: unknown constexpr/launch options {unknown}")


def split(values: list) -> tuple[list, tuple]:
    """(tensors, scalars) of bound values: the kernels take their tensors first."""
    k = 0
    for v in values:
        if not (isinstance(v, torch.Tensor) or hasattr(v, "data_ptr")):
            break
        k += 1
    return values[:k], tuple(values[k:])


def launch(kernel, grid: tuple[int, ...], args: dict, meta: dict) -> None:
    """kernel[grid](**args, **meta) on the first tensor's device, bound to positions by name (`bind`),
    the tensors being the kernel's leading parameters, all on that device. meta holds the constexprs and
    launch options; it may hold `maxnreg` (a per-thread register cap), honoured on direct CUDA launches
    only: the interpreter has no registers and torch.compile's wrap_triton would take it for a kernel
    argument."""
    tensors, scalars = split(bind(kernel, args))
    if is_wrap_triton_enabled():  # traced: the generated code sets the device itself
        _launch_wrapped(kernel, grid, tensors, scalars, meta)
    elif tensors[0].is_cuda:
        _launch_cuda(kernel, grid, tensors, scalars, meta)
    else:
        with device_switch(tensors[0]):
            _launch_wrapped(kernel, grid, tensors, scalars, meta)


def _launch_wrapped(kernel, grid, tensors, scalars, meta) -> None:
    check_meta(kernel, meta)
    meta = {k: v for k, v in meta.items() if k != "maxnreg"}
    # Under TRITON_INTERPRET=1 a kernel is an InterpretedFunction and runs as it is: torch 2.13's wrap_triton
    # hands it back unchanged, torch 2.11's refuses it ("wrap_triton only works on functions annotated ...").
    runner = kernel if isinstance(kernel, _InterpretedFunction) else wrap_triton(kernel)
    with _interpreter_turn(tensors[0]):
        runner[grid](*tensors, *scalars, **meta)


def _interpreter_turn(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """The interpreter's lock for a launch on CPU tensors (only Triton's interpreter runs those), so that
    launches from several threads run one at a time; nothing for device tensors, whose launches never
    wait (and the direct CUDA path never asks)."""
    return _INTERPRETER_LOCK if t.device.type == "cpu" else contextlib.nullcontext()


def _launch_cuda(kernel, grid, tensors, scalars, meta) -> None:
    if not internals.CACHED_LAUNCHES:
        check_meta(kernel, meta)
        with device_switch(tensors[0]):
            kernel[grid](*tensors, *scalars, **_debug_options(kernel, meta))
        return
    device = tensors[0].get_device()
    pointers = [t.data_ptr() for t in tensors]
    # id(kernel), not the JITFunction (whose hash is a Python call); the entry's kernel is compared.
    key = (id(kernel), grid, scalars, tuple(meta.items()), device, tuple([t.dtype for t in tensors]),
           tuple([p % 16 == 0 for p in pointers]))
    entry = _CACHE.get(key)
    if entry is not None and entry.kernel is kernel:
        if internals.current_cuda_device() == device:
            entry(device, pointers, scalars)
        else:
            with device_switch(tensors[0]):
                entry(device, pointers, scalars)
        return
    check_meta(kernel, meta)
    meta = _debug_options(kernel, meta)
    with device_switch(tensors[0]):
        compiled = kernel[grid](*tensors, *scalars, **meta)
    # A compiled kernel's launcher takes every parameter positionally, constexprs included.
    names = kernel.arg_names[len(tensors) + len(scalars):]
    if compiled is None or not hasattr(compiled, "__getitem__") or any(n not in meta for n in names):
        return  # an unexpected Triton: keep launching through kernel[grid]
    if len(_CACHE) >= _CACHE_LIMIT:
        _CACHE.clear()
    _CACHE[key] = _Compiled(kernel, tuple(grid) + (1,) * (3 - len(grid)), compiled, tuple(meta[n] for n in names))


def _debug_options(kernel, meta: dict) -> dict:
    """A kernel in debug mode (for its device asserts) launches without Triton's overflow checks."""
    return {**meta, "sanitize_overflow": False} if getattr(kernel, "debug", False) else meta
