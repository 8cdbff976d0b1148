"""Shared test machinery: choosing the execution path, tolerances, comparisons."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional
from unittest import mock

import pytest
import torch

from fusedops.launch import bind, split
from fusedops.registry import opaque_triton_ops  # noqa: F401  (re-exported for the tests)

# The three ways a CPU tensor can run: the PyTorch reference, or the Triton kernels in the interpreter
# under the CUDA or the Ascend launch plan.
PATHS = [
    pytest.param("reference", id="reference"),
    pytest.param("cuda", id="cuda-plan", marks=pytest.mark.interpreter),
    pytest.param("ascend", id="ascend-plan", marks=[pytest.mark.interpreter, pytest.mark.ascend]),
]
KERNEL_PATHS = PATHS[1:]

# Relative error ||out - ref|| / ||ref|| allowed per dtype, against a float64 reference.
RTOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

HAS_CUDA = torch.cuda.is_available()
INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"


def gpu(test):
    """A test that needs a CUDA device: marked `gpu` (what `pytest -m gpu` selects) and skipped elsewhere."""
    return pytest.mark.gpu(pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")(test))


def _put_env(name: str, value: Optional[str]) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


@contextlib.contextmanager
def _env(**updates: Optional[str]) -> Iterator[None]:
    """Set (a str) or unset (None) environment variables for the duration of the block."""
    saved = {k: os.environ.get(k) for k in updates}
    try:
        for k, v in updates.items():
            _put_env(k, v)
        yield
    finally:
        for k, v in saved.items():
            _put_env(k, v)


@contextlib.contextmanager
def execution_path(path: str, onchip_bytes: Optional[int] = None) -> Iterator[None]:
    """Run CPU tensors through `path` ("reference", "cuda" or "ascend"); `onchip_bytes` forces a small
    on-chip budget on both plans so the tiled code paths run at test sizes."""
    if path != "reference" and not INTERPRETER:
        pytest.skip("interpreter-plan tests need TRITON_INTERPRET=1 (CPU-only machines set it)")
    budget = None if onchip_bytes is None else str(onchip_bytes)
    with _env(
        FUSEDOPS_INTERPRET=None if path == "reference" else path,
        FUSEDOPS_CUDA_ONCHIP_BYTES=budget,
        FUSEDOPS_ASCEND_UB_BYTES=budget,
    ):
        yield


@contextlib.contextmanager
def recorded_launches(module) -> Iterator[list]:
    """Every kernel launch of `module` (an op module that calls fusedops.launch.launch) recorded as
    (kernel name, tensors, meta) and still run: what a kernel was handed, not what aten ops ran (a
    TorchDispatchMode around a fusedops op sees only the op, not the aten calls inside its body)."""
    launches: list = []
    real = module.launch

    def record(kernel, grid, args, meta):
        tensors, _ = split(bind(kernel, args))
        launches.append((getattr(kernel, "fn", kernel).__name__, list(tensors), dict(meta)))
        return real(kernel, grid, args, meta)

    with mock.patch.object(module, "launch", record):
        yield launches


def same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b are the same memory seen the same way (so a kernel handed a read b in place)."""
    return a.data_ptr() == b.data_ptr() and a.stride() == b.stride() and a.shape == b.shape


@contextlib.contextmanager
def float32_matmul_precision(precision: str) -> Iterator[None]:
    """torch.set_float32_matmul_precision(precision) for the block ("highest", "high" or "medium"), then
    the caller's setting back: the legacy one, and the new API's (torch >= 2.9) exactly."""
    matmul = torch.backends.cuda.matmul
    saved = getattr(matmul, "fp32_precision", None)
    # the legacy getter raises once the new API is in use
    legacy = torch.get_float32_matmul_precision() if saved in (None, "none") else "highest"
    try:
        torch.set_float32_matmul_precision(precision)
        yield
    finally:
        torch.set_float32_matmul_precision(legacy)
        if saved is not None:
            matmul.fp32_precision = saved


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere in out fails every tolerance."""
    out, ref = out.double(), ref.double()
    if torch.isnan(out).any():
        return float("inf")
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff / denom if denom > 0 else diff


def assert_close(name: str, out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    err = rel_err(out, ref)
    tol = RTOL[dtype] * scale
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.1e} ({dtype})"


def assert_compiles_like_eager(path: str, model: torch.nn.Module, x: torch.Tensor, rtol=1e-5, atol=1e-6) -> None:
    """torch.compile(fullgraph=True) of `model` (no graph break) gives eager's output and parameter
    gradients on `path`. rtol = atol = 0 asks for identical bits."""
    params = [p for p in model.parameters() if p.requires_grad]
    with execution_path(path), opaque_triton_ops():
        eager = model(x)
        eager_grads = torch.autograd.grad(eager.square().sum(), params)
        torch._dynamo.reset()
        out = torch.compile(model, fullgraph=True, backend="aot_eager")(x)
        grads = torch.autograd.grad(out.square().sum(), params)
    torch.testing.assert_close(out, eager, rtol=rtol, atol=atol)
    for g, ref in zip(grads, eager_grads):
        torch.testing.assert_close(g, ref, rtol=rtol * 10, atol=atol)


def assert_export_round_trip(path: str, model: torch.nn.Module, x: torch.Tensor, op: str, rtol=1e-5, atol=1e-6) -> None:
    """torch.export keeps `fusedops.<op>` as a node, and the saved and reloaded program gives the
    eager model's output on `path`."""
    import io

    with execution_path(path), opaque_triton_ops():
        program = torch.export.export(model, (x,))
        buffer = io.BytesIO()
        torch.export.save(program, buffer)
        buffer.seek(0)
        reloaded = torch.export.load(buffer)
        assert any(f"fusedops.{op}" in str(node.target) for node in reloaded.graph.nodes)
        torch.testing.assert_close(reloaded.module()(x), model(x), rtol=rtol, atol=atol)


def assert_compiled_leaves_like_eager(fn, inputs, rtol=2e-2, atol=2e-2) -> None:
    """fullgraph torch.compile of fn over leaf inputs that require grad (what a user compiling a
    function of parameters does): Inductor must not take a kernel for writing an input (a leaf cannot
    be written in place), and outputs and input gradients must match eager."""
    leaves = [t for t in inputs if t.requires_grad]
    eager = fn(*inputs)
    grad_out = torch.randn_like(eager)
    eager_grads = torch.autograd.grad(eager, leaves, grad_out)
    torch._dynamo.reset()
    out = torch.compile(fn, fullgraph=True)(*inputs)
    grads = torch.autograd.grad(out, leaves, grad_out)
    torch.testing.assert_close(out, eager, rtol=rtol, atol=atol)
    for g, ref in zip(grads, eager_grads):
        torch.testing.assert_close(g, ref, rtol=rtol, atol=atol * max(1.0, ref.abs().max().item()))


def assert_dynamic_compile_like_eager(fn, input_sets, backend: str = "aot_eager", rtol=1e-5, atol=1e-5) -> None:
    """torch.compile(fn, fullgraph=True, dynamic=True) over inputs of several shapes (what variable
    sequence lengths give a training loop): one graph serves them all, with no recompilation, and
    every output and input gradient matches eager's. Sizes must avoid 0 and 1, which torch always
    specialises. Run it inside the execution path under test (and opaque_triton_ops() on CPU)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend=backend)
    for inputs in input_sets:
        leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
        eager = fn(*inputs)
        grad_out = torch.randn_like(eager)
        eager_grads = torch.autograd.grad(eager, leaves, grad_out)
        out = compiled(*inputs)
        grads = torch.autograd.grad(out, leaves, grad_out)
        torch.testing.assert_close(out, eager, rtol=rtol, atol=atol)
        for g, ref in zip(grads, eager_grads):
            torch.testing.assert_close(g, ref, rtol=rtol, atol=atol * max(1.0, ref.abs().max().item()))
    assert counters["stats"]["unique_graphs"] == 1, f"recompiled: {dict(counters['stats'])}"


def assert_export_dynamic_like_eager(path: str, model: torch.nn.Module, example: tuple, dynamic_shapes,
                                     input_sets, op: str, rtol=1e-5, atol=1e-6) -> None:
    """torch.export with symbolic dims keeps `fusedops.<op>` as a node, and the saved and reloaded
    program serves inputs of other sizes like the eager model on `path`."""
    import io

    with execution_path(path), opaque_triton_ops():
        program = torch.export.export(model, example, dynamic_shapes=dynamic_shapes)
        buffer = io.BytesIO()
        torch.export.save(program, buffer)
        buffer.seek(0)
        reloaded = torch.export.load(buffer).module()
        assert any(f"fusedops.{op}" in str(node.target) for node in program.graph.nodes)
        for inputs in input_sets:
            torch.testing.assert_close(reloaded(*inputs), model(*inputs), rtol=rtol, atol=atol)


def assert_inductor_like_eager(model: torch.nn.Module, x: torch.Tensor, rtol=2e-2, atol=2e-2) -> None:
    """On a GPU, Inductor compiles the ops' Triton kernels into its own graph (triton_op + wrap_triton,
    no opaque node): fullgraph compile must match eager, forward and parameter gradients."""
    params = [p for p in model.parameters() if p.requires_grad]
    eager = model(x)
    eager_grads = torch.autograd.grad(eager.float().square().sum(), params)
    torch._dynamo.reset()
    out = torch.compile(model, fullgraph=True)(x)
    grads = torch.autograd.grad(out.float().square().sum(), params)
    torch.testing.assert_close(out, eager, rtol=rtol, atol=atol)
    for g, ref in zip(grads, eager_grads):
        torch.testing.assert_close(g, ref, rtol=rtol, atol=atol * max(1.0, ref.abs().max().item()))
