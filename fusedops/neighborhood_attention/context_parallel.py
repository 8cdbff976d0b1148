"""Context-parallel neighborhood attention: q, k, v sharded along one spatial axis over a process group.

Each rank holds a contiguous slab of the axis (rank order = slab order). It needs the keys its queries'
windows use: the extended range [lo, hi) from the first to the last key position (or shifted-window leader)
of any of its queries, computed from the reference's per-axis windows. It receives the rows of k and v in that
range from the ranks that own them (point-to-point, torch.distributed, as many hops as the range spans) and runs
the single-device op on its own queries against the extended keys (the op's query_offset: no halo query is
computed). Every window lies inside the extended range, so none is cut or shifted by its edges, and lo is a
multiple of dilation x stride so that stride groups (GNA) line up with the global ones: every local result
equals the single-device op's. The backward sends the halo keys' gradients back to their owners, which add them.

With OVERLAP on, where some of a slab's queries see only its own rows (slab_parts: a 1-D slab longer than the
window), their attention runs while the halo rows are in flight, and the queries at the slab's edges after; the
backward runs the edges first and the interior while their halo gradients travel.

Per peer and direction, k's and v's rows travel as one tensor (one point-to-point transfer, not two). Where a row
of the sharded axis is long (2-D and 3-D slabs sharded on their first axis), the extended k and v share one storage
with the sharded axis outermost: each peer's rows are received in place, and the op reads them through their
strides.

Measured and not kept (H200 x4, bench/NOTES.md, distributed run 4): pipelining over chunks of heads, each chunk's
halo in flight under the previous chunk's attention (slower at 2-8 chunks, with or without
TORCH_NCCL_HIGH_PRIORITY).
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .op import check_window_args, neighborhood_attention, neighborhood_attention_backward_op
from .reference import axis_leader, axis_window

# Receive halo rows in place (extend) where a row of the sharded axis is at least this many contiguous elements: the
# slab's copy into the extended storage then moves long runs (distributed run 5).
IN_PLACE_MIN_ROW = 4096
# True: where a slab has an interior (slab_parts), run its attention while the halo rows are in flight and the edges'
# after, and the backward likewise (three ops each way instead of one, no copy of the slab into the extended one).
# Off by default (distributed run 6, H200, 1-D 128K tokens, window 2048): on 2 ranks it gains (fwd 1.66 vs 1.93 ms,
# fwd+bwd 6.56 vs 6.90), on 4 it loses (1.56 vs 1.05, 3.85 vs 3.64): the exchange holds every rank to the slowest
# one's host, and the extra ops' host time no longer hides behind a slab's shorter attention.
OVERLAP = False


def _grid_windows(first: int, last: int, queries: Tensor, kernel: int, dilation: int, stride: int, causal: bool,
                  window: str) -> tuple[Tensor, Tensor, Tensor]:
    """(lo, hi, leader) in axis positions of the windows of `queries` (axis positions in [first, last)) on the key grid
    [first, last) of the axis, as the op places them on a key grid of that length: hi inclusive; leader the shifted
    window's stride-group leader (the query itself for a truncated window)."""
    i = queries - first
    group, within = i % dilation, i // dilation
    n = last - first
    group_length = n // dilation + (group < n % dilation).long()
    lo, hi = axis_window(within, group_length, kernel, stride, causal, window)
    leader = axis_leader(within, group_length, stride, causal) if window == "shifted" else within
    return tuple(x * dilation + group + first for x in (lo, hi, leader))


@functools.lru_cache(maxsize=256)
def slab_ranges(lengths: tuple[int, ...], kernel: int, dilation: int, stride: int, causal: bool, window: str
                ) -> tuple[tuple[int, int, int, int], ...]:
    """Per rank (start, end, lo, hi): its slab [start, end) of an axis of the given slab lengths, and the extended
    range [lo, hi) holding every key and shifted-window leader of its queries' windows (the slab included), lo
    rounded down to a multiple of dilation x stride, at least kernel x dilation long (the op's minimum; a wider
    range than the windows need changes no result)."""
    total, align, min_length = sum(lengths), dilation * stride, kernel * dilation
    start, out = 0, []
    for n in lengths:
        first, last = start, start + n
        if n:
            lo, hi, leader = _grid_windows(0, total, torch.arange(start, start + n), kernel, dilation, stride, causal,
                                           window)
            first = min(first, int(lo.min()))
            last = max(last, int(torch.maximum(hi, leader).max()) + 1)
        if last - first < min_length:
            first = max(0, last - min_length)
        first = first // align * align
        out.append((start, start + n, first, max(last, min(total, first + min_length))))
        start += n
    return tuple(out)


@functools.lru_cache(maxsize=256)
def slab_parts(lengths: tuple[int, ...], kernel: int, dilation: int, stride: int, causal: bool, window: str
               ) -> tuple[Optional[tuple[tuple[tuple[int, int, int, int], ...], int]], ...]:
    """Per rank, its slab's queries in parts (start, end, lo, hi) in axis order and the index of the interior one, or
    None where it has no interior part: the interior, the longest run of queries whose windows on the slab's own
    rows as the key grid are their windows on the whole axis, and the queries before and after it with their
    extended ranges (slab_ranges of the slab cut at the interior's ends).
    The interior needs no halo: its attention runs while the halo rows are in flight (see _ContextParallel)."""
    total, min_length = sum(lengths), kernel * dilation
    out, start = [], 0
    for rank, n in enumerate(lengths):
        end = start + n
        run = None
        if n >= max(min_length, 1):
            queries = torch.arange(start, end)
            inside = torch.ones(n, dtype=torch.bool)
            for want, got in zip(_grid_windows(0, total, queries, kernel, dilation, stride, causal, window),
                                 _grid_windows(start, end, queries, kernel, dilation, stride, causal, window)):
                inside &= want == got
            run = _longest_run(inside)
        if run is None:
            out.append(None)
        else:
            a, b = start + run[0], start + run[1]
            cut = tuple(m for m in (a - start, b - a, end - b) if m)
            ranges = slab_ranges(lengths[:rank] + cut + lengths[rank + 1:], kernel, dilation, stride, causal, window)
            parts = tuple((first, last, start, end) if first == a else (first, last, lo, hi)
                          for first, last, lo, hi in ranges if start <= first < end)
            out.append((parts, [p[0] for p in parts].index(a)))
        start = end
    return tuple(out)


def _longest_run(mask: Tensor) -> Optional[tuple[int, int]]:
    """[a, b) of the longest run of True in a 1-D mask (the first of equals), or None."""
    best, a = None, None
    for i, m in enumerate(mask.tolist() + [False]):
        if m and a is None:
            a = i
        elif not m and a is not None:
            if best is None or i - a > best[1] - best[0]:
                best = (a, i)
            a = None
    return best


def rank_ranges(lengths: Sequence[int], axis: int, ks: list, dil: list, st: list, causal: list, window: str
                ) -> tuple[tuple[int, int, int, int], ...]:
    """slab_ranges for normalised window arguments (check_window_args) sharded on spatial axis `axis`."""
    return slab_ranges(tuple(int(n) for n in lengths), ks[axis], dil[axis], st[axis], bool(causal[axis]), window)


def _peers(rank: int, ranges, group):
    """(peer's global rank, rows of this slab in the peer's range, rows of the peer's slab in this range)."""
    start, end, lo, hi = ranges[rank]
    for peer, (p_start, p_end, p_lo, p_hi) in enumerate(ranges):
        if peer != rank:
            yield (dist.get_global_rank(group, peer) if group is not None else peer,
                   (max(start, p_lo), min(end, p_hi)), (max(p_start, lo), min(p_end, hi)))


def _packs(xs: Sequence[Tensor]) -> list[list[int]]:
    """Indices of xs that travel together: all of them when they share a shape (k and v unless v's head dim
    differs), so one transfer per peer and direction (c10d's host cost is per tensor)."""
    return [list(range(len(xs)))] if all(x.shape == xs[0].shape for x in xs) else [[j] for j in range(len(xs))]


def extend(xs: Sequence[Tensor], dim: int, rank: int, ranges, group, wait: bool = True, slab: bool = True):
    """Each x's extended slab [lo, hi) along `dim`: x's rows, and the halo rows from the ranks that own them
    (point-to-point; on GPUs the current stream waits for them, the host does not). Where a row of `dim` is at
    least IN_PLACE_MIN_ROW contiguous elements, a pack's extended slabs share one storage with `dim` outermost and
    the pack's tensors next, so the rows from a peer are received in place (one contiguous block); else each is a
    plain tensor: the received rows and x's concatenated (wait and slab), else the received rows copied in. Every
    rank takes the same layout: it is the messages' too.
    wait=False: (exts, pending), the halo rows in flight until `finish(pending, exts, lo, dim)`. slab=False: x's
    own rows are not copied in (the caller copies those it needs)."""
    start, end, lo, hi = ranges[rank]
    in_place = math.prod(xs[0].shape[dim + 1:]) >= IN_PLACE_MIN_ROW

    def rows_of(j: int, a: int, b: int) -> Tensor:
        return xs[j].narrow(dim, a - start, b - a)

    if not in_place and slab and wait:
        # one torch.cat of the received rows and the slab: 1.8x faster than the slab copied into a strided range of
        # an empty extended tensor (bench/NOTES.md distributed run 7)
        requests, landed = _start_exchange(xs, rows_of, dim, rank, ranges, group, backward=False)
        for request in requests:
            request.wait()
        pieces = [[(start, x)] for x in xs]
        for j, first, rows in landed:
            pieces[j].append((first, rows))
        return [torch.cat([rows for _, rows in sorted(p, key=lambda piece: piece[0])], dim) for p in pieces]
    exts: list = [None] * len(xs)
    stores = []
    for pack in _packs(xs):
        shape = list(xs[pack[0]].shape)
        if in_place:
            del shape[dim]
            stores.append(xs[pack[0]].new_empty([hi - lo, len(pack)] + shape))
        else:
            shape[dim] = hi - lo
        for slot, j in enumerate(pack):
            exts[j] = stores[-1][:, slot].movedim(0, dim) if in_place else xs[j].new_empty(shape)
            if slab:
                exts[j].narrow(dim, start - lo, end - start).copy_(xs[j])
    pending = _start_exchange(xs, rows_of, dim, rank, ranges, group, backward=False,
                              stores=stores if in_place else None)
    if not wait:
        return exts, pending
    finish(pending, exts, lo, dim)
    return exts


def _start_exchange(like: Sequence[Tensor], rows_of, dim: int, rank: int, ranges, group, backward: bool,
                    stores=None) -> tuple[list, list]:
    """Start a halo exchange of tensors shaped as `like` (the local slabs) and return (requests, landed) for `finish`.
    Forward: receive the rows of [lo, hi) other ranks own (in place, into `stores`, when given: see extend) and send
    them the rows of the local slabs their ranges need. Backward: the reverse, the halo rows' gradients going back
    to their owners. rows_of(j, a, b): the rows [a, b) (axis positions) of tensor j that go out."""
    start, end, lo, hi = ranges[rank]
    ops, landed = [], []
    for peer, mine, theirs in _peers(rank, ranges, group):
        outgoing, incoming = (theirs, mine) if backward else (mine, theirs)
        for p, pack in enumerate(_packs(like)):
            if outgoing[1] > outgoing[0]:
                rows = [rows_of(j, *outgoing) for j in pack]
                rows = torch.stack([r.movedim(dim, 0) for r in rows], 1) if stores else torch.stack(rows)
                ops.append(dist.P2POp(dist.isend, rows, peer, group))
            if incoming[1] > incoming[0] and stores:
                ops.append(dist.P2POp(dist.irecv, stores[p].narrow(0, incoming[0] - lo, incoming[1] - incoming[0]),
                                      peer, group))
            elif incoming[1] > incoming[0]:
                shape = list(like[pack[0]].shape)
                shape[dim] = incoming[1] - incoming[0]
                buf = like[pack[0]].new_empty([len(pack)] + shape)
                ops.append(dist.P2POp(dist.irecv, buf, peer, group))
                landed.extend((j, incoming[0], buf[slot]) for slot, j in enumerate(pack))
    return (dist.batch_isend_irecv(ops) if ops else []), landed


def finish(pending: tuple[list, list], into: Sequence[Tensor], base: int, dim: int, add: bool = False) -> None:
    """Complete an exchange started by _start_exchange (on GPUs the current stream waits, not the host; a second call
    does nothing): rows not received in place are copied into (forward) or added to (add: backward) `into`, whose
    row 0 is axis position `base`."""
    requests, landed = pending
    for request in requests:
        request.wait()
    for j, first, rows in landed:
        target = into[j].narrow(dim, first - base, rows.shape[dim])
        if add:
            target.add_(rows)
        else:
            target.copy_(rows)
    requests.clear()
    landed.clear()


def _add_rows(into: Tensor, base: int, grads: list, dim: int) -> Tensor:
    """`into` (axis positions base, base + 1, ... along `dim`) plus, in place, the rows of each gradient given as
    (first row, tensor) that fall in its range."""
    last = base + into.shape[dim]
    for first, g in grads:
        s, e = max(base, first), min(last, first + g.shape[dim])
        if e > s:
            into.narrow(dim, s - base, e - s).add_(g.narrow(dim, s - first, e - s))
    return into


def _sum_rows(grads: list, like: Tensor, dim: int, a: int, b: int) -> Tensor:
    """Rows [a, b) (axis positions) of the sum of gradients given as (first row, tensor), shaped as `like` along the
    other dims; zeros where none reaches (a halo row only the range's alignment took in)."""
    shape = list(like.shape)
    shape[dim] = b - a
    return _add_rows(like.new_zeros(shape), a, grads, dim)


def _axis_offset(q: Tensor, dim: int, offset: int) -> list[int]:
    """query_offset placing q's box `offset` rows into the key grid along `dim`."""
    out = [0] * (q.dim() - 3)
    out[dim - 2] = offset
    return out


class _ContextParallel(torch.autograd.Function):
    """The rank's queries against the extended k and v; the backward's halo key gradients go back to their owners.
    Without parts (slab_parts: no query's window fits the slab's own rows), one op each way after the exchange.
    With parts, the interior's op runs on the local rows while the halo rows are in flight, then the edge parts'
    ops on their ranges of the extended k and v (the received rows and the slab's rows they need); the backward runs
    the edge parts first, sends their halo gradients, and runs the interior while they travel."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, dim: int, rank: int, ranges, parts, group, window_args: tuple):
        start, end, lo, hi = ranges[rank]
        ctx.set_materialize_grads(False)
        ctx.dim, ctx.rank, ctx.ranges, ctx.parts, ctx.group = dim, rank, ranges, parts, group
        ctx.window_args = window_args
        if parts is None:
            k_ext, v_ext = extend((k, v), dim, rank, ranges, group)
            out, lse = neighborhood_attention(q, k_ext, v_ext, *window_args, return_lse=True,
                                              query_offset=_axis_offset(q, dim, start - lo))
            ctx.save_for_backward(q, k_ext, v_ext, out, lse)
            return out, lse
        parts, interior = parts
        # the halo rows land in extended slabs without the slab's rows; each edge part's keys are a range of them,
        # its slab rows copied in
        (k_ext, v_ext), pending = extend((k, v), dim, rank, ranges, group, wait=False, slab=False)
        results, keys = [None] * len(parts), [(k, v)] * len(parts)  # the interior's key grid is the slab itself
        for p in [interior] + [p for p in range(len(parts)) if p != interior]:
            first, last, p_lo, p_hi = parts[p]
            if p != interior:
                finish(pending, (k_ext, v_ext), lo, dim)
                a, b = max(start, p_lo), min(end, p_hi)  # (a window holds its query: never empty)
                for x, ext in ((k, k_ext), (v, v_ext)):
                    ext.narrow(dim, a - lo, b - a).copy_(x.narrow(dim, a - start, b - a))
                keys[p] = tuple(x.narrow(dim, p_lo - lo, p_hi - p_lo) for x in (k_ext, v_ext))
            results[p] = neighborhood_attention(q.narrow(dim, first - start, last - first), *keys[p], *window_args,
                                                return_lse=True, query_offset=_axis_offset(q, dim, first - p_lo))
        finish(pending, (k_ext, v_ext), lo, dim)
        outs, lses = zip(*results)
        edge_keys = [x for p in range(len(parts)) if p != interior for x in keys[p]]
        ctx.save_for_backward(q, k, v, *edge_keys, *outs, *lses)
        return torch.cat(outs, dim), torch.cat(lses, dim)

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        dim, rank, ranges, group = ctx.dim, ctx.rank, ctx.ranges, ctx.group
        start, end, lo, hi = ranges[rank]
        if ctx.parts is None:
            q, k_ext, v_ext, out, lse = ctx.saved_tensors
            if grad_out is None:
                grad_out = torch.zeros_like(out)
            dq, dk_ext, dv_ext = neighborhood_attention_backward_op(
                grad_out, grad_lse, q, k_ext, v_ext, out, lse, *ctx.window_args, _axis_offset(q, dim, start - lo))
            dk, dv = (g.narrow(dim, start - lo, end - start).clone(memory_format=torch.contiguous_format)
                      for g in (dk_ext, dv_ext))
            pending = _start_exchange((dk, dv), lambda j, a, b: (dk_ext, dv_ext)[j].narrow(dim, a - lo, b - a), dim,
                                      rank, ranges, group, backward=True)
            finish(pending, (dk, dv), start, dim, add=True)
            return dq, dk, dv, None, None, None, None, None, None
        parts, interior = ctx.parts
        q, k, v, *saved = ctx.saved_tensors
        n = 2 * (len(parts) - 1)  # k's and v's rows of each edge part, then each part's out and lse
        edge_keys, outs, lses = saved[:n], saved[n:n + len(parts)], saved[n + len(parts):]
        keys = [(k, v)] * len(parts)
        for i, p in enumerate(p for p in range(len(parts)) if p != interior):
            keys[p] = edge_keys[2 * i:2 * i + 2]
        if grad_out is None:
            grad_out = q.new_zeros((*q.shape[:-1], v.shape[-1]))
        dqs, grads = [None] * len(parts), [None] * len(parts)
        # the edge parts first, so that their halo gradients travel while the interior's backward runs
        for p in [p for p in range(len(parts)) if p != interior] + [interior]:
            if p == interior:
                edges = [(parts[e][2], grads[e]) for e in range(len(parts)) if e != interior]
                pending = _start_exchange((k, v), lambda j, a, b: _sum_rows([(f, g[j]) for f, g in edges],
                                                                            (k, v)[j], dim, a, b),
                                          dim, rank, ranges, group, backward=True)
            first, last, p_lo, p_hi = parts[p]
            rows = (dim, first - start, last - first)
            dqs[p], *grads[p] = neighborhood_attention_backward_op(
                grad_out.narrow(*rows), None if grad_lse is None else grad_lse.narrow(*rows), q.narrow(*rows),
                *keys[p], outs[p], lses[p], *ctx.window_args, _axis_offset(q, dim, first - p_lo))
        # this slab's key gradients: the interior's (its key grid is the slab), each edge part's local rows, then
        # what the peers send
        dk, dv = (_add_rows(g, start, [(f, e[j]) for f, e in edges], dim) for j, g in enumerate(grads[interior]))
        finish(pending, (dk, dv), start, dim, add=True)
        return torch.cat(dqs, dim), dk, dv, None, None, None, None, None, None


def context_parallel_neighborhood_attention(
    q: Tensor, k: Tensor, v: Tensor, kernel_size, dilation=1, stride=1, is_causal=False,
    scale: Optional[float] = None, window: str = "shifted", *, axis: int = 0, group=None,
    lengths: Optional[Sequence[int]] = None, return_lse: bool = False, _lengths_agreed: bool = False,
):
    """`fusedops.neighborhood_attention` on q, k, v sharded along spatial axis `axis` over `group` (default:
    the default process group), each rank holding its contiguous slab [B, H, *spatial_local, D] in rank
    order. lengths: every rank's slab length on that axis, the same on every rank (default: all equal to this
    rank's; uneven slabs must pass them). Returns this rank's rows of out (and lse), equal to the single-device
    op's on the whole axis; differentiable in q, k, v. Every rank must call it (it exchanges halos
    point-to-point); no host synchronisation. Ranks whose lengths differ (uneven slabs without lengths) are
    refused: RuntimeError on CPU, a device-side assert on a GPU (one all-gather of the lengths a call)."""
    ndim = q.dim() - 3
    if not 0 <= axis < ndim:
        raise ValueError(f"axis must name a spatial axis in [0, {ndim}), got {axis}")
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    lengths = [q.shape[2 + axis]] * world if lengths is None else [int(n) for n in lengths]
    if len(lengths) != world or lengths[rank] != q.shape[2 + axis]:
        raise ValueError(f"lengths must hold one slab length per rank ({world}) with this rank's ({rank}) "
                         f"equal to q's axis {axis} ({q.shape[2 + axis]}), got {lengths}")
    for name, t in (("k", k), ("v", v)):
        if t.dim() != q.dim() or t.shape[2:-1] != q.shape[2:-1]:
            raise ValueError(f"{name} must have q's rank and spatial shape {tuple(q.shape[2:-1])}, got shape "
                             f"{tuple(t.shape)}")
    ks, dil, st, causal = check_window_args(ndim, kernel_size, dilation, stride, is_causal, window)
    if not _lengths_agreed:
        _assert_lengths_agree(lengths, group, q.device)
    ranges = rank_ranges(lengths, axis, ks, dil, st, causal, window)
    parts = slab_parts(tuple(lengths), ks[axis], dil[axis], st[axis], bool(causal[axis]), window)[rank] if OVERLAP \
        else None
    out, lse = _ContextParallel.apply(q, k, v, 2 + axis, rank, ranges, parts, group,
                                      (ks, dil, st, causal, scale, window))
    return (out, lse) if return_lse else out


def _assert_lengths_agree(lengths: list[int], group, device: torch.device) -> None:
    """Every rank must hold the same lengths: they fix which rows each rank sends and receives, and ranks that
    disagree exchange mismatched halos (a wrong result where the sizes happen to match). One all-gather of a hash
    of them, compared on the device: no host sync (made by a fill, not copied from the host; on CPU tensors the
    assert raises at once)."""
    mine = torch.full((1,), hash(tuple(lengths)) & (2 ** 62 - 1), dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in lengths]
    dist.all_gather(every, mine, group=group)
    torch._assert_async(torch.cat(every).eq(mine).all(),
                        f"context_parallel_neighborhood_attention: the ranks' slab lengths differ (this rank's: "
                        f"{lengths}); uneven slabs must pass lengths, the same on every rank")


def spatially_sharded(q) -> bool:
    """Whether q is a DTensor with a spatial axis sharded (the wrapper then runs context parallelism)."""
    placements = getattr(q, "placements", None)
    return placements is not None and any(p.is_shard() and 2 <= p.dim < q.dim() - 1 for p in placements)


def dtensor_neighborhood_attention(q, k, v, kernel_size, dilation, stride, is_causal, scale, window, return_lse):
    """The DTensor form: q, k, v sharded alike on one spatial axis over one mesh dim (other mesh dims
    replicated), slabs as DTensor's Shard lays them out; out (and lse) come back sharded the same way."""
    from torch.distributed.tensor import DTensor, Shard

    mesh, placements = q.device_mesh, tuple(q.placements)
    if tuple(k.placements) != placements or tuple(v.placements) != placements:
        raise ValueError(f"k and v must be sharded as q is ({placements}), got {k.placements} and {v.placements}")
    sharded = [(i, p) for i, p in enumerate(placements) if not p.is_replicate()]
    if len(sharded) != 1 or not (sharded[0][1].is_shard() and 2 <= sharded[0][1].dim < q.dim() - 1):
        raise ValueError(f"q must be sharded on one spatial axis over one mesh dim, the others replicated; got "
                         f"placements {placements}")
    mesh_dim, shard = sharded[0]
    world, n = mesh.size(mesh_dim), q.shape[shard.dim]
    lengths = [Shard.local_shard_size_and_offset(n, world, r)[0] for r in range(world)]
    out, lse = context_parallel_neighborhood_attention(
        q.to_local(), k.to_local(), v.to_local(), kernel_size, dilation, stride, is_causal, scale, window,
        axis=shard.dim - 2, group=mesh.get_group(mesh_dim), lengths=lengths, return_lse=True,
        _lengths_agreed=True)  # from the global shape: every rank's are the same
    out = DTensor.from_local(out, mesh, placements, run_check=False, **_global((*q.shape[:-1], v.shape[-1])))
    lse = DTensor.from_local(lse, mesh, placements, run_check=False, **_global(tuple(q.shape[:-1])))
    return (out, lse) if return_lse else out


def _global(shape: tuple) -> dict:
    """from_local's global shape and (contiguous) stride: uneven slabs cannot be inferred from one rank's."""
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= size
    return dict(shape=torch.Size(shape), stride=tuple(reversed(stride)))
