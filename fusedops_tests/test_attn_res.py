"""attn_res against a float64 einsum reference, on the PyTorch reference path and on both launch plans
under the Triton interpreter (CPU CI), and on real kernels when a GPU is present."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from unittest import mock

import pytest
import torch
from hypothesis import assume, currently_in_test_context, given, settings
from hypothesis import strategies as st

import fusedops
from fusedops.attn_res import op as ar_op
from fusedops.attn_res.plan import make_plan
from fusedops.launch import bind, launch, split
from fusedops.layout import collapse_dims
from fusedops.targets import cuda_target

from .helpers import (
    DTYPES,
    KERNEL_PATHS,
    PATHS,
    RTOL,
    assert_close,
    assert_compiled_leaves_like_eager,
    assert_compiles_like_eager,
    assert_dynamic_compile_like_eager,
    assert_export_dynamic_like_eager,
    assert_export_round_trip,
    assert_inductor_like_eager,
    execution_path,
    gpu,
    opaque_triton_ops,
    recorded_launches,
    same_view,
)

TILED_BUDGET = 2048  # bytes: forces D tiles of 64-128 elements on both plans


def einsum_logits(values, query, norm_weight, eps):
    """[N, *batch] float64 logits <query * norm_weight, rmsnorm(values[i])>."""
    v = values.double()
    w = torch.ones_like(query, dtype=torch.float64) if norm_weight is None else norm_weight.double()
    rms = torch.sqrt(torch.einsum("n...d,n...d->n...", v, v) / v.shape[-1] + eps)
    return torch.einsum("n...d,d->n...", v, query.double() * w) / rms


def einsum_attn_res(values, query, norm_weight, eps, return_lse=False):
    """The definition, in float64, written independently of fusedops.attn_res.reference."""
    logits = einsum_logits(values, query, norm_weight, eps)
    alpha = torch.softmax(logits, dim=0)
    out = torch.einsum("n...,n...d->...d", alpha, values.double())
    return (out, torch.logsumexp(logits, dim=0)) if return_lse else out


def reference_grads(values, query, norm_weight, eps, grad_out, grad_lse=None):
    leaves = [t.detach().double().requires_grad_() for t in (values, query)]
    if norm_weight is not None:
        leaves.append(norm_weight.detach().double().requires_grad_())
    out, lse = einsum_attn_res(leaves[0], leaves[1], leaves[2] if norm_weight is not None else None, eps, True)
    if grad_lse is None:
        grads = torch.autograd.grad(out, leaves, grad_out.double())
    else:
        grads = torch.autograd.grad((out, lse), leaves, (grad_out.double(), grad_lse.double()))
    return out.detach(), grads


def representable(ref_grads, values, query, norm_weight) -> bool:
    """Whether every true gradient fits its parameter's dtype. fp16 parameters with values of scale
    1e3 can have a norm-weight gradient past 65504: such a case has no correct fp16 answer."""
    params = (values, query, norm_weight)
    return all(p is None or bool(g.abs().max() <= torch.finfo(p.dtype).max) for g, p in zip(ref_grads, params))


# The entries: the wrapper runs fusedops::attn_res_with_lse, whose backward makes one pass over values
# with the saved out and lse; torch.ops.fusedops.attn_res saves neither, so its backward is two-phase.
ENTRIES = {
    "wrapper": lambda v, q, w, eps: fusedops.attn_res(v, q, w, eps),
    "ops.attn_res": lambda v, q, w, eps: torch.ops.fusedops.attn_res(v, q, w, eps),
}


# The kernels: the depth tiles where a token's N rows fit on chip (as planned for small N * D); else the
# online-softmax forward, and the one-pass backward with the forward's out and lse saved (the wrapper) or
# the two-phase one without them.
KERNEL_CHOICES = ["planned", "no-depth-tile"]


@contextlib.contextmanager
def kernel_choice(which):
    """"planned": the planner's choice; "no-depth-tile": the other kernels even where the depth tiles
    fit (what larger N * D runs), so that every kernel meets the test sizes, the one-pass backward with D a
    compile-time constant, its rows loaded a step ahead and a row's sums in one reduction (the
    interpreter's planned one-pass plans do none of these)."""
    if which == "planned":
        yield
    else:
        with fusedops.plan_override("attn_res", "forward", variant="rows"), \
                fusedops.plan_override("attn_res", "backward", variant="rows", constant_dim=True, prefetch=True,
                                        fused_sums=True):
            yield


def run_op(values, query, norm_weight, eps, grad_out, entry="wrapper"):
    leaves = [t.detach().clone().requires_grad_() for t in (values, query)]
    weight = None if norm_weight is None else norm_weight.detach().clone().requires_grad_()
    out = ENTRIES[entry](leaves[0], leaves[1], weight, eps)
    out.backward(grad_out)
    grads = [leaves[0].grad, leaves[1].grad] + ([weight.grad] if weight is not None else [])
    return out.detach(), grads


def make_values(n, batch, dim, dtype, layout, scale, gen):
    """values [n, *batch, dim] in the requested layout: contiguous, a leading slice of a larger bank,
    or batch dims permuted (non-contiguous); the last dim always has stride 1."""
    if layout == "bank":
        bank = torch.randn((n + 3, *batch, dim), generator=gen) * scale
        values = bank.to(dtype)[:n]
    elif layout == "permuted" and len(batch) >= 2:
        full = (torch.randn((n, *reversed(batch), dim), generator=gen) * scale).to(dtype)
        perm = [0] + list(range(len(batch), 0, -1)) + [len(batch) + 1]
        values = full.permute(perm)
    else:
        values = (torch.randn((n, *batch, dim), generator=gen) * scale).to(dtype)
    assert values.shape == (n, *batch, dim)
    return values


def grad_tolerance_scale(dtype):
    # Gradients pass the rounding of out's dtype twice (the stored gradient and a mixed-precision cast).
    return 1.0 if dtype == torch.float32 else 2.0


def grad_term_sizes(values, query, norm_weight, eps, grad_out, grad_lse=None):
    """Sizes of the terms the gradients sum, each taken in absolute value: rounding in fp32 scales
    with these, not with the gradients, which can be tiny where the terms cancel (a saturated softmax
    makes dot(g, v_i) - dot(g, out) cancel). Returns (values, query, norm_weight) term sizes."""
    v, g, q = values.double(), grad_out.double(), query.double()
    w = torch.ones_like(q) if norm_weight is None else norm_weight.double()
    u = q * w
    rstd = torch.rsqrt(v.square().mean(-1, keepdim=True) + eps)
    logits = (v * u).sum(-1, keepdim=True) * rstd
    alpha = torch.softmax(logits, 0)
    gv_abs = (g.abs() * v.abs()).sum(-1, keepdim=True)
    ds_abs = alpha * (gv_abs + (alpha * gv_abs).sum(0, keepdim=True))
    if grad_lse is not None:
        ds_abs = ds_abs + alpha * grad_lse.double().abs().unsqueeze(-1)
    values_terms = alpha * g.abs() + ds_abs * rstd * (u.abs() + logits.abs() * rstd * v.abs() / v.shape[-1])
    u_terms = (ds_abs * rstd * v.abs()).reshape(-1, v.shape[-1]).sum(0)
    return values_terms, u_terms * w.abs(), u_terms * q.abs()


def assert_grads_close(grads, ref_grads, values, query, weight, eps, grad_out, grad_lse=None):
    """Each gradient within RTOL of the float64 one, plus 1e-5 (~100 fp32 ulps) of its term sizes,
    plus the storage format's resolution."""
    scale = grad_tolerance_scale(values.dtype)
    params = (values, query, weight)
    names = ("grad_values", "grad_query", "grad_norm_weight")
    term_sizes = grad_term_sizes(*params, eps, grad_out, grad_lse)
    for name, grad, ref, terms, param in zip(names, grads, ref_grads, term_sizes, params):
        assert grad.dtype == param.dtype, f"{name}: dtype {grad.dtype} != {param.dtype}"
        assert grad.shape == ref.shape, f"{name}: shape {tuple(grad.shape)} != {tuple(ref.shape)}"
        dtype = values.dtype if param.dtype == torch.float32 else param.dtype
        err = float("inf") if torch.isnan(grad).any() else (grad.double() - ref).norm().item()
        # A gradient below the storage format's smallest subnormal (6e-8 in fp16) cannot be stored
        # closer than that spacing: that resolution is the floor of any bound.
        info = torch.finfo(grad.dtype)
        resolution = info.tiny * info.eps * grad.numel() ** 0.5
        bound = RTOL[dtype] * scale * ref.norm().item() + 1e-5 * terms.norm().item() + resolution
        assert err <= bound, f"{name}: error {err:.3e} > {bound:.3e}"


@st.composite
def attn_res_cases(draw, max_n=70, max_dim=300):
    n = draw(st.integers(1, max_n))
    batch = draw(st.lists(st.integers(1, 3), min_size=0, max_size=3))
    dim = draw(st.one_of(st.integers(1, max_dim), st.sampled_from([1, 7, 64, 123, 256, 300])))
    dtype = draw(st.sampled_from(DTYPES))
    param_dtype = draw(st.sampled_from([dtype, torch.float32]))
    layout = draw(st.sampled_from(["contiguous", "bank", "permuted"]))
    value_scale = 10.0 ** draw(st.floats(-3, 3))
    query_scale = draw(st.sampled_from([0.0, 0.1, 1.0, 5.0]))  # 5.0 saturates the softmax
    with_weight = draw(st.booleans())
    eps = draw(st.sampled_from([1e-6, 1e-5, 0.1]))
    seed = draw(st.integers(0, 2**31 - 1))
    return n, tuple(batch), dim, dtype, param_dtype, layout, value_scale, query_scale, with_weight, eps, seed


def build_inputs(case):
    n, batch, dim, dtype, param_dtype, layout, value_scale, query_scale, with_weight, eps, seed = case
    gen = torch.Generator().manual_seed(seed)
    values = make_values(n, batch, dim, dtype, layout, value_scale, gen)
    query = (torch.randn(dim, generator=gen) * query_scale).to(param_dtype)
    weight = (torch.rand(dim, generator=gen) + 0.5).to(param_dtype) if with_weight else None
    grad_out = torch.randn((*batch, dim), generator=gen).to(dtype)
    return values, query, weight, eps, grad_out


def check_case(case, path, onchip_bytes=None, entry="wrapper", kernels="planned"):
    values, query, weight, eps, grad_out = build_inputs(case)
    ref_out, ref_grads = reference_grads(values, query, weight, eps, grad_out)
    if currently_in_test_context():  # a hypothesis example: drop it; a fixed case must be representable
        assume(representable(ref_grads, values, query, weight))
    else:
        assert representable(ref_grads, values, query, weight)
    with execution_path(path, onchip_bytes), kernel_choice(kernels):
        out, grads = run_op(values, query, weight, eps, grad_out, entry)
    assert out.dtype == values.dtype
    assert_close("out", out, ref_out, values.dtype)
    assert_grads_close(grads, ref_grads, values, query, weight, eps, grad_out)


@pytest.mark.parametrize("path", PATHS)
@given(case=attn_res_cases())
def test_matches_einsum(path, case):
    check_case(case, path)


@pytest.mark.parametrize("path", KERNEL_PATHS)
@given(case=attn_res_cases())
def test_one_pass_backward_matches_einsum(path, case):
    """The wrapper's backward without the depth tile: one pass over values with the saved out and lse."""
    check_case(case, path, kernels="no-depth-tile")


def group_rows(rows: int, tokens_per_program: int, constant_dim: bool, split_per_core: int = 0,
               prefetch: bool = False, evict_first: bool = False) -> list:
    """Table rows planning the depth-tile forward in groups of `rows` source rows, on every vendor (evict_first: a
    prefetch row's byte range that takes every call evict-first instead)."""
    params = dict(group_rows=rows, num_warps=4, tokens_per_program=tokens_per_program, programs_per_core=2,
                  constant_dim=constant_dim, split_per_core=split_per_core, prefetch=prefetch)
    if evict_first:
        params.update(evict_first_min_bytes=0, evict_first_max_bytes=2**62)
    return [{"kernel": "fwd_depth", "vendor": vendor, "arch": "*", "when": {}, "params": params, "run": "test"}
            for vendor in ("cuda", "ascend")]


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize(("rows", "tokens_per_program", "constant_dim", "split_per_core", "prefetch", "evict"),
                         [(1, 0, False, 0, True, False), (2, 1, True, 0, True, False), (4, 3, True, 0, False, False),
                          (2, 0, True, 6, True, False), (1, 1, False, 16, False, False), (2, 1, True, 0, True, True),
                          (1, 0, False, 6, True, True)])
@settings(max_examples=8)
@given(case=attn_res_cases(max_n=11, max_dim=130))
def test_forward_in_row_groups_matches_einsum(path, rows, tokens_per_program, constant_dim, split_per_core, prefetch,
                                              evict, case):
    """The depth-tile forward with fewer rows a step than N (an online softmax across the groups), from a
    table row: one or several tokens a program or a persistent grid, D constant or not, each group's rows loaded
    a step ahead, evict-first (the row's byte range covering the call) or plainly; with split_per_core, few tokens
    split their groups over programs (segments past the last group included) and a merge folds them."""
    from fusedops.plans import candidate_rows

    n, batch = case[0], case[1]
    assume(n > rows)
    tokens = math.prod(batch)
    table = group_rows(rows, tokens_per_program, constant_dim, split_per_core, prefetch, evict)
    with candidate_rows("attn_res", table):
        values, query, weight, eps, _ = build_inputs(case)
        with execution_path(path):
            target = ar_op.target_for(values.device, values.dtype)
            plan = ar_op.forward_plan(target, tokens, n, values.shape[-1], values.element_size())
            out, lse = torch.ops.fusedops.attn_res_with_lse(values, query, weight, eps)
    splits = min(-(-n // rows), target.vector_cores * split_per_core // max(tokens, 1))
    if splits > 1:
        assert (plan.split, plan.tokens_per_program, plan.grid) == (splits, 1, tokens * splits)
    else:
        assert plan.split == 0 and plan.tokens_per_program == tokens_per_program
    assert (plan.block_n, plan.constant_dim, plan.prefetch, plan.evict_first) == (
        rows, constant_dim, prefetch and not evict, evict)
    ref_out, ref_lse = einsum_attn_res(values, query, weight, eps, return_lse=True)
    assert_close("out", out, ref_out, values.dtype)
    assert_close("lse", lse, ref_lse, torch.float32)


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("kernels", KERNEL_CHOICES)
@given(case=attn_res_cases())
def test_two_phase_backward_matches_einsum(path, kernels, case):
    """torch.ops.fusedops.attn_res has no lse to save: its backward is the depth tile where that fits
    (it needs neither out nor lse), else two-phase, re-deriving the softmax first."""
    check_case(case, path, entry="ops.attn_res", kernels=kernels)


def two_phase_rows(split_per_core: int) -> list:
    """Table rows planning the two-phase backward in large tiles, its sources split over programs where the token
    blocks are fewer than cores x split_per_core, on every vendor."""
    params = dict(tile_elements=0, tiled_tile_elements=0, num_warps=4, unroll=1, fill_cores=False,
                  programs_per_core=2, split_per_core=split_per_core, split_min_saved=0)
    when = {"interpreted": True}  # as specific as the table's interpreter rows: ties go to the candidates
    return [{"kernel": "bwd", "vendor": vendor, "arch": "*", "when": when, "params": params, "run": "test"}
            for vendor in ("cuda", "ascend")]


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("split_per_core", [1, 64])
@settings(max_examples=8)
@given(case=attn_res_cases(max_n=11, max_dim=130))
def test_two_phase_backward_split_over_sources_matches_einsum(path, split_per_core, case):
    """Few token blocks split their sources into slices, one program each: a launch for the slices' statistics,
    then one for their gradients after the softmax over all N, each slice with its own row of partial sums."""
    from fusedops.plans import candidate_rows

    n, batch, dim = case[0], case[1], case[2]
    tokens = math.prod(batch)
    with candidate_rows("attn_res", two_phase_rows(split_per_core)), \
            fusedops.plan_override("attn_res", "backward", variant="rows"):
        values = build_inputs(case)[0]
        with execution_path(path):
            target = ar_op.target_for(values.device, values.dtype)
            plan = ar_op.backward_plan(target, tokens, n, dim, values.element_size(), False)
        check_case(case, path, entry="ops.attn_res")
    slices = min(n, target.vector_cores * split_per_core // -(-tokens // plan.block_t))
    assert plan.split == (slices if slices > 1 else 0)
    assert plan.one_pass is False and (plan.split == 0 or plan.grid == -(-tokens // plan.block_t))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kernels", KERNEL_CHOICES)
@given(case=attn_res_cases(max_n=24), lse_scale=st.sampled_from([0.0, 1.0, 100.0]))
def test_lse_matches_and_its_gradient_flows(path, kernels, case, lse_scale):
    """return_lse gives logsumexp over depth of the logits; a loss on lse reaches every input."""
    values, query, weight, eps, grad_out = build_inputs(case)
    grad_lse = lse_scale * torch.randn(values.shape[1:-1], generator=torch.Generator().manual_seed(case[-1]))
    ref_out, ref_grads = reference_grads(values, query, weight, eps, grad_out, grad_lse)
    assume(representable(ref_grads, values, query, weight))
    _, ref_lse = einsum_attn_res(values, query, weight, eps, return_lse=True)
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (values, query, weight)]
    with execution_path(path), kernel_choice(kernels):
        out, lse = fusedops.attn_res(*leaves, eps, return_lse=True)
        torch.autograd.backward((out, lse), (grad_out, grad_lse))
    assert lse.dtype == torch.float32 and lse.shape == values.shape[1:-1]
    # Each logit carries a rounding error relative to its own size, so lse's error scales with the
    # largest |logit|, not with |lse|, which cancels to ~0 when the logits straddle zero.
    logit_size = einsum_logits(values, query, weight, eps).abs().amax(0).norm().item()
    scale = max(1.0, logit_size / max(ref_lse.norm().item(), 1e-30))
    assert_close("lse", lse, ref_lse, torch.float32 if values.dtype == torch.float32 else values.dtype, scale)
    assert_close("out", out.detach(), ref_out, values.dtype)
    grads = [t.grad for t in leaves if t is not None]
    assert_grads_close(grads, ref_grads, values, query, weight, eps, grad_out, grad_lse)


@pytest.mark.parametrize("path", KERNEL_PATHS)
@given(case=attn_res_cases(max_n=12))
def test_matches_einsum_tiled_over_d(path, case):
    """A small on-chip budget forces the two-pass D-tiled forward and multi-tile backward."""
    check_case(case, path, onchip_bytes=TILED_BUDGET)


@pytest.mark.parametrize("path", PATHS)
def test_many_sources_no_cap(path):
    """N far past the 32 where Liger silently drops sources."""
    gen = torch.Generator().manual_seed(0)
    n, dim = 1030, 64
    values = torch.randn(n, 2, dim, generator=gen)
    direction = torch.nn.functional.normalize(torch.randn(dim, generator=gen), dim=0)
    query = 20 * direction
    # The last source points along the query: its logit is 20 * sqrt(64) = 160, the others' ~20 * N(0, 1).
    values[n - 1] = 3 * direction
    with execution_path(path):
        out = fusedops.attn_res(values, query)
    assert_close("out", out, einsum_attn_res(values, query, None, 1e-6), torch.float32)
    torch.testing.assert_close(out, values[n - 1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kernels", KERNEL_CHOICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_sources_gradients(path, kernels, dtype):
    """Gradients at N = 1030 with narrow rows: on the CUDA plan the depth tile holds all of a token's
    rows at once (2048 x 8, most of them padding), elsewhere the one-pass or two-phase kernel walks them."""
    check_case((1030, (3,), 5, dtype, torch.float32, "bank", 1.0, 1.0, True, 1e-6, 7), path, kernels=kernels)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dim", [4096, 7168, 16384])
def test_model_sized_rows(path, dim):
    """Real model widths at the default budgets: 16384 does not fit on chip in either plan, so the
    forward walks D tiles twice and the backward walks them in both phases."""
    case = (3, (2,), dim, torch.bfloat16, torch.float32, "bank", 1.0, 0.05, True, 1e-6, dim)
    check_case(case, path)


@pytest.mark.parametrize("path", PATHS)
def test_empty_batch(path):
    values = torch.randn(3, 0, 5, 8, requires_grad=True)
    query, weight = torch.randn(8, requires_grad=True), torch.rand(8, requires_grad=True)
    with execution_path(path):
        out = fusedops.attn_res(values, query, weight)
        out.sum().backward()
    assert out.shape == (0, 5, 8) and values.grad.shape == values.shape
    assert torch.equal(query.grad, torch.zeros(8)) and torch.equal(weight.grad, torch.zeros(8))


@pytest.mark.parametrize("path", PATHS)
def test_broadcast_sources_and_batch(path):
    """Stride-0 (expanded) depth and batch dims are read in place; N copies of one row mix to it."""
    row = torch.randn(1, 1, 4, 8)
    values = row.expand(5, 3, 4, 8)
    with execution_path(path), recorded_launches(ar_op) as launches:
        out = fusedops.attn_res(values, torch.randn(8), torch.rand(8))
    torch.testing.assert_close(out, row[0].expand(3, 4, 8), rtol=1e-6, atol=1e-6)
    if path != "reference":
        assert_values_read_in_place(launches, values)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n", [1, 3])
def test_strongly_negative_logits_keep_gradients_finite(path, n):
    """Every logit below -88 (exp underflows/overflows in fp32): odd N exercises the unrolled
    backward's masked tail, whose missing row must weigh zero rather than exp(0 - lse) = inf."""
    gen = torch.Generator().manual_seed(n)
    direction = torch.nn.functional.normalize(torch.randn(64, generator=gen), dim=0)
    values = (-direction + 0.01 * torch.randn(n, 2, 64, generator=gen))  # anti-aligned with the query
    query, weight, grad_out = 40 * direction, torch.rand(64, generator=gen) + 0.5, torch.randn(2, 64, generator=gen)
    ref_out, ref_grads = reference_grads(values, query, weight, 1e-6, grad_out)
    with execution_path(path):
        out, grads = run_op(values, query, weight, 1e-6, grad_out)
    assert all(torch.isfinite(g).all() for g in grads)
    assert_close("out", out, ref_out, torch.float32)
    assert_grads_close(grads, ref_grads, values, query, weight, 1e-6, grad_out)


@pytest.mark.parametrize("path", PATHS)
def test_zero_query_is_uniform_average(path):
    values = torch.randn(5, 3, 17)
    with execution_path(path):
        out = fusedops.nn.AttnRes(17)(values)
    torch.testing.assert_close(out, values.mean(0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("wanted", [(True, False, False), (False, True, True), (False, False, True)])
@pytest.mark.parametrize("one_pass", [False, True])
@pytest.mark.parametrize("kernels", KERNEL_CHOICES)
def test_backward_computes_only_needed_grads(path, wanted, one_pass, kernels):
    gen = torch.Generator().manual_seed(1)
    values, query, weight = torch.randn(4, 3, 10, generator=gen), torch.randn(10, generator=gen), torch.rand(10)
    grad_out = torch.randn(3, 10, generator=gen)
    with execution_path(path), kernel_choice(kernels):
        saved = torch.ops.fusedops.attn_res_with_lse(values, query, weight, 1e-6) if one_pass else ()
        grads = torch.ops.fusedops.attn_res_backward(grad_out, values, query, weight, 1e-6, *wanted, *saved)
    _, ref = reference_grads(values, query, weight, 1e-6, grad_out)
    for need, grad, ref_grad in zip(wanted, grads, ref):
        if need:
            assert_close("grad", grad, ref_grad, torch.float32)
        else:
            assert grad.numel() == 0


def assert_values_read_in_place(launches, values):
    """Every kernel launched read values through the caller's view (same memory, same strides), except
    the parameter-gradient reduction, which reads values only when it rewrites stashed rows."""
    readers = [(name, tensors) for name, tensors, _ in launches if name != "attn_res_param_grad_kernel"]
    assert readers
    for name, tensors in readers:
        assert any(same_view(t, values) for t in tensors), name


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("layout", ["bank", "permuted"])
def test_strided_values_are_read_in_place(path, layout):
    gen = torch.Generator().manual_seed(2)
    values = make_values(6, (3, 4), 24, torch.float32, layout, 1.0, gen)
    assert values._base is not None and (layout == "bank" or not values.is_contiguous())
    query, grad_out = torch.randn(24, generator=gen), torch.randn(3, 4, 24, generator=gen)
    with execution_path(path), recorded_launches(ar_op) as launches:
        out, lse = torch.ops.fusedops.attn_res_with_lse(values, query, None, 1e-6)
        torch.ops.fusedops.attn_res_backward(grad_out, values, query, None, 1e-6, True, True, False)
        torch.ops.fusedops.attn_res_backward(grad_out, values, query, None, 1e-6, True, True, False, out, lse)
    assert_values_read_in_place(launches, values)


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("onchip_bytes", [None, TILED_BUDGET])
@pytest.mark.parametrize("one_pass", [False, True])
@pytest.mark.parametrize("kernels", KERNEL_CHOICES)
def test_backward_is_bitwise_deterministic(path, onchip_bytes, one_pass, kernels):
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(7, 9, 40, generator=gen).to(torch.bfloat16)
    query, weight = torch.randn(40, generator=gen), torch.rand(40, generator=gen)
    grad_out = torch.randn(9, 40, generator=gen).to(torch.bfloat16)
    with execution_path(path, onchip_bytes), kernel_choice(kernels):
        saved = torch.ops.fusedops.attn_res_with_lse(values, query, weight, 1e-6) if one_pass else ()
        runs = [
            torch.ops.fusedops.attn_res_backward(grad_out, values, query, weight, 1e-6, True, True, True, *saved)
            for _ in range(2)
        ]
    for a, b in zip(*runs):
        assert torch.equal(a, b)


# The one-pass backward's schedules beside the planned one (see attn_res_bwd_onepass_kernel).
ORDERS = [dict(prefetch=True), dict(fused_sums=True), dict(prefetch=True, fused_sums=True)]


def one_pass_grads(values, query, weight, grad_out, order: dict, **fields) -> tuple:
    """attn_res_backward on the one-pass kernel (the forward's out and lse saved) in `order` (prefetch,
    fused_sums: False unless given) and under other plan fields given; asserts the kernel ran so."""
    order = dict(dict(prefetch=False, fused_sums=False), **order)
    saved = torch.ops.fusedops.attn_res_with_lse(values, query, weight, 1e-6)
    with fusedops.plan_override("attn_res", "backward", variant="one_pass", **order, **fields), \
            recorded_launches(ar_op) as launches:
        grads = torch.ops.fusedops.attn_res_backward(grad_out, values, query, weight, 1e-6, True, True, True, *saved)
    assert [(meta["PREFETCH"], meta["FUSED_SUMS"]) for name, _, meta in launches
            if name == "attn_res_bwd_onepass_kernel"] == [(order["prefetch"], order["fused_sums"])]
    return grads


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_one_pass_prefetch_gives_the_same_bits(path, n):
    """Loading rows a step ahead changes when they arrive, not what is computed: the same bits, heavy
    (waiting) rows, odd N's tail and programs of several token blocks included. (fused_sums is held to
    the reference instead, through kernel_choice: the interpreter's tl.sum is numpy's pairwise sum and
    its tl.reduce adds one element at a time, so the two round differently here.)"""
    gen = torch.Generator().manual_seed(n)
    values = (torch.randn(n, 3, 5, 48, generator=gen) * 4).to(torch.bfloat16)
    query, weight = torch.randn(48, generator=gen), torch.rand(48, generator=gen) + 0.5
    grad_out = torch.randn(3, 5, 48, generator=gen).to(torch.bfloat16)
    with execution_path(path, STASH_BUDGET):  # 8 blocks of 2 tokens on 3 programs
        planned = one_pass_grads(values, query, weight, grad_out, {}, grid=3)
        other = one_pass_grads(values, query, weight, grad_out, dict(prefetch=True), grid=3)
    for a, b in zip(planned, other):
        assert torch.equal(a, b)


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("order", [{}, dict(prefetch=True, fused_sums=True)])
def test_one_pass_four_waiting_rows_a_token(path, order):
    """Four equal heavy rows a token (alpha ~1/4 each, two light ones beside them): four waiting slots
    filled in the pass and read back in two steps of the tail, against the float64 gradients."""
    gen = torch.Generator().manual_seed(5)
    query, weight = torch.randn(32, generator=gen), torch.rand(32, generator=gen) + 0.5
    base = (query * weight).expand(5, 32) * 3 + torch.randn(5, 32, generator=gen) * 0.1
    values = torch.stack([base] * 4 + [-base, -2 * base]).to(torch.bfloat16)
    grad_out = torch.randn(5, 32, generator=gen).to(torch.bfloat16)
    with execution_path(path):
        grads = one_pass_grads(values, query, weight, grad_out, order)
    assert_grads_close(grads, reference_grads(values, query, weight, 1e-6, grad_out)[1], values, query, weight,
                       1e-6, grad_out)


STASH_BUDGET = 4096  # bytes: several programs of two tokens each on both plans (one token each past D 64)


@contextlib.contextmanager
def stash_off():
    with fusedops.plan_override("attn_res", "backward", stash=0):
        yield


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("kernels", KERNEL_CHOICES)
@pytest.mark.parametrize(("dtype", "n", "dim", "scale"), [
    (torch.bfloat16, 2, 64, 1.0), (torch.bfloat16, 9, 96, 40.0), (torch.float16, 5, 32, 1.0),
    (torch.float32, 1, 48, 1.0), (torch.float32, 6, 40, 40.0)])
def test_partial_sums_are_stashed_in_grad_values(path, kernels, dtype, n, dim, scale):
    """The kernels that write each program's partial-sum row once put it in grad_values (over rows of
    the program's first token, rewritten by the reduction) instead of a [programs, D] fp32 buffer: the
    gradients are those of the separate buffer (bit for bit where the reduction's blocks are the same),
    across several programs of several tokens, and with rows that dominate the softmax (scale: the one-pass
    kernel defers them)."""
    gen = torch.Generator().manual_seed(11)
    values = (torch.randn(n, 3, 11, dim, generator=gen) * 2).to(dtype)[:, :, 1:]  # strided batch dims
    query = scale * torch.randn(dim, generator=gen) / dim**0.5
    weight, grad_out = torch.rand(dim, generator=gen) + 0.5, torch.randn(3, 10, dim, generator=gen).to(dtype)
    launches = []

    def record(kernel, grid, args, meta):
        tensors, _ = split(bind(kernel, args))
        launches.append((kernel.fn.__name__, grid, [tuple(t.shape) for t in tensors], meta))
        return launch(kernel, grid, args, meta)

    with execution_path(path, STASH_BUDGET), kernel_choice(kernels):
        out, lse = torch.ops.fusedops.attn_res_with_lse(values, query, weight, 1e-6)
        with mock.patch("fusedops.attn_res.op.launch", record):
            stashed = torch.ops.fusedops.attn_res_backward(grad_out, values, query, weight, 1e-6, True, True, True,
                                                          out, lse)
        with stash_off():
            own = torch.ops.fusedops.attn_res_backward(grad_out, values, query, weight, 1e-6, True, True, True,
                                                      out, lse)
    assert torch.equal(stashed[0], own[0])
    # The sums run in the same order unless the stash narrowed the reduction's feature blocks (16-bit rows
    # with D not a power of two: blocks must divide D), which changes their height on a small budget.
    same_blocks = values.element_size() == 4 or dim & (dim - 1) == 0
    for a, b in zip(stashed[1:], own[1:]):
        if same_blocks:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * b.abs().max().item())
    (_, (programs,), shapes, meta), (reduction, _, reduced, _) = launches
    # the backward kernel wrote the scalars of 4 / element-size rows per program, over several programs (the
    # Ascend plan stashes fp32 rows only, and takes the two-phase kernel for 16-bit values: see backward_plan)
    rows = 0 if path == "ascend" and values.element_size() == 2 else 4 // values.element_size()
    assert meta.get("STASH", 0) == rows and programs > 1, launches
    assert reduction == "attn_res_param_grad_kernel", launches
    assert reduced[0] == ((programs + 1, rows, 3) if rows else (programs, dim)), launches


@pytest.mark.parametrize(("vendor", "n", "dim", "elem", "rows"), [
    ("cuda", 8, 4096, 2, 2), ("cuda", 64, 7168, 2, 2), ("cuda", 2, 8192, 2, 2), ("cuda", 1, 4096, 2, 0),
    ("cuda", 1, 4096, 4, 1), ("cuda", 4, 123, 4, 1), ("cuda", 4, 300, 2, 0), ("cuda", 4, 123, 2, 0),
    ("cuda", 4, 4096, 8, 0), ("ascend", 8, 4096, 2, 0), ("ascend", 8, 8, 2, 0), ("ascend", 8, 48, 2, 0),
    ("ascend", 8, 4096, 4, 1)])
def test_stash_rows_plan(vendor, n, dim, elem, rows):
    """Two 16-bit rows (or one fp32 row) hold a program's D fp32 partial sums; 16-bit rows need a reduction
    block that divides D and spans a whole aligned row segment; N = 1 has a single 16-bit row. The Ascend
    plan stashes fp32 rows only."""
    from fusedops.attn_res.plan import reduce_plan, stash_rows
    from fusedops.targets import ascend_target

    target = cuda_target(interpreted=True) if vendor == "cuda" else ascend_target(interpreted=True)
    target = dataclasses.replace(target, interpreted=False)  # the device's plan, not the interpreter's
    assert stash_rows(target, n, dim, elem) == rows
    if rows == 2:
        block_d = reduce_plan(target, dim, 264, rows)[0]
        assert dim % block_d == 0 and block_d % 2 == 0 and block_d * elem >= target.row_align


def opcheck_samples():
    gen = torch.Generator().manual_seed(4)
    for shape, dtype, weight in [((3, 2, 5, 16), torch.float32, True), ((1, 9), torch.float32, False),
                                 ((4, 3, 33), torch.bfloat16, True)]:
        values = torch.randn(shape, generator=gen).to(dtype)
        query = torch.randn(shape[-1], generator=gen)
        norm_weight = torch.rand(shape[-1], generator=gen) if weight else None
        yield values, query, norm_weight


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck(path, requires_grad):
    with execution_path(path), opaque_triton_ops():
        for values, query, weight in opcheck_samples():
            leaves = [t.requires_grad_(requires_grad) if t is not None else None for t in (values, query, weight)]
            torch.library.opcheck(torch.ops.fusedops.attn_res.default, (*leaves, 1e-6))
            torch.library.opcheck(torch.ops.fusedops.attn_res_with_lse.default, (*leaves, 1e-6))
            grad_out = torch.randn(values.shape[1:]).to(values.dtype)
            plain = [t.detach() if t is not None else None for t in (values, query, weight)]
            needs = (True, True, weight is not None)
            torch.library.opcheck(torch.ops.fusedops.attn_res_backward.default, (grad_out, *plain, 1e-6, *needs))
            out, lse = torch.ops.fusedops.attn_res_with_lse(*plain, 1e-6)
            for grad_lse in (None, torch.randn(lse.shape)):
                torch.library.opcheck(torch.ops.fusedops.attn_res_backward.default,
                                      (grad_out, *plain, 1e-6, *needs, out, lse, grad_lse))


class TinyDepthModel(torch.nn.Module):
    def __init__(self, dim=16, depth=3):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(depth))
        self.mix = torch.nn.ModuleList(fusedops.nn.AttnRes(dim) for _ in range(depth))
        for m in self.mix:
            torch.nn.init.normal_(m.query, std=0.5)

    def forward(self, x):
        sources = [x]
        for layer, mix in zip(self.layers, self.mix):
            h = mix(torch.stack(sources))
            sources.append(torch.tanh(layer(h)))
        return sources[-1]


@pytest.mark.parametrize("path", PATHS)
def test_compile_fullgraph_matches_eager(path):
    torch.manual_seed(5)
    assert_compiles_like_eager(path, TinyDepthModel(), torch.randn(2, 5, 16))


@pytest.mark.parametrize("path", KERNEL_PATHS[:1])
def test_compile_fullgraph_of_the_split_forward_matches_eager(path):
    """The forward split over programs and its merge (a scratch buffer allocated inside the op) in a fullgraph
    compile: eager's outputs and gradients."""
    torch.manual_seed(5)
    with fusedops.plan_override("attn_res", "forward", variant="depth_tile", block_n=1, split=3):
        assert_compiles_like_eager(path, TinyDepthModel(), torch.randn(2, 5, 16))


@pytest.mark.parametrize("path", PATHS)
def test_export_round_trip(path):
    torch.manual_seed(6)
    assert_export_round_trip(path, TinyDepthModel().eval(), torch.randn(2, 5, 16), "attn_res")


def _depth_inputs(shapes, dim=24, device="cpu", dtype=torch.float32):
    return [(torch.randn(n, b, t, dim, device=device).to(dtype).requires_grad_(),
             (0.5 * torch.randn(dim, device=device)).requires_grad_(),
             (torch.rand(dim, device=device) + 0.5).requires_grad_()) for n, b, t in shapes]


@pytest.mark.parametrize("path", PATHS)
def test_compile_dynamic_shapes_one_graph(path):
    """Depth, batch and tokens change between calls of one dynamic=True compile: no recompilation
    and eager's outputs and gradients. Dynamo traces the default eps as a symbolic float here, which
    the argument checks must accept."""
    torch.manual_seed(12)
    with execution_path(path), opaque_triton_ops():
        assert_dynamic_compile_like_eager(lambda v, q, w: fusedops.attn_res(v, q, w),
                                          _depth_inputs([(3, 2, 5), (5, 3, 9), (9, 2, 33)]))


@pytest.mark.parametrize("path", PATHS)
def test_export_dynamic_shapes(path):
    """Exported with symbolic batch and sequence dims, one program serves other sizes."""
    torch.manual_seed(13)
    batch, seq = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("seq", min=2, max=4096)
    assert_export_dynamic_like_eager(path, TinyDepthModel().eval(), (torch.randn(2, 5, 16),),
                                     ({0: batch, 1: seq},), [(torch.randn(3, 11, 16),), (torch.randn(1, 2, 16),)],
                                     "attn_res")


# ---- bad input: ValueError naming the argument, for every path (checks never read tensor data) ----

def _good():
    return torch.randn(3, 2, 8), torch.randn(8), torch.rand(8)


BAD_INPUTS = {
    "values_1d": (lambda v, q, w: (v[0, 0], q, w, 1e-6), "values"),
    "n_zero": (lambda v, q, w: (v[:0], q, w, 1e-6), "values"),
    "d_zero": (lambda v, q, w: (v[..., :0], q[:0], w[:0], 1e-6), "values"),
    "query_dim": (lambda v, q, w: (v, q[:7], w, 1e-6), "query"),
    "query_2d": (lambda v, q, w: (v, q[None], w, 1e-6), "query"),
    "weight_dim": (lambda v, q, w: (v, q, w[:5], 1e-6), "norm_weight"),
    "values_int": (lambda v, q, w: (v.to(torch.int32), q, w, 1e-6), "values"),
    "query_int": (lambda v, q, w: (v, q.to(torch.int64), w, 1e-6), "query"),
    "weight_complex": (lambda v, q, w: (v, q, w.to(torch.complex64), 1e-6), "norm_weight"),
    "device": (lambda v, q, w: (v, q.to("meta"), w, 1e-6), "query"),
    "eps_zero": (lambda v, q, w: (v, q, w, 0.0), "eps"),
    "eps_negative": (lambda v, q, w: (v, q, w, -1e-6), "eps"),
    "eps_nan": (lambda v, q, w: (v, q, w, math.nan), "eps"),
    "eps_inf": (lambda v, q, w: (v, q, w, math.inf), "eps"),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_names_argument(path, case):
    make, name = BAD_INPUTS[case]
    args = make(*_good())
    with execution_path(path), pytest.raises(ValueError, match=name):
        fusedops.attn_res(*args)


def _backward_args():
    values, query, weight = _good()
    out, lse = torch.ops.fusedops.attn_res_with_lse(values, query, weight, 1e-6)
    return dict(grad_out=torch.randn(2, 8), values=values, query=query, norm_weight=weight, eps=1e-6,
                need_values=True, need_query=True, need_norm_weight=True, out=out, lse=lse, grad_lse=None)


BAD_BACKWARD_INPUTS = {
    "grad_out_shape": (dict(grad_out=torch.randn(3, 8)), "grad_out"),
    "out_without_lse": (dict(lse=None), "lse"),
    "out_shape": (dict(out=torch.randn(2, 7)), "out"),
    "out_dtype": (dict(out=torch.randn(2, 8).double()), "out"),
    "lse_shape": (dict(lse=torch.randn(3)), "lse"),
    "lse_dtype": (dict(lse=torch.randn(2).half()), "lse"),
    "grad_lse_shape": (dict(grad_lse=torch.randn(2, 1)), "grad_lse"),
    "grad_lse_device": (dict(grad_lse=torch.randn(2, device="meta")), "grad_lse"),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", sorted(BAD_BACKWARD_INPUTS))
def test_bad_backward_input_names_argument(path, case):
    change, name = BAD_BACKWARD_INPUTS[case]
    with execution_path(path):
        args = _backward_args()
        with pytest.raises(ValueError, match=name):
            torch.ops.fusedops.attn_res_backward(**{**args, **change})


def check_batch_dims_no_three_strides_can_walk(entry, device="cpu"):
    gen = torch.Generator().manual_seed(11)
    values = torch.randn(3, 3, 4, 5, 6, 8, generator=gen).to(device).permute(0, 4, 3, 2, 1, 5)[:, ::2, :, ::2]
    assert len(collapse_dims(values.shape[1:-1], values.stride()[1:-1])[0]) == 4
    query, weight = (torch.randn(8, generator=gen).to(device), (torch.rand(8, generator=gen) + 0.5).to(device))
    grad_out = torch.randn(values.shape[1:], generator=gen).to(device)
    ref_out, ref_grads = reference_grads(values, query, weight, 1e-6, grad_out)
    out, grads = run_op(values, query, weight, 1e-6, grad_out, entry)
    assert_close("out", out, ref_out, values.dtype)
    assert_grads_close(grads, ref_grads, values, query, weight, 1e-6, grad_out)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("entry", sorted(ENTRIES))
@pytest.mark.parametrize("kernels", KERNEL_CHOICES)
def test_batch_dims_no_three_strides_can_walk(path, entry, kernels):
    """Four batch dims that no stride merges: the kernels walk at most three, so such values are copied
    once; the result must still be the einsum's on every path (on CPU and GPU alike, no error)."""
    with execution_path(path), kernel_choice(kernels):
        check_batch_dims_no_three_strides_can_walk(entry)


def test_module_validates_arguments():
    with pytest.raises(ValueError, match="dim"):
        fusedops.nn.AttnRes(0)
    with pytest.raises(ValueError, match="eps"):
        fusedops.nn.AttnRes(8, eps=-1.0)


def test_module_reset_parameters_after_meta_init():
    """Built on the meta device, moved with to_empty (garbage memory), then reset_parameters: the
    module is a fresh one (query 0, norm gain 1), as FSDP-style deferred initialisation expects."""
    module = fusedops.nn.AttnRes(8, device="meta")
    module.to_empty(device="cpu")
    with torch.no_grad():
        module.query.fill_(3.0)  # what uninitialised memory may hold
        module.norm_weight.fill_(-2.0)
    module.reset_parameters()
    assert torch.equal(module.query, torch.zeros(8)) and torch.equal(module.norm_weight, torch.ones(8))
    assert module.state_dict().keys() == fusedops.nn.AttnRes(8).state_dict().keys()


def test_cuda_plan_fits_model_rows_on_chip():
    """D = 4096 and 7168 run the single-pass forward on an H100-like target, and up to 8192 the one-pass
    backward (at most 32 row elements per thread) where the depth tile does not fit (N = 64); D = 16384
    falls back to the D-tiled two-phase one."""
    from fusedops.attn_res.op import backward_plan

    target = cuda_target(interpreted=True)
    for dim in (4096, 7168):
        assert make_plan(target, 8192, dim, 2, backward=False).one_tile
    for dim in (123, 4096, 7168, 8192):
        plan = backward_plan(target, 8192, 1024, dim, 2, one_pass=True)
        assert plan.one_pass and plan.one_tile and plan.block_t * plan.block_d <= 32 * 32 * plan.num_warps
    plan = backward_plan(target, 8192, 64, 16384, 2, one_pass=True)
    assert not plan.one_pass and not plan.one_tile and not plan.block_n
    assert not backward_plan(target, 8192, 64, 4096, 2, one_pass=False).one_pass


@pytest.mark.parametrize(("n", "dim", "elem", "depth_tile"), [
    (4, 4096, 2, True), (4, 7168, 2, True), (2, 16384, 2, True), (16, 1024, 4, True), (8, 2048, 2, True),
    (8, 4096, 2, False), (16, 2048, 2, False), (4, 8192, 4, False), (3, 16384, 2, False)])
def test_cuda_backward_takes_the_depth_tile_where_measured_faster(n, dim, elem, depth_tile):
    """The H100 sweep (bench/NOTES.md): tiles of up to 16K elements, or up to 4 rows within the register
    budget; with at most 128 row elements per thread and one warp per 1K of row width (up to 8)."""
    from fusedops.attn_res.op import backward_plan

    for saved in (False, True):
        plan = backward_plan(cuda_target(interpreted=True), 8192, n, dim, elem, one_pass=saved)
        assert bool(plan.block_n) == depth_tile
        if depth_tile:
            assert plan.block_n >= n and plan.block_d >= dim
            threads = 32 * plan.num_warps
            assert plan.block_n * plan.block_d <= 128 * threads and plan.num_warps * 1024 >= min(plan.block_d, 8192)


@pytest.mark.parametrize(("n", "dim", "depth_tile"), [
    (2, 1024, True), (8, 1024, True), (4, 2048, True), (4, 4096, True), (3, 7168, True), (2, 16384, True),
    (16, 1024, False), (6, 2048, False), (8, 4096, False), (64, 4096, False)])
def test_cuda_forward_takes_the_depth_tile_where_measured_faster(n, dim, depth_tile):
    """The H100 sweep (bench/NOTES.md, run 11), the rules where no row groups are planned (the interpreter here;
    fp32 values and rows over 16K on GPUs): up to 4 rows of any width that fits, or tiles of up to 8K elements;
    128 row elements per thread; one program per token for tiles of up to 4K elements."""
    from fusedops.attn_res.op import forward_plan

    plan = forward_plan(cuda_target(interpreted=True), 8192, n, dim, 2)
    assert bool(plan.block_n) == depth_tile
    if depth_tile:
        tile = plan.block_n * plan.block_d
        assert plan.block_n >= n and plan.block_d >= dim and plan.num_warps == max(4, tile // (32 * 128))
        assert (plan.grid == 8192) == (tile <= 4096)


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize(("kernel", "fields", "gap"), [
    ("forward", dict(variant="online", block_d=8), "features past block_d = 8 of D = 24"),
    ("forward", dict(variant="depth_tile", block_d=16), "features past block_d = 16 of D = 24"),
    ("backward", dict(variant="one_pass", block_d=8), "features past block_d = 8 of D = 24"),
    ("backward", dict(variant="depth_tile", block_n=2), "sources past block_n = 2 of N = 3"),
])
def test_forced_plan_that_leaves_rows_out_is_refused(path, kernel, fields, gap):
    """plan_override fields are taken as given, except where the tiles would leave part of a row or some sources
    out: the kernels mask what their tiles do not cover, so those outputs were uninitialised memory (an online
    forward with block_d = 8 < D gave errors of 5e31). A plan that covers everything still runs."""
    values, query = torch.randn(3, 5, 24).requires_grad_(), torch.randn(24)
    with execution_path(path):
        with fusedops.plan_override("attn_res", kernel, **fields), pytest.raises(ValueError, match=re.escape(gap)):
            fusedops.attn_res(values, query).sum().backward()
        covered = dict(fields, **{k: 32 if k == "block_d" else 4 for k in fields if k != "variant"})
        with fusedops.plan_override("attn_res", kernel, **covered):
            out = fusedops.attn_res(values, query)
            out.sum().backward()
    with execution_path("reference"):
        torch.testing.assert_close(out, fusedops.attn_res(values, query), rtol=1e-5, atol=1e-5)


# D: (rows a group, tokens a program (0: 4 programs per SM), the next group's rows loaded ahead)
H200_GROUPS = {1024: (2, 1, True), 1536: (2, 1, True), 2048: (2, 1, True), 2304: (2, 1, True), 3072: (2, 1, True),
               3584: (2, 1, False), 4096: (4, 1, False), 5120: (2, 0, True), 6144: (2, 0, False), 7168: (2, 0, False),
               8192: (4, 0, False), 12288: (2, 0, False), 16384: (2, 0, False)}


@pytest.mark.parametrize("arch", ["sm90-h200", "sm90", "sm80"])
@pytest.mark.parametrize("dim", sorted(H200_GROUPS))
@pytest.mark.parametrize("n", [2, 9, 64])
def test_cuda_forward_takes_row_groups_by_width(arch, n, dim):
    """The H200 sweep (bench/NOTES.md, attn_res run 12), the same rows timed on the H100 and taken for unseen
    GPUs: 16-bit values of every width up to 16K take the depth tile in groups of 2-4 rows, D a compile-time
    constant; one program per token up to D = 4096, else a persistent grid of 4 programs per SM; a group holds
    at most 128 fp32 row elements per thread; the next group's rows loaded ahead up to D = 3072 and at D 4097-5120
    (run 16). fp32 values and wider rows keep the older rules (run 11), as does the interpreter."""
    from fusedops.attn_res.op import forward_plan

    interpreter = cuda_target(interpreted=True)
    gpu = dataclasses.replace(interpreter, arch=arch, vector_cores=132, interpreted=False)
    plan = forward_plan(gpu, 8192, n, dim, 2)
    rows, per_program, prefetch = H200_GROUPS[dim]
    # run 18: up to D = 3072, calls past the L2 (48 MiB) and up to 256 MiB load rows evict-first instead
    evict = prefetch and dim <= 3072 and 48 * 2**20 < (n + 1) * 8192 * dim * 2 <= 256 * 2**20
    # run 19: on the H200 at D 1025-2048, prefetching calls take 4 rows a group where N and D waste no lanes
    if arch == "sm90-h200" and 1024 < dim <= 2048 and prefetch and not evict and n % 4 == 0 and dim & (dim - 1) == 0:
        rows = 4
    assert (plan.block_n, plan.tokens_per_program, plan.constant_dim) == (min(rows, n), per_program, True)
    assert (plan.prefetch, plan.evict_first) == (prefetch and not evict, evict)
    assert plan.grid == (8192 if per_program else 4 * 132)
    assert plan.block_n * plan.block_d <= 128 * 32 * plan.num_warps
    assert not forward_plan(gpu, 8192, n, dim, 4).tokens_per_program
    assert not forward_plan(gpu, 8192, n, 32768, 2).block_n
    assert not forward_plan(interpreter, 8192, n, dim, 2).constant_dim
    assert plan.split == 0
    # few tokens split each token's groups over programs, up to 2 programs a core, where that shortens the
    # token's chain of groups by 4 or more (run 15)
    for tokens in (1, 16, 100):
        few = forward_plan(gpu, tokens, n, dim, 2)
        groups = -(-n // few.block_n)
        splits = min(groups, 132 * 2 // tokens)
        split = splits > 1 and groups - -(-groups // splits) >= 4
        assert few.split == (splits if split else 0) and few.block_n == min(rows, n)
        if few.split:
            assert (few.grid, few.tokens_per_program) == (tokens * splits, 1)


# ---- real kernels on a GPU ----

GPU_ONE_PASS_SIZES = [(8, 4096), (16, 4096), (64, 4096), (8, 7168), (16, 7168), (64, 7168)]
GPU_DEPTH_TILE_SIZES = [(2, 16384), (4, 4096), (3, 7168), (16, 1024)]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(("n", "dim"), GPU_ONE_PASS_SIZES + GPU_DEPTH_TILE_SIZES)
def test_gpu_real_sizes(n, dim):
    """Model widths on the one-pass backward (N >= 8) and on the depth tile (a token's rows fit on chip)."""
    from fusedops.attn_res.op import backward_plan

    plan = backward_plan(cuda_target(torch.device("cuda")), 256, n, dim, 2, one_pass=True)
    assert bool(plan.block_n) == ((n, dim) in GPU_DEPTH_TILE_SIZES)
    torch.manual_seed(n + dim)
    values = torch.randn(n, 2, 128, dim, device="cuda").to(torch.bfloat16)
    query = torch.randn(dim, device="cuda") * 0.05
    weight = torch.rand(dim, device="cuda") + 0.5
    grad_out = torch.randn(2, 128, dim, device="cuda").to(torch.bfloat16)
    ref_out, ref_grads = reference_grads(values, query, weight, 1e-6, grad_out)
    out, grads = run_op(values, query, weight, 1e-6, grad_out)
    assert_close("out", out, ref_out, torch.bfloat16)
    assert_grads_close(grads, ref_grads, values, query, weight, 1e-6, grad_out)
    again = run_op(values, query, weight, 1e-6, grad_out)[1]
    assert all(torch.equal(a, b) for a, b in zip(grads, again))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(("n", "tokens", "dim"), [(128, 1, 12288), (16, 64, 12288), (64, 1, 16384), (9, 3, 12288)])
def test_gpu_two_phase_backward_split_over_sources(n, tokens, dim):
    """Rows too wide for the one-pass kernel and few tokens: the two-phase backward splits each token block's
    sources over programs (a row of this GPU's arch with split_per_core 2); every gradient against the float64
    definition, bitwise equal run to run, strided tokens."""
    from fusedops.attn_res.op import backward_plan
    from fusedops.plans import candidate_rows

    target = cuda_target(torch.device("cuda"))
    params = dict(tile_elements=4096, tiled_tile_elements=8192, num_warps=4, unroll=2, fill_cores=True,
                  programs_per_core=2, split_per_core=2, split_min_saved=4)
    row = {"kernel": "bwd", "vendor": "cuda", "arch": target.arch or "*", "when": {"interpreted": False},
           "params": params, "run": "test"}
    torch.manual_seed(n + dim)
    values = torch.randn(n, tokens + 1, dim, device="cuda").to(torch.bfloat16)[:, 1:]
    values[n // 2] *= 20  # one source dominates some tokens
    query = torch.randn(dim, device="cuda") * 0.05
    weight = torch.rand(dim, device="cuda") + 0.5
    grad_out = torch.randn(tokens, dim, device="cuda").to(torch.bfloat16)
    ref_out, ref_grads = reference_grads(values, query, weight, 1e-6, grad_out)
    with candidate_rows("attn_res", [row]):
        assert backward_plan(target, tokens, n, dim, 2, one_pass=True).split > 1
        out, grads = run_op(values, query, weight, 1e-6, grad_out)
        again = run_op(values, query, weight, 1e-6, grad_out)[1]
    assert_close("out", out, ref_out, torch.bfloat16)
    assert_grads_close(grads, ref_grads, values, query, weight, 1e-6, grad_out)
    assert all(torch.equal(a, b) for a, b in zip(grads, again))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(("n", "dim"), GPU_ONE_PASS_SIZES + [(9, 3072), (7, 5120)])
@pytest.mark.parametrize("order", ORDERS)
def test_gpu_one_pass_order_gives_the_same_bits(n, dim, order):
    torch.manual_seed(n + dim)
    values = torch.randn(n, 300, dim, device="cuda").to(torch.bfloat16)
    query, weight = torch.randn(dim, device="cuda") * 0.05, torch.rand(dim, device="cuda") + 0.5
    grad_out = torch.randn(300, dim, device="cuda").to(torch.bfloat16)
    planned = one_pass_grads(values, query, weight, grad_out, {})
    for a, b in zip(planned, one_pass_grads(values, query, weight, grad_out, order)):
        assert torch.equal(a, b)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(("n", "tokens", "dim"), [(64, 1, 7168), (9, 8, 3072), (128, 3, 12288), (16, 100, 5120),
                                                   (33, 64, 2048), (20, 1, 1536)])
def test_gpu_forward_split_over_programs(n, tokens, dim):
    """Few tokens: the table splits each token's row groups over programs and merges them; out and lse against
    the float64 definition, bitwise equal run to run, strided tokens."""
    from fusedops.attn_res.op import forward_plan

    target = cuda_target(torch.device("cuda"))
    torch.manual_seed(n + dim)
    values = torch.randn(n, tokens + 1, dim, device="cuda").to(torch.bfloat16)[:, 1:]
    values[n // 2] *= 20  # one source dominates some tokens
    query = torch.randn(dim, device="cuda") * 0.05
    weight = torch.rand(dim, device="cuda") + 0.5
    plan = forward_plan(target, tokens, n, dim, 2)
    assert plan.split > 1, plan
    out, lse = torch.ops.fusedops.attn_res_with_lse(values, query, weight, 1e-6)
    again = torch.ops.fusedops.attn_res_with_lse(values, query, weight, 1e-6)
    ref_out, ref_lse = einsum_attn_res(values, query, weight, 1e-6, return_lse=True)
    assert_close("out", out, ref_out, torch.bfloat16)
    assert_close("lse", lse, ref_lse, torch.float32)
    assert torch.equal(out, again[0]) and torch.equal(lse, again[1])


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(("n", "dim"), [(9, 3072), (8, 7168), (24, 6144), (4, 12288), (6, 1024), (3, 8192)])
@pytest.mark.parametrize(("rows", "tokens_per_program", "constant_dim", "prefetch"),
                         [(2, 1, True, True), (4, 0, True, False), (1, 0, False, True), (2, 1, True, "evict")])
def test_gpu_forward_in_row_groups(n, dim, rows, tokens_per_program, constant_dim, prefetch):
    """The depth-tile forward in row groups at model widths (the H200 table's plans and their neighbours),
    from table rows of this GPU's arch, each group's rows loaded a step ahead, evict-first or plainly, against the
    float64 definition; bitwise equal run to run."""
    from fusedops.attn_res.op import forward_plan
    from fusedops.attn_res.plan import next_pow2
    from fusedops.plans import candidate_rows

    target = cuda_target(torch.device("cuda"))
    evict = prefetch == "evict"
    params = dict(group_rows=rows, num_warps=4 if rows * dim <= 16384 else 8, tokens_per_program=tokens_per_program,
                  programs_per_core=4, constant_dim=constant_dim, prefetch=bool(prefetch))
    if evict:
        params.update(evict_first_min_bytes=0, evict_first_max_bytes=2**62)
    when = {"interpreted": False, "dtype": "16", "dim": [1, None]}  # as specific as the table's rows: ties go to it
    row = {"kernel": "fwd_depth", "vendor": "cuda", "arch": target.arch or "*", "when": when, "params": params,
           "run": "test"}
    torch.manual_seed(n + dim)
    values = torch.randn(n, 3, 171, dim, device="cuda").to(torch.bfloat16)[:, :, 1:]  # 510 tokens, strided
    query = torch.randn(dim, device="cuda") * 0.05
    weight = torch.rand(dim, device="cuda") + 0.5
    with candidate_rows("attn_res", [row]):
        plan = forward_plan(target, 510, n, dim, 2)
        out, lse = torch.ops.fusedops.attn_res_with_lse(values, query, weight, 1e-6)
        again = torch.ops.fusedops.attn_res_with_lse(values, query, weight, 1e-6)
    block_n = min(rows, next_pow2(n))
    if block_n * next_pow2(dim) * 6 > target.onchip_bytes:  # a group must fit on chip (fp32 + bf16 a element)
        assert plan.block_n == 0
    else:
        assert (plan.block_n, plan.tokens_per_program, plan.constant_dim, plan.prefetch, plan.evict_first) == (
            block_n, tokens_per_program, constant_dim, prefetch is True, evict)
    ref_out, ref_lse = einsum_attn_res(values, query, weight, 1e-6, return_lse=True)
    assert_close("out", out, ref_out, torch.bfloat16)
    assert_close("lse", lse, ref_lse, torch.float32)
    assert torch.equal(out, again[0]) and torch.equal(lse, again[1])


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(("n", "dim"), [(8, 4096), (4, 4096), (8, 8192), (2, 16384)])
def test_gpu_step_peak_memory_is_under_ligers(n, dim):
    """A fwd+bwd step allocates out, lse, grad_values, the parameter gradients and O(programs) scalars: the
    partial sums are stashed in grad_values, so nothing else of size D x programs. Liger-Kernel's step
    holds out, grad_values, its saved alpha and rstd (2 x N x tokens fp32) and two fp32 parameter gradients:
    ours must stay under that."""
    tokens = 4096
    torch.manual_seed(n)
    values = torch.randn(n, tokens, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    query = (0.05 * torch.randn(dim, device="cuda")).requires_grad_()
    weight = (torch.rand(dim, device="cuda") + 0.5).requires_grad_()
    grad_out = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    grads = torch.autograd.grad(fusedops.attn_res(values, query, weight), (values, query, weight), grad_out)
    torch.cuda.synchronize()
    above = torch.cuda.max_memory_allocated() - base - (n + 1) * tokens * dim * 2  # out and grad_values
    assert above <= 2 * n * tokens * 4 + 2 * dim * 4, above
    assert torch.isfinite(grads[1]).all() and grads[1].abs().sum() > 0


@gpu
@pytest.mark.gpu
@given(case=attn_res_cases())
@settings(max_examples=40)
def test_gpu_matches_einsum(case):
    values, query, weight, eps, grad_out = (t.cuda() if isinstance(t, torch.Tensor) else t for t in build_inputs(case))
    ref_out, ref_grads = reference_grads(values, query, weight, eps, grad_out)
    out, grads = run_op(values, query, weight, eps, grad_out)
    assert_close("out", out, ref_out, values.dtype)
    assert_grads_close(grads, ref_grads, values, query, weight, eps, grad_out)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_gpu_batch_dims_no_three_strides_can_walk(entry):
    check_batch_dims_no_three_strides_can_walk(entry, "cuda")


@gpu
@pytest.mark.gpu
def test_gpu_compile_of_leaf_inputs_matches_eager():
    torch.manual_seed(8)
    values = torch.randn(4, 2, 64, 256, device="cuda").to(torch.bfloat16).requires_grad_()
    query = (torch.randn(256, device="cuda") * 0.1).requires_grad_()
    weight = (torch.rand(256, device="cuda") + 0.5).requires_grad_()
    assert_compiled_leaves_like_eager(lambda v, q, w: fusedops.attn_res(v, q, w), (values, query, weight))


@gpu
@pytest.mark.gpu
def test_gpu_inductor_fullgraph_matches_eager():
    torch.manual_seed(7)
    model = TinyDepthModel(dim=256, depth=4).cuda()
    assert_inductor_like_eager(model, torch.randn(4, 64, 256, device="cuda"))


@gpu
@pytest.mark.gpu
def test_gpu_inductor_dynamic_shapes_one_graph():
    """Inductor traces the op's body (plans, grids, launches) with symbolic sizes."""
    torch.manual_seed(14)
    assert_dynamic_compile_like_eager(
        lambda v, q, w: fusedops.attn_res(v, q, w), _depth_inputs([(4, 2, 64), (6, 3, 100), (9, 2, 257)], 256, "cuda"),
        backend="inductor", rtol=1e-4, atol=1e-4)
