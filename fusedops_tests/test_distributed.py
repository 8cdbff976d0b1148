"""The ops under DTensor on 2 and 4 gloo ranks (CPU): every sharding rule of fusedops.distributed, forward
and all gradients, against the single-process result; parallelize_module with torch's tensor-parallel
styles on the fusedops.nn modules against the same styles on torch's modules. Each test spawns its ranks;
each rank checks its own results and the test fails if any rank raised."""

from __future__ import annotations

import os
import sys
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import fusedops

from .helpers import INTERPRETER

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed")


def _spawn(fn, world: int, tmp_path, path: str = "reference", device: str = "cpu") -> None:
    """Run fn(rank, mesh) on `world` ranks (file rendezvous in tmp_path): gloo on CPU tensors on the given
    path, or NCCL with one GPU per rank (device "cuda", where new tensors land by default)."""
    if path != "reference" and not INTERPRETER:
        pytest.skip("kernel paths need TRITON_INTERPRET=1")
    errors = mp.get_context("spawn").Manager().list()
    mp.spawn(_worker, args=(world, fn, str(tmp_path / "rendezvous"), path, device, errors), nprocs=world, join=True)
    assert not list(errors), "\n".join(errors)


def _worker(rank, world, fn, store, path, device, errors):
    if path != "reference":
        os.environ["FUSEDOPS_INTERPRET"] = path
    if device == "cuda":
        torch.cuda.set_device(rank)
        torch.set_default_device("cuda")
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    mesh = None
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device, (world,))
        fn(rank, mesh)
    except Exception:  # noqa: BLE001 - reported by the parent
        errors.append(f"rank {rank}:\n{traceback.format_exc()}")
    finally:
        for group in mesh.get_all_groups() if mesh is not None else []:
            dist.barrier(group=group)  # every collective done (gloo's barrier follows its group's earlier work)
        dist.barrier()
        dist.destroy_process_group()
    # Leave without Python's finalisation: a gloo worker thread still releasing a finished work's tensors takes
    # the GIL, and during finalisation that ends in std::terminate (SIGABRT, seen in CI after all checks passed).
    # The results are already in `errors`.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def _check(name, got, want, atol=1e-5):
    from torch.distributed.tensor import DTensor

    full = got.full_tensor() if isinstance(got, DTensor) else got
    torch.testing.assert_close(full, want, atol=atol, rtol=1e-5, msg=lambda m: f"{name}: {m}")


# ----- attn_res ----------------------------------------------------------------------------------


def _attn_res_case(rank, mesh):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(0)
    values, query, weight = torch.randn(3, 4, 6, 16), torch.randn(16), torch.randn(16)
    grad_out, grad_lse = torch.randn(4, 6, 16), torch.randn(4, 6)
    for with_weight in (True, False):
        v, q, w = _leaves(values, query, weight)
        out, lse = fusedops.attn_res(v, q, w if with_weight else None, return_lse=True)
        torch.autograd.backward((out, lse), (grad_out, grad_lse))
        for dim in (1, 2):  # each batch dim of values
            dv = distribute_tensor(values, mesh, [Shard(dim)]).requires_grad_()
            dq = distribute_tensor(query, mesh, [Replicate()]).requires_grad_()
            dw = distribute_tensor(weight, mesh, [Replicate()]).requires_grad_()
            dout, dlse = fusedops.attn_res(dv, dq, dw if with_weight else None, return_lse=True)
            assert dout.placements == (Shard(dim - 1),) and dlse.placements == (Shard(dim - 1),)
            _check("out", dout, out.detach())
            _check("lse", dlse, lse.detach())
            torch.autograd.backward((dout, dlse), (distribute_tensor(grad_out, mesh, [Shard(dim - 1)]),
                                                  distribute_tensor(grad_lse, mesh, [Shard(dim - 1)])))
            _check("grad values", dv.grad, v.grad)
            _check("grad query", dq.grad, q.grad, atol=1e-4)
            if with_weight:
                _check("grad norm_weight", dw.grad, w.grad, atol=1e-4)
            plain = torch.ops.fusedops.attn_res(dv, dq, dw, 1e-6)  # the out-only op too
            _check("attn_res op", plain, fusedops.attn_res(values, query, weight))



def _block_attn_res_case(rank, mesh):
    """attn_res_multi on each batch dim of values and on its queries; attn_res_merge on each batch dim, with
    addends and an output gain: outputs and every gradient against one process."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(7)
    values, queries = torch.randn(3, 4, 8, 16), torch.randn(4, 16)
    grad_out, grad_lse = torch.randn(4, 4, 8, 16), torch.randn(4, 4, 8)
    v, q = _leaves(values, queries)
    out, lse = fusedops.attn_res_multi(v, q)
    torch.autograd.backward((out, lse), (grad_out, grad_lse))
    for v_pl, q_pl, o_pl in [(Shard(1), Replicate(), Shard(1)), (Shard(2), Replicate(), Shard(2)),
                             (Replicate(), Shard(0), Shard(0))]:
        dv = distribute_tensor(values, mesh, [v_pl]).requires_grad_()
        dq = distribute_tensor(queries, mesh, [q_pl]).requires_grad_()
        dout, dlse = fusedops.attn_res_multi(dv, dq)
        assert dout.placements == (o_pl,) and dlse.placements == (o_pl,), (dout.placements, dlse.placements)
        _check(f"multi out {v_pl} {q_pl}", dout, out.detach())
        _check(f"multi lse {v_pl} {q_pl}", dlse, lse.detach())
        torch.autograd.backward((dout, dlse), (distribute_tensor(grad_out, mesh, [o_pl]),
                                              distribute_tensor(grad_lse, mesh, [o_pl])))
        _check(f"multi grad values {v_pl} {q_pl}", dv.grad, v.grad, atol=1e-4)
        _check(f"multi grad queries {v_pl} {q_pl}", dq.grad, q.grad, atol=1e-4)

    o, l, p, a = torch.randn(4, 8, 16), torch.randn(4, 8), torch.randn(4, 8, 16), torch.randn(4, 8, 16)
    query, gain = torch.randn(16), torch.rand(16) + 0.5
    grad_h, grad_p = torch.randn(4, 8, 16), torch.randn(4, 8, 16)
    leaves = _leaves(o, l, p, a, query, gain)
    h, p_new = fusedops.attn_res_merge(*leaves[:3], leaves[4], addends=leaves[3], gain=leaves[5])
    torch.autograd.backward((h, p_new), (grad_h, grad_p))
    for dim in (0, 1):
        sharded = [distribute_tensor(t, mesh, [Shard(dim)]).requires_grad_() for t in (o, l, p, a)]
        replicated = [distribute_tensor(t, mesh, [Replicate()]).requires_grad_() for t in (query, gain)]
        dh, dp = fusedops.attn_res_merge(*sharded[:3], replicated[0], addends=sharded[3], gain=replicated[1])
        assert dh.placements == (Shard(dim),) and dp.placements == (Shard(dim),)
        _check(f"merge h dim {dim}", dh, h.detach())
        _check(f"merge partial dim {dim}", dp, p_new.detach())
        torch.autograd.backward((dh, dp), (distribute_tensor(grad_h, mesh, [Shard(dim)]),
                                          distribute_tensor(grad_p, mesh, [Shard(dim)])))
        for name, got, want in zip(("out", "lse", "partial", "addend", "query", "gain"), sharded + replicated, leaves):
            _check(f"merge grad {name} dim {dim}", got.grad, want.grad, atol=1e-4)


# ----- embedding ---------------------------------------------------------------------------------


def _embedding_case(rank, mesh):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(1)
    weight, indices = torch.randn(12, 8), torch.randint(0, 12, (4, 6))
    indices[0, :3] = 5  # repeats, and the padding row
    grad_out = torch.randn(4, 6, 8)
    for padding_idx, scale in [(None, False), (5, True), (-1, False)]:
        (w,) = _leaves(weight)
        out = fusedops.embedding(indices, w, padding_idx, scale)
        out.backward(grad_out)
        for weight_pl, index_pl in [(Shard(0), Replicate()), (Shard(1), Replicate()), (Replicate(), Shard(0)),
                                    (Replicate(), Shard(1))]:
            dw = distribute_tensor(weight, mesh, [weight_pl]).requires_grad_()
            di = distribute_tensor(indices, mesh, [index_pl])
            dout = fusedops.embedding(di, dw, padding_idx, scale)
            case = f"weight {weight_pl}, indices {index_pl}, padding_idx {padding_idx}, scale {scale}"
            _check(f"out ({case})", dout, out.detach())
            dout.backward(_grad_like(dout, grad_out, mesh))
            _check(f"grad weight ({case})", dw.grad, w.grad)
    # vocabulary parallel: an index outside [0, V) is masked to a zero row before any rank's op sees it, unless
    # checked first (it was returned as a zero row). Each rank checks its own indices (CPU: an IndexError; on a GPU
    # a device-side assert, which would end the process); here every rank's shard holds the bad index, so that
    # every rank raises (one raising alone leaves the others waiting in DTensor's next collective)
    dw = distribute_tensor(weight, mesh, [Shard(0)])
    for bad in (12, -1) if mesh.device_type == "cpu" else ():
        wrong = indices.clone()
        wrong[:, -1] = bad
        for index_pl in (Replicate(), Shard(0)):
            with pytest.raises(IndexError, match=f"indices holds {bad}"):
                fusedops.embedding(distribute_tensor(wrong, mesh, [index_pl]), dw)


def _grad_like(out, grad, mesh):
    """grad laid out as out is, a pending sum (row-wise embedding's output) taken as replicated."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    return distribute_tensor(grad, mesh, [Replicate() if p.is_partial() else p for p in out.placements])



# ----- neighborhood attention ----------------------------------------------------------------------


def _na_case(rank, mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(2)
    world = mesh.size()
    for spatial, heads in [((10,), (4, 2)), ((5, 6), (world, world))]:
        q = torch.randn(world, heads[0], *spatial, 16)
        k, v = (torch.randn(world, heads[1], *spatial, 16) for _ in range(2))
        grad_out, grad_lse = torch.randn_like(q), torch.randn(q.shape[:-1])
        kw = dict(kernel_size=3, dilation=1, is_causal=len(spatial) == 1, return_lse=True)
        lq, lk, lv = _leaves(q, k, v)
        out, lse = fusedops.neighborhood_attention(lq, lk, lv, **kw)
        torch.autograd.backward((out, lse), (grad_out, grad_lse))
        dims = [0] + ([1] if heads[0] % world == 0 and heads[1] % world == 0 else [])
        for dim in dims:
            dq, dk, dv = (distribute_tensor(t, mesh, [Shard(dim)]).requires_grad_() for t in (q, k, v))
            dout, dlse = fusedops.neighborhood_attention(dq, dk, dv, **kw)
            assert dout.placements == (Shard(dim),), dout.placements
            _check("out", dout, out.detach())
            _check("lse", dlse, lse.detach())
            torch.autograd.backward((dout, dlse), (distribute_tensor(grad_out, mesh, [Shard(dim)]),
                                                  distribute_tensor(grad_lse, mesh, [Shard(dim)])))
            for name, got, want in (("dq", dq, lq), ("dk", dk, lk), ("dv", dv, lv)):
                _check(name, got.grad, want.grad, atol=1e-4)



# ----- every rule against one process, on both kinds of path ---------------------------------------------

# Each case: attn_res on any batch dim; Block AttnRes on batch dims and queries; embedding column-wise, row-wise
# and token-sharded (with padding and scale_grad_by_freq); neighborhood attention on batch and heads (GQA);
# context-parallel NA (below).
RULE_CASES = ["_attn_res_case", "_block_attn_res_case", "_embedding_case", "_na_case", "_cp_case"]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("path", ["reference", pytest.param("cuda", marks=pytest.mark.interpreter)])
@pytest.mark.parametrize("case", RULE_CASES, ids=lambda name: name.strip("_"))
def test_sharded_ops_match_one_process(case, world, path, tmp_path):
    if path == "cuda" and world == 4:
        pytest.skip("one kernel-path world size is enough for CI time")
    _spawn(globals()[case], world, tmp_path, path)


# ----- parallelize_module ---------------------------------------------------------------------------


def _parallel_styles_case(rank, mesh):
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    torch.manual_seed(3)
    tokens = torch.randint(0, 16, (2, 8))
    for style in (ColwiseParallel(), RowwiseParallel()):
        ours, theirs = fusedops.nn.Embedding(16, 8, padding_idx=2), torch.nn.Embedding(16, 8, padding_idx=2)
        theirs.load_state_dict(ours.state_dict())
        for module in (ours, theirs):
            parallelize_module(module, mesh, style)
        a, b = ours(tokens), theirs(tokens)  # each rank's local output: its shard (colwise) or all (rowwise)
        _check(f"{type(style).__name__} out", a, b)
        a.pow(2).sum().backward()
        b.pow(2).sum().backward()
        assert ours.weight.grad.placements == theirs.weight.grad.placements
        _check(f"{type(style).__name__} grad", ours.weight.grad, theirs.weight.grad.full_tensor())
    # Sequence parallelism for AttnRes: values [N, B, S, D] sharded on S, parameters replicated.
    mix = fusedops.nn.AttnRes(8)
    torch.nn.init.normal_(mix.query)
    values = torch.randn(3, 2, 8, 8)
    want = mix(values).detach()
    parallelize_module(mix, mesh, SequenceParallel(sequence_dim=2, use_local_output=False))
    local = values.chunk(mesh.size(), dim=2)[rank]  # the layer before hands each rank its sequence shard
    _check("AttnRes under SequenceParallel", mix(local), want)


@pytest.mark.parametrize("world", [2, 4])
def test_parallelize_module_styles_match_torch_modules(world, tmp_path):
    _spawn(_parallel_styles_case, world, tmp_path)


# ----- FSDP2 -----------------------------------------------------------------------------------------


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = fusedops.nn.Embedding(32, 16)
        self.mix = fusedops.nn.AttnRes(16)
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, tokens):
        h = self.embed(tokens)
        return self.mix(torch.stack([h, self.proj(h)])).square().mean()


def _fsdp_case(rank, mesh):
    import warnings

    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(4)
    model = _Tiny()
    torch.nn.init.normal_(model.mix.query)
    tokens = torch.randint(0, 32, (mesh.size() * 2, 5))
    model(tokens).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    for module in (model.embed, model.mix, model):
        fully_shard(module, mesh=mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "output of embedding is a view" would fail here
        loss = model(tokens.chunk(mesh.size())[rank])  # data parallel: each rank its half of the batch
    loss.backward()
    for name, p in model.named_parameters():
        # FSDP averages the ranks' gradients; each rank's loss is the mean over its half of the batch.
        _check(f"FSDP2 grad {name}", p.grad, want[name], atol=1e-5)


@pytest.mark.parametrize("world", [2])
def test_fsdp2_fully_shard_matches_one_process(world, tmp_path):
    _spawn(_fsdp_case, world, tmp_path)


# ----- context-parallel neighborhood attention ---------------------------------------------------------

# (spatial, sharded axis, kernel, dilation, stride, causal, window, slab lengths): halos of one and of
# several hops (slabs shorter than the halo), uneven slabs, dilation x stride alignment, causal, both modes.
CP_CASES = [
    ((24,), 0, 5, 1, 1, False, "shifted", None),
    ((24,), 0, 7, 2, 3, False, "shifted", None),
    ((26,), 0, 9, 1, 4, True, "shifted", None),
    ((23,), 0, 5, 3, 1, False, "truncated", "uneven"),
    ((30,), 0, 11, 2, 1, True, "truncated", None),
    ((12, 6), 0, (5, 3), (1, 2), (2, 1), (False, True), "shifted", None),
    ((5, 16), 1, 3, (1, 3), 1, False, "shifted", "uneven"),
    ((8, 4, 5), 0, 3, 1, (2, 1, 1), (True, False, False), "shifted", None),
]


def _cp_case(rank, mesh):
    from fusedops.neighborhood_attention import context_parallel as cp

    world = mesh.size()
    group = mesh.get_group()
    for i, (spatial, axis, ks, dil, st, causal, window, uneven) in enumerate(CP_CASES):
        cp.IN_PLACE_MIN_ROW = 0 if i % 2 else 1 << 30  # halo rows received in place on every other case
        cp.OVERLAP = i not in (2, 4)  # slabs in parts (slab_parts) where they have an interior, but on two cases
        torch.manual_seed(10 + i)
        q = torch.randn(2, 4, *spatial, 8)
        k, v = (torch.randn(2, 2, *spatial, 8) for _ in range(2))
        grads = torch.randn_like(q), torch.randn(q.shape[:-1])
        kw = dict(kernel_size=ks, dilation=dil, stride=st, is_causal=causal, window=window)
        lq, lk, lv = _leaves(q, k, v)
        out, lse = fusedops.neighborhood_attention(lq, lk, lv, return_lse=True, **kw)
        torch.autograd.backward((out, lse), grads)
        n = spatial[axis]
        if uneven:  # rank r holds more rows than rank r + 1
            lengths = [n // world + (1 if r < n % world else 0) for r in range(world)]
            lengths[0], lengths[-1] = lengths[0] + lengths[-1] - 1, 1
        else:
            lengths = [len(c) for c in torch.arange(n).tensor_split(world)]
        dim = 2 + axis
        pieces = [t.split(lengths, dim)[rank] for t in (q, k, v, *grads, out.detach(), lse.detach())]
        sq, sk, sv = _leaves(*pieces[:3])
        got, got_lse = fusedops.context_parallel_neighborhood_attention(
            sq, sk, sv, **kw, axis=axis, group=group, lengths=lengths, return_lse=True)
        case = f"case {i} {CP_CASES[i]}"
        _check(f"out ({case})", got, pieces[5])
        _check(f"lse ({case})", got_lse, pieces[6])
        torch.autograd.backward((got, got_lse), pieces[3:5])
        for name, leaf, full in (("dq", sq, lq), ("dk", sk, lk), ("dv", sv, lv)):
            _check(f"{name} ({case})", leaf.grad, full.grad.split(lengths, dim)[rank], atol=1e-4)
        if uneven and mesh.device_type == "cpu":
            # uneven slabs without lengths (each rank assumes all are its own length): every rank refuses, where
            # the mismatched halos gave a wrong result or a failed transfer (on a GPU: a device-side assert)
            with pytest.raises(RuntimeError, match="slab lengths differ"):
                fusedops.context_parallel_neighborhood_attention(sq, sk, sv, **kw, axis=axis, group=group)



@settings(max_examples=40, deadline=None)
@given(length=st.integers(4, 40), kernel=st.integers(2, 9), dilation=st.integers(1, 3), stride=st.integers(1, 9),
       causal=st.booleans(), truncated=st.booleans(), cuts=st.lists(st.integers(0, 40), min_size=1, max_size=4),
       seed=st.integers(0, 2 ** 16))
def test_context_parallel_ranges_hold_every_window(length, kernel, dilation, stride, causal, truncated, cuts, seed):
    """Each rank's extended range holds its queries' windows: the op on the slab's queries against the range's
    keys (query_offset) equals the whole axis's op on those queries; so does each part of a slab (slab_parts: they
    cover it in order, the interior's keys its own rows). No process group: the ranges alone."""
    from fusedops.neighborhood_attention import reference
    from fusedops.neighborhood_attention.context_parallel import slab_parts, slab_ranges

    window = "truncated" if truncated else "shifted"
    kernel = kernel | 1 if truncated else kernel
    stride = 1 if truncated else min(stride, kernel)
    assume(kernel * dilation <= length)
    bounds = sorted({0, length, *(c % length for c in cuts)})
    lengths = tuple(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    torch.manual_seed(seed)
    q, k, v = (torch.randn(1, 1, length, 4, dtype=torch.float64) for _ in range(3))
    args = ([kernel], [dilation], [stride], [causal], 0.5, window)
    want, want_lse = reference.neighborhood_attention(q, k, v, *args)
    slabs = slab_ranges(lengths, kernel, dilation, stride, causal, window)
    for (start, end, lo, hi), parts in zip(slabs, slab_parts(lengths, kernel, dilation, stride, causal, window)):
        assert lo <= start <= end <= hi and lo % (dilation * stride) == 0 and hi - lo >= kernel * dilation
        pieces = [(start, end, lo, hi)]
        if parts is not None:
            parts, interior = parts
            assert [p[0] for p in parts] == [start] + [p[1] for p in parts[:-1]] and parts[-1][1] == end
            assert parts[interior][2:] == (start, end)  # the interior's key grid is the slab's own rows
            pieces += parts
        for first, last, p_lo, p_hi in pieces:
            got, got_lse = reference.neighborhood_attention(q[:, :, first:last], k[:, :, p_lo:p_hi],
                                                             v[:, :, p_lo:p_hi], *args, [first - p_lo])
            torch.testing.assert_close(got, want[:, :, first:last], rtol=0, atol=1e-12)
            torch.testing.assert_close(got_lse, want_lse[:, :, first:last], rtol=0, atol=1e-12)


def test_context_parallel_ranges_take_only_the_windows_reach():
    """A middle slab of 64 rows with 80-row windows needs 40 rows a side (NATTEN's shifted windows reach k // 2 = 40
    before a query and k - 1 - k // 2 = 39 after it), not the kernel's length: the 2-D benchmark case on 4 ranks."""
    from fusedops.neighborhood_attention.context_parallel import slab_ranges

    assert slab_ranges((64,) * 4, 80, 1, 1, False, "shifted") == (
        (0, 64, 0, 103), (64, 128, 24, 167), (128, 192, 88, 231), (192, 256, 152, 256))


def _cp_dtensor_case(rank, mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    from fusedops.neighborhood_attention import context_parallel as cp

    torch.manual_seed(20)
    # 9 rows over 2 or 4 ranks: uneven slabs; v's head dim differs from k's: k and v travel apart
    q, k, v = (torch.randn(1, 2, 9, 7, d) for d in (8, 8, 16))
    grad_out = torch.randn_like(v)
    kw = dict(kernel_size=(3, 5), dilation=(2, 1), stride=(1, 2))
    lq, lk, lv = _leaves(q, k, v)
    out = fusedops.neighborhood_attention(lq, lk, lv, **kw)
    out.backward(grad_out)
    dq, dk, dv = (distribute_tensor(t, mesh, [Shard(2)]).requires_grad_() for t in (q, k, v))
    cp.IN_PLACE_MIN_ROW = 0  # received in place, k and v apart
    dout = fusedops.neighborhood_attention(dq, dk, dv, **kw)
    assert dout.placements == (Shard(2),)
    _check("DTensor context-parallel out", dout, out.detach())
    dout.backward(distribute_tensor(grad_out, mesh, [Shard(2)]))
    for name, got, want in (("dq", dq, lq), ("dk", dk, lk), ("dv", dv, lv)):
        _check(f"DTensor context-parallel {name}", got.grad, want.grad, atol=1e-4)


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_through_dtensor(world, tmp_path):
    _spawn(_cp_dtensor_case, world, tmp_path)


# ----- the example model, distributed --------------------------------------------------------------------

LM = dict(vocab=64, dim=32, heads=4, layers=2, block_layers=1, window=4, period=3, seq=16, batch=8, steps=3)


def _lm_case(rank, mesh, tp):
    from fusedops.examples import lm

    cfg = lm.Config(**LM)
    torch.manual_seed(cfg.seed)
    single = lm.train(lm.AttnResLM(cfg), lm.SyntheticText(cfg.vocab, cfg.period, cfg.noise, cfg.seed), cfg.steps,
                      torch.device("cpu"), compile=False, log=None)
    torch.manual_seed(cfg.seed)
    model = lm.AttnResLM(cfg)
    shard = lm.parallelize(model, tp, torch.device("cpu"))
    got = lm.train(model, lm.SyntheticText(cfg.vocab, cfg.period, cfg.noise, cfg.seed), cfg.steps,
                   torch.device("cpu"), compile=False, log=None, shard=shard)
    lm.drain_collectives(model)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(single), rtol=2e-4, atol=0)


@pytest.mark.parametrize("world, tp", [(2, 2), (2, 1), (4, 2)])
def test_example_lm_fsdp2_and_tensor_parallel_match_one_process(world, tp, tmp_path):
    """The same global batches: FSDP2 over world / tp ranks x tensor parallel over tp give the
    single-process losses, step for step (the optimizer and gradient clipping included)."""
    import functools

    _spawn(functools.partial(_lm_case, tp=tp), world, tmp_path)


def test_example_lm_runs_under_torchrun(tmp_path):
    import subprocess
    import sys

    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "fusedops.examples.lm", "--device", "cpu", "--tp", "2", "--steps", "3", "--vocab", "64",
            "--dim", "32", "--heads", "2", "--layers", "2", "--block-layers", "1", "--seq", "16", "--batch", "4"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "tensor parallel over 2" in done.stdout and "loss" in done.stdout


# ----- the same on GPUs, NCCL -----------------------------------------------------------------------


GPU_CASES = [_attn_res_case, _block_attn_res_case, _embedding_case, _na_case, _cp_case, _cp_dtensor_case,
             _parallel_styles_case, _fsdp_case]


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda f: f.__name__.strip("_"))
def test_rules_on_gpus_with_nccl(world, case, tmp_path):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices")
    _spawn(case, world, tmp_path, device="cuda")
