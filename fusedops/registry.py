"""Registering fusedops ops with torch.library, once for every op.

`fused_op` wraps `torch.library.triton_op` under the `fusedops::` namespace and remembers the
implementation, so that `register_npu_kernels` can give each op an explicit PrivateUse1 ("npu")
kernel when torch_npu is present. The op body itself picks the plan from the tensors' device type.

Eager calls skip the dispatcher where that is safe (`direct_call_ok`): the torch.ops path of a
triton_op costs ~0.1-0.2 ms of host time per call (fill_defaults, redispatch, the autograd wrapper),
more than a whole small kernel. The wrappers then run the same implementation through a plain
torch.autograd.Function (`direct_autograd`); whatever traces (torch.compile, export, fake tensors,
functorch transforms, tensor subclasses, modes) goes through torch.ops and sees the registered op.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable

import torch
from torch.library import triton_op

from fusedops import internals
from fusedops.internals import set_wrap_triton_enabled
from fusedops.plans import carry_overrides

NAMESPACE = "fusedops"

_IMPLS: dict[str, tuple[object, Callable]] = {}
_NPU_DONE: set[str] = set()  # ops whose npu kernel is registered
_npu_enabled = False  # register_npu_kernels ran: ops defined later register theirs at definition


def fused_op(name: str, mutates_args: tuple[str, ...] = ()) -> Callable[[Callable], object]:
    """Decorator: define `fusedops::<name>` from a body that launches kernels through wrap_triton;
    `mutates_args` names the arguments it writes in place (an inference-only op: no autograd)."""

    def define(fn: Callable) -> object:
        op = triton_op(f"{NAMESPACE}::{name}", fn, mutates_args=mutates_args)
        _IMPLS[name] = (op, fn)
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
    op, fn = _IMPLS[name]
    op.register_kernel("npu", fn)
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


def direct_call_ok(*tensors) -> bool:
    """Whether an eager call may run an op's implementation directly rather than through torch.ops:
    not tracing (torch.compile, export), no torch function or dispatch mode (fake tensors, make_fx,
    FunctionalTensorMode), no functorch transform (vmap, grad), and every tensor a plain Tensor or
    Parameter (no subclass). None entries are skipped. Always False with the direct calls off
    (fusedops.internals: FUSEDOPS_FAST_PATH=0, or an internal they need is missing)."""
    if not internals.DIRECT_CALLS or torch.compiler.is_compiling() or internals.modes_active():
        return False
    return all(t is None or type(t) in _PLAIN_TENSORS for t in tensors)


def call_direct(fn: Callable, *args):
    """Run an op implementation with its wrap_triton launches going straight to Triton (as
    triton_op's own eager kernel does)."""
    with set_wrap_triton_enabled(False):
        return fn(*args)


def register_autograd(op, backward: Callable, setup_context: Callable) -> None:
    """op.register_autograd with the backward planned under the plan_override blocks of its forward
    (fusedops.plans.carry_overrides)."""
    setup_context, backward = carry_overrides(setup_context, backward)
    op.register_autograd(backward, setup_context=setup_context)


def direct_autograd(name: str, forward: Callable, setup_context: Callable, backward: Callable) -> type:
    """A torch.autograd.Function running `forward` (an op's checked-args implementation) with the op's
    own setup_context and backward rule. The backward rule decides again whether to call the backward
    implementation directly (see `backward_direct_ok`). Its `call` is `apply` where autograd will need a
    graph, and the bare implementation where it will not (no tensor argument requires grad, or grad
    mode is off): the Function machinery costs ~40 us of host time, a third of a small eager call."""

    setup_context, backward = carry_overrides(setup_context, backward)

    def run(ctx, *args):
        # forward(ctx, ...) rather than a separate setup_context staticmethod: with the latter,
        # autograd.Function.apply binds the arguments through inspect.signature on every call.
        output = call_direct(forward, *args)
        setup_context(ctx, args, output)
        return output

    def call(*args):
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return cls.apply(*args)
        return call_direct(forward, *args)

    cls = type(name, (torch.autograd.Function,),
               {"forward": staticmethod(run), "backward": staticmethod(backward), "call": staticmethod(call)})
    return cls


def backward_direct_ok(*tensors) -> bool:
    """direct_call_ok for a backward rule: also requires grad mode off, so a double backward
    (create_graph=True) goes through the backward op, which refuses it, instead of silently
    returning gradients that carry no graph."""
    return not torch.is_grad_enabled() and direct_call_ok(*tensors)


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
