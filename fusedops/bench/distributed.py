"""Multi-GPU benchmark (issue #33): context-parallel neighborhood attention and the ops under DTensor
sharding, against one GPU running the whole problem, in one torchrun launch:

    torchrun --standalone --nproc-per-node 4 -m fusedops.bench.distributed

Every rank times the same fixed number of calls, issued back to back, each between CUDA events (medians; a barrier
before each timed region; the slowest rank's median is reported); rank 0 also times the single-GPU op on the full
problem first (do_bench). Prints
per case: one GPU, all ranks, speed-up and scaling efficiency (speed-up / ranks), bf16.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist


def timed(fn, warmup: int = 3, reps: int = 10) -> float:
    """Median ms per call over a fixed number of calls on every rank (do_bench picks its repeat count
    from each rank's own first calls: ranks that exchange data would then wait for calls never made),
    issued back to back as do_bench issues them (the host's launch time overlaps the previous call's GPU work),
    each between its own CUDA events; the slowest rank's median."""
    for _ in range(warmup):
        fn()
    dist.barrier()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(end) for start, end in events)
    worst = torch.tensor([times[reps // 2]], device="cuda")
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


def na_cases():
    # (name, q shape, kernel_size, dilation, axis)
    yield "NA 1D 131072 tokens, window 2048, H8 D128", (1, 8, 131072, 128), 2048, 1, 0
    yield "NA 2D 256x256, window 80x80, H24 D128", (1, 24, 256, 256, 128), (80, 80), 1, 0


def run_na(rank, world, rows):
    import fusedops

    for name, shape, ks, dil, axis in na_cases():
        torch.manual_seed(0)
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        grad = torch.randn_like(q)
        times = {}
        if rank == 0:
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            times["one fwd"] = _single(lambda: fusedops.neighborhood_attention(*leaves, ks, dil))
            times["one fwd+bwd"] = _single(
                lambda: torch.autograd.grad(fusedops.neighborhood_attention(*leaves, ks, dil), leaves, grad))
        dim = 2 + axis
        local = [t.tensor_split(world, dim)[rank].contiguous().requires_grad_() for t in (q, k, v, grad)]
        lengths = [s.shape[dim] for s in q.tensor_split(world, dim)]

        def fwd():
            return fusedops.context_parallel_neighborhood_attention(*local[:3], ks, dil, axis=axis, lengths=lengths)

        times["cp fwd"] = timed(fwd)
        times["cp fwd+bwd"] = timed(lambda: torch.autograd.grad(fwd(), local[:3], local[3]))
        with _parts():
            times["parts fwd"] = timed(fwd)
            times["parts fwd+bwd"] = timed(lambda: torch.autograd.grad(fwd(), local[:3], local[3]))
        with _other_layout(local[1], dim):
            times["layout fwd"] = timed(fwd)
            times["layout fwd+bwd"] = timed(lambda: torch.autograd.grad(fwd(), local[:3], local[3]))
        times.update(_compute_only(rank, local, lengths, ks, dil, axis))
        rows.append((name, times))
        del q, k, v, grad, local
        torch.cuda.empty_cache()


@contextlib.contextmanager
def _parts():
    """Context parallelism with the interior's attention under the exchange and the edges after
    (context_parallel.OVERLAP on), where a slab has an interior."""
    from fusedops.neighborhood_attention import context_parallel as cp

    default, cp.OVERLAP = cp.OVERLAP, True
    try:
        yield
    finally:
        cp.OVERLAP = default


@contextlib.contextmanager
def _other_layout(k, dim):
    """The extended slabs in the layout the rule (context_parallel.IN_PLACE_MIN_ROW) does not pick for k: received
    in place where it copies them in, and the reverse."""
    import math

    from fusedops.neighborhood_attention import context_parallel as cp

    rule = cp.IN_PLACE_MIN_ROW
    cp.IN_PLACE_MIN_ROW = 1 << 62 if math.prod(k.shape[dim + 1:]) >= rule else 0
    try:
        yield
    finally:
        cp.IN_PLACE_MIN_ROW = rule


def _compute_only(rank, local, lengths, ks, dil, axis) -> dict:
    """The rank's op on its queries against k/v halos exchanged once beforehand: the time without the
    exchange (the copies into the extended slabs and the point-to-point transfers); and the exchange alone."""
    import fusedops
    from fusedops.neighborhood_attention import context_parallel as cp
    from fusedops.neighborhood_attention.op import check_window_args

    q, k, v, grad = local
    ndim = q.dim() - 3
    ranges = cp.rank_ranges(lengths, axis, *check_window_args(ndim, ks, dil, 1, False, "shifted"), "shifted")
    with torch.no_grad():
        times = {"exchange alone": timed(lambda: cp.extend((k, v), 2 + axis, rank, ranges, None))}
        k_ext, v_ext = (t.requires_grad_() for t in cp.extend((k, v), 2 + axis, rank, ranges, None))
    offset = [0] * ndim
    offset[axis] = ranges[rank][0] - ranges[rank][2]

    def fwd():
        return fusedops.neighborhood_attention(q, k_ext, v_ext, ks, dil, query_offset=offset)

    times["compute fwd"] = timed(fwd)
    times["compute fwd+bwd"] = timed(lambda: torch.autograd.grad(fwd(), (q, k_ext, v_ext), grad))
    return times


def _single(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")


def run_attn_res(rank, world, rows):
    """attn_res sequence-sharded (each rank 1/world of the tokens) against the whole batch on one GPU."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import fusedops

    mesh = init_device_mesh("cuda", (world,))
    n, b, s, d = 9, 2, 16384, 7168
    torch.manual_seed(0)
    values = torch.randn(n, b, s, d, device="cuda", dtype=torch.bfloat16)
    query, weight = torch.randn(d, device="cuda"), torch.ones(d, device="cuda")
    times = {}
    if rank == 0:
        leaves = [t.clone().requires_grad_() for t in (values, query, weight)]
        g = torch.randn(b, s, d, device="cuda", dtype=torch.bfloat16)
        times["one fwd"] = _single(lambda: fusedops.attn_res(*leaves))
        times["one fwd+bwd"] = _single(lambda: torch.autograd.grad(fusedops.attn_res(*leaves), leaves, g))
    dv = distribute_tensor(values, mesh, [Shard(2)]).requires_grad_()
    dq = distribute_tensor(query, mesh, [Replicate()]).requires_grad_()
    dw = distribute_tensor(weight, mesh, [Replicate()]).requires_grad_()
    dg = distribute_tensor(torch.randn(b, s, d, device="cuda", dtype=torch.bfloat16), mesh, [Shard(1)])
    times["cp fwd"] = timed(lambda: fusedops.attn_res(dv, dq, dw))
    times["cp fwd+bwd"] = timed(lambda: torch.autograd.grad(fusedops.attn_res(dv, dq, dw), [dv, dq, dw], dg))
    rows.append((f"attn_res N={n} {b}x{s} tokens D={d}, sequence-sharded", times))


def main() -> None:
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    rows: list = []
    try:
        run_na(rank, world, rows)
        run_attn_res(rank, world, rows)
    finally:
        if rank == 0:
            _report(rows, world)
        dist.destroy_process_group()


def _report(rows, world) -> None:
    print(f"\n{torch.cuda.get_device_name()} x {world}, bf16, ms (medians; all ranks: the slowest)")
    print("(parts: the interior's attention under the exchange, the edges after (context_parallel.OVERLAP); layout: "
          "the extended slabs in the layout the rule does not pick; compute: the ranks' op alone on halos exchanged "
          "beforehand, its efficiency the ceiling without the exchange)")
    print(f"{'case':<58} {'mode':<8} {'one GPU':>8} {'ranks':>8} {'speed-up':>8} {'efficiency':>10} "
          f"{'parts':>8} {'layout':>8} {'compute':>8} {'ceiling':>8} {'exchange':>8}")
    nan = float("nan")
    for name, t in rows:
        for mode in ("fwd", "fwd+bwd"):
            one, cp, alone = t.get(f"one {mode}", nan), t[f"cp {mode}"], t.get(f"compute {mode}", nan)
            print(f"{name:<58} {mode:<8} {one:8.3f} {cp:8.3f} {one / cp:8.2f} {one / cp / world:10.0%} "
                  f"{t.get(f'parts {mode}', nan):8.3f} {t.get(f'layout {mode}', nan):8.3f} {alone:8.3f} "
                  f"{one / alone / world:8.0%} {t.get('exchange alone', nan):8.3f}")


if __name__ == "__main__":
    main()
