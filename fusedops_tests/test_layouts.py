"""Every op, every tensor argument, any memory layout: a call on strided views (step slices, stride-0
expands, permuted storage, storage offsets, size-1 dims) gives the bits of the same call on contiguous
copies, forward and backward, on every path. Storage the views skip holds NaN (float) or other valid
indices, so a kernel that ignores a stride returns a visibly wrong answer instead of passing by luck."""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fusedops

from .helpers import PATHS, assert_close, execution_path


@st.composite
def layouts(draw, ndim: int, expandable: tuple[int, ...] = ()):
    """How to lay out a tensor of `ndim` dims: the storage order of its dims, a step per dim, an offset,
    and which dims (of `expandable`) are stride-0 expands of one slice."""
    return dict(
        order=draw(st.permutations(range(ndim))),
        steps=[draw(st.sampled_from([1, 1, 2, 3])) for _ in range(ndim)],
        offset=draw(st.integers(0, 5)),
        expand=[d for d in expandable if draw(st.integers(0, 3)) == 0],
    )


def relayout(t: torch.Tensor, layout: dict, junk) -> torch.Tensor:
    """A view holding t's values (constant along the expanded dims: their first slice) in a storage laid
    out as `layout` says; the storage around and between its elements holds `junk`."""
    full = t.shape
    for d in layout["expand"]:
        t = t.narrow(d, 0, 1)
    order, steps = layout["order"], layout["steps"]
    big = [t.shape[d] * steps[d] for d in order]
    buf = torch.full((layout["offset"] + math.prod(big),), junk, dtype=t.dtype)
    base = buf[layout["offset"]:].view(big).permute([order.index(d) for d in range(t.dim())])
    view = base[tuple(slice(None, None, s) for s in steps)]
    view.copy_(t)
    return view.expand(full)


def dense(t):
    return None if t is None else t.contiguous()


def assert_same(name, got, want, exact):
    """The kernels read a view as they read its contiguous copy: the same bits. The reference path is
    torch's CPU ops, whose reduction order may follow the layout: the same values within rounding."""
    assert got.shape == want.shape and got.dtype == want.dtype, name
    if exact:
        assert torch.equal(got, want), f"{name}: a strided layout changed the result"
    else:
        assert_close(name, got, want, got.dtype if got.is_floating_point() else torch.float32)


def grads_of(fn, inputs, grad_outs):
    """fn(*inputs) and, given output gradients, the gradients of every floating-point input."""
    train = bool(grad_outs)
    leaves = [x.detach().requires_grad_(train and x.is_floating_point()) if x is not None else None for x in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    if not train:
        return [o.detach() for o in outs], []
    wrt = [x for x in leaves if x is not None and x.requires_grad]
    grads = torch.autograd.grad(outs, wrt, grad_outs[: len(outs)], allow_unused=True)
    return [o.detach() for o in outs], list(grads)


def check_layouts(fn, inputs, grad_outs, data, expandable):
    """fn on relaid-out inputs and output gradients against fn on contiguous copies of the same values;
    expandable[i]: the dims of argument i (inputs, then grad_outs) that may be stride-0 expands."""
    views = []
    for i, t in enumerate(list(inputs) + list(grad_outs)):
        if t is None:
            views.append(None)
            continue
        junk = float("nan") if t.is_floating_point() else int(t.reshape(-1)[0]) if t.numel() else 0
        views.append(relayout(t, data.draw(layouts(t.dim(), expandable.get(i, ())), label=f"arg{i}"), junk))
    n = len(inputs)
    strided = grads_of(fn, views[:n], views[n:])
    contiguous = grads_of(fn, [dense(v) for v in views[:n]], [dense(v) for v in views[n:]])
    exact = os.environ.get("FUSEDOPS_INTERPRET") is not None
    for kind, got, want in zip(("out", "grad"), strided, contiguous):
        assert len(got) == len(want)
        for j, (g, w) in enumerate(zip(got, want)):
            assert_same(f"{kind}{j}", g, w, exact)


DTYPE = st.sampled_from([torch.float32, torch.bfloat16])


@pytest.mark.parametrize("path", PATHS)
@given(data=st.data(), dtype=DTYPE, shape=st.lists(st.integers(1, 4), min_size=1, max_size=3),
       V=st.integers(1, 9), D=st.integers(1, 12), scale=st.booleans())
@settings(max_examples=15)
def test_embedding(path, data, dtype, shape, V, D, scale):
    indices = torch.randint(0, V, shape)
    weight = torch.randn(V, D).to(dtype)
    grad_out = torch.randn(*shape, D).to(dtype)
    index_dims, grad_dims = tuple(range(len(shape))), tuple(range(len(shape) + 1))
    with execution_path(path):
        check_layouts(lambda w, i: fusedops.embedding(i, w, None, scale), (weight, indices), (grad_out,), data,
                      {0: (0, 1), 1: index_dims, 2: grad_dims})
        check_layouts(lambda g, i: torch.ops.fusedops.embedding_backward(g, i, V, None, scale), (grad_out, indices),
                      (), data, {0: grad_dims, 1: index_dims})


@pytest.mark.parametrize("path", PATHS)
@given(data=st.data(), dtype=DTYPE, n=st.integers(1, 5), batch=st.lists(st.integers(1, 3), min_size=0, max_size=3),
       D=st.integers(1, 24), with_weight=st.booleans())
@settings(max_examples=15)
def test_attn_res(path, data, dtype, n, batch, D, with_weight):
    values = torch.randn(n, *batch, D).to(dtype)
    query = torch.randn(D)
    weight = torch.randn(D) if with_weight else None
    grads = (torch.randn(*batch, D).to(dtype), torch.randn(batch))
    all_dims = tuple(range(values.dim()))
    with execution_path(path):
        check_layouts(lambda v, q, w: fusedops.attn_res(v, q, w, return_lse=True), (values, query, weight), grads,
                      data, {0: all_dims, 3: all_dims[:-1], 4: all_dims[:-2]})
        out, lse = fusedops.attn_res(values, query, weight, return_lse=True)

        def backward_op(g, v, q, w, o, l, gl):
            return torch.ops.fusedops.attn_res_backward(g, v, q, w, 1e-6, True, True, w is not None, o, l, gl)

        check_layouts(backward_op, (grads[0], values, query, weight, out, lse, grads[1]), (), data,
                      {0: all_dims[:-1], 1: all_dims})


@pytest.mark.parametrize("path", PATHS)
@given(data=st.data(), dtype=DTYPE, spatial=st.sampled_from([(9,), (5, 4)]), heads=st.sampled_from([(2, 1), (2, 2)]),
       D=st.sampled_from([8, 16]), causal=st.booleans())
@settings(max_examples=5)
def test_neighborhood_attention(path, data, dtype, spatial, heads, D, causal):
    B, (H, Hkv) = 2, heads
    q = torch.randn(B, H, *spatial, D).to(dtype)
    k = torch.randn(B, Hkv, *spatial, D).to(dtype)
    v = torch.randn(B, Hkv, *spatial, D).to(dtype)
    grads = (torch.randn(B, H, *spatial, D).to(dtype), torch.randn(B, H, *spatial))
    kw = dict(kernel_size=3, is_causal=causal)
    dims = tuple(range(q.dim()))
    expandable = {i: dims for i in range(5)}  # every dim of q, k, v, grad_out; grad_lse's leading ones
    expandable[4] = dims[:-1]
    with execution_path(path):
        check_layouts(lambda q, k, v: fusedops.neighborhood_attention(q, k, v, return_lse=True, **kw), (q, k, v), grads,
                      data, expandable)
        out, lse = fusedops.neighborhood_attention(q, k, v, return_lse=True, **kw)
        ndim = len(spatial)

        def backward_op(g, gl, q, k, v, o, l):
            return torch.ops.fusedops.neighborhood_attention_backward(
                g, gl, q, k, v, o, l, [3] * ndim, [1] * ndim, [1] * ndim, [causal] * ndim, None, "shifted")

        check_layouts(backward_op, (grads[0], grads[1], q, k, v, out, lse), (), data,
                      {0: dims, 1: dims[:-1], 2: dims, 3: dims, 4: dims, 5: dims, 6: dims[:-1]})


@pytest.mark.parametrize("path", PATHS)
@given(data=st.data(), dtype=DTYPE, n=st.integers(1, 5), m=st.integers(1, 3),
       batch=st.lists(st.integers(1, 3), min_size=0, max_size=2), D=st.integers(1, 24))
@settings(max_examples=40)
def test_attn_res_multi(path, data, dtype, n, m, batch, D):
    values, queries = torch.randn(n, *batch, D).to(dtype), torch.randn(m, D)
    grads = (torch.randn(m, *batch, D).to(dtype), torch.randn(m, *batch))
    dims = tuple(range(values.dim()))
    with execution_path(path):
        check_layouts(lambda v, q: fusedops.attn_res_multi(v, q), (values, queries), grads, data,
                      {0: dims, 1: (0, 1), 2: dims, 3: dims[:-1]})


@pytest.mark.parametrize("path", PATHS)
@given(data=st.data(), dtype=DTYPE, batch=st.lists(st.integers(1, 3), min_size=1, max_size=2),
       D=st.integers(1, 24), with_gain=st.booleans())
@settings(max_examples=10)
def test_attn_res_merge(path, data, dtype, batch, D, with_gain):
    out, partial, addend = (torch.randn(*batch, D).to(dtype) for _ in range(3))
    lse, query = torch.randn(batch), torch.randn(D)
    gain = torch.rand(D) + 0.5 if with_gain else None
    grads = (torch.randn(*batch, D).to(dtype), torch.randn(*batch, D).to(dtype))
    dims = tuple(range(out.dim()))
    with execution_path(path):
        check_layouts(lambda o, l, p, q, a, g: fusedops.attn_res_merge(o, l, p, q, a, g),
                      (out, lse, partial, query, addend, gain), grads, data,
                      {0: dims, 1: dims[:-1], 2: dims, 4: dims, 6: dims, 7: dims})
