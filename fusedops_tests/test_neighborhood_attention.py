"""fusedops.neighborhood_attention against a float64 dense-mask oracle written straight from the
issue's formulas, on the PyTorch reference and on both launch plans under the Triton interpreter."""

from __future__ import annotations

import dataclasses
import math
import os
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import triton
import triton.language as tl

import fusedops
from fusedops.neighborhood_attention import op as na_op
from fusedops.neighborhood_attention import reference
from fusedops.neighborhood_attention.kernels import _box, _cell_bits, _neighbours, _query_span, _window_bits
from fusedops.neighborhood_attention.op import reach
from fusedops.neighborhood_attention.plan import fused_1d_block, make_plan, mask_bits_fit, tiles_from_string
from fusedops.numerics import tf32_allowed
from fusedops.targets import Target, ascend_target, cuda_target

from .helpers import (
    DTYPES,
    INTERPRETER,
    KERNEL_PATHS,
    PATHS,
    assert_close,
    assert_compiled_leaves_like_eager,
    assert_compiles_like_eager,
    assert_dynamic_compile_like_eager,
    assert_export_dynamic_like_eager,
    assert_export_round_trip,
    assert_inductor_like_eager,
    execution_path,
    float32_matmul_precision,
    gpu,
    opaque_triton_ops,
    recorded_launches,
    same_view,
)

# ---- the oracle: per-axis key lists from the issue text, a dense S x S mask, float64 autograd ----------


def axis_keys(length, k, d, s, causal, window, i):
    """Original-coordinate keys of query i on one axis, literally as the issue states them."""
    g, ip = i % d, i // d
    lg = length // d + (1 if g < length % d else 0)
    if window == "shifted":
        if causal:
            c = min((ip // s) * s + s - 1, lg - 1)
            keys = range(max(c - k + 1, 0), ip + 1)
        else:
            c = min((ip // s) * s + s // 2, lg - 1)
            start = min(max(c - k // 2, 0), lg - k)
            keys = range(start, start + k)
    else:
        if causal:
            keys = range(max(ip - k + 1, 0), ip + 1)
        else:
            keys = [ip + j - k // 2 for j in range(k) if 0 <= ip + j - k // 2 < lg]
    return [j * d + g for j in keys]


def dense_mask(spatial, ks, dil, strd, causal, window):
    mask = torch.ones(1, 1, dtype=torch.bool)
    for a, length in enumerate(spatial):
        m = torch.zeros(length, length, dtype=torch.bool)
        for i in range(length):
            m[i, axis_keys(length, ks[a], dil[a], strd[a], causal[a], window, i)] = True
        mask = (mask[:, None, :, None] & m[None, :, None, :]).reshape(mask.shape[0] * length, -1)
    return mask


def oracle(q, k, v, ks, dil, strd, causal, scale, window):
    """(out, lse) in float64 from a dense mask; differentiable."""
    b, h = q.shape[:2]
    hkv = k.shape[1]
    mask = dense_mask(q.shape[2:-1], ks, dil, strd, causal, window).to(q.device)
    qf = q.double().reshape(b, h, -1, q.shape[-1])
    kf = k.double().reshape(b, hkv, -1, k.shape[-1]).repeat_interleave(h // hkv, 1)
    vf = v.double().reshape(b, hkv, -1, v.shape[-1]).repeat_interleave(h // hkv, 1)
    logits = (qf @ kf.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(logits, -1)
    out = torch.softmax(logits, -1) @ vf
    return out.reshape(*q.shape[:-1], v.shape[-1]), lse.reshape(q.shape[:-1])


# ---- random cases -------------------------------------------------------------------------------------

MAX_LEN = {1: 20, 2: 8, 3: 5}


@st.composite
def na_cases(draw, dtypes=(torch.float32,), max_len=None):
    ndim = draw(st.integers(1, 3))
    window = draw(st.sampled_from(["shifted", "truncated"]))
    limit = (max_len or MAX_LEN)[ndim]
    ks, dil, strd, causal, spatial = [], [], [], [], []
    for _ in range(ndim):
        if window == "truncated":
            k = draw(st.sampled_from([x for x in (3, 5) if x <= limit]))
            s = 1
        else:
            k = draw(st.integers(2, min(5, limit)))
            s = draw(st.integers(1, k))
        d = draw(st.integers(1, max(1, min(3, limit // k))))
        length = draw(st.integers(k * d, max(k * d, limit)))
        ks.append(k), dil.append(d), strd.append(s), spatial.append(length)
        causal.append(draw(st.booleans()))
    return dict(
        spatial=spatial, ks=ks, dil=dil, strd=strd, causal=causal, window=window,
        batch=draw(st.integers(1, 2)), kv_heads=draw(st.integers(1, 2)), groups=draw(st.integers(1, 2)),
        head_dim=draw(st.sampled_from([8, 12, 16, 24])), head_dim_v=draw(st.sampled_from([8, 16, 20])),
        dtype=draw(st.sampled_from(dtypes)), strided=draw(st.booleans()), scale=draw(st.sampled_from([None, 0.3])),
        with_lse_grad=draw(st.booleans()), seed=draw(st.integers(0, 2**16)),
    )


def _make(shape, dtype, strided, gen, device="cpu"):
    """[B, H, *spatial, D]; strided: a heads-last tensor seen through a permuted view (no copy)."""
    if strided:
        b, h, *spatial, d = shape
        base = torch.randn(b, *spatial, h, d, generator=gen).to(dtype).to(device)
        nd = len(spatial)
        return base.permute(0, nd + 1, *range(1, nd + 1), nd + 2)
    return torch.randn(shape, generator=gen).to(dtype).to(device)


def build(case, device="cpu"):
    gen = torch.Generator().manual_seed(case["seed"])
    b, hkv, grp = case["batch"], case["kv_heads"], case["groups"]
    sp = case["spatial"]
    q = _make((b, hkv * grp, *sp, case["head_dim"]), case["dtype"], case["strided"], gen, device)
    k = _make((b, hkv, *sp, case["head_dim"]), case["dtype"], case["strided"], gen, device)
    v = _make((b, hkv, *sp, case["head_dim_v"]), case["dtype"], case["strided"], gen, device)
    grad_out = torch.randn(*q.shape[:-1], case["head_dim_v"], generator=gen).to(case["dtype"]).to(device)
    grad_lse = torch.randn(q.shape[:-1], generator=gen).to(device) if case["with_lse_grad"] else None
    return q, k, v, grad_out, grad_lse


def run_fused(q, k, v, grad_out, grad_lse, case):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = fusedops.neighborhood_attention(
        q, k, v, case["ks"], case["dil"], case["strd"], case["causal"], scale=case["scale"], window=case["window"],
        return_lse=True,
    )
    loss = (out.float() * grad_out.float()).sum()
    if grad_lse is not None:
        loss = loss + (lse * grad_lse).sum()
    return out, lse, torch.autograd.grad(loss, (q, k, v))


def run_oracle(q, k, v, grad_out, grad_lse, case):
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    scale = case["scale"] if case["scale"] is not None else q.shape[-1] ** -0.5
    out, lse = oracle(q, k, v, case["ks"], case["dil"], case["strd"], case["causal"], scale, case["window"])
    loss = (out * grad_out.double()).sum()
    if grad_lse is not None:
        loss = loss + (lse * grad_lse.double()).sum()
    return out, lse, torch.autograd.grad(loss, (q, k, v))


def check_case(case, device="cpu"):
    q, k, v, grad_out, grad_lse = build(case, device)
    out, lse, grads = run_fused(q, k, v, grad_out, grad_lse, case)
    ref_out, ref_lse, ref_grads = run_oracle(q, k, v, grad_out, grad_lse, case)
    dtype = case["dtype"]
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close("out", out, ref_out, dtype, 2.0)
    assert_close("lse", lse, ref_lse, dtype, 1.0)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert g.dtype == dtype
        assert_close(name, g, r, dtype, 4.0)


@pytest.mark.parametrize("path", PATHS)
@given(case=na_cases(max_len={1: 16, 2: 7, 3: 4}))
@settings(max_examples=10)
def test_matches_dense_oracle(path, case):
    with execution_path(path):
        check_case(case)


@pytest.mark.parametrize("path", PATHS)
@given(case=na_cases(max_len={1: 16, 2: 7, 3: 4}), data=st.data())
@settings(max_examples=5)
def test_query_offset_computes_a_box_of_the_grid(path, case, data):
    """q holding a box of k's grid (query_offset) gives the box's rows of the whole grid's out and lse, dq of
    those rows, and the whole grid's dk/dv when only the box's rows carry gradient: against the float64 oracle
    on the whole grid. The box is a view of a (maybe heads-last) whole-grid q: its strides are not q's own."""
    box = [data.draw(st.integers(1, n)) for n in case["spatial"]]
    offset = [data.draw(st.integers(0, n - m)) for n, m in zip(case["spatial"], box)]
    rows = (slice(None), slice(None), *(slice(o, o + m) for o, m in zip(offset, box)))
    q_grid, k, v, grad_grid, grad_lse_grid = build(case)
    q = q_grid[rows]
    grad_out = torch.zeros_like(grad_grid)
    grad_out[rows] = grad_grid[rows]
    grad_lse = None if grad_lse_grid is None else torch.zeros_like(grad_lse_grid)
    if grad_lse is not None:
        grad_lse[rows] = grad_lse_grid[rows]
    with execution_path(path):
        q_in, k_in, v_in = (t.detach().requires_grad_() for t in (q, k, v))
        out, lse = fusedops.neighborhood_attention(
            q_in, k_in, v_in, case["ks"], case["dil"], case["strd"], case["causal"], scale=case["scale"],
            window=case["window"], return_lse=True, query_offset=offset)
        loss = (out * grad_out[rows]).sum() + (0 if grad_lse is None else (lse * grad_lse[rows]).sum())
        grads = torch.autograd.grad(loss, (q_in, k_in, v_in))
    ref_out, ref_lse, (ref_dq, ref_dk, ref_dv) = run_oracle(q_grid, k, v, grad_out, grad_lse, case)
    assert out.shape == (*q.shape[:-1], v.shape[-1]) and lse.shape == q.shape[:-1]
    assert_close("out", out, ref_out[rows], torch.float32, 2.0)
    assert_close("lse", lse, ref_lse[rows], torch.float32, 1.0)
    for name, g, r in zip(("dq", "dk", "dv"), grads, (ref_dq[rows], ref_dk, ref_dv)):
        assert_close(name, g, r, torch.float32, 4.0)


@given(case=na_cases(dtypes=DTYPES))
@settings(max_examples=40)
def test_reference_matches_dense_oracle_all_dtypes(case):
    with execution_path("reference"):
        check_case(case)


@pytest.mark.parametrize("path", KERNEL_PATHS)
@given(case=na_cases(dtypes=(torch.float16, torch.bfloat16), max_len={1: 12, 2: 6, 3: 4}))
@settings(max_examples=3)
def test_kernels_half_precision(path, case):
    with execution_path(path):
        check_case(case)


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_kernels_many_tiles_small_budget(path, ndim):
    """A tiny on-chip budget forces several query and key tiles per axis: the tile walk and the
    exact skip test of the backward are exercised, not only one-tile problems."""
    spatial = {1: [23], 2: [9, 7], 3: [4, 5, 4]}[ndim]
    case = dict(
        spatial=spatial, ks={1: [5], 2: [3, 4], 3: [2, 3, 2]}[ndim], dil={1: [2], 2: [1, 1], 3: [2, 1, 1]}[ndim],
        strd={1: [2], 2: [1, 2], 3: [1, 2, 2]}[ndim], causal={1: [False], 2: [False, True], 3: [True, False, False]}[ndim],
        window="shifted", batch=1, kv_heads=1, groups=2, head_dim=8, head_dim_v=8, dtype=torch.float32,
        strided=True, scale=None, with_lse_grad=True, seed=ndim,
    )
    with execution_path(path, onchip_bytes=12 * 1024):
        target = cuda_target(interpreted=True) if path == "cuda" else ascend_target(interpreted=True)
        plan = make_plan(target, [1] * (3 - ndim) + spatial, [1] * (3 - ndim) + case["dil"], 8, 8, torch.float32,
                         ndim, backward=True)
        assert plan.block_m < math.prod(spatial) and plan.block_n < math.prod(spatial)
        check_case(case)


# dK's layout: [D, keys], [keys, D] (dk_by_keys), or scores as [keys, queries] (keys_major, with the unguarded walk
# and the unmasked inside boxes of the rows it is measured with)
DK_LAYOUTS = {"d_major": dict(dk_by_keys=False), "by_keys": dict(dk_by_keys=True),
              "keys_major": dict(keys_major=True, walk_tests=False, unmasked_inside=True)}


@pytest.mark.parametrize("dk_layout", list(DK_LAYOUTS))
@pytest.mark.parametrize("ndim, dq_boxes, dkdv_boxes", [
    (1, ((1, 1, 8), (1, 1, 4)), ((1, 1, 4), (1, 1, 8))),
    (2, ((1, 4, 4), (1, 8, 2)), ((1, 8, 2), (1, 2, 4))),  # the H100's tall-box pattern, at test sizes
    # (plan_override clamps forced boxes to the group lengths, [2, 5, 6] here: (2, 4, 1) stays as it is)
    (3, ((2, 2, 2), (2, 2, 2)), ((1, 2, 4), (2, 4, 1))),
])
def test_dkdv_walks_boxes_of_its_own(ndim, dq_boxes, dkdv_boxes, dk_layout):
    """The dK/dV kernel on query and key boxes other than the dQ kernel's (Plan.dkdv, as the H100's 2-D plan
    has them), with dK accumulated either way round (Plan.dk_by_keys, the H100's choice at D 128) or the scores
    transposed (Plan.keys_major): gradients match the oracle, several tiles per axis, GQA, stride, causal axes."""
    spatial = {1: [37], 2: [9, 7], 3: [4, 5, 6]}[ndim]
    case = dict(
        spatial=spatial, ks={1: [6], 2: [3, 4], 3: [2, 3, 3]}[ndim], dil={1: [2], 2: [1, 1], 3: [2, 1, 1]}[ndim],
        strd={1: [3], 2: [1, 2], 3: [1, 2, 1]}[ndim],
        causal={1: [False], 2: [False, True], 3: [True, False, False]}[ndim],
        window="shifted", batch=1, kv_heads=1, groups=2, head_dim=8, head_dim_v=8, dtype=torch.float32,
        strided=True, scale=None, with_lse_grad=True, seed=ndim,
    )
    with execution_path("cuda"), \
            fusedops.plan_override("neighborhood_attention", "bwd", bm=dq_boxes[0], bn=dq_boxes[1], fused_block=0), \
            fusedops.plan_override("neighborhood_attention", "dkdv", bm=dkdv_boxes[0], bn=dkdv_boxes[1],
                                   **DK_LAYOUTS[dk_layout]), \
            recorded_launches(na_op) as launches:
        check_case(case)

    def boxes(meta):
        return tuple(meta[f"BM{a}"] for a in range(3)), tuple(meta[f"BN{a}"] for a in range(3))

    dq = [meta for name, _, meta in launches if name == "na_bwd_dq_kernel"]
    dkdv = [meta for name, _, meta in launches if name == "na_bwd_dkdv_kernel"]
    assert dq and dkdv  # the forced plan ran, not the fused 1-D backward
    assert all(boxes(m) == dq_boxes for m in dq)
    layout = DK_LAYOUTS[dk_layout]
    assert all(boxes(m) == dkdv_boxes and m["DK_BY_KEYS"] == layout.get("dk_by_keys", m["DK_BY_KEYS"])
               and m["KEYS_MAJOR"] == layout.get("keys_major", False) for m in dkdv)


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("ks, dil, strd, causal, window, groups", [
    (3, 1, 1, False, "shifted", 1),
    (5, 2, 2, False, "shifted", 2),  # dilation groups of different lengths, stride leaders, GQA
    (4, 1, 3, True, "shifted", 3),
    (7, 3, 1, False, "truncated", 1),
    (5, 1, 1, True, "truncated", 2),
])
def test_fused_1d_backward_many_blocks(path, ks, dil, strd, causal, window, groups):
    """The fused 1-D backward (one score block of owned rows plus a halo per program) on problems of
    several blocks per dilation group, so halo rows owned by a neighbour are read but never written."""
    length = 200
    case = dict(spatial=[length], ks=[ks], dil=[dil], strd=[strd], causal=[causal], window=window, batch=2,
                kv_heads=2, groups=groups, head_dim=16, head_dim_v=24, dtype=torch.float32, strided=True,
                scale=None, with_lse_grad=True, seed=ks + 10 * dil)
    with execution_path(path):
        target = cuda_target(interpreted=True) if path == "cuda" else ascend_target(interpreted=True)
        plan = make_plan(target, [1, 1, length], [1, 1, dil], 16, 24, torch.float32, 1, backward=True,
                         halo=reach(ks, strd, causal, window))
        assert plan.fused and plan.block_m - 2 * reach(ks, strd, causal, window) < -(-length // dil)
        check_case(case)


def test_window_reach_bounds_every_window():
    """reach() is the fused backward's halo: no key of any window lies farther from its query (checked
    against the issue's key lists for every axis length <= 24, kernel, stride and causality), and it
    is attained for stride 1, so the halo is no wider than it must be."""
    for lg in range(2, 25):
        for k in range(2, lg + 1):
            for s in range(1, k + 1):
                for causal in (False, True):
                    for window in ("shifted", "truncated"):
                        if window == "truncated" and (s != 1 or (k % 2 == 0 and not causal)):
                            continue
                        far = max(abs(j - i) for i in range(lg) for j in axis_keys(lg, k, 1, s, causal, window, i))
                        assert far <= reach(k, s, causal, window), (lg, k, s, causal, window)
                        if s == 1 and lg >= 2 * k:
                            assert far == reach(k, s, causal, window), (lg, k, causal, window)


# ---- the formulas pinned by hand: border rows of every mode ---------------------------------------------

# (length, kernel, dilation, stride, causal, window) -> {query: expected keys}
HAND = [
    ((7, 3, 1, 1, False, "shifted"), {0: [0, 1, 2], 1: [0, 1, 2], 3: [2, 3, 4], 5: [4, 5, 6], 6: [4, 5, 6]}),
    ((7, 3, 1, 1, False, "truncated"), {0: [0, 1], 1: [0, 1, 2], 3: [2, 3, 4], 6: [5, 6]}),
    ((7, 3, 1, 1, True, "shifted"), {0: [0], 1: [0, 1], 2: [0, 1, 2], 6: [4, 5, 6]}),
    ((7, 3, 1, 1, True, "truncated"), {0: [0], 1: [0, 1], 6: [4, 5, 6]}),
    ((8, 4, 1, 1, False, "shifted"), {0: [0, 1, 2, 3], 2: [0, 1, 2, 3], 3: [1, 2, 3, 4], 7: [4, 5, 6, 7]}),
    # dilation 2 on 7: group 0 = 0,2,4,6 (L_g 4), group 1 = 1,3,5 (L_g 3)
    ((7, 3, 2, 1, False, "shifted"), {0: [0, 2, 4], 1: [1, 3, 5], 4: [2, 4, 6], 5: [1, 3, 5], 6: [2, 4, 6]}),
    ((7, 3, 2, 1, False, "truncated"), {0: [0, 2], 1: [1, 3], 3: [1, 3, 5], 5: [3, 5], 6: [4, 6]}),
    ((7, 3, 2, 1, True, "shifted"), {1: [1], 3: [1, 3], 6: [2, 4, 6]}),
    # stride 2: queries of one stride group share a window (leader (i'//2)*2 + 1)
    ((8, 3, 1, 2, False, "shifted"), {0: [0, 1, 2], 1: [0, 1, 2], 2: [2, 3, 4], 3: [2, 3, 4], 6: [5, 6, 7],
                                      7: [5, 6, 7]}),
    ((8, 3, 1, 2, True, "shifted"), {0: [0], 1: [0, 1], 2: [1, 2], 3: [1, 2, 3], 6: [5, 6], 7: [5, 6, 7]}),
    # stride 3 with the leader clamped at the end: i' = 6, 7 -> leader min(7, 7) = 7
    ((8, 3, 1, 3, False, "shifted"), {0: [0, 1, 2], 2: [0, 1, 2], 3: [3, 4, 5], 5: [3, 4, 5], 6: [5, 6, 7],
                                      7: [5, 6, 7]}),
]


@pytest.mark.parametrize("spec,expected", HAND, ids=[f"L{h[0][0]}k{h[0][1]}d{h[0][2]}s{h[0][3]}"
                                                        f"{'c' if h[0][4] else ''}-{h[0][5]}" for h in HAND])
def test_hand_neighbor_lists_oracle_and_reference(spec, expected):
    length, k, d, s, causal, window = spec
    idx, valid = reference.axis_neighbors(length, k, d, s, causal, window)
    for i, keys in expected.items():
        assert axis_keys(length, k, d, s, causal, window, i) == keys
        assert idx[i][valid[i]].tolist() == keys


@pytest.mark.parametrize("path", PATHS)
def test_hand_neighbor_lists_through_the_op(path):
    """q = 0 makes every neighbour weigh the same; v = identity reads the neighbour set off the output."""
    for (length, k, d, s, causal, window), expected in HAND:
        q = torch.zeros(1, 1, length, 8)
        v = torch.eye(length, 8)[None, None]
        with execution_path(path):
            out = fusedops.neighborhood_attention(q, q.clone(), v, k, d, s, causal, window=window)
        for i, keys in expected.items():
            row = out[0, 0, i]
            got = torch.nonzero(row > 1e-6).flatten().tolist()
            assert got == keys, (length, k, d, s, causal, window, i, got)
            torch.testing.assert_close(row[keys], torch.full((len(keys),), 1.0 / len(keys)))


@triton.jit
def _query_span_probe(jl_ptr, jh_ptr, lg_ptr, k_ptr, st_ptr, causal_ptr, out_ptr, n,
                      TRUNCATED: tl.constexpr, BLOCK: tl.constexpr):
    for start in range(0, n, BLOCK):
        i = start + tl.arange(0, BLOCK)
        m = i < n
        first, last = _query_span(tl.load(jl_ptr + i, mask=m), tl.load(jh_ptr + i, mask=m),
                                  tl.load(lg_ptr + i, mask=m, other=1), tl.load(k_ptr + i, mask=m, other=1),
                                  tl.load(st_ptr + i, mask=m, other=1), tl.load(causal_ptr + i, mask=m), TRUNCATED)
        tl.store(out_ptr + 2 * i, first, mask=m)
        tl.store(out_ptr + 2 * i + 1, last, mask=m)


@pytest.mark.interpreter
@pytest.mark.parametrize("window", ["shifted", "truncated"])
def test_backward_query_span_is_exact(window):
    """The dK/dV kernel walks, per axis, the queries [first, last] that _query_span inverts from the
    window formulas in closed form: checked against brute force over every key range of every axis
    length <= 18, kernel, stride and causality (a too-narrow span would silently drop gradient terms)."""
    if not INTERPRETER:
        pytest.skip("needs TRITON_INTERPRET=1")
    rows, want = [], []
    for lg in range(2, 19):
        for k in range(2, lg + 1):
            for s in (range(1, k + 1) if window == "shifted" else [1]):
                for causal in (False, True):
                    if window == "truncated" and k % 2 == 0 and not causal:
                        continue
                    seen = [axis_keys(lg, k, 1, s, causal, window, i) for i in range(lg)]
                    for jl in range(lg):
                        for jh in range(jl, lg):
                            hit = [i for i in range(lg) if any(jl <= j <= jh for j in seen[i])]
                            rows.append((jl, jh, lg, k, s, int(causal)))
                            want.append((hit[0], hit[-1]) if hit else None)
    cols = [torch.tensor(c, dtype=torch.int32) for c in zip(*rows)]
    out = torch.empty(len(rows), 2, dtype=torch.int32)
    _query_span_probe[(1,)](*cols, out, len(rows), TRUNCATED=window == "truncated", BLOCK=4096)
    for row, (first, last), expected in zip(rows, out.tolist(), want):
        assert (first, last) == expected if expected else first > last, (row, first, last, expected)


@triton.jit
def _mask_probe(lo_ptr, hi_ptr, row_ok_ptr, bits_ptr, compares_ptr, j0, j1, j2, NDIM: tl.constexpr,
                BM: tl.constexpr, BN0: tl.constexpr, BN1: tl.constexpr, BN2: tl.constexpr):
    r = tl.arange(0, BM)
    row_ok = tl.load(row_ok_ptr + r) != 0
    lo0, lo1, lo2 = tl.load(lo_ptr + 3 * r), tl.load(lo_ptr + 3 * r + 1), tl.load(lo_ptr + 3 * r + 2)
    hi0, hi1, hi2 = tl.load(hi_ptr + 3 * r), tl.load(hi_ptr + 3 * r + 1), tl.load(hi_ptr + 3 * r + 2)
    c0, c1, c2 = _box(BN0, BN1, BN2)
    cells = r[:, None] * (BN0 * BN1 * BN2) + tl.arange(0, BN0 * BN1 * BN2)[None, :]
    compares = _neighbours(row_ok, c2 >= 0, j0 + c0, j1 + c1, j2 + c2, lo0, hi0, lo1, hi1, lo2, hi2, NDIM, False)
    m = _window_bits(row_ok, lo0 - j0, hi0 - j0, lo1 - j1, hi1 - j1, lo2 - j2, hi2 - j2, BN0, BN1, BN2, NDIM)
    bits = ((~m)[:, None] & _cell_bits(c0, c1, c2, BN1, BN2, NDIM)[None, :]) == 0
    tl.store(compares_ptr + cells, compares.to(tl.int8))
    tl.store(bits_ptr + cells, bits.to(tl.int8))


@pytest.mark.interpreter
@pytest.mark.ascend
@pytest.mark.parametrize("ndim, box", [(2, (1, 16, 2)), (2, (1, 8, 8)), (2, (1, 16, 4)), (2, (1, 4, 16)),
                                       (3, (2, 4, 8)), (3, (4, 4, 8))])
def test_window_bit_sets_match_the_compares(ndim, box):
    """The bit-set window mask (Plan.mask_bits: per-row fields over the key box, one AND per element) equals
    the per-axis interval compares for windows that start before, inside or after the box, end likewise,
    are empty, or belong to rows outside the tile, at key boxes anywhere on the axis."""
    if not INTERPRETER:
        pytest.skip("needs TRITON_INTERPRET=1")
    gen = torch.Generator().manual_seed(sum(box) + ndim)
    rows = 64
    for j in ((0, 0, 0), (3, 17, 40), (1, 2, 5)):
        origin = torch.tensor(j)
        lo = origin + torch.randint(-6, max(box) + 6, (rows, 3), generator=gen)
        hi = lo + torch.randint(-2, max(box) + 8, (rows, 3), generator=gen)
        row_ok = (torch.rand(rows, generator=gen) > 0.15).to(torch.int32)
        lo, hi = lo.to(torch.int32).contiguous(), hi.to(torch.int32).contiguous()
        bits = torch.full((rows, math.prod(box)), 7, dtype=torch.int8)
        compares = torch.full_like(bits, 7)
        _mask_probe[(1,)](lo, hi, row_ok, bits, compares, *j, NDIM=ndim, BM=rows, BN0=box[0], BN1=box[1], BN2=box[2])
        assert compares.max() <= 1 and 0 < int(compares.sum()) < compares.numel()  # both outcomes occur
        assert torch.equal(bits, compares), (j, box)


def test_2d_neighborhood_is_the_product_of_axes():
    q = torch.zeros(1, 1, 4, 6, 8)
    v = torch.eye(24)[None, None].reshape(1, 1, 4, 6, 24)[..., :24]
    out = fusedops.neighborhood_attention(q, q.clone(), v[..., :24], [2, 3], 1, 1, [True, False])
    # query (row 2, col 0): rows causal k=2 -> {1, 2}; cols shifted k=3 -> {0, 1, 2}
    got = torch.nonzero(out[0, 0, 2, 0] > 1e-6).flatten().tolist()
    assert got == [r * 6 + c for r in (1, 2) for c in (0, 1, 2)]


# ---- layouts, determinism, memory ---------------------------------------------------------------------

@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_backward_is_bitwise_deterministic(path):
    case = dict(spatial=[6, 5], ks=[3, 3], dil=[1, 1], strd=[1, 1], causal=[False, False], window="shifted",
                batch=1, kv_heads=1, groups=3, head_dim=16, head_dim_v=16, dtype=torch.bfloat16, strided=False,
                scale=None, with_lse_grad=False, seed=7)
    q, k, v, grad_out, grad_lse = build(case)
    with execution_path(path):
        runs = [run_fused(q, k, v, grad_out, grad_lse, case)[2] for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_heads_last_views_are_read_in_place(path):
    """Permuted heads-last q, k, v reach every kernel as the caller's views (same memory, same strides)."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (_make((1, 2, 9, 16), torch.float32, True, gen) for _ in range(3))
    assert not q.is_contiguous()
    with execution_path(path), recorded_launches(na_op) as launches:
        out, lse = torch.ops.fusedops.neighborhood_attention(q, k, v, [3], [1], [1], [False], None, "shifted")
        torch.ops.fusedops.neighborhood_attention_backward(out, None, q, k, v, out, lse, [3], [1], [1], [False],
                                                           None, "shifted")
    assert len(launches) >= 2
    for name, tensors, _ in launches:
        assert [same_view(a, b) for a, b in zip(tensors[:3], (q, k, v))] == [True] * 3, name


def test_reference_never_builds_a_dense_mask():
    """The reference's working set is O(S x kernel): with S = 2**15 (a dense mask: 2**30 elements) no tensor
    it makes, forward or backward, holds more than its chunk bound or S x kernel x D elements."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class LargestTensor(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.largest = max(self.largest, t.numel())
            return out

    S, K, D = 2**15, 3, 8
    q = torch.randn(1, 1, S, D)
    args = ([K], [1], [1], [False], D**-0.5, "shifted")
    with LargestTensor() as watch:  # the reference itself: its aten calls are what the mode sees
        out, lse = reference.neighborhood_attention(q, q, q, *args)
        reference.neighborhood_attention_backward(out, None, q, q, q, out, lse, *args)
    assert out.shape == q.shape
    assert watch.largest <= max(reference.CHUNK_ELEMENTS, S * K * D) < S * S // 16, watch.largest


# ---- registration: opcheck, compile, export -------------------------------------------------------------

def opcheck_samples():
    gen = torch.Generator().manual_seed(4)
    yield (torch.randn(1, 2, 7, 8, generator=gen), torch.randn(1, 1, 7, 8, generator=gen),
           torch.randn(1, 1, 7, 16, generator=gen), [3], [2], [1], [False], None, "shifted")
    yield (torch.randn(1, 1, 4, 5, 8, generator=gen).bfloat16(), torch.randn(1, 1, 4, 5, 8, generator=gen).bfloat16(),
           torch.randn(1, 1, 4, 5, 8, generator=gen).bfloat16(), [3, 3], [1, 1], [1, 1], [True, False], 0.5,
           "truncated")
    # q a 2 x 3 box of k's 4 x 6 grid (query_offset)
    yield (torch.randn(1, 2, 2, 3, 8, generator=gen), torch.randn(1, 2, 4, 6, 8, generator=gen),
           torch.randn(1, 2, 4, 6, 8, generator=gen), [3, 3], [1, 2], [2, 1], [False, False], None, "shifted",
           [1, 2])


@pytest.mark.parametrize("path", PATHS)
def test_registered_op_broadcasts_one_entry_lists_in_its_backward(path):
    """torch.ops.fusedops.neighborhood_attention takes a 1-element list for every spatial axis, as the wrapper
    takes an int; the backward, which gets the forward's arguments as the caller passed them, must read them the
    same way (its direct call once took [3] on a 2-D grid for a window of 1 x 3: wrong gradients)."""
    torch.manual_seed(21)
    dtype = torch.float64 if path == "reference" else torch.float32
    q, k, v = (torch.randn(1, 2, 6, 7, 8, dtype=dtype, requires_grad=True) for _ in range(3))
    with execution_path(path):
        out, _ = torch.ops.fusedops.neighborhood_attention(q, k, v, [3], [2], [1], [True], None, "shifted", [0])
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        want = fusedops.neighborhood_attention(q, k, v, 3, dilation=2, is_causal=True)
        want_grads = torch.autograd.grad(want.sum(), (q, k, v))
    for name, got, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), (want, *want_grads)):
        torch.testing.assert_close(got, ref, msg=name)


@pytest.mark.parametrize("path", PATHS)
def test_opcheck(path):
    with execution_path(path), opaque_triton_ops():
        for args in opcheck_samples():
            q, k, v = (t.requires_grad_() for t in args[:3])
            torch.library.opcheck(torch.ops.fusedops.neighborhood_attention.default, (q, k, v, *args[3:]))
            with torch.no_grad():
                out, lse = torch.ops.fusedops.neighborhood_attention(*args)
            grad_out = torch.randn_like(out)
            for grad_lse in (None, torch.randn_like(lse)):
                torch.library.opcheck(
                    torch.ops.fusedops.neighborhood_attention_backward.default,
                    (grad_out, grad_lse, q.detach(), k.detach(), v.detach(), out, lse, *args[3:]),
                )


class TinyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = fusedops.nn.NeighborhoodAttention2d(16, 2, kernel_size=3, dilation=(1, 2), is_causal=(False, True))

    def forward(self, x):
        return torch.tanh(self.attn(x)).sum(-1)


@pytest.mark.parametrize("path", PATHS)
def test_compile_fullgraph_matches_eager(path):
    torch.manual_seed(5)
    assert_compiles_like_eager(path, TinyModel(), torch.randn(1, 5, 7, 16))


@pytest.mark.parametrize("path", PATHS)
def test_export_round_trip(path):
    torch.manual_seed(6)
    assert_export_round_trip(path, TinyModel().eval(), torch.randn(1, 5, 7, 16), "neighborhood_attention")


class BoxAttention(torch.nn.Module):
    """Attention of a query box (rows 3..7 of 12) against the whole grid: query_offset through compile/export."""

    def __init__(self):
        super().__init__()
        self.gain = torch.nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, x):
        x = x * self.gain
        return fusedops.neighborhood_attention(x[:, :, 3:8], x, x, 5, dilation=2, query_offset=3)


def test_query_offset_compiles_and_exports():
    """query_offset is a schema argument: fullgraph compile and export keep it (the fake kernel takes q's box)."""
    torch.manual_seed(8)
    x = torch.randn(1, 2, 12, 8)
    assert_compiles_like_eager("reference", BoxAttention(), x)
    assert_export_round_trip("reference", BoxAttention(), x, "neighborhood_attention")


def _qkv_sets(spatials, heads=(4, 2), dim=16, device="cpu", dtype=torch.float32):
    return [tuple(torch.randn(2, h, *sp, dim, device=device).to(dtype).requires_grad_() for h in (heads[0], heads[1], heads[1]))
            for sp in spatials]


# Not on the Ascend plan (CI time: the slowest test of the suite there): a graph serving every size needs plans
# that hold for any size, which test_dispatch's test_plans_from_any_size_hint_stay_correct checks on both plans.
@pytest.mark.parametrize("path", PATHS[:2])
def test_compile_dynamic_shapes_one_graph(path):
    """Sequence length, image size and head dim change between calls of one dynamic=True compile
    (GQA, dilation, stride, a causal axis): no recompilation, eager's outputs and gradients. The
    default scale, D ** -0.5, is then a symbolic float."""
    torch.manual_seed(15)
    with execution_path(path), opaque_triton_ops():
        assert_dynamic_compile_like_eager(
            lambda q, k, v: fusedops.neighborhood_attention(q, k, v, 5, dilation=2, stride=2),
            _qkv_sets([(23,), (31,)]))
        assert_dynamic_compile_like_eager(
            lambda q, k, v: fusedops.neighborhood_attention(q, k, v, (3, 5), is_causal=(True, False)),
            _qkv_sets([(6, 7), (9, 8)], dim=8) + _qkv_sets([(5, 9)], dim=12))


@pytest.mark.parametrize("path", PATHS)
def test_export_dynamic_shapes(path):
    """Exported with symbolic image dims, one program serves other sizes; the kernel*dilation <= L
    checks become bounds on the dims (3 and 6 here), not specialisations."""
    torch.manual_seed(16)
    b, h, w = (torch.export.Dim(name, min=lo, max=512) for name, lo in (("b", 1), ("h", 3), ("w", 6)))
    assert_export_dynamic_like_eager(path, TinyModel().eval(), (torch.randn(2, 7, 9, 16),), ({0: b, 1: h, 2: w},),
                                     [(torch.randn(1, 3, 6, 16),), (torch.randn(2, 11, 8, 16),)],
                                     "neighborhood_attention")


@pytest.mark.parametrize("cls,shape", [("NeighborhoodAttention1d", (2, 9, 16)), ("NeighborhoodAttention2d", (1, 5, 6, 16)),
                                       ("NeighborhoodAttention3d", (1, 3, 4, 5, 16))])
def test_modules_match_functional(cls, shape):
    torch.manual_seed(8)
    module = getattr(fusedops.nn, cls)(16, 2, kernel_size=3, stride=1, qkv_bias=False)
    x = torch.randn(shape, requires_grad=True)
    out = module(x)
    assert out.shape == x.shape
    nd = len(shape) - 2
    qkv = module.qkv(x).reshape(*shape[:-1], 3, 2, 8)
    q, k, v = (qkv[..., i, :, :].movedim(-2, 1) for i in range(3))
    ref = oracle(q, k, v, [3] * nd, [1] * nd, [1] * nd, [False] * nd, 8**-0.5, "shifted")[0]
    ref = module.proj(ref.movedim(1, -2).reshape(shape).float())
    torch.testing.assert_close(out, ref.float(), rtol=1e-4, atol=1e-5)
    out.sum().backward()
    assert x.grad is not None and module.qkv.weight.grad is not None


# ---- bad input: ValueError naming the argument ------------------------------------------------------------

def _good():
    return torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)


BAD_INPUTS = {
    "kernel_size_lt_2": (lambda q, k, v: dict(q=q, k=k, v=v, kernel_size=1), r"^kernel_size must be >= 2"),
    "kernel_times_dilation_gt_len": (lambda q, k, v: dict(q=q, k=k, v=v, kernel_size=5, dilation=2),
                                     r"^kernel_size \* dilation must not exceed the axis length"),
    "truncated_even_kernel": (lambda q, k, v: dict(q=q, k=k, v=v, kernel_size=4, window="truncated"),
                              r"^kernel_size must be odd with window='truncated'"),
    "truncated_stride": (lambda q, k, v: dict(q=q, k=k, v=v, kernel_size=3, stride=2, window="truncated"),
                         r"^stride must be 1 with window='truncated'"),
    "stride_gt_kernel": (lambda q, k, v: dict(q=q, k=k, v=v, kernel_size=3, stride=4),
                         r"^stride must not exceed kernel_size"),
    "batch_mismatch": (lambda q, k, v: dict(q=q, k=torch.randn(2, 2, 9, 8), v=v, kernel_size=3),
                       r"^k must have q's batch size"),
    "spatial_mismatch": (lambda q, k, v: dict(q=q, k=k, v=torch.randn(1, 2, 8, 8), kernel_size=3),
                         r"^v must have k's spatial shape"),
    "k_grid_without_query_offset": (lambda q, k, v: dict(q=q, k=torch.randn(1, 2, 12, 8), v=torch.randn(1, 2, 12, 8),
                                                         kernel_size=3), r"^k must have q's spatial shape"),
    "query_offset_outside_k": (lambda q, k, v: dict(q=q, k=torch.randn(1, 2, 12, 8), v=torch.randn(1, 2, 12, 8),
                                                    kernel_size=3, query_offset=4),
                               r"^query_offset must place q's spatial box \(9,\) inside k's \(12,\)"),
    "query_offset_negative": (lambda q, k, v: dict(q=q, k=k, v=v, kernel_size=3, query_offset=-1),
                              r"^query_offset must place q's spatial box"),
    "query_offset_wrong_axes": (lambda q, k, v: dict(q=q, k=k, v=v, kernel_size=3, query_offset=(0, 0)),
                                r"^query_offset must have one entry per spatial axis"),
    "head_dim_mismatch": (lambda q, k, v: dict(q=q, k=torch.randn(1, 2, 9, 16), v=v, kernel_size=3),
                          r"^k must have q's head dim"),
    "heads_not_divisible": (lambda q, k, v: dict(q=torch.randn(1, 3, 9, 8), k=k, v=v, kernel_size=3),
                            r"^k's number of heads \(2\) must divide q's \(3\)"),
    "rank_3": (lambda q, k, v: dict(q=q[0], k=k[0], v=v[0], kernel_size=3), r"^q must be \[B, H, \*spatial, D\]"),
    "rank_7": (lambda q, k, v: dict(q=torch.randn(1, 1, 2, 2, 2, 2, 8), k=k, v=v, kernel_size=2),
               r"^q must be \[B, H, \*spatial, D\]"),
    "int_dtype": (lambda q, k, v: dict(q=q, k=k.to(torch.int32), v=v, kernel_size=3),
                  r"^k must be float32, float16, bfloat16 or float64"),
    "complex": (lambda q, k, v: dict(q=q.to(torch.complex64), k=k, v=v, kernel_size=3),
                r"^q must be float32, float16, bfloat16 or float64"),
    "float64_q_only": (lambda q, k, v: dict(q=q.double(), k=k, v=v, kernel_size=3),
                       r"^k must have q's dtype torch.float64"),
    "mixed_devices": (lambda q, k, v: dict(q=q, k=k, v=v.to("meta"), kernel_size=3), r"^v is on meta but q is on cpu"),
    "scale_zero": (lambda q, k, v: dict(q=q, k=k, v=v, kernel_size=3, scale=0.0),
                   r"^scale must be positive and finite"),
    "scale_negative": (lambda q, k, v: dict(q=q, k=k, v=v, kernel_size=3, scale=-1.0),
                       r"^scale must be positive and finite"),
    "bad_window": (lambda q, k, v: dict(q=q, k=k, v=v, kernel_size=3, window="centered"), r"^window must be one of"),
    "kernel_size_wrong_axes": (lambda q, k, v: dict(q=q, k=k, v=v, kernel_size=(3, 3)),
                               r"^kernel_size must have one entry per spatial axis"),
    "is_causal_not_bool": (lambda q, k, v: dict(q=q, k=k, v=v, kernel_size=3, is_causal=[2]),
                           r"^is_causal must be a bool"),
    "head_dim_too_small": (lambda q, k, v: dict(q=q[..., :4], k=k[..., :4], v=v, kernel_size=3),
                           r"^q's head dim must be in \[8, 256\]"),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_names_argument(path, case):
    make, name = BAD_INPUTS[case]
    kwargs = make(*_good())
    with execution_path(path), pytest.raises(ValueError, match=name):
        fusedops.neighborhood_attention(**kwargs)


def test_bad_input_op_level_and_backward():
    q = torch.randn(1, 2, 9, 8)
    with pytest.raises(ValueError, match="kernel_size"):
        torch.ops.fusedops.neighborhood_attention(q, q, q, [1], [1], [1], [False], None, "shifted")
    out, lse = torch.ops.fusedops.neighborhood_attention(q, q, q, [3], [1], [1], [False], None, "shifted")
    with pytest.raises(ValueError, match="grad_out"):
        torch.ops.fusedops.neighborhood_attention_backward(out[:, :1], None, q, q, q, out, lse, [3], [1], [1],
                                                           [False], None, "shifted")


BAD_MODULE_ARGS = {
    "dim_not_multiple": (dict(dim=10, num_heads=3, kernel_size=3),
                         r"^dim \(10\) must be a positive multiple of num_heads \(3\)"),
    "head_dim_too_small": (dict(dim=8, num_heads=2, kernel_size=3), r"^dim // num_heads \(the head dim"),
    "head_dim_too_large": (dict(dim=512, num_heads=1, kernel_size=3), r"^dim // num_heads \(the head dim"),
    "kernel_size_lt_2": (dict(dim=16, num_heads=2, kernel_size=1), r"^kernel_size must be >= 2"),
    "kernel_size_wrong_axes": (dict(dim=16, num_heads=2, kernel_size=(3, 3)),
                               r"^kernel_size must have one entry per spatial axis"),
    "dilation_zero": (dict(dim=16, num_heads=2, kernel_size=3, dilation=0), r"^dilation must be >= 1"),
    "stride_gt_kernel": (dict(dim=16, num_heads=2, kernel_size=3, stride=4), r"^stride must not exceed kernel_size"),
    "truncated_even_kernel": (dict(dim=16, num_heads=2, kernel_size=4, window="truncated"),
                              r"^kernel_size must be odd with window='truncated'"),
    "bad_window": (dict(dim=16, num_heads=2, kernel_size=3, window="centered"), r"^window must be one of"),
    "is_causal_not_bool": (dict(dim=16, num_heads=2, kernel_size=3, is_causal=1), r"^is_causal must be a bool"),
}


@pytest.mark.parametrize("case", sorted(BAD_MODULE_ARGS))
def test_module_validates_arguments_at_construction(case):
    """A bad module argument fails when the module is built, naming it, not at its first forward."""
    kwargs, name = BAD_MODULE_ARGS[case]
    with pytest.raises(ValueError, match=name):
        fusedops.nn.NeighborhoodAttention1d(**kwargs)


def test_integer_arguments_of_any_integer_type():
    """numpy integers (e.g. from a config array) are ints, as torch's own ops take them."""
    np = pytest.importorskip("numpy")
    q, k, v = _good()
    want = fusedops.neighborhood_attention(q, k, v, 3, dilation=2, stride=2)
    got = fusedops.neighborhood_attention(q, k, v, np.int64(3), dilation=[np.int32(2)], stride=(np.int8(2),))
    assert torch.equal(got, want)
    module = fusedops.nn.NeighborhoodAttention2d(16, 2, kernel_size=np.array([3, 5])[0], stride=np.int64(2))
    assert module(torch.randn(1, 5, 6, 16)).shape == (1, 5, 6, 16)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("spatial", [(9,), (5, 6)])
def test_empty_batch(path, spatial):
    """B = 0 gives empty outputs, lse and gradients on every path (and through the module)."""
    q = torch.randn(0, 4, *spatial, 8, requires_grad=True)
    k, v = (torch.randn(0, 2, *spatial, 8, requires_grad=True) for _ in range(2))
    with execution_path(path):
        out, lse = fusedops.neighborhood_attention(q, k, v, 3, return_lse=True)
        (out.sum() + lse.sum()).backward()
        module = getattr(fusedops.nn, f"NeighborhoodAttention{len(spatial)}d")(16, 2, 3)
        y = module(torch.randn(0, *spatial, 16))
    assert out.shape == (0, 4, *spatial, 8) and lse.shape == (0, 4, *spatial)
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    assert y.shape == (0, *spatial, 16)


def test_ascend_plan_respects_budget_and_grid():
    target = ascend_target(interpreted=True)
    plan = make_plan(target, [1, 1, 16384], [1, 1, 1], 128, 128, torch.bfloat16, 1, backward=True)
    from fusedops.neighborhood_attention.plan import _footprint
    assert _footprint(plan.block_m, plan.block_n, plan.block_d, plan.block_dv, True) <= target.onchip_bytes
    from fusedops.neighborhood_attention.plan import grid
    assert grid(target, 10**7) <= min(target.max_grid, target.matrix_cores * target.resident)


def _h100() -> Target:
    return Target(vendor="cuda", vector_cores=132, matrix_cores=132, onchip_bytes=192 * 1024,
                  max_grid=2**31 - 1, row_align=16, resident=4, persistent=False)


def _axes(volume: int, ndim: int) -> list[int]:
    """The per-axis kernel (padded to 3 axes) of a cubic window of `volume` positions."""
    return [1] * (3 - ndim) + [round(volume ** (1 / ndim))] * ndim


@pytest.mark.parametrize("spatial, kernel, stride, d, dtype, fwd_keys, dq_keys, dkdv", [
    ([64, 64], (3, 3), (1, 1), 64, torch.bfloat16, (1, 16, 2), (1, 16, 2), ((1, 16, 4), (1, 8, 8))),
    ([64, 64], (7, 7), (1, 1), 64, torch.bfloat16, (1, 16, 2), (1, 16, 2), ((1, 16, 4), (1, 8, 8))),
    ([64, 64], (9, 5), (1, 1), 128, torch.float16, (1, 16, 2), (1, 16, 2), ((1, 16, 4), (1, 8, 8))),
    ([64, 64], (7, 7), (3, 1), 64, torch.bfloat16, (1, 16, 2), (1, 16, 2), ((1, 16, 4), (1, 8, 8))),  # 16 rows
    ([64, 64], (7, 7), (4, 1), 64, torch.bfloat16, (1, 32, 2), (1, 16, 2), ((1, 8, 8), (1, 16, 4))),  # 17 rows
    ([64, 64], (11, 3), (1, 1), 64, torch.bfloat16, (1, 32, 2), (1, 16, 2), ((1, 8, 8), (1, 16, 4))),
    ([128, 128], (13, 13), (1, 1), 128, torch.bfloat16, (1, 32, 2), (1, 16, 2), ((1, 8, 8), (1, 16, 4))),
    ([64, 64], (27, 3), (1, 1), 64, torch.bfloat16, (1, 8, 8), (1, 8, 8), None),  # 34 rows: 8x8 boxes
    ([64, 64], (7, 7), (1, 1), 256, torch.bfloat16, (1, 4, 8), (1, 4, 4), None),  # heads over 128: not measured
    ([64, 64], (7, 7), (1, 1), 64, torch.float32, (1, 4, 8), (1, 4, 8), None),  # fp32: the ieee tiles
])
def test_cuda_2d_tall_key_boxes(spatial, kernel, stride, d, dtype, fwd_keys, dq_keys, dkdv):
    """The H100's 2-D tiles for 16-bit inputs with heads up to 128 (bench/NOTES.md run 20): 8x8 query boxes
    over key boxes 16 or 32 rows tall and 2 wide (the rows an 8-row query box's windows span: 8 + kernel +
    stride - 2), so a query box walks its key rows in the innermost loop; the dK/dV kernel walks 16x4 query
    boxes over 8x8 key boxes when those rows fit 16, else owns 16x4 key boxes. Wider windows, wider heads
    and fp32 keep their boxes; none of it under the interpreter or a tile override."""
    pad3 = [1] + spatial, [1, *kernel], [1, *stride]

    def plan(target, backward):
        return make_plan(target, pad3[0], [1, 1, 1], d, d, dtype, 2, backward=backward,
                         kernel_volume=math.prod(kernel), kernel=pad3[1], stride=pad3[2])

    forward, backward = plan(_h100(), False), plan(_h100(), True)
    assert forward.bn == fwd_keys
    assert backward.bn == dq_keys and forward.dkdv is None
    if dkdv:
        assert (backward.dkdv.bm, backward.dkdv.bn) == dkdv
        assert forward.bm == backward.bm == (1, 8, 8)
        assert (forward.num_warps, backward.num_warps, backward.dkdv.num_warps) == (4, 4, 4)
        # register caps: the forward and dQ at D 64 only (128, but 168 for a forward over 32-row key boxes),
        # dK/dV never (runs 20, 22)
        assert backward.dq_registers == (128 if d <= 64 else None)
        assert forward.fwd_registers == ((128 if fwd_keys[1] == 16 else 168) if d <= 64 else None)
        assert backward.dkdv.dkdv_registers is None and backward.fwd_registers is None
        assert backward.dkdv.dk_by_keys == backward.dk_by_keys == (d == 128) and not forward.dk_by_keys
    else:
        assert backward.dkdv is None and forward.fwd_registers is None
    for target in (cuda_target(interpreted=True), ascend_target(interpreted=True)):
        assert plan(target, True).dkdv is None and plan(target, False).fwd_registers is None
    with fusedops.plan_override("neighborhood_attention", "fwd", bm=(1, 8, 8), bn=(1, 8, 8), num_warps=4), \
            fusedops.plan_override("neighborhood_attention", "bwd", bm=(1, 8, 8), bn=(1, 8, 8), num_warps=4):
        assert plan(_h100(), True).dkdv is None and plan(_h100(), False).bn == (1, 8, 8)
        assert plan(_h100(), False).fwd_registers is None


def test_dkdv_tile_override():
    """plan_override(..., "dkdv", ...) gives the dK/dV kernel its own boxes, warps and stages (uncapped) and
    leaves the forward and the dQ kernel to the planner (or to their own overrides), on every plan."""
    args = ([1, 64, 64], [1, 1, 1], 64, 64, torch.bfloat16, 2)
    kw = dict(kernel_volume=49, kernel=[1, 7, 7])
    planned, planned_forward = (make_plan(_h100(), *args, backward=b, **kw) for b in (True, False))
    with fusedops.plan_override("neighborhood_attention", "dkdv", bm=(1, 4, 16), bn=(1, 8, 8), num_warps=8,
                                num_stages=2):
        plan = make_plan(_h100(), *args, backward=True, **kw)
        assert (plan.bm, plan.bn, plan.dq_registers) == (planned.bm, planned.bn, planned.dq_registers)
        dkdv = plan.dkdv
        assert (dkdv.bm, dkdv.bn, dkdv.num_warps, dkdv.num_stages, dkdv.dkdv_registers) == (
            (1, 4, 16), (1, 8, 8), 8, 2, None)
        assert make_plan(_h100(), *args, backward=False, **kw) == planned_forward
        interpreted = make_plan(cuda_target(interpreted=True), *args, backward=True, **kw).dkdv
        assert (interpreted.bm, interpreted.bn, interpreted.num_warps) == ((1, 4, 16), (1, 8, 8), 8)
    assert make_plan(_h100(), *args, backward=True, **kw) == planned  # restored on exit


@pytest.mark.parametrize("bm, warps, walk_tests, keys_major, by_keys", [
    (32, 8, False, False, False), (16, 8, False, False, False),  # the miscompiled kind: dK as [D, keys] instead
    (64, 8, False, False, True), (32, 4, False, False, True), (32, 8, True, False, True), (32, 8, False, True, True)])
def test_forced_dkdv_plan_avoids_the_miscompiled_dk_layout(bm, warps, walk_tests, keys_major, by_keys):
    """A forced dK/dV plan with dK as [keys, D] on the pipelined walk of 8 warps over fewer than 64 query rows was
    compiled to wrong dK on the H100 (Triton 3.6; h100-2026-12-07-na-run-33, 8-45% off) where [D, keys] gave the
    plan's bits: on a CUDA GPU such a plan takes [D, keys]. Others keep the layout forced; interpreters too."""
    args = ([1, 1, 16384], [1, 1, 1], 128, 128, torch.bfloat16, 1)
    kw = dict(kernel_volume=513, kernel=[1, 1, 513])
    with fusedops.plan_override("neighborhood_attention", "dkdv", bm=(1, 1, bm), bn=(1, 1, 128), num_warps=warps,
                                walk_tests=walk_tests, unmasked_inside=True, keys_major=keys_major, dk_by_keys=True):
        plan = make_plan(_h100(), *args, backward=True, **kw).dkdv
        assert (plan.block_m, plan.num_warps, plan.walk_tests, plan.keys_major) == (bm, warps, walk_tests, keys_major)
        assert plan.dk_by_keys == by_keys
        assert make_plan(cuda_target(interpreted=True), *args, backward=True, **kw).dkdv.dk_by_keys


@pytest.mark.parametrize("spatial, kernel, d, dtype, backward, bm, bn, warps, fused", [
    ([4096], 7, 64, torch.bfloat16, False, (1, 1, 64), (1, 1, 32), 4, False),
    ([64, 64], 49, 64, torch.bfloat16, False, (1, 8, 8), (1, 16, 2), 4, False),
    ([128, 128], 169, 128, torch.bfloat16, False, (1, 8, 8), (1, 32, 2), 4, False),
    ([64, 64], 729, 64, torch.bfloat16, False, (1, 8, 8), (1, 8, 8), 4, False),  # 27x27: 8x8 boxes
    ([16, 32, 32], 343, 64, torch.bfloat16, False, (4, 4, 8), (2, 4, 8), 4, False),
    ([4096], 7, 64, torch.bfloat16, True, (1, 1, 64), (1, 1, 64), 4, True),
    ([4096], 17, 64, torch.float16, True, (1, 1, 64), (1, 1, 64), 4, True),
    ([8192], 15, 128, torch.bfloat16, True, (1, 1, 64), (1, 1, 64), 4, True),
    ([4096], 7, 64, torch.float32, True, (1, 1, 32), (1, 1, 16), 2, False),
    ([8192], 17, 128, torch.bfloat16, True, (1, 1, 32), (1, 1, 32), 4, False),
    ([4096], 31, 64, torch.bfloat16, True, (1, 1, 64), (1, 1, 32), 4, False),
    ([8192], 33, 64, torch.bfloat16, True, (1, 1, 64), (1, 1, 32), 4, False),
    ([16384], 129, 64, torch.bfloat16, True, (1, 1, 64), (1, 1, 64), 4, False),
    ([64, 64], 49, 64, torch.bfloat16, True, (1, 8, 8), (1, 16, 2), 4, False),
])
def test_cuda_plan_is_the_measured_one(spatial, kernel, d, dtype, backward, bm, bn, warps, fused):
    """The H100 plans chosen from device-time sweeps (bench/NOTES.md, neighborhood attention runs 12-14, 20):
    4-warp forwards (1D 64 x 32, 2D 8x8 query boxes over tall key boxes up to 32 key rows, else 8x8 boxes,
    3D 4x4x8 x 2x4x8); the fused 1-D backward (64 rows, 4 warps, one stage) for 16-bit inputs up to k17 at
    D 64 and k15 at D 128; otherwise 1D tiles by window width."""
    target = _h100()
    pad = [1] * (3 - len(spatial))
    halo = reach(kernel, 1, False, "shifted") if len(spatial) == 1 else None
    plan = make_plan(target, pad + spatial, [1, 1, 1], d, d, dtype, len(spatial), backward=backward,
                     kernel_volume=kernel, halo=halo, kernel=_axes(kernel, len(spatial)))
    stages = 1 if fused else None
    assert (plan.bm, plan.bn, plan.num_warps, plan.num_stages, plan.fused) == (bm, bn, warps, stages, fused)
    assert fused_1d_block(target, 1, 256, 256, torch.bfloat16) is None  # the widest heads: two kernels


@pytest.mark.parametrize("spatial, kernel, d, dtype, dq_cap, dkdv_cap", [
    ([8192], 33, 128, torch.bfloat16, 168, 168),
    ([16384], 129, 64, torch.float16, 168, 168),
    ([64, 64], 49, 64, torch.bfloat16, 128, None),  # the tall 2-D dQ tiles at D 64: four programs per SM
    ([64, 64], 121, 64, torch.float16, 128, None),
    ([128, 128], 169, 128, torch.bfloat16, None, None),  # the tall 2-D dQ tiles at D 128 (run 20)
    ([16, 32, 32], 343, 64, torch.bfloat16, 168, None),
    ([8192], 33, 64, torch.float32, None, None),  # fp32: not measured, uncapped
    ([2048], 33, 256, torch.bfloat16, None, None),  # heads wider than 128: not measured
    ([4096], 7, 64, torch.bfloat16, None, None),  # the fused 1-D backward
])
def test_cuda_backward_register_caps(spatial, kernel, d, dtype, dq_cap, dkdv_cap):
    """The two-kernel backward's register caps (bench/NOTES.md runs 16, 20, 22): dQ at 168 on the measured plans,
    at 128 on the tall 2-D ones at D 64 and uncapped on those at D 128, dK/dV only in 1-D; never on the interpreter (no registers) or under a tile
    override (a sweep's tiles are timed as given)."""
    pad = [1] * (3 - len(spatial))
    halo = reach(kernel, 1, False, "shifted") if len(spatial) == 1 else None

    def caps(target):
        plan = make_plan(target, pad + spatial, [1, 1, 1], d, d, dtype, len(spatial), backward=True,
                         kernel_volume=kernel, halo=halo, kernel=_axes(kernel, len(spatial)))
        return plan.dq_registers, plan.dkdv_registers

    assert caps(_h100()) == (dq_cap, dkdv_cap)
    assert caps(cuda_target(interpreted=True)) == (None, None)
    assert caps(ascend_target(interpreted=True)) == (None, None)
    with fusedops.plan_override("neighborhood_attention", "bwd", bm=(1, 1, 64), bn=(1, 1, 32), num_warps=4):
        assert caps(_h100()) == (None, None)


@pytest.mark.parametrize("ndim, dtype, h100, interpreted_cuda, interpreted_ascend", [
    (1, torch.bfloat16, True, True, True),
    (1, torch.float32, False, True, True),  # CUDA's fp32 (ieee) kernels keep the two-compare mask
    (2, torch.bfloat16, False, False, False),
    (3, torch.float16, False, False, False),
])
def test_one_compare_mask_plan(ndim, dtype, h100, interpreted_cuda, interpreted_ascend):
    """The 1-D plans' one-compare window mask (bench/NOTES.md run 16): on the H100 for 16-bit inputs only;
    always in 1-D under the interpreter, so the CPU CI runs it on both plans."""
    spatial = [1] * (3 - ndim) + [32] * ndim

    def one_compare(target, backward):
        return make_plan(target, spatial, [1, 1, 1], 64, 64, dtype, ndim, backward=backward,
                         kernel_volume=7 ** ndim).one_compare_mask

    for backward in (False, True):
        assert one_compare(_h100(), backward) == h100
        assert one_compare(cuda_target(interpreted=True), backward) == interpreted_cuda
        assert one_compare(ascend_target(interpreted=True), backward) == interpreted_ascend


@pytest.mark.parametrize("spatial, kernel, d, dtype, fwd, dq, dkdv, walk_tests", [
    ([64, 64], (7, 7), 64, torch.bfloat16, True, False, True, False),  # the 16-row tall plan at D 64
    ([64, 64], (3, 3), 64, torch.float16, True, False, True, False),
    ([64, 64], (7, 7), 128, torch.bfloat16, True, False, True, True),  # D 128: the unguarded walk spills
    ([128, 128], (13, 13), 128, torch.bfloat16, False, False, False, True),  # 32-row tall plan
    ([16, 32, 32], (7, 7, 7), 64, torch.bfloat16, False, True, True, True),
    ([16, 32, 32], (7, 7, 7), 128, torch.bfloat16, False, False, False, True),  # not measured
    ([64, 64], (7, 7), 64, torch.float32, False, False, False, True),  # fp32 (ieee tiles): not measured
    ([8192], (33,), 128, torch.bfloat16, False, False, False, True),  # 1-D: the one-compare mask
])
def test_window_mask_plan(spatial, kernel, d, dtype, fwd, dq, dkdv, walk_tests):
    """Where the H100 plans take the bit-set window mask and the dK/dV walk without its chunk tests
    (bench/NOTES.md run 25, MASK_BITS_WIDTH in plan.py); the interpreter's CUDA plan takes both wherever the
    key box fits (so the CPU CI runs them), the Ascend plan neither (so it runs the compares and the tests)."""
    ndim = len(spatial)
    pad = [1] * (3 - ndim)

    def plans(target):
        return tuple(make_plan(target, pad + spatial, [1, 1, 1], d, d, dtype, ndim, backward=backward,
                               kernel_volume=math.prod(kernel), kernel=pad + list(kernel))
                     for backward in (False, True))

    forward, backward = plans(_h100())
    dkdv_plan = backward.dkdv or backward
    assert (forward.mask_bits, backward.mask_bits, dkdv_plan.mask_bits, dkdv_plan.walk_tests) == (
        fwd, dq, dkdv, walk_tests)
    forward, backward = plans(cuda_target(interpreted=True))
    dkdv_plan = backward.dkdv or backward
    fits = [mask_bits_fit(plan.bn, ndim) for plan in (forward, backward, dkdv_plan)]
    assert [forward.mask_bits, backward.mask_bits, dkdv_plan.mask_bits] == fits and not dkdv_plan.walk_tests
    assert any(fits) == (ndim > 1)
    forward, backward = plans(ascend_target(interpreted=True))
    assert not (forward.mask_bits or backward.mask_bits) and backward.walk_tests and backward.dkdv is None


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("mask_bits, walk_tests", [(True, True), (False, False)])
@pytest.mark.parametrize("ndim", [2, 3])
def test_window_mask_variants_match_oracle(path, ndim, mask_bits, walk_tests):
    """Each kernel with the window mask and the dK/dV walk the other way from what its plan picks under the
    interpreter (the CUDA plan: bit sets, no chunk tests; the Ascend plan: compares, tests), so both forms run
    on both plans, in both interpreters (triton-ascend's too), with several tiles per axis."""
    spatial = {2: [9, 7], 3: [4, 5, 6]}[ndim]
    case = dict(
        spatial=spatial, ks={2: [3, 4], 3: [2, 3, 3]}[ndim], dil={2: [2, 1], 3: [2, 1, 1]}[ndim],
        strd={2: [1, 2], 3: [1, 2, 1]}[ndim], causal={2: [False, True], 3: [True, False, False]}[ndim],
        window="shifted", batch=1, kv_heads=1, groups=2, head_dim=8, head_dim_v=8, dtype=torch.float32,
        strided=True, scale=None, with_lse_grad=True, seed=ndim,
    )
    with execution_path(path, onchip_bytes=12 * 1024), \
            fusedops.plan_override("neighborhood_attention", "fwd", mask_bits=mask_bits), \
            fusedops.plan_override("neighborhood_attention", "bwd", mask_bits=mask_bits), \
            fusedops.plan_override("neighborhood_attention", "dkdv", mask_bits=mask_bits, walk_tests=walk_tests), \
            recorded_launches(na_op) as launches:
        check_case(case)
    names = {name for name, _, _ in launches}
    assert {"na_fwd_kernel", "na_bwd_dq_kernel", "na_bwd_dkdv_kernel"} <= names
    assert any(meta["MASK_BITS"] for _, _, meta in launches) == mask_bits  # the forced mask ran
    assert all(meta["WALK_TESTS"] == walk_tests for name, _, meta in launches if name == "na_bwd_dkdv_kernel")


# (spatial, kernel, dilation, stride, causal, window, query box, key box): windows several boxes wide
_INSIDE_CASES = [
    ([40], [17], [1], [1], [False], "shifted", (1, 1, 4), (1, 1, 4)),
    ([40], [16], [1], [4], [True], "shifted", (1, 1, 4), (1, 1, 4)),  # stride groups of whole query boxes
    ([45], [9], [2], [1], [False], "truncated", (1, 1, 4), (1, 1, 2)),
    ([12, 11], [7, 6], [1, 1], [1, 3], [False, True], "shifted", (1, 2, 4), (1, 2, 2)),
    ([5, 8, 5], [4, 4, 4], [1, 2, 1], [1, 2, 1], [True, False, False], "shifted", (2, 2, 2), (2, 2, 2)),
]
# the same on boxes of 16 cells or more: triton-ascend's interpreter takes no smaller dot
_INSIDE_CASES_16 = [
    ([72], [41], [1], [1], [False], "shifted", (1, 1, 16), (1, 1, 16)),
    ([72], [32], [1], [16], [True], "shifted", (1, 1, 16), (1, 1, 16)),
    ([20, 18], [11, 9], [1, 1], [1, 1], [False, True], "shifted", (1, 4, 4), (1, 4, 4)),
]


@pytest.mark.parametrize("path, spatial, ks, dil, strd, causal, window, bm, bn", [
    pytest.param("cuda", *c, marks=pytest.mark.interpreter, id=f"cuda-plan-{i}") for i, c in enumerate(_INSIDE_CASES)
] + [
    pytest.param("ascend", *c, marks=[pytest.mark.interpreter, pytest.mark.ascend], id=f"ascend-plan-{i}")
    for i, c in enumerate(_INSIDE_CASES_16)
])
def test_unmasked_inside_boxes_match_oracle(path, spatial, ks, dil, strd, causal, window, bm, bn):
    """Plan.unmasked_inside: key boxes inside the window every row of the query tile (or, in dK/dV, of the query
    chunk) shares skip the window mask. Windows several boxes wide make most boxes inside and leave others at
    their edges (causal, stride groups, dilation, truncated windows at the borders); all three kernels must still
    give the oracle's results, with rows outside the tile contributing nothing."""
    case = dict(spatial=spatial, ks=ks, dil=dil, strd=strd, causal=causal, window=window, batch=1, kv_heads=1,
                groups=2, head_dim=8, head_dim_v=8, dtype=torch.float32, strided=True, scale=None, with_lse_grad=True,
                seed=len(spatial))
    override = dict(bm=bm, bn=bn, unmasked_inside=True)
    with execution_path(path), fusedops.plan_override("neighborhood_attention", "fwd", **override), \
            fusedops.plan_override("neighborhood_attention", "bwd", fused_block=0, **override), \
            fusedops.plan_override("neighborhood_attention", "dkdv", **override), \
            recorded_launches(na_op) as launches:
        check_case(case)
    names = {name for name, _, meta in launches if meta["INSIDE"]}
    assert names == {"na_fwd_kernel", "na_bwd_dq_kernel", "na_bwd_dkdv_kernel"}


@pytest.mark.parametrize("spatial, kernel, d, bm, bn, warps", [
    ([16384], 129, 64, (1, 1, 32), (1, 1, 32), 4),
    ([8192], 33, 128, (1, 1, 16), (1, 1, 32), 4),
    ([1024], 129, 256, (1, 1, 16), (1, 1, 16), 8),
    ([64, 64], 49, 64, (1, 4, 8), (1, 4, 8), 4),
    ([128, 128], 169, 128, (1, 4, 4), (1, 4, 8), 4),
    ([16, 32, 32], 343, 64, (2, 4, 4), (2, 4, 4), 4),
])
def test_cuda_float32_exact_dots_plan(spatial, kernel, d, bm, bn, warps):
    """CUDA float32 with exact (ieee, FMA) dots: the spill-free tiles of CUDA_IEEE forward and backward
    (bench/NOTES.md run 18; the 16-bit tiles spilled kilobytes, up to 12x slower); with TF32 dots, the
    16-bit plans' tiles, but in 2-D the 8x8 boxes (the tall key boxes were measured on 16-bit inputs only)."""
    pad = [1] * (3 - len(spatial))
    halo = reach(kernel, 1, False, "shifted") if len(spatial) == 1 else None
    for backward in (False, True):
        def plan(dtype, tf32=False):
            return make_plan(_h100(), pad + spatial, [1, 1, 1], d, d, dtype, len(spatial), backward=backward,
                             kernel_volume=kernel, halo=halo, tf32=tf32)

        exact = plan(torch.float32)
        assert (exact.bm, exact.bn, exact.num_warps, exact.precision) == (bm, bn, warps, "ieee")
        tf32, half = plan(torch.float32, tf32=True), plan(torch.bfloat16)
        if len(spatial) == 2:
            assert half.dkdv is not None or not backward
            assert (tf32.dkdv, tf32.precision) == (None, "tf32") and tf32.bn[2] > 2  # no tall key boxes
        else:
            assert (tf32.bm, tf32.bn, tf32.num_warps, tf32.precision) == (half.bm, half.bn, half.num_warps, "tf32")


@pytest.mark.parametrize("precision, allowed", [("highest", False), ("high", True), ("medium", True)])
def test_tf32_allowed_follows_torch(precision, allowed):
    with float32_matmul_precision(precision):
        assert tf32_allowed() == allowed
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):  # torch >= 2.9: the new per-backend setting wins
        with float32_matmul_precision(precision):
            matmul.fp32_precision = "ieee" if allowed else "tf32"
            assert tf32_allowed() == (not allowed)
    assert not tf32_allowed()  # restored


@pytest.mark.parametrize("spatial, kernel", [((64,), 7), ((12, 12), 5)])
def test_float32_dots_follow_the_tf32_setting(spatial, kernel):
    """float32 inputs on the H100 plan: TF32 dots where torch's matmul precision allows them (as torch's
    matmuls and FlexAttention do), exact ieee dots otherwise, in every kernel, with the cached launch specs
    keyed on the setting; 16-bit inputs and interpreted plans unaffected. The launches are recorded, not
    run."""
    def precisions(target, dtype, setting):
        seen = []
        q, k, v = (torch.randn(1, 2, *spatial, 32, dtype=dtype, requires_grad=True) for _ in range(3))
        with float32_matmul_precision(setting), \
                mock.patch.object(na_op, "target_for", lambda device, dtype=None: target), \
                mock.patch.object(na_op, "launch", lambda kernel, grid, args, meta: seen.append(
                    (meta["DOT_FP32"], meta["PRECISION"]))):
            out = fusedops.neighborhood_attention(q, k, v, kernel)
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        assert len(seen) >= 2  # forward and backward
        return set(seen)

    assert precisions(_h100(), torch.float32, "highest") == {(True, "ieee")}
    assert precisions(_h100(), torch.float32, "high") == {(True, "tf32")}
    assert precisions(_h100(), torch.float32, "highest") == {(True, "ieee")}
    assert precisions(_h100(), torch.bfloat16, "high") == {(False, "tf32")}  # 16-bit dots: the flag is moot
    assert precisions(cuda_target(interpreted=True), torch.float32, "high") == {(True, "ieee")}


def test_tile_override_is_taken_as_given():
    """A sweep's forced boxes (plan_override) are timed as named: not shrunk to the planner's on-chip budget
    (the planner's own 2-D tiles for heads over 128 are), only clamped to the group lengths."""
    spatial = [1, 64, 64]
    plan = make_plan(_h100(), spatial, [1, 1, 1], 256, 256, torch.bfloat16, 2, backward=False)
    assert plan.block_m * plan.block_n < 64 * 256
    with fusedops.plan_override("neighborhood_attention", "fwd", **tiles_from_string("1,8,8/1,16,16/8")):
        plan = make_plan(_h100(), spatial, [1, 1, 1], 256, 256, torch.bfloat16, 2, backward=False)
        assert (plan.bm, plan.bn, plan.num_warps) == ((1, 8, 8), (1, 16, 16), 8)
        plan = make_plan(_h100(), [1, 64, 6], [1, 1, 1], 64, 64, torch.bfloat16, 2, backward=False)
        assert (plan.bm, plan.bn) == ((1, 8, 8), (1, 16, 8))


# ---- real kernels on a GPU ------------------------------------------------------------------------------

GPU_CASES = [
    # (spatial, kernel, dilation, stride, causal, window, B, H, Hkv, D)
    ((4096,), (7,), (1,), (1,), (False,), "truncated", 2, 4, 4, 64),
    ((4099,), (9,), (2,), (3,), (False,), "shifted", 1, 8, 2, 64),  # the fused 1-D backward, GQA
    ((2048,), (33,), (2,), (4,), (False,), "shifted", 1, 4, 2, 128),
    ((4096,), (129,), (1,), (1,), (True,), "shifted", 1, 2, 1, 64),
    ((64, 64), (7, 7), (1, 1), (1, 1), (False, False), "shifted", 1, 4, 4, 64),
    ((48, 40), (13, 9), (2, 1), (2, 3), (False, True), "shifted", 1, 2, 2, 96),
    ((16, 32, 32), (7, 7, 7), (1, 1, 1), (1, 1, 1), (False, False, False), "shifted", 1, 2, 2, 64),
    ((12, 20, 18), (3, 5, 3), (2, 1, 3), (1, 5, 2), (True, False, False), "shifted", 1, 2, 1, 40),
    ((1024,), (129,), (1,), (1,), (False,), "shifted", 1, 2, 2, 256),  # the largest head dim
    # the wide-window plans (unmasked inside boxes; plans.json run 29): 1-D D128 and D64, 2-D, 3-D
    ((4100,), (1025,), (1,), (1,), (True,), "shifted", 1, 4, 2, 128),
    ((3000,), (300,), (2,), (100,), (False,), "shifted", 1, 2, 1, 64),
    ((100, 96), (48, 45), (1, 2), (16, 1), (False, True), "shifted", 1, 2, 1, 128),
    ((14, 20, 24), (10, 10, 12), (1, 1, 2), (1, 4, 1), (False, True, False), "shifted", 1, 2, 2, 128),
]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("spec", GPU_CASES, ids=[str(c[0]) + str(c[1]) for c in GPU_CASES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_real_sizes(spec, dtype):
    if dtype == torch.float32 and spec[0] not in ((2048,), (48, 40), (12, 20, 18)):
        pytest.skip("fp32 on the odd-shaped cases only (keeps the GPU stage short)")
    spatial, ks, dil, strd, causal, window, b, h, hkv, d = spec
    case = dict(spatial=list(spatial), ks=list(ks), dil=list(dil), strd=list(strd), causal=list(causal),
                window=window, batch=b, kv_heads=hkv, groups=h // hkv, head_dim=d, head_dim_v=d, dtype=dtype,
                strided=True, scale=None, with_lse_grad=True, seed=11)
    q, k, v, grad_out, grad_lse = build(case, "cuda")
    out, lse, grads = run_fused(q, k, v, grad_out, grad_lse, case)
    # the memory-frugal reference (fp32) on the same device as the yardstick
    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    rout, rlse = reference.neighborhood_attention(qr, kr, vr, case["ks"], case["dil"], case["strd"], case["causal"],
                                                  d**-0.5, window)
    rgrads = reference.neighborhood_attention_backward(grad_out.float(), grad_lse, qr, kr, vr, rout, rlse,
                                                       case["ks"], case["dil"], case["strd"], case["causal"],
                                                       d**-0.5, window)
    assert_close("out", out, rout, dtype, 2.0)
    assert_close("lse", lse, rlse, dtype, 1.0)
    for name, g, r in zip(("dq", "dk", "dv"), grads, rgrads):
        assert_close(name, g, r, dtype, 4.0)
    again = run_fused(q, k, v, grad_out, grad_lse, case)[2]
    assert all(torch.equal(a, b) for a, b in zip(grads, again))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("spec, box, offset", [
    (GPU_CASES[1], (1500,), (1200,)),  # the grid's backward would be the fused 1-D kernel: the box takes two
    (GPU_CASES[9], (1031,), (2049,)),
    (GPU_CASES[11], (40, 96), (31, 0)),
    (GPU_CASES[12], (5, 20, 9), (4, 0, 13)),
], ids=["1d-fused-grid", "1d-causal-1025", "2d-wide", "3d-wide"])
def test_gpu_query_offset_rows_of_the_grid(spec, box, offset):
    """A box of queries (query_offset) on real sizes gives the grid's rows of out and lse, their dq, and the
    grid's dk/dv when only the box carries gradient (within bf16 tolerance: the box's tiles start elsewhere, so
    the key boxes and the order of the sums differ)."""
    spatial, ks, dil, strd, causal, window, b, h, hkv, d = spec
    case = dict(spatial=list(spatial), ks=list(ks), dil=list(dil), strd=list(strd), causal=list(causal),
                window=window, batch=b, kv_heads=hkv, groups=h // hkv, head_dim=d, head_dim_v=d,
                dtype=torch.bfloat16, strided=True, scale=None, with_lse_grad=True, seed=3)
    q_grid, k, v, grad_grid, grad_lse_grid = build(case, "cuda")
    rows = (slice(None), slice(None), *(slice(o, o + m) for o, m in zip(offset, box)))
    grad_out, grad_lse = torch.zeros_like(grad_grid), torch.zeros_like(grad_lse_grid)
    grad_out[rows], grad_lse[rows] = grad_grid[rows], grad_lse_grid[rows]
    want_out, want_lse, (want_dq, want_dk, want_dv) = run_fused(q_grid, k, v, grad_out, grad_lse, case)
    q, k, v = (t.detach().requires_grad_() for t in (q_grid[rows], k, v))
    out, lse = fusedops.neighborhood_attention(q, k, v, ks, dil, strd, causal, window=window, return_lse=True,
                                               query_offset=offset)
    dq, dk, dv = torch.autograd.grad((out.float() * grad_out[rows].float()).sum() + (lse * grad_lse[rows]).sum(),
                                     (q, k, v))
    assert_close("out", out, want_out[rows], torch.bfloat16, 4.0)
    assert_close("lse", lse, want_lse[rows], torch.bfloat16, 2.0)
    for name, got, want in (("dq", dq, want_dq[rows]), ("dk", dk, want_dk), ("dv", dv, want_dv)):
        assert_close(name, got, want, torch.bfloat16, 4.0)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("spatial, ks", [((2048,), (33,)), ((48, 40), (13, 9))])
def test_gpu_float32_under_tf32(spatial, ks):
    """torch.set_float32_matmul_precision("high") lets float32 dots use TF32 (different bits from the exact
    default) at TF32's accuracy: a 10-bit mantissa like float16's, so float16's tolerances."""
    case = dict(spatial=list(spatial), ks=list(ks), dil=[1] * len(ks), strd=[1] * len(ks), causal=[False] * len(ks),
                window="shifted", batch=1, kv_heads=2, groups=2, head_dim=64, head_dim_v=64, dtype=torch.float32,
                strided=True, scale=None, with_lse_grad=True, seed=5)
    q, k, v, grad_out, grad_lse = build(case, "cuda")
    with float32_matmul_precision("highest"):
        exact = run_fused(q, k, v, grad_out, grad_lse, case)
        ref_out, ref_lse, ref_grads = run_oracle(q, k, v, grad_out, grad_lse, case)
    with float32_matmul_precision("high"):
        out, lse, grads = run_fused(q, k, v, grad_out, grad_lse, case)
    assert not torch.equal(out, exact[0])
    assert_close("out", out, ref_out, torch.float16, 2.0)
    assert_close("lse", lse, ref_lse, torch.float16, 1.0)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(name, g, r, torch.float16, 4.0)
    assert_close("exact out", exact[0], ref_out, torch.float32, 2.0)


@gpu
@pytest.mark.gpu
@given(case=na_cases(dtypes=DTYPES, max_len={1: 300, 2: 40, 3: 14}))
@settings(max_examples=12)
def test_gpu_matches_dense_oracle(case):
    check_case(case, "cuda")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kernel_size", [7, (3, 5)])
def test_gpu_compile_of_leaf_inputs_matches_eager(kernel_size):
    torch.manual_seed(9)
    spatial = (64,) if isinstance(kernel_size, int) else (12, 16)
    q, k, v = (torch.randn(2, 4, *spatial, 32, device="cuda").to(torch.bfloat16).requires_grad_() for _ in range(3))
    assert_compiled_leaves_like_eager(lambda q, k, v: fusedops.neighborhood_attention(q, k, v, kernel_size), (q, k, v))


@gpu
@pytest.mark.gpu
def test_gpu_inductor_fullgraph_matches_eager():
    torch.manual_seed(7)
    assert_inductor_like_eager(TinyModel().cuda(), torch.randn(2, 12, 14, 16, device="cuda"))


@gpu
@pytest.mark.gpu
def test_gpu_inductor_dynamic_shapes_one_graph():
    """Inductor traces the op's body (plans, grids, launches) with symbolic sizes."""
    torch.manual_seed(17)
    assert_dynamic_compile_like_eager(
        lambda q, k, v: fusedops.neighborhood_attention(q, k, v, 7, dilation=2),
        _qkv_sets([(100,), (257,), (1000,)], dim=64, device="cuda", dtype=torch.bfloat16),
        backend="inductor", rtol=2e-2, atol=2e-2)
    assert_dynamic_compile_like_eager(
        lambda q, k, v: fusedops.neighborhood_attention(q, k, v, (5, 7)),
        _qkv_sets([(12, 16), (20, 13), (9, 31)], dim=32, device="cuda", dtype=torch.bfloat16),
        backend="inductor", rtol=2e-2, atol=2e-2)
