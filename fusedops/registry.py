"""Registering fusedops ops with torch.library, once for every op.

`fused_op` wraps `torch.library.triton_op` under the `fusedops::` namespace and remembers the
implementation, so that `register_npu_kernels` can give each op an explicit PrivateUse1 ("npu")
kernel when torch_npu is present. The op body itself picks the plan from the tensors' device type.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch.library import triton_op

NAMESPACE = "fusedops"

_IMPLS: dict[str, tuple[object, Callable]] = {}
_NPU_DONE: set[str] = set()  # ops whose npu kernel is registered
_npu_enabled = False  # register_npu_kernels ran: ops defined later register theirs at definition


def fused_op(name: str) -> Callable[[Callable], object]:
    """Decorator: define `fusedops::<name>` from a body that launches kernels through wrap_triton."""

    def define(fn: Callable) -> object:
        op = triton_op(f"{NAMESPACE}::{name}", fn, mutates_args=())
        _IMPLS[name] = (op, fn)
        if _npu_enabled:
            _register_npu(name)
        return op

    return define


def op_names() -> list[str]:
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
    backend = torch._C._get_privateuse1_backend_name()
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
    import torch._functorch.config as functorch_config

    if hasattr(functorch_config, "decompose_custom_triton_ops"):
        return functorch_config.patch(decompose_custom_triton_ops=False)
    return contextlib.nullcontext()
