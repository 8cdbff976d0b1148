"""Correctness on a real Ascend NPU (Atlas A2/A3): every op's compiled Ascend-plan kernels, forward and
gradients, at realistic sizes, against the same op's PyTorch reference on the CPU.

Skipped everywhere else (CI has no NPU and never installs torch_npu; torch_npu is not even imported
unless it is installed). On a machine with an NPU, torch_npu, CANN and triton-ascend:

    TRITON_INTERPRET=0 python -m pytest -q fusedops_tests/test_npu_device.py

TRITON_INTERPRET=0 matters: without CUDA, fusedops_tests/conftest.py otherwise turns the interpreter
on, and these tests must run the compiled kernels. See docs/ascend.md.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from fusedops_tests.helpers import assert_close

if importlib.util.find_spec("torch_npu") is None:
    pytest.skip("needs torch_npu and an Ascend NPU", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("run with TRITON_INTERPRET=0: these tests run the compiled kernels", allow_module_level=True)

import torch_npu  # noqa: E402,F401

if not torch.npu.is_available():
    pytest.skip("torch_npu sees no NPU", allow_module_level=True)

import fusedops  # noqa: E402

NPU = torch.device("npu")
DTYPES = [torch.float32, torch.bfloat16]


def run(fn, inputs, dtype, device, grad_seed=1234):
    """fn's output and the gradients of every floating input, for a fixed random cotangent."""
    xs = []
    for x in inputs:
        if x.is_floating_point():
            x = x.detach().to(device=device, dtype=dtype).requires_grad_(True)
        else:
            x = x.to(device)
        xs.append(x)
    out = fn(*xs)
    gen = torch.Generator().manual_seed(grad_seed)
    grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(device=device, dtype=out.dtype)
    grads = torch.autograd.grad(out, [x for x in xs if x.is_floating_point()], grad_out)
    return [out.detach().cpu()] + [g.cpu() for g in grads]


def compare(name, fn, inputs, dtype, scale=1.0):
    """The NPU's answer in `dtype` against the op's PyTorch reference on the CPU in float32 (fp32
    accumulation: ~1e-6 relative error, well inside every tolerance of fusedops_tests.helpers.RTOL)."""
    os.environ.pop("FUSEDOPS_INTERPRET", None)  # CPU tensors take the reference path
    expected = run(fn, inputs, torch.float32, torch.device("cpu"))
    got = run(fn, inputs, dtype, NPU)
    labels = ["out"] + [f"grad{i}" for i in range(len(got) - 1)]
    for label, g, e in zip(labels, got, expected):
        assert_close(f"{name} {label}", g, e, dtype, scale)


ATTN_RES = [(8, (2, 1024), 1024), (4, (4, 256), 4096), (16, (1, 128), 7168), (6, (1, 64), 16384)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,batch,dim", ATTN_RES, ids=[f"N{c[0]}-D{c[2]}" for c in ATTN_RES])
def test_attn_res(n, batch, dim, dtype):
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(n, *batch, dim, generator=gen)
    query = 0.5 * torch.randn(dim, generator=gen)
    weight = 1 + 0.1 * torch.randn(dim, generator=gen)
    compare("attn_res", lambda v, q, w: fusedops.attn_res(v, q, w), (values, query, weight), dtype)


EMBEDDING = [(32000, 4096, (4, 512)), (50257, 768, (8, 1024)), (1000, 1600, (2, 333))]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab,dim,shape", EMBEDDING, ids=[f"V{c[0]}-D{c[1]}" for c in EMBEDDING])
def test_embedding(vocab, dim, shape, dtype):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, dim, generator=gen)
    indices = torch.randint(0, vocab, shape, generator=gen)
    indices.view(-1)[:64] = 7  # a long run of one index: the backward's reduction
    compare("embedding", lambda w, i: fusedops.embedding(i, w), (weight, indices), dtype)


NA = [
    ((1, 4, 2048, 64), 7, False),
    ((1, 4, 2048, 128), 33, True),
    ((1, 2, 56, 56, 64), (7, 7), False),
    ((1, 2, 16, 16, 16, 64), (3, 3, 3), False),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,kernel,causal", NA, ids=[f"{len(c[0]) - 3}D-{c[1]}" for c in NA])
def test_neighborhood_attention(shape, kernel, causal, dtype):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=gen) for _ in range(3))
    compare(
        "neighborhood_attention",
        lambda q, k, v: fusedops.neighborhood_attention(q, k, v, kernel, is_causal=causal),
        (q, k, v),
        dtype,
    )


def test_npu_kernels_are_registered():
    for name in fusedops.op_names():
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"fusedops::{name}", "PrivateUse1"), name


def test_ascend_target_reads_the_device():
    from fusedops.targets import target_for

    t = target_for(torch.device("npu", torch.npu.current_device()))
    assert t.vendor == "ascend" and not t.interpreted
    print(f"Ascend target: {t}")
    assert t.vector_cores > 0 and t.matrix_cores > 0
