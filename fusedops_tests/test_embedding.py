"""embedding against torch.nn.functional.embedding in float64, on the PyTorch reference path and on
both launch plans under the Triton interpreter (CPU CI), and on real kernels when a GPU is present."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

import fusedops
from fusedops.embedding import op as emb_op
from fusedops.embedding.kernels import embedding_bwd_kernel, embedding_fwd_kernel
from fusedops.embedding.plan import backward_plan, make_plan
from fusedops.targets import ascend_target, cuda_target

from .compile_sm90 import H100
from .helpers import _env
from .helpers import (
    DTYPES,
    KERNEL_PATHS,
    PATHS,
    assert_close,
    assert_compiled_leaves_like_eager,
    assert_compiles_like_eager,
    assert_dynamic_compile_like_eager,
    assert_export_dynamic_like_eager,
    assert_export_round_trip,
    execution_path,
    gpu,
    opaque_triton_ops,
    recorded_launches,
)

TILED_BUDGET = 1024  # bytes: forces multi-tile grids and feature blocks of 8-32 elements on both plans
FEW_CORES = "3"  # Ascend vector cores in tests: the persistent grid-stride loop then runs several tiles
INDEX_DTYPES = [torch.int32, torch.int64]


def make_weight(V, D, dtype, layout, gen, device="cpu"):
    """[V, D] weight: contiguous, a column slice of a wider matrix (row stride > D), or transposed
    storage (column stride V)."""
    if layout == "slice":
        full = torch.randn(V, D + 5, generator=gen).to(device=device, dtype=dtype)
        w = full[:, 2 : 2 + D]
    elif layout == "transposed":
        w = torch.randn(D, V, generator=gen).to(device=device, dtype=dtype).t()
    else:
        w = torch.randn(V, D, generator=gen).to(device=device, dtype=dtype)
    assert w.shape == (V, D)
    return w


def torch_reference(weight, indices, grad_out, padding_idx, scale):
    """F.embedding forward and weight gradient in float64."""
    w = weight.detach().double().requires_grad_()
    out = F.embedding(indices.long(), w, padding_idx=padding_idx, scale_grad_by_freq=scale)
    out.backward(grad_out.double())
    return out.detach(), w.grad


def run_fused(weight, indices, grad_out, padding_idx, scale, **kw):
    w = weight.detach().clone().requires_grad_()  # clone keeps the strides of a dense layout
    if not w.is_leaf or w.stride() != weight.stride():
        w = weight.detach().requires_grad_()
    out = fusedops.embedding(indices, w, padding_idx, scale, **kw)
    out.backward(grad_out)
    return out.detach(), w.grad


@st.composite
def problems(draw):
    V = draw(st.integers(1, 24))
    D = draw(st.integers(1, 40))
    shape = draw(st.lists(st.integers(0, 6), min_size=0, max_size=3))
    pool = draw(st.sampled_from(["all", "few", "one"]))  # heavy repetition: draw from 1-2 rows only
    padding = draw(st.one_of(st.none(), st.integers(-V, V - 1)))
    return dict(
        V=V, D=D, shape=tuple(shape), pool=pool, padding=padding,
        scale=draw(st.booleans()),
        dtype=draw(st.sampled_from(DTYPES)),
        index_dtype=draw(st.sampled_from(INDEX_DTYPES)),
        layout=draw(st.sampled_from(["contiguous", "slice", "transposed"])),
        tiled=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def build(p, device="cpu"):
    gen = torch.Generator().manual_seed(p["seed"])
    V = p["V"]
    weight = make_weight(V, p["D"], p["dtype"], p["layout"], gen, device)
    high = {"all": V, "few": min(V, 2), "one": 1}[p["pool"]]
    indices = torch.randint(0, high, p["shape"], generator=gen)
    if p["pool"] == "one":
        indices = indices + (V - 1)  # heavy repetition of the last row (padding_idx=-1 hits it)
    indices = indices.to(device=device, dtype=p["index_dtype"])
    grad_out = torch.randn((*p["shape"], p["D"]), generator=gen).to(device=device, dtype=p["dtype"])
    return weight, indices, grad_out


@pytest.mark.parametrize("path", PATHS)
@given(p=problems())
def test_matches_torch(path, p):
    weight, indices, grad_out = build(p)
    ref_out, ref_grad = torch_reference(weight, indices, grad_out, p["padding"], p["scale"])
    with execution_path(path, TILED_BUDGET if p["tiled"] else None), _env(FUSEDOPS_ASCEND_VECTOR_CORES=FEW_CORES):
        out, grad = run_fused(weight, indices, grad_out, p["padding"], p["scale"])
    assert out.dtype == weight.dtype and grad.dtype == weight.dtype
    # The forward is a copy: bit-exact.
    assert torch.equal(out, ref_out.to(weight.dtype)), "forward is not an exact gather"
    assert_close("grad_weight", grad, ref_grad, p["dtype"])
    if p["padding"] is not None:
        assert not grad[p["padding"]].any(), "padding row got a gradient"


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("scale", [False, True])
def test_backward_bitwise_deterministic(path, scale, monkeypatch):
    monkeypatch.setenv("FUSEDOPS_ASCEND_VECTOR_CORES", FEW_CORES)
    gen = torch.Generator().manual_seed(0)
    V, D = 17, 24
    # Zipf-like: row 0 is named by half the tokens, plus an empty-row stretch and singletons.
    indices = torch.cat([torch.zeros(40, dtype=torch.long), torch.randint(0, V, (40,), generator=gen)])
    indices = indices[torch.randperm(80, generator=gen)].reshape(8, 10)
    grad_out = torch.randn(8, 10, D, generator=gen) * 100
    with execution_path(path, TILED_BUDGET):
        first = torch.ops.fusedops.embedding_backward(grad_out, indices, V, None, scale)
        for _ in range(2):
            assert torch.equal(torch.ops.fusedops.embedding_backward(grad_out, indices, V, None, scale), first)
    ref = torch_reference(torch.zeros(V, D), indices, grad_out, None, scale)[1]
    assert_close("grad_weight", first, ref, torch.float32)


class _Embedding64(torch.autograd.Function):
    """F.embedding with its backward written in differentiable torch ops, so that autograd derives the
    true derivatives of the backward map at every order. (torch's own double backward of embedding drops
    scale_grad_by_freq's 1/count: gradcheck of aten.embedding_backward fails with it on.)"""

    @staticmethod
    def forward(ctx, weight, indices, padding_idx, scale):
        ctx.save_for_backward(indices)
        ctx.shape, ctx.pad, ctx.scale = weight.shape, padding_idx, scale
        return F.embedding(indices, weight)

    @staticmethod
    def backward(ctx, grad_out):
        (indices,) = ctx.saved_tensors
        flat, g = indices.reshape(-1), grad_out.reshape(-1, ctx.shape[1])
        if ctx.scale:
            g = g / torch.bincount(flat, minlength=ctx.shape[0]).to(g.dtype)[flat, None]
        if ctx.pad is not None:
            g = g * (flat != ctx.pad % ctx.shape[0]).to(g.dtype)[:, None]
        return g.new_zeros(ctx.shape).index_add(0, flat, g), None, None, None


def check_double_backward(padding_idx, scale, device="cpu", V=9, D=6, tokens=8):
    """With L = sum(r * out**2): dL/dW, the gradient of <c, dL/dW> + |dL/dW|^2 (a Hessian-vector product
    and a penalty on grad_weight) and a third derivative, against float64 autograd of the backward map."""
    gen = torch.Generator().manual_seed(5)
    indices = torch.randint(0, V, (2, tokens // 2), generator=gen)
    indices[:, 0] = 2  # a repeated row, padding in one of the cases
    weight = torch.randn(V, D, generator=gen)
    r, c = torch.randn(*indices.shape, D, generator=gen), torch.randn(V, D, generator=gen)

    def derivatives(lookup, w):
        out = lookup(w)
        (grad_w,) = torch.autograd.grad((r.to(w) * out**2).sum(), w, create_graph=True)
        (second,) = torch.autograd.grad((c.to(w) * grad_w).sum() + (grad_w**2).sum(), w, create_graph=True)
        (third,) = torch.autograd.grad(second.sum(), w)
        return grad_w.detach(), second.detach(), third

    ref = derivatives(lambda w: _Embedding64.apply(w, indices, padding_idx, scale), weight.double().requires_grad_())
    torch_first = derivatives(lambda w: F.embedding(indices, w, padding_idx, scale_grad_by_freq=scale),
                              weight.double().requires_grad_())[0]
    torch.testing.assert_close(ref[0], torch_first)  # the reference's first derivative is torch's
    on_device = indices.to(device)
    got = derivatives(lambda w: fusedops.embedding(on_device, w, padding_idx, scale_grad_by_freq=scale),
                      weight.to(device).requires_grad_())
    assert ref[1].abs().max() > 0 and ref[2].abs().max() > 0  # the case exercises every order
    for name, a, b in zip(("grad", "grad of grad", "third derivative"), got, ref):
        assert_close(name, a.cpu(), b, torch.float32)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("padding_idx", [None, 2, -1])
@pytest.mark.parametrize("scale", [False, True])
def test_double_backward_is_the_true_derivative(path, padding_idx, scale):
    """Backward through the weight gradient works as with torch.nn.Embedding, to any order."""
    with execution_path(path):
        check_double_backward(padding_idx, scale)


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_backward_every_run_length_up_to_29(path, monkeypatch):
    """Row r is named r + 1 times (shuffled), so the run walk (four tokens, then eight per step) ends at
    every offset of its first step and of the later ones; on the interpreter's plans runs longer than 16
    are split into two chunks and merged."""
    monkeypatch.setenv("FUSEDOPS_ASCEND_VECTOR_CORES", FEW_CORES)
    gen = torch.Generator().manual_seed(4)
    V, D = 30, 8
    indices = torch.cat([torch.full((r + 1,), r) for r in range(29)])
    indices = indices[torch.randperm(indices.numel(), generator=gen)]
    grad_out = torch.randn(indices.numel(), D, generator=gen)
    for scale in (False, True):
        with execution_path(path):
            got = torch.ops.fusedops.embedding_backward(grad_out, indices, V, None, scale)
        assert_close("grad_weight", got, torch_reference(torch.zeros(V, D), indices, grad_out, None, scale)[1],
                     torch.float32)
        assert not got[29].any()


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("lengths", [(3, 17, 40, 1, 33, 16, 64), (16, 16, 17, 15, 48, 49, 2), (200,)])
def test_backward_long_runs_split_into_chunks(path, lengths, monkeypatch):
    """Runs longer than a chunk (16 tokens on the interpreter's plans) are summed by chunks and merged
    in chunk order: lengths at and around multiples of the chunk, long runs ending and starting within
    one chunk-sized block of sorted positions, with padding and scale_grad_by_freq; deterministic."""
    monkeypatch.setenv("FUSEDOPS_ASCEND_VECTOR_CORES", FEW_CORES)
    gen = torch.Generator().manual_seed(len(lengths))
    V, D = len(lengths) + 1, 20
    indices = torch.cat([torch.full((n,), r) for r, n in enumerate(lengths)])
    indices = indices[torch.randperm(indices.numel(), generator=gen)]
    grad_out = torch.randn(indices.numel(), D, generator=gen)
    with execution_path(path, TILED_BUDGET):
        assert make_plan(emb_op.target_for(indices.device), V, D, 4, backward=True).run_chunk == 16
        for pad, scale in [(None, False), (1, True)]:
            got = torch.ops.fusedops.embedding_backward(grad_out, indices, V, pad, scale)
            want = torch_reference(torch.zeros(V, D), indices, grad_out, pad, scale)[1]
            assert_close("grad_weight", got, want, torch.float32)
        again = torch.ops.fusedops.embedding_backward(grad_out, indices, V, pad, scale)  # the last config again
        assert torch.equal(got, again)


@st.composite
def scan_problems(draw):
    """Small batches for the two backward paths: heavy repeats (runs past the interpreter plans' 16-token
    chunk), padding, index views read through a stride or an expand, grad_out rows of mixed magnitudes
    (so that any other summation order changes the bits) read through strides, several feature tiles."""
    V = draw(st.integers(1, 12))
    return dict(
        V=V, D=draw(st.integers(1, 40)), tokens=draw(st.integers(0, 40)),
        pool=draw(st.sampled_from(["all", "few", "one"])),
        padding=draw(st.one_of(st.none(), st.integers(-V, V - 1))), scale=draw(st.booleans()),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float64])),
        index_dtype=draw(st.sampled_from(INDEX_DTYPES)),
        index_layout=draw(st.sampled_from(["contiguous", "step", "expanded"])),
        grad_layout=draw(st.sampled_from(["contiguous", "slice", "expanded"])),
        scan_block=draw(st.sampled_from([2, 4, 16])), tiled=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def build_scan_problem(p):
    gen = torch.Generator().manual_seed(p["seed"])
    V, D, n = p["V"], p["D"], p["tokens"]
    high = {"all": V, "few": min(V, 2), "one": 1}[p["pool"]]
    if p["index_layout"] == "step":
        indices = torch.randint(0, high, (2 * n,), generator=gen)[::2]
    elif p["index_layout"] == "expanded":
        indices = torch.randint(0, high, (), generator=gen).expand(n)
    else:
        indices = torch.randint(0, high, (n,), generator=gen)
    magnitudes = torch.exp(3 * torch.randn(n, 1, generator=gen))
    if p["grad_layout"] == "slice":
        grad_out = (torch.randn(n, D + 3, generator=gen) * magnitudes)[:, 1 : 1 + D]
    elif p["grad_layout"] == "expanded":
        grad_out = torch.randn(1, D, generator=gen).expand(n, D)
    else:
        grad_out = torch.randn(n, D, generator=gen) * magnitudes
    return indices.to(p["index_dtype"]), grad_out.to(p["dtype"])


SCAN_CASE = dict(V=5, D=20, tokens=40, pool="one", padding=None, scale=True, dtype=torch.float32,
                 index_dtype=torch.int64, index_layout="contiguous", grad_layout="contiguous", scan_block=4,
                 tiled=True, seed=1)


@pytest.mark.parametrize("path", KERNEL_PATHS)
@given(p=scan_problems())
@settings(max_examples=8)
# always: a run of 40 tokens (chunks of 16, 16 and 8) over ten scan steps and three feature tiles; two runs
# of about 20 tokens, one of them the padding row's, in 16-index steps
@example(p=SCAN_CASE)
@example(p=dict(SCAN_CASE, pool="few", padding=0, scan_block=16, index_dtype=torch.int32, index_layout="step"))
def test_scan_backward_gives_the_sort_paths_bits(path, p):
    """The sort-free backward of small batches (forced with scan_tokens) stores exactly the sort path's
    bits, in one launch: each run summed in token order by chunks of run_chunk tokens, chunk sums added
    in chunk order, scaled after; padding and unnamed rows zero."""
    indices, grad_out = build_scan_problem(p)
    grads, kernels = [], []
    with execution_path(path, TILED_BUDGET if p["tiled"] else None), _env(FUSEDOPS_ASCEND_VECTOR_CORES=FEW_CORES):
        on_kernels = emb_op.target_for(grad_out.device, grad_out.dtype) is not None  # not float64 on Ascend
        for forced in (dict(scan_tokens=0), dict(scan_tokens=10**6, scan_block=p["scan_block"])):
            with fusedops.plan_override("embedding", "bwd", **forced), recorded_launches(emb_op) as launches:
                grads.append(torch.ops.fusedops.embedding_backward(grad_out, indices, p["V"], p["padding"], p["scale"]))
            kernels.append([name for name, _, _ in launches])
    sort, scan = grads
    assert kernels[1] == (["embedding_bwd_scan_kernel"] if p["tokens"] and on_kernels else [])
    assert "embedding_bwd_scan_kernel" not in kernels[0]
    assert scan.dtype == p["dtype"] and torch.equal(scan, sort)
    want = torch_reference(torch.zeros(p["V"], p["D"]), indices, grad_out, p["padding"], p["scale"])[1]
    assert_close("grad_weight", scan, want, torch.float32 if p["dtype"] == torch.float64 else p["dtype"])


@pytest.mark.ascend
def test_backward_path_follows_the_batch_size():
    """The plan takes the scan kernel for a known batch of at most bwd_scan's max_tokens (2048 on the
    H100's rows, 64 on the interpreter's CUDA plan, none on Ascend), the sort path otherwise: a symbolic
    batch (a dynamic-shape graph, which serves every size) always, and so does a CUDA graph capture.
    plan_override's scan_tokens picks."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    symbolic = ShapeEnv().create_unbacked_symint()

    def scans(target, tokens):
        return backward_plan(target, 1000, 768, 2, tokens).scans(tokens)

    interpreted = cuda_target(interpreted=True)
    assert scans(H100, 2048) and not scans(H100, 2049) and not scans(H100, symbolic)
    assert not backward_plan(H100, 1000, 768, 2, 64, capturing=True).scans(64)
    assert scans(interpreted, 64) and not scans(interpreted, 65)
    assert not any(scans(ascend_target(interpreted=i), 1) for i in (False, True))
    with fusedops.plan_override("embedding", "bwd", scan_tokens=0):
        assert not scans(H100, 1)
    with fusedops.plan_override("embedding", "bwd", scan_tokens=10**6, block_d=128):
        plan = backward_plan(ascend_target(), 1000, 768, 2, 5000)
        assert plan.scans(5000) and plan.block_d == 128 and not scans(ascend_target(), symbolic)
        assert backward_plan(H100, 1000, 768, 2, 64, capturing=True).scans(64)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
def test_empty_indices(path, index_dtype):
    weight = torch.randn(5, 6, requires_grad=True)
    for shape in [(0,), (3, 0), (0, 2, 4)]:
        indices = torch.zeros(shape, dtype=index_dtype)
        with execution_path(path):
            out = fusedops.embedding(indices, weight, padding_idx=1)
            assert out.shape == (*shape, 6)
            (grad,) = torch.autograd.grad(out.sum(), weight)
        assert torch.equal(grad, torch.zeros(5, 6))


@pytest.mark.parametrize("path", PATHS)
def test_expanded_grad_and_noncontiguous_indices(path):
    """out.sum() hands the backward a stride-0 grad_out; a transposed index tensor is not contiguous."""
    weight = torch.randn(9, 33)
    indices = torch.randint(0, 9, (7, 5)).t()
    with execution_path(path):
        out, grad = run_fused(weight, indices, torch.ones(5, 7, 33).expand(5, 7, 33), 3, True)
        w = weight.clone().requires_grad_()
        fusedops.embedding(indices, w, 3, True).sum().backward()
    ref_out, ref_grad = torch_reference(weight, indices, torch.ones(5, 7, 33), 3, True)
    assert torch.equal(out, ref_out.float())
    assert_close("grad_weight", w.grad, ref_grad, torch.float32)


# ----- out-of-range indices -----------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("check_bounds", ["device", "host"])
@pytest.mark.parametrize("bad", [-1, 8, 1000])
def test_out_of_range_raises_on_cpu(path, check_bounds, bad):
    """Forward and backward ops, any index layout: the first bad value is named."""
    weight = torch.randn(7, 4)
    indices = torch.tensor([[0, 3, 1], [bad, 6, bad]])[:, ::2]
    names_bad = rf"^indices holds {bad}, outside the weight's rows \[0, 7\)"  # the value, not the row count
    with execution_path(path), pytest.raises(IndexError, match=names_bad):
        fusedops.embedding(indices, weight, check_bounds=check_bounds)
    with execution_path(path), pytest.raises(IndexError, match=names_bad):
        torch.ops.fusedops.embedding(weight, indices, None, False)
    with execution_path(path), pytest.raises(IndexError, match=names_bad):
        torch.ops.fusedops.embedding_backward(torch.ones(2, 2, 4), indices, 7, None, False)


@pytest.mark.parametrize("check_bounds", [True, False, "no", None])
def test_check_bounds_takes_its_modes_only(check_bounds):
    """Booleans included: False once meant "no check", and an unchecked index is never silent now."""
    with pytest.raises(ValueError, match="^check_bounds must be 'device'"):
        fusedops.embedding(torch.tensor([1]), torch.randn(3, 2), check_bounds=check_bounds)
    with pytest.raises(ValueError, match="^check_bounds must be 'device'"):
        fusedops.nn.Embedding(3, 2, check_bounds=check_bounds)


def _guarded(shape, dtype):
    """A tensor of `shape` in the middle of a NaN-filled buffer, and a check that the guards hold."""
    numel = 1
    for s in shape:
        numel *= s
    guard = 64
    buf = torch.full((numel + 2 * guard,), float("nan"), dtype=dtype)
    view = buf[guard : guard + numel].view(shape)

    def guards_intact():
        return bool(torch.isnan(buf[:guard]).all() and torch.isnan(buf[guard + numel :]).all())

    return view, guards_intact


@pytest.mark.parametrize("plan", ["cuda", "ascend"], ids=["cuda-plan", "ascend-plan"])
@given(num_weights=st.sampled_from([1, 5, 300, 2**15 - 1, 2**15, 2**15 + 1]), data=st.data())
def test_run_detection(plan, num_weights, data, request):
    """_sorted_runs against its definition: out-of-range indices become -1 and sort first, the sort is
    stable, offsets[v] counts the keys below v; the keys are int16 where the plan allows up to V = 2**15."""
    if plan == "ascend":
        request.applymarker(pytest.mark.ascend)
    tokens = data.draw(st.integers(1, 300))
    lo, hi = (-3, num_weights + 3) if num_weights < 100 else (-2**31, 2**31 - 1)
    dtype = data.draw(st.sampled_from(INDEX_DTYPES))
    flat = torch.tensor(data.draw(st.lists(st.integers(lo, hi), min_size=tokens, max_size=tokens)), dtype=dtype)
    if num_weights >= 100:  # mostly in range, with repeats, plus a few out of range
        flat = torch.where(torch.rand(tokens) < 0.9, flat.remainder(min(num_weights, 50)) * (num_weights // 50), flat)
    with execution_path(plan):
        target = cuda_target(interpreted=True) if plan == "cuda" else ascend_target(interpreted=True)
        keys, perm, offsets = emb_op._sorted_runs(flat, num_weights, target)
    narrow = plan == "cuda" and num_weights <= 2**15
    assert keys.dtype == (torch.int16 if narrow else torch.int32)
    want = torch.where((flat >= 0) & (flat < num_weights), flat.long(), -1)
    order = torch.sort(want, stable=True)
    assert torch.equal(keys.long(), order.values) and torch.equal(perm, order.indices)
    bounds = torch.arange(num_weights + 1)
    assert torch.equal(offsets, torch.searchsorted(order.values, bounds))


@pytest.mark.parametrize("plan", ["cuda", "ascend"], ids=["cuda-plan", "ascend-plan"])
@pytest.mark.parametrize("tiled", [False, True])
def test_kernels_mask_out_of_range_indices(plan, tiled, request, monkeypatch):
    """Where device asserts are compiled out (the interpreter; an Inductor build without them) the kernels
    themselves must be safe: out-of-range rows read as zeros, contribute no gradient, and nothing is
    written outside the output tensors."""
    monkeypatch.setenv("FUSEDOPS_ASCEND_VECTOR_CORES", FEW_CORES)
    if plan == "ascend":
        request.applymarker(pytest.mark.ascend)
    with execution_path(plan, TILED_BUDGET if tiled else None):
        target = cuda_target(interpreted=True) if plan == "cuda" else ascend_target(interpreted=True)
        V, D = 6, 20
        weight = torch.randn(V, D)
        indices = torch.tensor([0, -1, 5, 6, 2, -7, 2**40, 5, 3], dtype=torch.int64)
        ok = (indices >= 0) & (indices < V)
        # Forward into a guarded output.
        out, intact = _guarded((indices.numel(), D), torch.float32)
        p = make_plan(target, indices.numel(), D, 4, backward=False)
        if plan == "ascend" and tiled:
            assert p.grid < p.tiles(indices.numel(), D)  # the grid-stride loop visits several tiles
        embedding_fwd_kernel[(p.grid,)](
            indices, weight, out, indices.numel(), V, D, indices.stride(0), weight.stride(0), weight.stride(1),
            BLOCK_T=p.block_rows, BLOCK_D=p.block_d,
        )
        assert intact(), "forward wrote outside its output"
        expected = torch.where(ok[:, None], weight[torch.where(ok, indices, 0)], 0.0)
        assert torch.equal(out, expected)
        # The internal launch path the op uses on a GPU (which skips the CPU-only check).
        assert torch.equal(emb_op._forward(weight, indices, target), expected)
        # Backward into a guarded grad_weight.
        grad_out = torch.randn(indices.numel(), D)
        keys, perm, offsets = emb_op._sorted_runs(indices, V, target)
        gw, intact = _guarded((V, D), torch.float32)
        p = make_plan(target, V, D, 4, backward=True, tokens=indices.numel())
        embedding_bwd_kernel[(p.grid,)](
            grad_out, keys, perm, offsets, gw, torch.empty(1), V, D, indices.numel(), grad_out.stride(0),
            grad_out.stride(1), -1, p.zeros_per_run(V, indices.numel()), SCALE=True, BLOCK_R=p.block_rows,
            BLOCK_D=p.block_d, EVICT=p.evict, CHUNK=p.run_chunk,  # runs of at most 2: never split
        )
        assert intact(), "backward wrote outside grad_weight"
        ref = torch_reference(weight, indices[ok], grad_out[ok], None, True)[1]
        assert_close("grad_weight", gw, ref, torch.float32)
        assert_close("grad_weight", emb_op._backward(grad_out, indices, V, -1, True, target), ref, torch.float32)


@pytest.mark.parametrize("plan", ["cuda", "ascend"], ids=["cuda-plan", "ascend-plan"])
def test_backward_item_order_does_not_change_the_bits(plan, request, monkeypatch):
    """The backward interleaves run items with zero tiles (ZEROS_PER_RUN of them per run item, the
    rest last). Every valid interleave, none included, must write the same bits, and the plan's must
    actually interleave here (more zero tiles than run items, with a remainder)."""
    monkeypatch.setenv("FUSEDOPS_ASCEND_VECTOR_CORES", FEW_CORES)
    if plan == "ascend":
        request.applymarker(pytest.mark.ascend)
    with execution_path(plan, TILED_BUDGET):
        target = cuda_target(interpreted=True) if plan == "cuda" else ascend_target(interpreted=True)
        V, D, pad = 100, 12, 4
        gen = torch.Generator().manual_seed(3)
        indices = torch.tensor([7, 4, 30, 7, 99, 7, 0])
        grad_out = torch.randn(indices.numel(), D, generator=gen)
        keys, perm, offsets = emb_op._sorted_runs(indices, V, target)
        p = make_plan(target, V, D, 4, backward=True, tokens=indices.numel())
        planned = p.zeros_per_run(V, indices.numel())
        zero_tiles = -(-V // p.block_rows)
        assert planned >= 1 and zero_tiles % indices.numel() != 0
        results = []
        for zeros_per_run in sorted({0, 1, planned}):
            gw = torch.full((V, D), float("nan"))
            embedding_bwd_kernel[(p.grid,)](
                grad_out, keys, perm, offsets, gw, torch.empty(1), V, D, indices.numel(), D, 1, pad, zeros_per_run,
                SCALE=False, BLOCK_R=p.block_rows, BLOCK_D=p.block_d, EVICT=p.evict, CHUNK=p.run_chunk,  # runs <= 3
            )
            results.append(gw)
        ref = torch_reference(torch.randn(V, D), indices, grad_out, pad, False)[1]
        assert_close("grad_weight", results[0], ref, torch.float32)
        for gw in results[1:]:
            assert torch.equal(gw, results[0])


# ----- bad input: one test each ---------------------------------------------------------------------


def _w():
    return torch.randn(5, 4)


def _i():
    return torch.tensor([1, 2])


@pytest.mark.parametrize(
    "call, exc, word",
    [
        (lambda: fusedops.embedding(_i(), _w().long()), ValueError, "weight"),
        (lambda: fusedops.embedding(_i(), _w().to(torch.complex64)), ValueError, "weight"),
        (lambda: fusedops.embedding(_i(), torch.randn(5)), ValueError, "weight"),
        (lambda: fusedops.embedding(_i(), torch.randn(2, 5, 4)), ValueError, "weight"),
        (lambda: fusedops.embedding(_i().float(), _w()), ValueError, "indices"),
        (lambda: fusedops.embedding(_i().to(torch.int16), _w()), ValueError, "indices"),
        (lambda: fusedops.embedding([1, 2], _w()), ValueError, "indices"),
        (lambda: fusedops.embedding(_i().to("meta"), _w()), ValueError, "indices"),
        (lambda: fusedops.embedding(_i(), _w(), padding_idx=5), ValueError, "padding_idx"),
        (lambda: fusedops.embedding(_i(), _w(), padding_idx=-6), ValueError, "padding_idx"),
        (lambda: fusedops.embedding(_i(), _w(), padding_idx=1.0), ValueError, "padding_idx"),
        (lambda: fusedops.embedding(_i(), _w(), max_norm=1.0), ValueError, "max_norm"),
        (lambda: fusedops.embedding(_i(), _w(), sparse=True), ValueError, "sparse"),
        (lambda: fusedops.embedding(_i(), _w(), padding_idx=True), ValueError, "padding_idx"),
        # torch's 4th positional argument is max_norm: caught, not taken for a truthy scale_grad_by_freq
        (lambda: fusedops.embedding(_i(), _w(), None, 0.5), ValueError, "scale_grad_by_freq"),
        (lambda: fusedops.embedding(_i(), _w(), scale_grad_by_freq=1), ValueError, "scale_grad_by_freq"),
        (lambda: fusedops.embedding(torch.tensor([2, 6, 7]), _w()), IndexError, "^indices holds 6,"),
        (lambda: fusedops.embedding(torch.tensor([-6]), _w()), IndexError, "^indices holds -6,"),
        (lambda: fusedops.nn.Embedding(5, 4, max_norm=1.0), ValueError, "max_norm"),
        (lambda: fusedops.nn.Embedding(5, 4, sparse=True), ValueError, "sparse"),
        (lambda: fusedops.nn.Embedding(5, 4, padding_idx=5), ValueError, "padding_idx"),
        (lambda: fusedops.nn.Embedding.from_pretrained(_w(), max_norm=2.0), ValueError, "max_norm"),
        (lambda: fusedops.nn.Embedding.from_pretrained(torch.randn(5)), ValueError, "embeddings"),
        (lambda: torch.ops.fusedops.embedding_backward(torch.randn(3, 4), _i(), 5, None, False), ValueError, "grad_out"),
        (lambda: torch.ops.fusedops.embedding_backward(torch.randn(2, 4).long(), _i(), 5, None, False), ValueError, "grad_out"),
        (lambda: torch.ops.fusedops.embedding_backward(torch.randn(2, 4), _i(), 5, 7, False), ValueError, "padding_idx"),
        (lambda: torch.ops.fusedops.embedding_backward(torch.randn(2, 4), _i(), -1, None, False), ValueError, "num_weights"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_bad_input(call, exc, word):
    with pytest.raises(exc, match=word):
        call()


def test_torch_keyword_signature_and_integer_types():
    """F.embedding's keywords (norm_type with no max_norm) and numpy integers for padding_idx, in the
    wrapper and the module, give torch's result."""
    np = pytest.importorskip("numpy")
    w = torch.randn(6, 4, requires_grad=True)
    i = torch.tensor([[0, 2, 2], [5, 1, 0]])
    ref = torch.nn.functional.embedding(i, w, padding_idx=2, norm_type=1.0, scale_grad_by_freq=True)
    got = fusedops.embedding(i, w, padding_idx=np.int64(2), norm_type=1.0, scale_grad_by_freq=True)
    (ref_grad,) = torch.autograd.grad(ref, w, torch.ones_like(ref))
    (got_grad,) = torch.autograd.grad(got, w, torch.ones_like(got))
    assert torch.equal(got, ref) and torch.equal(got_grad, ref_grad)
    module = fusedops.nn.Embedding(6, 4, padding_idx=np.int32(-1))
    assert module.padding_idx == 5 and isinstance(module.padding_idx, int)


# ----- torch integration ----------------------------------------------------------------------------


def opcheck_samples():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(11, 20, generator=gen)
    yield weight, torch.randint(0, 11, (3, 4), generator=gen), None, False
    yield weight.half(), torch.randint(0, 11, (6,), generator=gen, dtype=torch.int32), -2, True
    yield torch.randn(20, 11, generator=gen).t(), torch.randint(0, 11, (2, 3), generator=gen), 4, False


@pytest.mark.parametrize("path", PATHS)
def test_opcheck(path):
    with execution_path(path), opaque_triton_ops():
        for weight, indices, pad, scale in opcheck_samples():
            w = weight.detach().requires_grad_()
            torch.library.opcheck(torch.ops.fusedops.embedding.default, (w, indices, pad, scale))
            grad_out = torch.randn(*indices.shape, weight.shape[1], dtype=weight.dtype)
            torch.library.opcheck(
                torch.ops.fusedops.embedding_backward.default, (grad_out, indices, weight.shape[0], pad, scale)
            )


class Tower(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = fusedops.nn.Embedding(13, 24, padding_idx=0, scale_grad_by_freq=True)
        self.proj = torch.nn.Linear(24, 3)

    def forward(self, x):
        return self.proj(self.emb(x)).sum(-1)


@pytest.mark.parametrize("path", PATHS)
def test_compile_fullgraph_matches_eager(path):
    torch.manual_seed(0)
    assert_compiles_like_eager(path, Tower(), torch.randint(0, 13, (4, 6)), rtol=0, atol=0)


@pytest.mark.parametrize("path", PATHS)
def test_export_round_trip(path):
    torch.manual_seed(0)
    assert_export_round_trip(path, Tower().eval(), torch.randint(0, 13, (3, 5)), "embedding", rtol=0, atol=0)


@pytest.mark.parametrize("path", PATHS)
def test_compile_dynamic_shapes_one_graph(path):
    """Batch and sequence length change between calls of one dynamic=True compile: no recompilation,
    eager's outputs and weight gradients (padding row and frequency scaling included)."""
    torch.manual_seed(2)
    weight = torch.randn(40, 12, requires_grad=True)
    sets = [(torch.randint(0, 40, shape), weight) for shape in ((2, 5), (3, 9), (4, 17))]
    with execution_path(path), opaque_triton_ops():
        assert_dynamic_compile_like_eager(lambda i, w: fusedops.embedding(i, w, padding_idx=3, scale_grad_by_freq=True),
                                          sets)


@pytest.mark.parametrize("path", PATHS)
def test_export_dynamic_shapes(path):
    torch.manual_seed(3)
    batch, seq = torch.export.Dim("batch", min=1, max=1024), torch.export.Dim("seq", min=1, max=8192)
    assert_export_dynamic_like_eager(path, Tower().eval(), (torch.randint(0, 13, (3, 5)),), ({0: batch, 1: seq},),
                                     [(torch.randint(0, 13, (2, 9)),), (torch.randint(0, 13, (7, 1)),)], "embedding",
                                     rtol=0, atol=0)


# ----- the module -----------------------------------------------------------------------------------


def test_module_is_drop_in_and_state_dict_round_trip():
    torch.manual_seed(0)
    ref = torch.nn.Embedding(10, 8, padding_idx=-2, scale_grad_by_freq=True)
    ours = fusedops.nn.Embedding(10, 8, padding_idx=-2, scale_grad_by_freq=True)
    assert isinstance(ours, torch.nn.Embedding)
    assert ours.padding_idx == ref.padding_idx == 8 and not ours.weight[8].any()
    assert ours.state_dict().keys() == ref.state_dict().keys()
    ours.load_state_dict(ref.state_dict())
    x = torch.randint(0, 10, (3, 7))
    assert torch.equal(ours(x), ref(x))
    ours.weight.data.mul_(2)
    back = torch.nn.Embedding(10, 8)
    back.load_state_dict(ours.state_dict())
    assert torch.equal(back.weight, ours.weight)
    ours(x).sum().backward()
    ref.weight.data.mul_(2)
    ref(x).sum().backward()
    assert_close("grad", ours.weight.grad, ref.weight.grad, torch.float32)
    assert "check_bounds='host'" in repr(fusedops.nn.Embedding(3, 2, check_bounds="host"))
    assert "check_bounds" not in repr(fusedops.nn.Embedding(3, 2))


def test_from_pretrained():
    pretrained = torch.randn(6, 5)
    ours = fusedops.nn.Embedding.from_pretrained(pretrained, padding_idx=1)
    ref = torch.nn.Embedding.from_pretrained(pretrained, padding_idx=1)
    assert isinstance(ours, fusedops.nn.Embedding)
    assert not ours.weight.requires_grad and ours.padding_idx == 1
    x = torch.tensor([[1, 5, 0]])
    assert torch.equal(ours(x), ref(x))
    trainable = fusedops.nn.Embedding.from_pretrained(pretrained, freeze=False)
    assert trainable.weight.requires_grad


def test_module_dtype_and_device_args():
    m = fusedops.nn.Embedding(4, 3, dtype=torch.bfloat16, device="cpu")
    assert m.weight.dtype == torch.bfloat16
    assert m(torch.tensor([1, 3], dtype=torch.int32)).dtype == torch.bfloat16


# ----- plans ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "V, D, elem", [(32768, 768, 2), (50257, 1600, 2), (151936, 4096, 2), (10**6, 7, 4), (3, 100000, 4)]
)
def test_plans_fit_targets(V, D, elem):
    for target in (ascend_target(interpreted=True), cuda_target(interpreted=True)):
        for backward in (False, True):
            p = make_plan(target, V, D, elem, backward=backward)
            per = (16 + elem) if backward else (8 + 2 * elem)
            assert p.block_rows * p.block_d * per <= target.onchip_bytes
            assert p.block_d * elem >= target.row_align or p.block_d >= D
            assert 1 <= p.grid <= target.max_grid
    ascend = ascend_target(interpreted=True)
    p = make_plan(ascend, 151936, 4096, 2, backward=True)
    assert p.grid == ascend.vector_cores  # persistent: one program per vector core, grid-stride loop


@pytest.mark.parametrize("V, D, shape, warps, cap, evict", [
    (151936, 4096, (4, 1024), 4, 128, ""), (32768, 768, (4, 256), 2, None, "evict_first"),
    (50257, 1600, (4, 256), 2, None, "evict_first"), (10**6, 7, (64, 8), 2, None, "evict_first"),
    (1000, 100, (32, 16), 2, None, "evict_first")])
def test_cuda_backward_plan_is_the_measured_one(V, D, shape, warps, cap, evict):
    """The H100 backward plan (bench/NOTES.md, embedding v5 and run 16): 4-row tiles (at least 512
    elements for narrow rows); 1024-wide feature blocks on 4 warps with registers capped at 128, shorter
    ones on 2 warps uncapped and their once-touched traffic evict_first; one program per work item: run
    items (tokens x feature blocks) and zero tiles. Other targets keep the default eviction policy."""
    p = make_plan(H100, V, D, 2, backward=True, tokens=3000)
    assert (p.block_rows, p.block_d, p.num_warps, p.max_registers, p.evict) == (*shape, warps, cap, evict)
    assert p.grid == p.tiles(V, D) + 3000 * -(-D // p.block_d)
    assert make_plan(H100, 4096, D, 2, backward=False).max_registers is None
    for other in (cuda_target(interpreted=True), ascend_target(interpreted=True)):
        assert make_plan(other, V, D, 2, backward=True, tokens=3000).evict == ""


# ----- real kernels on a GPU ------------------------------------------------------------------------


@gpu
@pytest.mark.gpu
class TestGPU:
    SIZES = [(32768, 768, 16384), (50257, 1600, 4096), (151936, 4096, 2048)]

    @pytest.mark.parametrize("V, D, tokens", SIZES)
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
    def test_matches_torch(self, V, D, tokens, dtype):
        gen = torch.Generator().manual_seed(V)
        weight = torch.randn(V, D, generator=gen).to("cuda", dtype)
        indices = torch.randint(0, V, (tokens // 8, 8), generator=gen).cuda()
        indices[:, 0] = 7  # one heavily repeated row
        grad_out = torch.randn(tokens // 8, 8, D, generator=gen).to("cuda", dtype)
        for pad, scale in [(None, False), (7, True), (-1, False)]:
            out, grad = run_fused(weight, indices, grad_out, pad, scale)
            assert torch.equal(out, F.embedding(indices, weight))
            ref_grad = torch_reference(weight, indices, grad_out, pad, scale)[1]
            assert_close("grad_weight", grad, ref_grad, dtype)
            again = torch.ops.fusedops.embedding_backward(grad_out, indices, V, pad, scale)
            assert torch.equal(again, grad), "backward not bitwise reproducible"

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
    def test_scan_backward_gives_the_sort_paths_bits(self, dtype):
        """The compiled scan kernel stores the sort path's bits: runs of one token to six chunks of 256
        (merged), padding, scale_grad_by_freq, int32 indices read through a stride."""
        gen = torch.Generator().manual_seed(6)
        V, D, tokens = 50257, 1600, 4096
        indices = torch.randint(0, 300, (2 * tokens,), generator=gen, dtype=torch.int32)
        indices[::6] = 7  # every third strided token: a run of ~1370, six chunks
        indices = indices.cuda()[::2]
        grad_out = torch.randn(tokens, D, generator=gen) * torch.exp(3 * torch.randn(tokens, 1, generator=gen))
        grad_out = grad_out.to("cuda", dtype)
        for pad, scale in [(None, False), (7, True), (11, False)]:
            grads = []
            for scan_tokens in (0, tokens):
                with fusedops.plan_override("embedding", "bwd", scan_tokens=scan_tokens):
                    grads.append(torch.ops.fusedops.embedding_backward(grad_out, indices, V, pad, scale))
            assert torch.equal(grads[0], grads[1]), (pad, scale)

    @pytest.mark.parametrize("padding_idx, scale", [(None, False), (2, True)])
    def test_double_backward_is_the_true_derivative(self, padding_idx, scale):
        check_double_backward(padding_idx, scale, "cuda", V=5000, D=96, tokens=4096)

    def test_int32_strided_and_empty(self):
        weight = torch.randn(1000, 300, device="cuda")[:, 10:266]
        idx = torch.randint(0, 1000, (513,), device="cuda", dtype=torch.int32)
        out, grad = run_fused(weight, idx, torch.randn(513, 256, device="cuda"), None, False)
        assert torch.equal(out, weight[idx.long()])
        empty = fusedops.embedding(idx[:0], weight)
        assert empty.shape == (0, 256)

    def test_out_of_range_host_check_names_the_value(self):
        weight = torch.randn(100, 64, device="cuda")
        idx = torch.tensor([3, 150, -1, 2**40, 99], device="cuda")
        with pytest.raises(IndexError, match="^indices holds 150,"):
            fusedops.embedding(idx, weight, check_bounds="host")

    @pytest.mark.parametrize("call", ["eager", "backward_op", "compiled", "strided"])
    def test_out_of_range_fails_a_device_assert(self, call):
        """The default call never reads the indices on the host, yet a bad index is never silent: the
        kernel's device assert fails (in a child process: it leaves the CUDA context unusable)."""
        script = f"""
import torch, fusedops
w = torch.randn(100, 64, device="cuda", requires_grad=True)
idx = torch.tensor([3, 150, 99, 7], device="cuda")
call = {call!r}
if call == "eager":
    out = fusedops.embedding(idx, w)
elif call == "strided":
    out = fusedops.embedding(torch.tensor([1, 2, 150, 4], device="cuda")[::2], w)
elif call == "backward_op":
    out = torch.ops.fusedops.embedding_backward(torch.ones(4, 64, device="cuda"), idx, 100, None, False)
else:
    out = torch.compile(lambda i: fusedops.embedding(i, w) * 2, fullgraph=True)(idx)
torch.cuda.synchronize()
print("NO ERROR", out.shape)
"""
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        assert "NO ERROR" not in done.stdout and done.returncode != 0, done.stdout + done.stderr
        assert "device-side assert" in done.stderr, done.stderr[-3000:]

    def test_default_step_is_captured_in_a_cuda_graph(self):
        """No host synchronisation on the default path: a forward + backward step is captured and replays
        the eager bits on new indices."""
        V, D = 5000, 256
        weight = torch.randn(V, D, device="cuda", requires_grad=True)
        idx = torch.randint(0, V, (64, 33), device="cuda")
        grad_out = torch.randn(64, 33, D, device="cuda")

        def step():
            out = fusedops.embedding(idx, weight, padding_idx=3)
            return out, torch.autograd.grad(out, weight, grad_out)[0]

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()  # compile and cache the launches outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, grad = step()
        idx.copy_(torch.randint(0, V, idx.shape, device="cuda"))
        graph.replay()
        want_out, want_grad = step()
        assert torch.equal(out, want_out) and torch.equal(grad, want_grad)

    def test_captured_small_step_takes_the_sort_path(self):
        """A batch the scan kernel takes in eager mode takes the sort path inside a CUDA graph capture (no
        host time to save there; a padded batch's long run is slower to scan): same bits either way."""
        V, D = 5000, 768
        weight = torch.randn(V, D, device="cuda", requires_grad=True)
        idx = torch.randint(0, V, (2, 256), device="cuda")
        idx[:, 100:] = 0  # padding without padding_idx: one run of 312 tokens
        grad_out = torch.randn(2, 256, D, device="cuda")

        def step():
            return torch.autograd.grad(fusedops.embedding(idx, weight), weight, grad_out)[0]

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # compile both paths' kernels outside the capture
            step()
            with fusedops.plan_override("embedding", "bwd", scan_tokens=0):
                step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with recorded_launches(emb_op) as captured_launches, torch.cuda.graph(graph):
            grad = step()
        graph.replay()
        with recorded_launches(emb_op) as eager_launches:
            eager = step()
        assert "embedding_bwd_scan_kernel" in [name for name, _, _ in eager_launches]
        captured = [name for name, _, _ in captured_launches]
        assert "embedding_bwd_kernel" in captured and "embedding_bwd_scan_kernel" not in captured
        assert torch.equal(grad, eager)

    def test_large_vocabulary_padding_and_repeats(self):
        """At a real vocabulary size: the padding row's gradient is zero, heavy repeats sum right, and the
        backward is bitwise reproducible."""
        V, D = 40000, 4096
        weight = torch.randn(V, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        idx = torch.randint(0, V, (4096,), device="cuda")
        idx[::7], idx[2::11] = V - 1, 11
        out = fusedops.embedding(idx, weight, padding_idx=11)
        grad_out = torch.randn_like(out)
        (grad,) = torch.autograd.grad(out, weight, grad_out, retain_graph=True)
        ref = torch_reference(weight.detach(), idx, grad_out, 11, False)[1]
        assert_close("grad_weight", grad, ref, torch.bfloat16)
        assert not grad[11].any()
        assert torch.equal(grad, torch.autograd.grad(out, weight, grad_out)[0]), "backward not bitwise reproducible"

    def test_compile_of_leaf_weight_matches_eager(self):
        weight = torch.randn(300, 64, device="cuda").requires_grad_()
        idx = torch.randint(0, 300, (8, 33), device="cuda")
        assert_compiled_leaves_like_eager(lambda w, i: fusedops.embedding(i, w), (weight, idx))

    def test_compile_inductor(self):
        model = Tower().cuda()
        x = torch.randint(0, 13, (64, 32), device="cuda")
        eager = model(x)
        compiled = torch.compile(model, fullgraph=True)
        assert torch.allclose(compiled(x), eager)

    def test_inductor_dynamic_shapes_one_graph(self):
        """Inductor traces the op's body (plans, grids, launches) with symbolic sizes."""
        weight = torch.randn(5000, 96, device="cuda").requires_grad_()
        sets = [(torch.randint(0, 5000, shape, device="cuda"), weight) for shape in ((4, 100), (8, 33), (3, 1000))]
        assert_dynamic_compile_like_eager(lambda i, w: fusedops.embedding(i, w), sets,
                                          backend="inductor")


def test_inductor_compile_on_cpu_needs_no_wrapper_and_refuses_bad_indices():
    """The CPU bounds check is data-dependent; traced, it becomes an assert inside the graph instead
    of breaking it (no opaque_triton_ops needed), and a bad index still fails at run time."""
    torch.manual_seed(0)
    module = fusedops.nn.Embedding(50, 8)
    compiled = torch.compile(lambda i: module(i), fullgraph=True)
    good = torch.randint(0, 50, (3, 4))
    torch.testing.assert_close(compiled(good), F.embedding(good, module.weight))
    with pytest.raises(RuntimeError, match=r"indices outside the weight's rows \[0, 50\)"):
        compiled(torch.tensor([[1, 50]]))
