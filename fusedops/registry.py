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


def fused_op(name: str) -> Callable[[Callable], object]:
    """Decorator: define `fusedops::<name>` from a body that launches kernels through wrap_triton."""

    def define(fn: Callable) -> object:
        op = triton_op(f"{NAMESPACE}::{name}", fn, mutates_args=())
        _IMPLS[name] = (op, fn)
        return op

    return define


def op_names() -> list[str]:
    return sorted(_IMPLS)


def register_npu_kernels() -> None:
    """Register every op's body as its "npu" (PrivateUse1) kernel. Needs the PrivateUse1 backend to be
    named "npu" (torch_npu does this on import)."""
    for op, fn in _IMPLS.values():
        op.register_kernel("npu", fn)


def opaque_triton_ops():
    """A context in which torch.compile and torch.export keep fusedops ops as single graph nodes
    instead of tracing into their kernels. Needed on CPU under the Triton interpreter, whose kernels
    cannot be traced; a no-op on torch builds without the flag."""
    import torch._functorch.config as functorch_config

    if hasattr(functorch_config, "decompose_custom_triton_ops"):
        return functorch_config.patch(decompose_custom_triton_ops=False)
    return contextlib.nullcontext()
