"""Block AttnRes (issue 37): attn_res_multi (phase 1) and attn_res_merge (phase 2) against a float64 einsum
definition of the single-query softmax over all sources, on the PyTorch reference path and on both launch plans
under the Triton interpreter; list and bank sources; fused add/norm variants against their compositions; opcheck,
compile, export, gradcheck, determinism and bad input."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

import fusedops
from fusedops.block_attn_res import op as bar_op
from fusedops.block_attn_res.plan import MergePlan, merge_plan, multi_plan
from fusedops.targets import ascend_target, cuda_target, target_for

from .helpers import (
    KERNEL_PATHS,
    PATHS,
    assert_close,
    execution_path,
    gpu,
    opaque_triton_ops,
    recorded_launches,
    same_view,
)

EPS = 1e-6
# The interpreter runs a program at a time: few, tiny examples per property keep this file near 2 minutes.
FEW = settings(max_examples=6)


def einsum_attn_res(sources, query, eps):
    """The single-query AttnRes over sources [N, *batch, D] in float64, written independently of fusedops:
    (out, lse)."""
    v = sources.double()
    rms = torch.sqrt(torch.einsum("n...d,n...d->n...", v, v) / v.shape[-1] + eps)
    logits = torch.einsum("n...d,d->n...", v, query.double()) / rms
    return torch.einsum("n...,n...d->...d", torch.softmax(logits, 0), v), torch.logsumexp(logits, 0)


def rmsnorm(h, gain, eps):
    return h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps) * gain


def block_case():
    return st.tuples(
        st.integers(1, 5),  # N completed blocks
        st.integers(1, 4),  # M sublayers
        st.lists(st.integers(1, 3), min_size=0, max_size=2),  # batch dims
        st.one_of(st.integers(1, 40), st.sampled_from([1, 16, 33])),  # D
        st.booleans(),  # a gain (the next sublayer's norm) folded into the merge
        st.sampled_from([0, 1, 2]),  # addends per merge
        st.sampled_from([0.1, 1.0, 3.0]),  # query scale (3: saturating softmaxes)
        st.integers(0, 2**31 - 1),
    )


def _sublayer_weights(m, dim, gen):
    return [torch.randn(dim, dim, generator=gen, dtype=torch.float64) / dim**0.5 for _ in range(m)]


def run_block(values, queries, partial0, weights, gain, num_add, multi, merge):
    """One block of M sublayers, Block AttnRes's two phases: phase 1 for all M queries, then per sublayer the
    merge with the partial sum (after adding the previous sublayer's output(s) into it) and the sublayer
    f_l(h) = tanh(h W_l) (two addends: f_l and a scaled copy, as routed and shared experts)."""
    out, lse = multi(values, queries)
    p, pending, hs = partial0, (), []
    for l in range(queries.shape[0]):
        h, p = merge(out[l], lse[l], p, queries[l], pending[:num_add], gain)
        hs.append(h)
        f = torch.tanh(h.double() @ weights[l]).to(h.dtype)
        pending = (f, 0.5 * f) if num_add else ()
    return hs, p


def fused_block(values, queries, partial0, weights, gain, num_add):
    return run_block(values, queries, partial0, weights, gain, num_add, fusedops.attn_res_multi,
                     lambda o, lse, p, q, adds, g: fusedops.attn_res_merge(o, lse, p, q, adds, g, EPS))


def definition_block(values, queries, partial0, weights, gain, num_add):
    """The same block with every sublayer's h the single-query softmax over [b_0..b_{N-1}, p'] (float64)."""

    def multi(v, q):
        return v, q  # phase 1 is folded into each sublayer's softmax below

    def merge(v, q_all, p, q, adds, g):
        for a in adds:
            p = p + a
        h, _ = einsum_attn_res(torch.cat([v, p.unsqueeze(0)]), q, EPS)
        return (h if g is None else rmsnorm(h, g, EPS)), p

    out, lse = values, queries
    p, pending, hs = partial0, (), []
    for l in range(queries.shape[0]):
        h, p = merge(out, None, p, queries[l], pending[:num_add], gain)
        hs.append(h)
        f = torch.tanh(h @ weights[l])
        pending = (f, 0.5 * f) if num_add else ()
    return hs, p


def _block_inputs(case, dtype):
    n, m, batch, dim, with_gain, num_add, q_scale, seed = case
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(n, *batch, dim, generator=gen, dtype=torch.float64).to(dtype)
    queries = (q_scale * torch.randn(m, dim, generator=gen, dtype=torch.float64)).to(dtype)
    partial0 = torch.randn(*batch, dim, generator=gen, dtype=torch.float64).to(dtype)
    gain = (torch.rand(dim, generator=gen, dtype=torch.float64) + 0.5).to(dtype) if with_gain else None
    weights = _sublayer_weights(m, dim, gen)
    return values, queries, partial0, gain, weights, num_add


def _block_grads(fn, values, queries, partial0, gain, weights, num_add):
    leaves = [t.detach().clone().requires_grad_() for t in (values, queries, partial0)]
    g = None if gain is None else gain.detach().clone().requires_grad_()
    hs, p = fn(*leaves, weights, g, num_add)
    gen = torch.Generator().manual_seed(99)
    loss = sum((h.double() * torch.randn(h.shape, generator=gen, dtype=torch.float64)).sum() for h in hs)
    loss = loss + (p.double() * torch.randn(p.shape, generator=gen, dtype=torch.float64)).sum()
    params = leaves + ([g] if g is not None else [])
    grads = torch.autograd.grad(loss, params)
    return [h.detach() for h in hs], p.detach(), grads


@pytest.mark.parametrize("path", PATHS)
@FEW
@given(case=block_case())
def test_block_equals_single_query_softmax_over_all_sources(path, case):
    """Phase 1 + the merges of a whole block (float64) equal, for every sublayer, the single-query softmax over
    [b_0..b_{N-1}, p] (with the addends added into p first, and the output norm where asked): forward, the
    final partial sum and the gradients of a loss on every sublayer's output w.r.t. values, queries, the
    initial partial sum and the gain."""
    inputs = _block_inputs(case, torch.float64)
    ref_h, ref_p, ref_grads = _block_grads(definition_block, *inputs)
    with execution_path(path):
        hs, p, grads = _block_grads(fused_block, *inputs)
    for l, (h, ref) in enumerate(zip(hs, ref_h)):
        torch.testing.assert_close(h, ref, rtol=1e-10, atol=1e-10, msg=f"sublayer {l}")
    torch.testing.assert_close(p, ref_p, rtol=1e-10, atol=1e-10)
    for name, g, ref in zip(("values", "queries", "partial", "gain"), grads, ref_grads):
        torch.testing.assert_close(g, ref, rtol=1e-9, atol=1e-9, msg=f"grad of {name}")


@pytest.mark.parametrize("path", PATHS)
@FEW
@given(case=block_case(), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_block_low_precision_forward(path, case, dtype):
    """The same block in float32/bfloat16/float16 (the sublayers in float64 between): every output within the
    dtype's tolerance of the float64 definition run on the same rounded inputs."""
    values, queries, partial0, gain, weights, num_add = _block_inputs(case, dtype)
    ref_h, _ = definition_block(values.double(), queries.double(), partial0.double(), weights,
                                None if gain is None else gain.double(), 0)
    with execution_path(path):
        hs, _ = fused_block(values, queries, partial0, weights, gain, 0)
    # The rounded h feeds the next sublayer: errors compound over the block (M <= 4 sublayers).
    for h, ref in zip(hs, ref_h):
        assert h.dtype == dtype
        assert_close("h", h, ref, dtype, scale=2.0 * queries.shape[0])


# ---- attn_res_multi ------------------------------------------------------------------------------------------


def multi_reference(values, queries, eps, grad_out, grad_lse):
    v = values.detach().double().requires_grad_()
    q = queries.detach().double().requires_grad_()
    outs, lses = zip(*(einsum_attn_res(v, q[l], eps) for l in range(q.shape[0])))
    out, lse = torch.stack(outs), torch.stack(lses)
    grads = torch.autograd.grad((out, lse), (v, q), (grad_out.double(), grad_lse.double()))
    return out.detach(), lse.detach(), grads


@pytest.mark.parametrize("path", PATHS)
@FEW
@given(n=st.integers(1, 9), m=st.integers(1, 6), batch=st.lists(st.integers(1, 3), max_size=2),
       dim=st.integers(1, 48), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
       layout=st.sampled_from(["contiguous", "bank", "list"]), seed=st.integers(0, 2**31 - 1))
def test_multi_matches_per_query_attn_res(path, n, m, batch, dim, dtype, layout, seed):
    """out[l] and lse[l] are the single-query AttnRes of query l (fusedops.attn_res's definition), and the
    gradients (through out and lse) those of float64 autograd, for contiguous values, a token-major bank
    [tokens, N_max, D] read in place, and a list of its slots."""
    gen = torch.Generator().manual_seed(seed)
    tokens = math.prod(batch)
    bank = torch.randn(tokens, n + 2, dim, generator=gen).to(dtype)
    stacked = bank[:, :n].movedim(1, 0).reshape(n, *batch, dim)
    queries = torch.randn(m, dim, generator=gen).to(torch.float64 if dtype == torch.float64 else torch.float32)
    grad_out = torch.randn(m, *batch, dim, generator=gen).to(dtype)
    grad_lse = torch.randn(m, *batch, generator=gen)
    ref_out, ref_lse, ref_grads = multi_reference(stacked, queries, EPS, grad_out, grad_lse.double())
    leaf = (bank if layout != "contiguous" else stacked.contiguous()).detach().requires_grad_()
    q = queries.clone().requires_grad_()
    if layout == "contiguous":
        values = leaf
    elif layout == "bank":
        values = leaf[:, :n].movedim(1, 0).reshape(n, *batch, dim)
    else:
        values = [leaf[:, i].reshape(*batch, dim) for i in range(n)]
    with execution_path(path):
        out, lse = fusedops.attn_res_multi(values, q, EPS)
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        torch.autograd.backward((out, lse), (grad_out, grad_lse.to(acc)))
    assert out.dtype == dtype and lse.dtype == acc and out.shape == (m, *batch, dim) and lse.shape == (m, *batch)
    tol = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2, torch.float64: 1e-12}[dtype]
    torch.testing.assert_close(out.double(), ref_out, rtol=tol, atol=tol * 4)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5 if dtype != torch.float64 else 1e-12,
                               atol=1e-5 if dtype != torch.float64 else 1e-12)
    grad_values = leaf.grad if layout == "contiguous" else leaf.grad[:, :n].movedim(1, 0).reshape(n, *batch, dim)
    if layout != "contiguous":
        assert not leaf.grad[:, n:].any()  # the bank's unused slots get no gradient
    scale = max(1.0, ref_grads[0].abs().max().item())
    torch.testing.assert_close(grad_values.double(), ref_grads[0], rtol=tol * 4, atol=tol * 4 * scale)
    qscale = max(1.0, ref_grads[1].abs().max().item())
    torch.testing.assert_close(q.grad.double(), ref_grads[1], rtol=tol * 4, atol=tol * 4 * qscale)


@pytest.mark.parametrize("path", KERNEL_PATHS)
@FEW
@given(n=st.integers(1, 17), m=st.integers(1, 20), batch=st.sampled_from([(8,), (13,), (3, 5), (2, 3, 7)]),
       dim=st.integers(1, 150), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       layout=st.sampled_from(["contiguous", "bank"]), seed=st.integers(0, 2**31 - 1))
def test_multi_two_pass_forward_matches_per_query_attn_res(path, n, m, batch, dim, dtype, layout, seed):
    """From 8 tokens the interpreter's table row plans the two-pass forward (the GPU rows from 1024 tokens): the
    weights kernel then the outputs kernel (ragged feature tiles, batch dims walked, a bank read in place) give
    each query's single-query AttnRes and lse; above 16 sources the one-kernel forward stays (and on Ascend)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = math.prod(batch)
    bank = torch.randn(tokens, n + 2, dim, generator=gen).to(dtype)
    stacked = bank[:, :n].movedim(1, 0).reshape(n, *batch, dim)
    values = stacked if layout == "bank" else stacked.contiguous()
    queries = torch.randn(m, dim, generator=gen)
    with execution_path(path):
        plan = multi_plan(target_for(values.device, values.dtype), tokens, n, m, dim, values.element_size())
        out, lse = fusedops.attn_res_multi(values, queries, EPS)
    assert plan.two_pass == (n <= 16 and path == "cuda")  # Ascend plans keep the CUDA-core forward
    tol = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]
    for l in range(m):
        ref, ref_lse = einsum_attn_res(stacked.double(), queries[l].double(), EPS)
        torch.testing.assert_close(out[l].double(), ref, rtol=tol, atol=4 * tol)
        torch.testing.assert_close(lse[l].double(), ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", KERNEL_PATHS)
@FEW
@given(n=st.integers(1, 70), m=st.integers(1, 70), batch=st.sampled_from([(1,), (5,), (3, 3)]),
       dim=st.integers(1, 80), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       grads_of=st.sampled_from(["out", "lse", "both"]), wanted=st.sampled_from(["values", "queries", "both"]),
       flat=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_multi_backward_matches_float64(path, n, m, batch, dim, dtype, grads_of, wanted, flat, seed):
    """The backward on its own terms: gradients through out, lse or both, of values, queries or both (the other
    frozen), for depths and query counts past one tensor-core tile (CUDA plans: the statistics then gradients
    kernels, the flat one (as planned, within its rows and columns caps) or the batched one (not flat: forced),
    fewer tokens a step for deep or wide blocks and the CUDA-core kernel past the interpreter row's caps; Ascend's:
    the CUDA-core kernel), against float64 autograd."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(n, *batch, dim, generator=gen).to(dtype)
    queries = torch.randn(m, dim, generator=gen)
    grad_out = torch.randn(m, *batch, dim, generator=gen).to(dtype) * (grads_of != "lse")
    grad_lse = torch.randn(m, *batch, generator=gen) * (grads_of != "out")
    _, _, ref_grads = multi_reference(values, queries, EPS, grad_out, grad_lse.double())
    v = values.clone().requires_grad_(wanted != "queries")
    q = queries.clone().requires_grad_(wanted != "values")
    batched = {} if flat else {"grad_rows": 0}
    with execution_path(path), fusedops.plan_override("block_attn_res", "multi_bwd", **batched):
        out, lse = fusedops.attn_res_multi(v, q, EPS)
        outputs = [(out, grad_out), (lse, grad_lse)]
        outputs = outputs[:1] if grads_of == "out" else outputs[1:] if grads_of == "lse" else outputs
        torch.autograd.backward(*zip(*outputs))
    tol = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]
    for leaf, ref in ((v, ref_grads[0]), (q, ref_grads[1])):
        if leaf.requires_grad:
            scale = max(1.0, ref.abs().max().item())
            torch.testing.assert_close(leaf.grad.double(), ref, rtol=tol * 4, atol=tol * 4 * scale)


@pytest.mark.parametrize("path", PATHS)
def test_multi_with_one_query_is_attn_res(path):
    gen = torch.Generator().manual_seed(1)
    values, query = torch.randn(5, 3, 24, generator=gen), torch.randn(1, 24, generator=gen)
    with execution_path(path):
        out, lse = fusedops.attn_res_multi(values, query, EPS)
        ref, ref_lse = fusedops.attn_res(values, query[0], None, EPS, return_lse=True)
    torch.testing.assert_close(out[0], ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse[0], ref_lse, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("n", "m"), [(17, 3), (40, 33)])
def test_multi_deep_and_wide_blocks(path, n, m):
    """More sources and queries than the measured tensor-core tiles hold (the plan then takes fewer tokens a
    step and narrower tiles): still each query's single-query AttnRes, in float32 and float16."""
    gen = torch.Generator().manual_seed(7)
    for dtype, tol in ((torch.float32, 2e-5), (torch.float16, 2e-3)):
        values, queries = torch.randn(n, 5, 24, generator=gen).to(dtype), torch.randn(m, 24, generator=gen)
        with execution_path(path):
            out, lse = fusedops.attn_res_multi(values, queries, EPS)
        for l in range(m):
            ref, ref_lse = einsum_attn_res(values.double(), queries[l].double(), EPS)
            torch.testing.assert_close(out[l].double(), ref, rtol=tol, atol=4 * tol)
            torch.testing.assert_close(lse[l].double(), ref_lse, rtol=1e-5, atol=1e-5)


def test_bank_is_read_in_place_and_lists_equal_stacked():
    """Kernels read the token-major bank (a strided view, a list of its slots) without a copy, and list, bank
    and stacked inputs give the same bits, for attn_res and attn_res_multi, forward and gradients."""
    gen = torch.Generator().manual_seed(2)
    bank = torch.randn(6, 5, 16, generator=gen)
    queries = torch.randn(3, 16, generator=gen)
    for path in ("cuda", "ascend"):
        with execution_path(path):
            view = bank[:, :4].movedim(1, 0)
            with recorded_launches(bar_op) as launches:
                out, lse = fusedops.attn_res_multi(view, queries)
            kernel = {"cuda": "attn_res_multi_fwd_dot_kernel", "ascend": "attn_res_multi_fwd_kernel"}[path]
            assert [name for name, _, _ in launches] == [kernel]
            assert any(same_view(t, view) for t in launches[0][1])
            slots = [bank[:, i] for i in range(4)]
            separate = [bank[:, i].clone() for i in range(4)]
            stacked = view.contiguous()
            for vs in (slots, separate, stacked):
                o2, l2 = fusedops.attn_res_multi(vs, queries)
                assert torch.equal(o2, out) and torch.equal(l2, lse)
                assert torch.equal(fusedops.attn_res(vs, queries[0]), fusedops.attn_res(view, queries[0]))
            # gradients reach each list element (view path) and each separate tensor (stack path)
            for vs in (slots, separate):
                leaves = [t.detach().clone().requires_grad_() for t in vs]
                base = torch.stack([t.detach() for t in vs], 1).requires_grad_()
                as_slots = [base[:, i] for i in range(4)]
                for inputs, grads_of in ((leaves, lambda: [t.grad for t in leaves]),
                                         (as_slots, lambda: list(base.grad.unbind(1)))):
                    o, l = fusedops.attn_res_multi(inputs, queries)
                    (o.square().sum() + l.sum()).backward()
                    ref_v = stacked.clone().requires_grad_()
                    ro, rl = fusedops.attn_res_multi(ref_v, queries)
                    (ro.square().sum() + rl.sum()).backward()
                    for g, r in zip(grads_of(), ref_v.grad.unbind(0)):
                        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6)


def test_list_read_in_place_is_saved_as_a_bank_view():
    """A list of bank slots is read in place and saved as a view of the bank (README): writing another slot
    before the backward is autograd's in-place error, as for torch ops that save a view; a stacked copy is not."""
    bank = torch.randn(5, 4, 8)
    query = torch.randn(8, requires_grad=True)
    fusedops.attn_res([bank[:, i] for i in range(3)], query).sum().backward()  # nothing written: fine
    out = fusedops.attn_res([bank[:, i] for i in range(3)], query)
    bank[:, 3] = 1.0
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    out = fusedops.attn_res(torch.stack([bank[:, i] for i in range(3)]), query)
    bank[:, 3] = 2.0
    out.sum().backward()


def test_list_view_needs_equal_spacing():
    from fusedops.block_attn_res.sources import stack_sources

    bank = torch.randn(4, 6, 8)
    view = stack_sources("values", [bank[:, i] for i in (0, 1, 2)])
    assert view.data_ptr() == bank.data_ptr() and view.stride() == (8, 48, 1)
    gapped = stack_sources("values", [bank[:, i] for i in (0, 1, 3)])  # not equally spaced: stacked
    assert gapped.is_contiguous() and torch.equal(gapped, bank[:, [0, 1, 3]].movedim(1, 0))


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize(("tokens", "n", "m", "dim", "block_d", "splits"), [
    (1, 9, 6, 40, 8, 5), (3, 4, 3, 37, 16, 2), (2, 1, 1, 5, 2, 3), (5, 8, 16, 24, 8, 1)])
def test_multi_decode_plans_split_d(path, tokens, n, m, dim, block_d, splits):
    """Decode plans: SPLITS programs share a token, each writing its D_CHUNK of the output rows (ragged last
    chunk), with D tiled; the plan's automatic splits for few tokens on a small budget too."""
    gen = torch.Generator().manual_seed(3)
    values, queries = torch.randn(n, tokens, dim, generator=gen), torch.randn(m, dim, generator=gen)
    ref_out, ref_lse = fusedops.attn_res_multi(values.double(), queries.double())
    per = -(-(-(-dim // block_d)) // splits) * block_d
    splits = -(-dim // per)
    forced = dict(block_m=1 << (m - 1).bit_length(), block_n=1 << (n - 1).bit_length(), block_d=block_d,
                  splits=splits, d_chunk=per, grid=min(tokens, 2) * splits, dot=False, two_pass=False)
    with execution_path(path), fusedops.plan_override("block_attn_res", "multi_fwd", **forced):
        out, lse = fusedops.attn_res_multi(values, queries)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    with execution_path(path, onchip_bytes=512):
        auto = multi_plan(target_for(values.device), tokens, n, m, dim, 4)
        out, lse = fusedops.attn_res_multi(values, queries)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    assert auto.d_chunk * auto.splits >= dim and auto.grid % auto.splits == 0


def test_decode_plans_split_d_on_the_devices():
    """The device plans (not the interpreter's) split D across programs when a few tokens cannot fill the
    chip: 1 token at D = 7168 runs on many programs; many tokens take no split."""
    import dataclasses

    for target in (cuda_target(interpreted=True), ascend_target(interpreted=True)):
        target = dataclasses.replace(target, interpreted=False, vector_cores=132)
        one = multi_plan(target, 1, 9, 24, 7168, 2)
        assert one.splits > 1 and one.grid == one.splits and one.splits * one.d_chunk >= 7168
        many = multi_plan(target, 8192, 9, 24, 7168, 2)
        assert many.splits == 1
        assert merge_plan(target, 1, 7168, 2).grid == 1


# ---- attn_res_merge ------------------------------------------------------------------------------------------


def merge_inputs(batch, dim, dtype, gen, num_add, with_gain):
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    out = torch.randn(*batch, dim, generator=gen).to(dtype)
    lse = (2 * torch.randn(*batch, generator=gen)).to(acc)
    partial = torch.randn(*batch, dim, generator=gen).to(dtype)
    query = torch.randn(dim, generator=gen).to(acc)
    adds = tuple(torch.randn(*batch, dim, generator=gen).to(dtype) for _ in range(num_add))
    gain = (torch.rand(dim, generator=gen) + 0.5).to(acc) if with_gain else None
    return out, lse, partial, query, adds, gain


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("num_add", [0, 1, 2])
@pytest.mark.parametrize("with_gain", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_fused_variants_equal_their_composition(path, num_add, with_gain, dtype):
    """The fused add / norm variants equal: p' = partial + addends (in float32, rounded once), h = the plain
    merge of p', y = rmsnorm(h) * gain (h not rounded before the norm); and the plain merge equals the
    single-query softmax over [sources, p']. Gradients of the fused op equal the composition's (float64)."""
    gen = torch.Generator().manual_seed(4 + num_add)
    out, lse, partial, query, adds, gain = merge_inputs((2, 3), 24, dtype, gen, num_add, with_gain)
    with execution_path(path):
        y, p_new = fusedops.attn_res_merge(out, lse, partial, query, adds, gain)
        p_ref = partial.float()
        for a in adds:
            p_ref = p_ref + a.float()
        p_ref = p_ref.to(dtype)
        if num_add and (dtype == torch.float32 or path == "reference"):
            torch.testing.assert_close(p_new, p_ref, rtol=0, atol=0)
        elif num_add:  # Triton's interpreter rounds float32 -> bfloat16 toward zero, GPUs to nearest even
            torch.testing.assert_close(p_new.float(), p_ref.float(), rtol=2**-7, atol=0)
        else:
            assert p_new is partial
        h, same = fusedops.attn_res_merge(out, lse, p_ref, query)
        assert same is p_ref
    h64 = _merge_definition(out.double(), lse.double(), p_ref.double(), query.double())
    assert_close("h", h if not with_gain else y, h64 if not with_gain else rmsnorm(h64, gain.double(), EPS), dtype)
    if not with_gain and (dtype == torch.float32 or path == "reference"):
        assert torch.equal(y, h)  # the fused add changes no bit of the merge (bf16: see the rounding above)
    elif not with_gain:
        assert_close("y", y, h.double(), dtype)
    # gradients, float64: the fused op against autograd through the composition
    leaves = [t.double().requires_grad_() for t in (out, lse, partial, query, *adds)]
    g = gain.double().requires_grad_() if with_gain else None
    o64, l64, p64, q64, *a64 = leaves
    gen = torch.Generator().manual_seed(5)
    gy, gp = torch.randn(2, 3, 24, generator=gen, dtype=torch.float64), torch.randn(2, 3, 24, generator=gen,
                                                                                   dtype=torch.float64)
    params = leaves + ([g] if g is not None else [])
    with execution_path(path):
        y, pn = fusedops.attn_res_merge(o64, l64, p64, q64, a64, g)
        fused = torch.autograd.grad((y, pn) if num_add else (y,), params, (gy, gp) if num_add else (gy,))
    pc = p64 + sum(a64) if num_add else p64
    hc = _merge_definition(o64, l64, pc, q64)
    yc = rmsnorm(hc, g, EPS) if g is not None else hc
    comp = torch.autograd.grad((yc, pc) if num_add else (yc,), params, (gy, gp) if num_add else (gy,))
    for f, c in zip(fused, comp):
        torch.testing.assert_close(f, c, rtol=1e-10, atol=1e-10)


def _merge_definition(out, lse, p, query):
    """h = sigmoid(lse - s) out + sigmoid(s - lse) p, s = rstd(p) <q, p> (float64)."""
    s = (p * query).sum(-1) / torch.sqrt(p.square().mean(-1) + EPS)
    return torch.sigmoid(lse - s).unsqueeze(-1) * out + torch.sigmoid(s - lse).unsqueeze(-1) * p


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("plan", [MergePlan(1, 4, 2), MergePlan(2, 8, 2), MergePlan(4, 64, 2),
                                  MergePlan(1, 64, 2, whole_row=True), MergePlan(2, 64, 1, whole_row=True,
                                                                                 blocks_per_program=2),
                                  MergePlan(1, 64, 5, whole_row=True, blocks_per_program=1, constant_dim=True)],
                         ids=["t1-d4", "t2-d8", "t4-d64", "whole-persistent", "whole-t2-2-blocks", "whole-1-token-D"])
def test_merge_tiled_plans(path, plan):
    """The merge's multi-pass D tiles and whole rows, token blocks (ragged last ones), persistent or a fixed
    number of blocks a program (the grid then follows from it: the plan's grid of 1 or 5 does not matter), D
    constant or not, and a bank slot read in place."""
    block_t, block_d = plan.block_t, plan.block_d
    gen = torch.Generator().manual_seed(6)
    dtype = torch.float32 if path == "ascend" else torch.float64  # triton-ascend has no float64
    tol = 2e-5 if dtype == torch.float32 else 1e-11
    out, lse, partial, query, adds, gain = merge_inputs((5,), 37, dtype, gen, 2, True)
    bank = torch.randn(5, 3, 37, generator=gen, dtype=dtype)
    slot = bank[:, 1]
    ref_y, ref_p = fusedops.attn_res_merge(out, lse, slot, query, adds, gain)
    gy, gp = torch.randn_like(ref_y), torch.randn_like(ref_p)
    ref_grads = torch.ops.fusedops.attn_res_merge_backward(gy, gp, out, lse, ref_p, query, gain, EPS, EPS,
                                                          True, True, True, True, True)
    with execution_path(path):
        target = target_for(out.device)
        with recorded_launches(bar_op) as launches, plan_override("merge_fwd", plan):
            y, p_new = bar_op._merge_forward(out, lse, slot, query, *adds, gain, EPS, EPS, target)
        assert any(same_view(t, slot) for t in launches[0][1])
        with plan_override("merge_bwd", MergePlan(block_t, block_d, 3)):
            grads = bar_op._merge_backward(gy, gp, out, lse, ref_p, query, gain, EPS, EPS, True, True, True, True,
                                           True, target)
    torch.testing.assert_close(y, ref_y, rtol=tol, atol=tol)
    torch.testing.assert_close(p_new, ref_p, rtol=0, atol=0)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def plan_override(kernel: str, plan):
    """fusedops.plan_override forcing every field of a MergePlan or MultiPlan on `kernel` of block_attn_res."""
    fields = dataclasses.asdict(plan)
    from fusedops.plans import override_keys

    keys = override_keys("block_attn_res")[kernel]
    return fusedops.plan_override("block_attn_res", kernel, **{k: v for k, v in fields.items() if k in keys})


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_forced_plans_cover_the_shape_or_raise(path):
    """fusedops.plan_override forces a plan on each kernel (the backward of a call made in the block too); a
    forced plan whose tiles would leave sources, queries or features out raises ValueError naming them instead
    of masking them away."""
    gen = torch.Generator().manual_seed(12)
    values, queries = torch.randn(5, 9, 40, generator=gen), torch.randn(3, 40, generator=gen)
    ref_out, ref_lse = fusedops.attn_res_multi(values.double(), queries.double())
    leaf = values.clone().requires_grad_()
    # CUDA: the two-pass forward with 16-wide output tiles (D = 40 ragged); Ascend: its CUDA-core forward, 8-wide
    forward = (dict(two_pass=True, block_n=4, tail_rows=1, block_t=16, block_d2=16) if path == "cuda"
               else dict(block_d=8, grid=3))
    with execution_path(path):
        with fusedops.plan_override("block_attn_res", "multi_fwd", **forward), \
                fusedops.plan_override("block_attn_res", "multi_bwd", block_d=8, grid=2):
            out, lse = fusedops.attn_res_multi(leaf, queries)
            (out.sum() + lse.sum()).backward()
        with pytest.raises(ValueError, match="sources past 4 of N = 5"):
            with fusedops.plan_override("block_attn_res", "multi_fwd", two_pass=True, block_n=4, tail_rows=0):
                fusedops.attn_res_multi(values, queries)
        with pytest.raises(ValueError, match="queries past block_m = 2 of M = 3"):
            with fusedops.plan_override("block_attn_res", "multi_bwd", block_m=2):
                torch.ops.fusedops.attn_res_multi_backward(torch.ones(3, 9, 40), None, values, queries, EPS, True,
                                                           True)
        if path == "ascend":  # its plans carry no two-pass or tensor-core fields (was a ZeroDivisionError)
            with pytest.raises(ValueError, match="two-pass forward needs block_t and block_d2"):
                with fusedops.plan_override("block_attn_res", "multi_fwd", two_pass=True, block_n=4, tail_rows=1):
                    fusedops.attn_res_multi(values, queries)
        with pytest.raises(ValueError, match="features past block_d = 32 of D = 40"):
            with fusedops.plan_override("block_attn_res", "merge_fwd", whole_row=True, block_d=32):
                fusedops.attn_res_merge(out[0].detach(), lse[0].detach(), values[0], queries[0])
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    v64 = values.double().requires_grad_()
    o64, l64 = fusedops.attn_res_multi(v64, queries.double())
    (o64.sum() + l64.sum()).backward()
    torch.testing.assert_close(leaf.grad.double(), v64.grad, rtol=1e-4, atol=1e-4)


def whole_row_merge_rows(whole_row_d: int) -> list:
    """Table rows planning the merge's forward one whole row a program up to next_pow2(D) = whole_row_d."""
    params = dict(one_row=True, whole_row_d=whole_row_d, constant_dim=True, tile_d=8, tile_elements=0,
                  elements_per_warp=0, few_rows_elements_per_warp=0, num_warps=4, max_warps=4, many_rows_max_warps=4)
    return [{"kernel": "merge_fwd", "vendor": vendor, "arch": "*", "when": {"interpreted": True}, "params": params,
             "run": "test"}
            for vendor in ("cuda", "ascend")]


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("num_add", [0, 1, 2])
@pytest.mark.parametrize("with_gain", [False, True])
@pytest.mark.parametrize("dim", [24, 33])
def test_merge_whole_row_plan_from_the_table(path, num_add, with_gain, dim):
    """A table row asking for whole rows gives one program per token with D constant where next_pow2(D) fits
    whole_row_d, tiles of tile_d on a persistent grid above it; both equal the float64 definition, with every
    fused add and the output norm, and the updated partial sum is the rounded sum."""
    from fusedops.plans import candidate_rows

    gen = torch.Generator().manual_seed(9 + num_add)
    tokens = 5
    out, lse, partial, query, adds, gain = merge_inputs((tokens,), dim, torch.float32, gen, num_add, with_gain)
    with candidate_rows("block_attn_res", whole_row_merge_rows(32)), execution_path(path):
        plan = merge_plan(target_for(out.device), tokens, dim, 4)
        y, p_new = fusedops.attn_res_merge(out, lse, partial, query, adds, gain)
    whole = dim <= 32
    assert (plan.whole_row, plan.blocks_per_program, plan.constant_dim) == (whole, int(whole), True)
    assert plan.block_d == (32 if whole else 8)
    p_ref = partial
    for a in adds:
        p_ref = p_ref + a
    if num_add:
        torch.testing.assert_close(p_new, p_ref, rtol=0, atol=0)
    h64 = _merge_definition(out.double(), lse.double(), p_ref.double(), query.double())
    assert_close("y", y, rmsnorm(h64, gain.double(), EPS) if with_gain else h64, torch.float32)


def test_device_merge_plans_take_whole_rows_by_width():
    """The GPU rows: one program per token over the whole row up to D = 16384, D tiles on a persistent grid
    above; a decode step is one program either way."""
    for arch in ("sm90-h200", "sm90", "sm80"):
        target = dataclasses.replace(cuda_target(interpreted=True), interpreted=False, vector_cores=132, arch=arch)
        wide = merge_plan(target, 8192, 7168, 2)
        assert (wide.whole_row, wide.block_d, wide.grid, wide.constant_dim) == (True, 8192, 8192, True)
        wider = merge_plan(target, 8192, 16385, 2)
        assert not wider.whole_row and wider.block_d < 16385 and wider.blocks_per_program == 0
        assert merge_plan(target, 1, 7168, 2).grid == 1


# ---- op contracts: opcheck, compile, export, gradcheck, determinism, bad input --------------------------------


def _multi_samples():
    gen = torch.Generator().manual_seed(7)
    for shape, m, dtype in [((3, 2, 5, 16), 4, torch.float32), ((1, 9), 1, torch.float32),
                            ((4, 3, 33), 3, torch.bfloat16)]:
        yield torch.randn(shape, generator=gen).to(dtype), torch.randn(m, shape[-1], generator=gen)


def _merge_samples():
    gen = torch.Generator().manual_seed(8)
    for batch, dim, dtype, num_add, with_gain in [((2, 3), 16, torch.float32, 2, True), ((4,), 9, torch.float32, 0,
                                                                                         False),
                                                  ((3,), 33, torch.bfloat16, 1, True)]:
        out, lse, partial, query, adds, gain = merge_inputs(batch, dim, dtype, gen, num_add, with_gain)
        yield out, lse, partial, query, (adds + (None, None))[:2], gain


@pytest.mark.parametrize("path", PATHS)
def test_opcheck(path):
    with execution_path(path), opaque_triton_ops():
        for values, queries in _multi_samples():
            for rg in (False, True):
                torch.library.opcheck(torch.ops.fusedops.attn_res_multi.default,
                                      (values.clone().requires_grad_(rg), queries.clone().requires_grad_(rg), EPS))
            out, lse = torch.ops.fusedops.attn_res_multi(values, queries, EPS)
            for g, gl in ((torch.randn_like(out), torch.randn_like(lse)), (torch.randn_like(out), None),
                          (None, torch.randn_like(lse))):
                torch.library.opcheck(torch.ops.fusedops.attn_res_multi_backward.default,
                                      (g, gl, values, queries, EPS, True, True))
        for out, lse, partial, query, (a1, a2), gain in _merge_samples():
            args = (out, lse, partial, query, a1, a2, gain, EPS, 1e-5)
            torch.library.opcheck(torch.ops.fusedops.attn_res_merge.default, args)
            leaves = tuple(t.clone().requires_grad_() if isinstance(t, torch.Tensor) else t for t in args)
            torch.library.opcheck(torch.ops.fusedops.attn_res_merge.default, leaves)
            y, p_new = torch.ops.fusedops.attn_res_merge(*args)
            p = p_new if a1 is not None else partial
            for gp in (None, torch.randn_like(partial)):
                torch.library.opcheck(torch.ops.fusedops.attn_res_merge_backward.default,
                                      (torch.randn_like(y), gp, out, lse, p, query, gain, EPS, 1e-5,
                                       True, True, True, True, True))


class TinyBlock(torch.nn.Module):
    """One Block AttnRes block of 3 sublayers over 2 stored block sums: phase 1, then merge + sublayer."""

    def __init__(self, dim=16, m=3):
        super().__init__()
        self.queries = torch.nn.Parameter(0.5 * torch.randn(m, dim))
        self.gain = torch.nn.Parameter(torch.rand(dim) + 0.5)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(m))

    def forward(self, x):
        values = torch.stack([x, torch.tanh(x)])
        out, lse = fusedops.attn_res_multi(values, self.queries)
        p, pending = x, ()
        for l, layer in enumerate(self.layers):
            h, p = fusedops.attn_res_merge(out[l], lse[l], p, self.queries[l], pending, self.gain)
            pending = (torch.tanh(layer(h)),)
        return p + pending[0]


@pytest.mark.parametrize("path", PATHS)
def test_compile_fullgraph_and_export(path):
    from .helpers import assert_compiles_like_eager, assert_export_round_trip

    torch.manual_seed(9)
    model = TinyBlock()
    x = torch.randn(2, 5, 16)
    assert_compiles_like_eager(path, model, x)
    assert_export_round_trip(path, model.eval(), x, "attn_res_multi")
    assert_export_round_trip(path, model.eval(), x, "attn_res_merge")


@pytest.mark.parametrize("path", PATHS)
def test_gradcheck_float64(path):
    gen = torch.Generator().manual_seed(10)
    values = torch.randn(3, 2, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    queries = torch.randn(2, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    out, lse, partial, query, adds, gain = merge_inputs((2,), 6, torch.float64, gen, 2, True)
    merge_args = [t.requires_grad_() for t in (out, lse, partial, query, *adds, gain)]
    with execution_path(path):
        assert torch.autograd.gradcheck(lambda v, q: fusedops.attn_res_multi(v, q), (values, queries))
        assert torch.autograd.gradcheck(
            lambda o, l, p, q, a1, a2, g: fusedops.attn_res_merge(o, l, p, q, (a1, a2), g, norm_eps=1e-3),
            merge_args)
        assert torch.autograd.gradcheck(lambda o, l, p, q: fusedops.attn_res_merge(o, l, p, q)[0],
                                        merge_args[:4])


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_backward_is_bitwise_deterministic(path):
    gen = torch.Generator().manual_seed(11)
    values = torch.randn(5, 9, 40, generator=gen).to(torch.bfloat16)
    queries = torch.randn(4, 40, generator=gen)
    grad_out = torch.randn(4, 9, 40, generator=gen).to(torch.bfloat16)
    grad_lse = torch.randn(4, 9, generator=gen)
    out, lse, partial, query, (a1,), gain = merge_inputs((9,), 40, torch.bfloat16, gen, 1, True)
    with execution_path(path):
        runs = [torch.ops.fusedops.attn_res_multi_backward(grad_out, grad_lse, values, queries, EPS, True, True)
                + torch.ops.fusedops.attn_res_merge(out, lse, partial, query, a1, None, gain, EPS, EPS)
                + torch.ops.fusedops.attn_res_merge_backward(out, a1, out, lse, partial, query, gain, EPS, EPS,
                                                             True, True, True, True, True)
                for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def _good_merge():
    gen = torch.Generator().manual_seed(12)
    out, lse, partial, query, (a1,), gain = merge_inputs((2,), 8, torch.float32, gen, 1, True)
    return dict(out=out, lse=lse, partial=partial, query=query, addend=a1, addend2=None, gain=gain, eps=EPS,
                norm_eps=EPS)


BAD_MULTI = {
    "values_1d": (lambda v, q: (v[0, 0], q), "values"),
    "n_zero": (lambda v, q: (v[:0], q), "values"),
    "values_int": (lambda v, q: (v.int(), q), "values"),
    "queries_1d": (lambda v, q: (v, q[0]), "queries"),
    "queries_dim": (lambda v, q: (v, q[:, :7]), "queries"),
    "queries_m_zero": (lambda v, q: (v, q[:0]), "queries"),
    "queries_device": (lambda v, q: (v, q.to("meta")), "queries"),
    "list_mismatch": (lambda v, q: ([v[0], v[1, :1]], q), r"values\[1\]"),
    "list_not_tensor": (lambda v, q: ([v[0], 3.0], q), r"values\[1\]"),
    "list_empty": (lambda v, q: ([], q), "values"),
}
BAD_MERGE = {
    "out_int": ("out", lambda t: t.int()),
    "lse_dtype": ("lse", lambda t: t.half()),
    "lse_shape": ("lse", lambda t: t[:1]),
    "partial_shape": ("partial", lambda t: t[:1]),
    "partial_dtype": ("partial", lambda t: t.double()),
    "partial_device": ("partial", lambda t: t.to("meta")),
    "query_shape": ("query", lambda t: t[:3]),
    "addend_shape": ("addend", lambda t: t[:, :3]),
    "addend_device": ("addend", lambda t: t.to("meta")),
    "gain_shape": ("gain", lambda t: t[None]),
    "gain_int": ("gain", lambda t: t.long()),
    "eps": ("eps", lambda e: 0.0),
    "norm_eps": ("norm_eps", lambda e: math.nan),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", sorted(BAD_MULTI))
def test_bad_multi_input_names_argument(path, case):
    make, name = BAD_MULTI[case]
    gen = torch.Generator().manual_seed(13)
    args = make(torch.randn(3, 2, 8, generator=gen), torch.randn(2, 8, generator=gen))
    with execution_path(path), pytest.raises(ValueError, match=name):
        fusedops.attn_res_multi(*args)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", sorted(BAD_MERGE))
def test_bad_merge_input_names_argument(path, case):
    """Every argument of the op, through the wrapper's checks, the op body and its fake kernel."""
    name, spoil = BAD_MERGE[case]
    args = _good_merge()
    args[name] = spoil(args[name])
    with execution_path(path), pytest.raises(ValueError, match=rf"\b{name}\b"):
        torch.ops.fusedops.attn_res_merge(**args)
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    fake = {n: mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for n, a in args.items()}
    with mode, pytest.raises(ValueError, match=rf"\b{name}\b"):
        torch.ops.fusedops.attn_res_merge(**fake)


def test_bad_backward_inputs_name_argument():
    gen = torch.Generator().manual_seed(14)
    values, queries = torch.randn(3, 2, 8, generator=gen), torch.randn(2, 8, generator=gen)
    with pytest.raises(ValueError, match="grad_out"):
        torch.ops.fusedops.attn_res_multi_backward(torch.randn(1, 2, 8), None, values, queries, EPS, True, True)
    with pytest.raises(ValueError, match="grad_lse"):
        torch.ops.fusedops.attn_res_multi_backward(None, torch.randn(2, 2).double(), values, queries, EPS, True,
                                                   True)
    a = _good_merge()
    with pytest.raises(ValueError, match="grad_h"):
        torch.ops.fusedops.attn_res_merge_backward(a["out"][:1], None, a["out"], a["lse"], a["partial"], a["query"],
                                                   a["gain"], EPS, EPS, True, True, True, True, True)
    with pytest.raises(ValueError, match="grad_partial"):
        torch.ops.fusedops.attn_res_merge_backward(a["out"], a["out"].half(), a["out"], a["lse"], a["partial"],
                                                   a["query"], a["gain"], EPS, EPS, True, True, True, True, True)
    with pytest.raises(ValueError, match="addends"):
        fusedops.attn_res_merge(a["out"], a["lse"], a["partial"], a["query"], (a["out"],) * 3)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("num_add", [0, 2])
def test_merge_writes_the_updated_sum_into_a_bank_slot(path, num_add):
    """partial_out: p' goes into the next slot of a token-major bank (read from slot 0, written to slot 1, in
    place, one launch without grad); the result equals the functional op's, and with grad it stays
    differentiable (the functional op, then a copy). Overlapping slots are refused, naming partial_out."""
    gen = torch.Generator().manual_seed(15)
    out, lse, _, query, adds, gain = merge_inputs((4,), 16, torch.float32, gen, num_add, True)
    bank = torch.randn(4, 3, 16, generator=gen)
    ref_h, ref_p = fusedops.attn_res_merge(out, lse, bank[:, 0], query, adds, gain)
    with execution_path(path):
        if path != "reference":
            with recorded_launches(bar_op) as launches:
                h, p = fusedops.attn_res_merge(out, lse, bank[:, 0], query, adds, gain, partial_out=bank[:, 1])
            assert len(launches) == 1 and any(same_view(t, bank[:, 1]) for t in launches[0][1])
        else:
            h, p = fusedops.attn_res_merge(out, lse, bank[:, 0], query, adds, gain, partial_out=bank[:, 1])
        assert p.data_ptr() == bank[:, 1].data_ptr()
        # the eager call skips the dispatcher but announces the write as it would: a saved view of the bank
        # is then refused by autograd instead of silently differentiated at the new values
        before = bank._version
        fusedops.attn_res_merge(out, lse, bank[:, 0], query, adds, gain, partial_out=bank[:, 2])
        assert bank._version > before
        torch.testing.assert_close(h, ref_h, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(bank[:, 1], ref_p, rtol=0, atol=0)
        with pytest.raises(ValueError, match="partial_out"):
            fusedops.attn_res_merge(out, lse, bank[:, 0], query, adds, gain, partial_out=bank[:, 0])
        with pytest.raises(ValueError, match="partial_out"):
            fusedops.attn_res_merge(out, lse, bank[:, 0], query, adds, gain, partial_out=bank[:2, 1])
        q = query.clone().requires_grad_()
        slot = torch.zeros(4, 16)
        h, p = fusedops.attn_res_merge(out, lse, bank[:, 0], q, adds, gain, partial_out=slot)
        h.sum().backward()
        assert p is slot and torch.equal(slot, ref_p) and q.grad is not None
    with execution_path(path), opaque_triton_ops():
        torch.library.opcheck(torch.ops.fusedops.attn_res_merge_into.default,
                              (out, lse, bank[:, 0], query, *(adds + (None, None))[:2], gain, EPS, EPS,
                               torch.zeros(4, 16)))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "grad"])
@pytest.mark.parametrize("shares", ["out", "lse", "partial", "query", "addend", "gain"])
def test_merge_partial_out_is_checked_on_both_routes(path, grad, shares):
    """partial_out is checked whether the fused in-place op runs (no grad) or the differentiable op then a copy
    (grad): its shape, dtype and device, and that it shares no byte with any input, each error naming what it
    shares (the kernel re-reads query, gain and lse after writing p': an overlap gave a wrong h; with grad no
    check ran at all: a [2, T, D] buffer took a broadcast copy, a float16 one a cast)."""
    gen = torch.Generator().manual_seed(17)
    out, lse, partial, query, adds, gain = merge_inputs((4,), 16, torch.float32, gen, 1, True)
    buffer = torch.randn(4, 16, generator=gen)  # the slot p' goes to, holding the shared input
    inputs = dict(out=out, lse=lse, partial=partial, query=query, addend=adds[0], gain=gain)
    inputs[shares] = {"lse": buffer[:, 3], "query": buffer[1], "gain": buffer[2]}.get(shares, buffer)
    if grad:
        trained = "query" if shares == "out" else "out"
        inputs[trained] = inputs[trained].clone().requires_grad_()

    def merge(partial_out):
        return fusedops.attn_res_merge(inputs["out"], inputs["lse"], inputs["partial"], inputs["query"],
                                       inputs["addend"], inputs["gain"], partial_out=partial_out)

    with execution_path(path):
        for wrong in (torch.zeros(2, 4, 16), torch.zeros(4, 16, dtype=torch.float16),
                      torch.zeros(4, 16, device="meta")):
            with pytest.raises(ValueError, match="partial_out"):
                merge(wrong)
        with pytest.raises(ValueError, match=f"partial_out must not overlap {shares} "):
            merge(buffer)
        h, p = merge(torch.empty(4, 16))  # the same inputs into a buffer of its own
        ref_h, ref_p = fusedops.attn_res_merge(*(inputs[k].detach() for k in ("out", "lse", "partial", "query")),
                                               inputs["addend"].detach(), inputs["gain"].detach())
    torch.testing.assert_close(h.detach(), ref_h, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(p, ref_p, rtol=0, atol=0)


@pytest.mark.parametrize("path", PATHS)
def test_module_matches_separate_attn_res_modules(path):
    """fusedops.nn.BlockAttnRes over a block equals M fusedops.nn.AttnRes modules (same query and norm_weight)
    over the stacked sources [b_0..b_{N-1}, p], forward and parameter gradients."""
    torch.manual_seed(16)
    dim, m = 12, 3
    block = fusedops.nn.BlockAttnRes(dim, m)
    with torch.no_grad():
        block.query.normal_()
        block.norm_weight.uniform_(0.5, 1.5)
    singles = [fusedops.nn.AttnRes(dim) for _ in range(m)]
    for l, s in enumerate(singles):
        with torch.no_grad():
            s.query.copy_(block.query[l])
            s.norm_weight.copy_(block.norm_weight[l])
    values, partial = torch.randn(4, 5, dim), torch.randn(5, dim)
    with execution_path(path):
        out, lse = block(values)
        hs, p = [], partial
        for l in range(m):
            h, p = block.merge(l, out, lse, p, (torch.tanh(hs[-1]),) if hs else None)
            hs.append(h)
        ref, p = [], partial
        for l, s in enumerate(singles):
            p = p + torch.tanh(ref[-1]) if ref else p
            ref.append(s(torch.cat([values, p[None]])))
        grads = torch.autograd.grad(sum(h.sum() for h in hs), (block.query, block.norm_weight))
        params = [t for s in singles for t in (s.query, s.norm_weight)]
        flat = torch.autograd.grad(sum(r.sum() for r in ref), params)
        ref_grads = [torch.stack(flat[0::2]), torch.stack(flat[1::2])]
    for h, r in zip(hs, ref):
        torch.testing.assert_close(h, r, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="sublayer"):
        block.merge(m, out, lse, partial)


@pytest.mark.parametrize("path", PATHS[:2])  # the Ascend plan's interpreter run of the whole model takes 20 s
def test_example_lm_two_phase_inference_matches_training_form(path):
    """fusedops.examples.lm's Block AttnRes inference path (phase 1 per block, then fused merges with the
    residual add and the sublayer's pre-norm) gives the training-form model's logits."""
    from fusedops.examples.lm import AttnResLM, Config

    torch.manual_seed(17)
    model = AttnResLM(Config(vocab=32, dim=16, heads=2, layers=4, block_layers=2, seq=8)).eval()
    for p in model.parameters():  # non-zero pseudo-queries: a uniform mix would hide a wrong merge
        if p.dim() == 1 and p.shape[0] == 16:
            torch.nn.init.normal_(p, mean=1.0, std=0.5)
    tokens = torch.randint(0, 32, (2, 8))
    with execution_path(path), torch.no_grad():
        ref = model(tokens)
        got = model.forward_two_phase(tokens)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, in the interpreter
def test_empty_batch_and_non_finite_inputs_follow_the_reference(path):
    """No token: empty outputs and zero parameter gradients. Non-finite inputs (an inf in a source, an inf in
    a query, an lse of -inf) give the reference path's results, NaNs in the same places."""
    values = torch.randn(3, 0, 8, requires_grad=True)
    queries = torch.randn(2, 8, requires_grad=True)
    with execution_path(path):
        out, lse = fusedops.attn_res_multi(values, queries)
        (out.sum() + lse.sum()).backward()
        h, p = fusedops.attn_res_merge(out[0], lse[0], torch.randn(0, 8), queries[0], torch.randn(0, 8))
    assert out.shape == (2, 0, 8) and lse.shape == (2, 0) and h.shape == (0, 8) and p.shape == (0, 8)
    assert torch.equal(queries.grad, torch.zeros(2, 8))
    gen = torch.Generator().manual_seed(18)
    values, queries = torch.randn(3, 4, 8, generator=gen), torch.randn(2, 8, generator=gen)
    values[1, 0, 3] = math.inf
    queries[1, 5] = -math.inf
    out_l, lse_l, partial = torch.randn(4, 8, generator=gen), torch.randn(4, generator=gen), torch.randn(4, 8)
    lse_l[2] = -math.inf
    results = []
    for p in ("reference", path):
        with execution_path(p):
            merged = fusedops.attn_res_merge(out_l, lse_l, partial, queries[0], None)
            results.append(fusedops.attn_res_multi(values, queries) + merged)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_bench_runs_on_cpu():
    """fusedops/bench/block_attn_res.py (run on a GPU by hand) runs every part at its tiny CPU sizes."""
    from fusedops.bench import block_attn_res as bench
    from fusedops.bench.common import Context

    with execution_path("reference"):
        rows = bench.run(Context(device=torch.device("cpu"), dtype=torch.float32, quick=True, verbose=False))
    assert {r["case"].split(",")[0] for r in rows} == set(bench.PARTS)
    assert all(r.get("ms") is not None and not r.get("error") for r in rows), rows


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "m", "tokens", "dim"), [(9, 24, 64, 7168), (4, 6, 1, 4096), (8, 16, 300, 1000),
                                                     (9, 16, 1024, 1536), (4, 6, 2048, 2000)])
def test_gpu_block_matches_float64_and_replays_in_a_cuda_graph(dtype, n, m, tokens, dim):
    """On a CUDA device (never run on the CPU-only CI): phase 1 + merges at model widths, the decode (D-split)
    plan at 1 token and the two-pass phase 1 from 1024 tokens, against the float64 definition on the CPU; then
    the same block captured in a CUDA graph (no host synchronisation) replays to the same bits."""
    gen = torch.Generator().manual_seed(19)
    values = torch.randn(n, tokens, dim, generator=gen).to(dtype)
    queries = 0.05 * torch.randn(m, dim, generator=gen)
    partial, addend = torch.randn(tokens, dim, generator=gen).to(dtype), torch.randn(tokens, dim, generator=gen)
    gain = torch.rand(dim, generator=gen) + 0.5
    ref_out, ref_lse = fusedops.attn_res_multi(values.double(), queries.double())
    cuda = [t.cuda() for t in (values, queries, partial, addend.to(dtype), gain)]

    def block(v, q, p, a, g):
        out, lse = fusedops.attn_res_multi(v, q)
        hs = []
        for l in range(3):
            h, p = fusedops.attn_res_merge(out[l], lse[l], p, q[l], a, g)
            hs.append(h)
        return out, lse, hs

    out, lse, hs = block(*cuda)
    assert_close("out", out.cpu(), ref_out, dtype)
    torch.testing.assert_close(lse.cpu().double(), ref_lse, rtol=1e-4, atol=1e-4)
    p = partial.double()
    for l, h in enumerate(hs):
        p = (p + addend.to(dtype).double()).to(dtype).double()
        ref, _ = einsum_attn_res(torch.cat([values.double(), p[None]]), queries[l].double(), EPS)
        assert_close(f"h[{l}]", h.cpu(), rmsnorm(ref, gain.double(), EPS), dtype, scale=2.0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        block(*cuda)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            captured = block(*cuda)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[0], out) and all(torch.equal(a, b) for a, b in zip(captured[2], hs))


@gpu
@pytest.mark.parametrize("tokens", [512, 1024])
def test_gpu_multi_reads_sources_past_2_31_elements(tokens):
    """Sources 2^30 + 2^16 elements apart (a 4.3 GB storage): the third source's offset, 2 x STRIDE_N, does not
    fit int32. The one-kernel (512 tokens) and two-pass (1024) forwards read it as the compact copy does, bit
    for bit (the same plan)."""
    n, dim = 3, 256
    step = 2**30 + 2**16
    storage = torch.zeros(2 * step + tokens * dim, device="cuda", dtype=torch.bfloat16)
    values = storage.as_strided((n, tokens, dim), (step, dim, 1))
    values.copy_(torch.randn(n, tokens, dim, device="cuda"))
    queries = torch.randn(5, dim, device="cuda")
    out, lse = fusedops.attn_res_multi(values, queries)
    ref_out, ref_lse = fusedops.attn_res_multi(values.contiguous(), queries)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("flat", [True, False])
@pytest.mark.parametrize(("n", "m", "tokens", "dim"), [(8, 24, 300, 7168), (9, 6, 257, 4096), (4, 16, 1000, 1000),
                                                     (12, 5, 64, 2048)])
def test_gpu_multi_backward_matches_float64(dtype, flat, n, m, tokens, dim):
    """On a CUDA device: the tensor-core backward at model widths (the gradients pass as the flat kernel, as planned,
    or the batched one, forced), gradients through out and lse against float64 autograd on the CPU (bfloat16 values
    take the exact bfloat16 split only a GPU runs), and bitwise equal run to run."""
    gen = torch.Generator().manual_seed(23)
    values = torch.randn(n, tokens, dim, generator=gen).to(dtype)
    queries = 0.05 * torch.randn(m, dim, generator=gen)
    grad_out = torch.randn(m, tokens, dim, generator=gen).to(dtype)
    grad_lse = torch.randn(m, tokens, generator=gen)
    _, _, ref_grads = multi_reference(values, queries, EPS, grad_out, grad_lse.double())
    plan = multi_plan(cuda_target(torch.device("cuda")), tokens, n, m, dim, values.element_size(), backward=True)
    assert plan.dot and (plan.grad_rows > 0)
    forced = {} if flat else {"grad_rows": 0}

    def grads():
        v, q = values.cuda().requires_grad_(), queries.cuda().requires_grad_()
        with fusedops.plan_override("block_attn_res", "multi_bwd", **forced):
            out, lse = fusedops.attn_res_multi(v, q, EPS)
            torch.autograd.backward([out, lse], [grad_out.cuda(), grad_lse.cuda()])
        return v.grad, q.grad

    first, again = grads(), grads()
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    tol = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2}[dtype]
    for got, ref in zip(first, ref_grads):
        scale = max(1.0, ref.abs().max().item())
        torch.testing.assert_close(got.cpu().double(), ref, rtol=tol * 4, atol=tol * 4 * scale)


QUERY_STRIDE_CASES = [  # path, forced forward, forced backward, the kernels that must run
    ("cuda", {"dot": False, "two_pass": False}, {}, {"fwd", "bwd_stats", "bwd_grads_flat"}),
    ("cuda", {"two_pass": True}, {"grad_rows": 0}, {"logits", "softmax", "out", "bwd_stats", "bwd_grads"}),
    ("cuda", {"dot": True, "two_pass": False}, {}, {"fwd_dot", "bwd_stats", "bwd_grads_flat"}),
    pytest.param("ascend", {}, {}, {"fwd", "bwd"}, marks=pytest.mark.ascend),
]
QUERY_STRIDE_IDS = ["cuda-plan-one-kernel", "cuda-plan-two-passes", "cuda-plan-tensor-cores", "ascend-plan"]


@pytest.mark.interpreter
@pytest.mark.parametrize(("path", "forward", "backward", "kernels"), QUERY_STRIDE_CASES, ids=QUERY_STRIDE_IDS)
def test_multi_reads_query_rows_past_2_31_elements(path, forward, backward, kernels):
    """Queries as a strided view, rows 2^29 elements apart (a column of a [M, 2^29] activation): row 4 sits 2^31
    elements past row 0. Every forward and backward kernel reads it where it is (the offset m * QS in int32 read
    the element 2^32 before it: a decoy placed there must change nothing), bit for bit as the same call on a
    compact copy. 8 GB of address space, a few pages of it touched."""
    n, tokens, m, dim, row_step = 2, 8, 5, 16, 2**29
    try:
        storage = torch.empty(2**31 + (m - 1) * row_step + dim, dtype=torch.float16)
    except RuntimeError as e:  # an address space that will not map 8 GB
        pytest.skip(f"cannot reserve the strided queries' storage: {e}")
    gen = torch.Generator().manual_seed(3)
    queries = storage[2**31:].as_strided((m, dim), (row_step, 1))
    queries.copy_(torch.randn(m, dim, generator=gen))
    storage[:dim] = 4 * torch.randn(dim, generator=gen)  # where the wrapped offset of row 4 lands
    values = torch.randn(n, tokens, dim, generator=gen).half()
    grad_out = torch.randn(m, tokens, dim, generator=gen).half()
    results = []
    for q in (queries, queries.contiguous()):
        v, q = values.clone().requires_grad_(), q.detach().requires_grad_()
        with execution_path(path), recorded_launches(bar_op) as launches, \
                fusedops.plan_override("block_attn_res", "multi_fwd", **forward), \
                fusedops.plan_override("block_attn_res", "multi_bwd", **backward):
            out, lse = fusedops.attn_res_multi(v, q, EPS)
            out.backward(grad_out)
        results.append((out, lse, v.grad, q.grad))
    assert {name.removeprefix("attn_res_multi_").removesuffix("_kernel") for name, *_ in launches} == kernels
    for name, strided, compact in zip(("out", "lse", "grad_values", "grad_queries"), *results):
        assert torch.equal(strided, compact), name
