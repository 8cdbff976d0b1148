"""Context-parallel neighborhood attention: q, k, v sharded along one spatial axis over a process group.

Each rank holds a contiguous slab of the axis (rank order = slab order). It needs the keys its queries'
windows use: the extended range [lo, hi) from the first to the last key position (or shifted-window leader)
of any of its queries, computed from the reference's per-axis windows. It receives the rows of k and v in that
range from the ranks that own them (point-to-point, torch.distributed, as many hops as the range spans) and runs
the single-device op on its own queries against the extended keys (the op's query_offset: no halo query is
computed). Every window lies inside the extended range, so none is cut or shifted by its edges, and lo is a
multiple of dilation x stride so that stride groups (GNA) line up with the global ones: every local result
equals the single-device op's. The backward sends the halo keys' gradients back to their owners, which add them.

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
            i = torch.arange(start, start + n)
            group, within = i % dilation, i // dilation
            group_length = total // dilation + (group < total % dilation).long()
            lo, hi = axis_window(within, group_length, kernel, stride, causal, window)
            if window == "shifted":
                hi = torch.maximum(hi, axis_leader(within, group_length, stride, causal))
            first = min(first, int((lo * dilation + group).min()))
            last = max(last, int((hi * dilation + group).max()) + 1)
        if last - first < min_length:
            first = max(0, last - min_length)
        first = first // align * align
        out.append((start, start + n, first, max(last, min(total, first + min_length))))
        start += n
    return tuple(out)


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


def extend(xs: Sequence[Tensor], dim: int, rank: int, ranges, group) -> list[Tensor]:
    """Each x's extended slab [lo, hi) along `dim`: x's rows, and the halo rows from the ranks that own them
    (point-to-point; on GPUs the current stream waits for them, the host does not). Where a row of `dim` is at
    least IN_PLACE_MIN_ROW contiguous elements, a pack's extended slabs share one storage with `dim` outermost and
    the pack's tensors next, so the rows from a peer are received in place (one contiguous block); else each is a
    plain tensor and the received rows are copied in."""
    start, end, lo, hi = ranges[rank]
    in_place = math.prod(xs[0].shape[dim + 1:]) >= IN_PLACE_MIN_ROW
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
            exts[j].narrow(dim, start - lo, end - start).copy_(xs[j])
    _exchange(list(xs), exts, dim, rank, ranges, group, backward=False, stores=stores if in_place else None)
    return exts


def _exchange(local: list, ext: list, dim: int, rank: int, ranges, group, backward: bool, stores=None) -> None:
    """Forward: receive into each extended slab the rows of [lo, hi) other ranks own (in place, into `stores`,
    when given: see extend) and send them the rows of the local slabs their ranges need. Backward: the reverse,
    adding what comes back into the local slabs."""
    start, end, lo, hi = ranges[rank]
    ops, landed = [], []
    for peer, mine, theirs in _peers(rank, ranges, group):
        outgoing, incoming = (theirs, mine) if backward else (mine, theirs)
        source, base = (ext, lo) if backward else (local, start)
        for p, pack in enumerate(_packs(local)):
            if outgoing[1] > outgoing[0]:
                rows = [source[j].narrow(dim, outgoing[0] - base, outgoing[1] - outgoing[0]) for j in pack]
                rows = torch.stack([r.movedim(dim, 0) for r in rows], 1) if stores else torch.stack(rows)
                ops.append(dist.P2POp(dist.isend, rows, peer, group))
            if incoming[1] > incoming[0] and stores:
                ops.append(dist.P2POp(dist.irecv, stores[p].narrow(0, incoming[0] - lo, incoming[1] - incoming[0]),
                                      peer, group))
            elif incoming[1] > incoming[0]:
                shape = list(local[pack[0]].shape)
                shape[dim] = incoming[1] - incoming[0]
                buf = local[pack[0]].new_empty([len(pack)] + shape)
                ops.append(dist.P2POp(dist.irecv, buf, peer, group))
                landed.extend((j, incoming[0], buf[slot]) for slot, j in enumerate(pack))
    for request in dist.batch_isend_irecv(ops) if ops else []:
        request.wait()
    for j, first, rows in landed:
        if backward:
            local[j].narrow(dim, first - start, rows.shape[dim]).add_(rows)
        else:
            ext[j].narrow(dim, first - lo, rows.shape[dim]).copy_(rows)


class _ContextParallel(torch.autograd.Function):
    """The rank's queries against the extended k and v, one op; its backward one op too, whose halo key
    gradients go back to their owners."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, dim: int, rank: int, ranges, group, window_args: tuple):
        k_ext, v_ext = extend((k, v), dim, rank, ranges, group)
        offset = [0] * (q.dim() - 3)
        offset[dim - 2] = ranges[rank][0] - ranges[rank][2]  # the slab's first row in the extended one
        out, lse = neighborhood_attention(q, k_ext, v_ext, *window_args, return_lse=True, query_offset=offset)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k_ext, v_ext, out, lse)
        ctx.dim, ctx.rank, ctx.ranges, ctx.group = dim, rank, ranges, group
        ctx.window_args, ctx.offset = window_args, offset
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k_ext, v_ext, out, lse = ctx.saved_tensors
        dim, rank, ranges = ctx.dim, ctx.rank, ctx.ranges
        start, end, lo, _ = ranges[rank]
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        dq, dk_ext, dv_ext = neighborhood_attention_backward_op(
            grad_out, grad_lse, q, k_ext, v_ext, out, lse, *ctx.window_args, ctx.offset)
        dk, dv = (g.narrow(dim, start - lo, end - start).clone(memory_format=torch.contiguous_format)
                  for g in (dk_ext, dv_ext))
        _exchange([dk, dv], [dk_ext, dv_ext], dim, rank, ranges, ctx.group, backward=True)
        return dq, dk, dv, None, None, None, None, None


def context_parallel_neighborhood_attention(
    q: Tensor, k: Tensor, v: Tensor, kernel_size, dilation=1, stride=1, is_causal=False,
    scale: Optional[float] = None, window: str = "shifted", *, axis: int = 0, group=None,
    lengths: Optional[Sequence[int]] = None, return_lse: bool = False,
):
    """`fusedops.neighborhood_attention` on q, k, v sharded along spatial axis `axis` over `group` (default:
    the default process group), each rank holding its contiguous slab [B, H, *spatial_local, D] in rank
    order. lengths: every rank's slab length on that axis (default: all equal to this rank's). Returns
    this rank's rows of out (and lse), equal to the single-device op's on the whole axis; differentiable
    in q, k, v. Every rank must call it (it exchanges halos point-to-point); no host synchronisation."""
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
    ranges = rank_ranges(lengths, axis, ks, dil, st, causal, window)
    out, lse = _ContextParallel.apply(q, k, v, 2 + axis, rank, ranges, group, (ks, dil, st, causal, scale, window))
    return (out, lse) if return_lse else out


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
        axis=shard.dim - 2, group=mesh.get_group(mesh_dim), lengths=lengths, return_lse=True)
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
