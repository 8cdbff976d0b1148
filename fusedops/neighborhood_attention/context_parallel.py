"""Context-parallel neighborhood attention: q, k, v sharded along one spatial axis over a process group.

Each rank holds a contiguous slab of the axis (rank order = slab order). A query's window reaches at most
a few kernel lengths (times the dilation) along the axis, so each rank needs only the halo of key positions
around its slab that its windows reach: it receives those rows of k and v from the ranks that own them
(point-to-point, torch.distributed, as many hops as the halo spans) and runs the single-device op on its own
queries against the extended keys (the op's query_offset: no halo query is computed). The extended slab
starts where the global axis does or far enough out that no window of a local query is cut or shifted by
its edge, and at a multiple of dilation x stride so that stride groups (GNA) line up with the global ones:
every local result equals the single-device op's. The backward is one op over all the rank's queries; it
sends the halo keys' gradients back to their owners, which add them.

Not overlapped: running the queries whose windows lie inside the slab while the halo is in flight, and the
rest after it lands, was 2-4% slower than one op after the halo lands (H200 x2, bench/NOTES.md, distributed
run 2): the exchange did not run under the interior's kernel.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .op import check_window_args, neighborhood_attention, neighborhood_attention_backward_op


def axis_halo(kernel: int, dilation: int, stride: int, causal: bool, window: str) -> tuple[int, int]:
    """(left, right) positions beyond a slab that the windows of its queries may need on one axis. In
    within-group steps: a shifted window's leader lies up to stride - 1 before (its group's start) or
    stride // 2 after its query, the window k // 2 around the leader and clamped inward at the ends;
    causal leaders up to stride - 1 after the query; truncated windows k // 2 around the query."""
    if window == "truncated":
        steps = (kernel - 1, 0) if causal else (kernel // 2, kernel // 2)
    elif causal:
        steps = (kernel - 1, stride - 1)
    else:
        steps = (kernel - 1 + stride // 2, kernel - 1 + stride // 2)
    return steps[0] * dilation, steps[1] * dilation


def slab_ranges(lengths: Sequence[int], halo: tuple[int, int], align: int, min_length: int
                ) -> list[tuple[int, int, int, int]]:
    """Per rank (start, end, lo, hi): its slab [start, end) of the axis and the extended range [lo, hi)
    its windows need, lo rounded down to a multiple of `align`, at least min_length long (the op needs
    kernel_size x dilation positions; a wider range than the windows need changes no result)."""
    total, start, out = sum(lengths), 0, []
    for n in lengths:
        lo, hi = max(0, start - halo[0]), min(total, start + n + halo[1])
        if hi - lo < min_length:
            lo = max(0, hi - min_length)
        lo = lo // align * align
        out.append((start, start + n, lo, max(hi, min(total, lo + min_length))))
        start += n
    return out


def rank_ranges(lengths: Sequence[int], axis: int, ks: list, dil: list, st: list, causal: list, window: str
                ) -> list[tuple[int, int, int, int]]:
    """slab_ranges for normalised window arguments (check_window_args) sharded on spatial axis `axis`."""
    halo = axis_halo(ks[axis], dil[axis], st[axis], causal[axis], window)
    return slab_ranges(lengths, halo, dil[axis] * st[axis], ks[axis] * dil[axis])


def extend(xs: Sequence[Tensor], dim: int, rank: int, ranges: list, group) -> list[Tensor]:
    """Each x's extended slab [lo, hi) along `dim`: x's rows, and the halo rows from the ranks that own them
    (point-to-point, one batch for all xs; on GPUs the current stream waits for them, the host does not)."""
    start, end, lo, hi = ranges[rank]
    exts = []
    for x in xs:
        shape = list(x.shape)
        shape[dim] = hi - lo
        exts.append(x.new_empty(shape))
        exts[-1].narrow(dim, start - lo, end - start).copy_(x)
    _exchange(list(zip(xs, exts)), dim, rank, ranges, group, backward=False)
    return exts


def _exchange(pairs: list, dim: int, rank: int, ranges: list, group, backward: bool) -> None:
    """For each (local slab, extended slab) pair, forward: receive into the extended slab the rows of [lo, hi)
    other ranks own and send them the rows of this slab their ranges need. Backward: the reverse, adding what
    comes back into local. One batch of transfers for all pairs."""
    start, end, lo, hi = ranges[rank]
    ops, landed = [], []
    for peer, (p_start, p_end, p_lo, p_hi) in enumerate(ranges):
        if peer == rank:
            continue
        peer_rank = dist.get_global_rank(group, peer) if group is not None else peer
        mine = (max(start, p_lo), min(end, p_hi))  # rows of this slab in the peer's range
        theirs = (max(p_start, lo), min(p_end, hi))  # rows of the peer's slab in this range
        outgoing, incoming = (theirs, mine) if backward else (mine, theirs)
        for local, ext in pairs:
            source, base_out = (ext, lo) if backward else (local, start)
            if outgoing[1] > outgoing[0]:
                rows = source.narrow(dim, outgoing[0] - base_out, outgoing[1] - outgoing[0]).contiguous()
                ops.append(dist.P2POp(dist.isend, rows, peer_rank, group))
            if incoming[1] > incoming[0]:
                shape = list(local.shape)
                shape[dim] = incoming[1] - incoming[0]
                buf = local.new_empty(shape)
                ops.append(dist.P2POp(dist.irecv, buf, peer_rank, group))
                landed.append((local, ext, buf, incoming[0]))
    for request in dist.batch_isend_irecv(ops) if ops else []:
        request.wait()
    for local, ext, buf, first in landed:
        if backward:
            local.narrow(dim, first - start, buf.shape[dim]).add_(buf)
        else:
            ext.narrow(dim, first - lo, buf.shape[dim]).copy_(buf)


class _ContextParallel(torch.autograd.Function):
    """The rank's queries against the extended k and v, one op; its backward one op too, whose halo key
    gradients go back to their owners."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, dim: int, rank: int, ranges: list, group, window_args: tuple):
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
        _exchange([(dk, dk_ext), (dv, dv_ext)], dim, rank, ranges, ctx.group, backward=True)
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
