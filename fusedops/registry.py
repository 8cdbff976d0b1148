"""Registering fusedops ops with torch.library, once for every op.

`fused_op` declares an op from its body (a `torch.library.triton_op` under the `fusedops::` namespace), its
fake kernel and its autograd formula, and remembers it, so that `register_npu_kernels` can give each op an
explicit PrivateUse1 ("npu") kernel when torch_npu is present. The op body itself picks the plan from the
tensors' device type.

Calling the declared op (a `FusedOp`) skips the dispatcher where that is safe (`direct_call_ok`): the
torch.ops path of a triton_op costs ~0.1-0.2 ms of host time per call (fill_defaults, redispatch, the
autograd wrapper), more than a whole small kernel. The same implementation then runs through a plain
torch.autograd.Function with the op's own formula; whatever traces (torch.compile, export, fake tensors,
functorch transforms, tensor subclasses, modes) goes through torch.ops and sees the registered op.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Callable, Optional

import torch
from torch.library import triton_op

from fusedops import internals
from fusedops.internals import set_wrap_triton_enabled
from fusedops.plans import carry_overrides

NAMESPACE = "fusedops"

_IMPLS: dict[str, "FusedOp"] = {}
_NPU_DONE: set[str] = set()  # ops whose npu kernel is registered
_npu_enabled = False  # register_npu_kernels ran: ops defined later register theirs at definition


class FusedOp:
    """One op, `torch.ops.fusedops.<name>`, declared once with `fused_op`. Calling it runs the op as an eager
    caller wants it: the implementation straight away where that is safe (`direct_call_ok`; through a plain
    torch.autograd.Function carrying the op's autograd formula where a gradient will be needed), else through
    torch.ops, which is what tracing, fake tensors, functorch transforms, modes and tensor subclasses see.
    Public wrappers and autograd formulas call ops this way, never torch.ops directly."""

    def __init__(self, name: str, body: Callable, run: Callable, fake: Callable, setup_context: Optional[Callable],
                 backward: Optional[Callable], mutates_args: tuple[str, ...]):
        self.name = name
        self.op = triton_op(f"{NAMESPACE}::{name}", body, mutates_args=mutates_args)
        self.op.register_fake(fake)
        self.body, self.run = body, run
        self.overload = getattr(getattr(torch.ops, NAMESPACE), name).default
        params = list(inspect.signature(body).parameters)
        self._mutated = tuple(params.index(arg) for arg in mutates_args)
        self._function = None
        if backward is not None:
            setup_context, backward = carry_overrides(setup_context, backward)
            self.op.register_autograd(backward, setup_context=setup_context)
            self._function = _direct_function(name, run, setup_context, backward)

    def __call__(self, *args):
        if direct_call_ok(*args):
            if self._function is not None:
                return self._function.call(*args)
            # No autograd formula (a backward op, an in-place op): torch.ops refuses a gradient, so must this.
            if not _grad_needed(args):
                result = call_direct(self.run, *args)
                for i in self._mutated:  # announce the write as the dispatcher would (a saved view then fails)
                    torch.autograd.graph.increment_version(args[i])
                return result
        return self.overload(*args)


def fused_op(name: str, *, fake: Callable, run: Optional[Callable] = None, setup_context: Optional[Callable] = None,
             backward: Optional[Callable] = None, mutates_args: tuple[str, ...] = ()) -> Callable[[Callable], FusedOp]:
    """Decorator declaring `fusedops::<name>` from its body, the op's whole implementation: it validates its
    arguments (ValueError naming the argument) and launches kernels through wrap_triton (or runs the reference).
    The body's annotated signature is the op's schema, its docstring the op's. With it:
      fake(*args): the same checks, then empty outputs of the right shapes and dtypes (tracing, meta tensors);
      run(*args): the body without its checks, for eager calls whose wrapper has checked the arguments (default:
        the body). It takes the op's arguments with the op's meaning: a caller may pass them in a normal form
        (per-axis lists, a default filled in) only where the op reads that form the same way;
      setup_context(ctx, args, output) and backward(ctx, *grads): the autograd formula, as
        torch.library.register_autograd takes it; the backward calls the backward op (a FusedOp) for its
        gradients. Without them the op has no gradient (a backward op, or an inference-only one).
      mutates_args: the arguments the body writes in place (then no autograd formula)."""

    def define(body: Callable) -> FusedOp:
        op = FusedOp(name, body, run or body, fake, setup_context, backward, mutates_args)
        _IMPLS[name] = op
        if _npu_enabled:
            _register_npu(name)
        return op

    return define


def op_names() -> list[str]:
    """The registered fusedops op names (forward and backward ops, e.g. "embedding_backward"), sorted;
    each is torch.ops.fusedops.<name>."""
    return sorted(_IMPLS)


def _register_npu(name: str) -> None:
    if name in _NPU_DONE:
        return
    fused = _IMPLS[name]
    fused.op.register_kernel("npu", fused.body)
    _NPU_DONE.add(name)


def register_npu_kernels() -> list[str]:
    """Register every op's body as its "npu" (PrivateUse1) kernel, once per op; ops defined afterwards
    register theirs when they are defined. Needs the PrivateUse1 backend to be named "npu" (torch_npu
    does this on import). Returns the names of the ops registered."""
    global _npu_enabled
    backend = internals.privateuse1_backend_name()
    if backend != "npu":
        raise RuntimeError(
            f'fusedops registers its Ascend kernels for the "npu" device, but the PrivateUse1 backend is '
            f"named {backend!r}: import torch_npu (or torch.utils.rename_privateuse1_backend('npu')) first"
        )
    _npu_enabled = True
    for name in op_names():
        _register_npu(name)
    return op_names()


def opaque_triton_ops():
    """A context in which torch.compile and torch.export keep fusedops ops as single graph nodes
    instead of tracing into their kernels. Needed on CPU under the Triton interpreter, whose kernels
    cannot be traced; a no-op on torch builds without the flag."""
    functorch_config = internals.functorch_config()
    if hasattr(functorch_config, "decompose_custom_triton_ops"):
        return functorch_config.patch(decompose_custom_triton_ops=False)
    return contextlib.nullcontext()


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def direct_call_ok(*args) -> bool:
    """Whether an eager call may run an op's implementation directly rather than through torch.ops:
    not tracing (torch.compile, export), no torch function or dispatch mode (fake tensors, make_fx,
    FunctionalTensorMode), no functorch transform (vmap, grad), and every tensor among args a plain Tensor
    or Parameter (no subclass); other arguments are not looked at. Always False with the direct calls off
    (fusedops.internals: FUSEDOPS_FAST_PATH=0, or an internal they need is missing)."""
    if not internals.DIRECT_CALLS or torch.compiler.is_compiling() or internals.modes_active():
        return False
    return all(type(a) in _PLAIN_TENSORS for a in args if isinstance(a, torch.Tensor))


def _grad_needed(args) -> bool:
    return torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


def call_direct(fn: Callable, *args):
    """Run an op implementation with its wrap_triton launches going straight to Triton (as
    triton_op's own eager kernel does)."""
    with set_wrap_triton_enabled(False):
        return fn(*args)


def _direct_function(name: str, run: Callable, setup_context: Callable, backward: Callable) -> type:
    """A torch.autograd.Function running `run` with the op's setup_context and backward rule. Its `call` is
    `apply` where autograd will need a graph, and the bare implementation where it will not (no tensor
    argument requires grad, or grad mode is off): the Function machinery costs ~40 us of host time, a third
    of a small eager call."""

    def forward(ctx, *args):
        # forward(ctx, ...) rather than a separate setup_context staticmethod: with the latter,
        # autograd.Function.apply binds the arguments through inspect.signature on every call.
        output = call_direct(run, *args)
        setup_context(ctx, args, output)
        return output

    def call(*args):
        if _grad_needed(args):
            return cls.apply(*args)
        return call_direct(run, *args)

    cls = type(name, (torch.autograd.Function,),
               {"forward": staticmethod(forward), "backward": staticmethod(backward), "call": staticmethod(call)})
    return cls


def memoize(fn: Callable) -> Callable:
    """lru_cache for launch specs and plans, skipped when an argument is unhashable (symbolic sizes while
    torch.compile traces with dynamic shapes)."""
    cached = functools.lru_cache(maxsize=1024)(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            hash((args, tuple(kwargs.items())))
        except TypeError:
            return fn(*args, **kwargs)
        return cached(*args, **kwargs)

    call.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
    return call
