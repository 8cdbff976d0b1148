"""Host overhead vs GPU time of one step of each op (CUDA): python -m fusedops.bench.host

For a small case of each op (where the host, not the GPU, bounds the step) it prints the wall time
per call of the public wrapper (the direct eager path), of the same call through torch.ops, and of a
torch.compile'd call, next to the GPU time the profiler sees; then the cost of one bare Triton launch
of each neighborhood-attention kernel, and a cProfile of the wrapper's fwd+bwd step. First, how the
L2 flush between timed calls moves a short kernel's time (HOST_L2_ONLY=1: only that). HOST_PROFILE=name:
only the cProfile of that case's step (e.g. "attn_res N4").
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import time

import torch

import fusedops
from fusedops.bench.common import gpu_time_ms


def wall_ms(fn, reps: int = 200) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / reps * 1e3)
    return best


def host_ms(fn, reps: int = 20) -> float:
    """Host time per call: calls issued back to back without a sync, few enough that the launch queue
    never fills, so none of them waits for the GPU."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    elapsed = (time.perf_counter() - t) / reps * 1e3
    torch.cuda.synchronize()
    return elapsed


def cases():
    dev, bf16 = "cuda", torch.bfloat16
    q, k, v = (torch.randn(2, 12, 4096, 64, device=dev, dtype=bf16, requires_grad=True) for _ in range(3))
    yield ("neighborhood_attention 1D 4096 k7", (q, k, v),
           lambda q, k, v: fusedops.neighborhood_attention(q, k, v, 7),
           lambda q, k, v: torch.ops.fusedops.neighborhood_attention(q, k, v, [7], [1], [1], [False], None,
                                                                       "shifted")[0])
    q2, k2, v2 = (torch.randn(1, 16, 64, 64, 64, device=dev, dtype=bf16, requires_grad=True) for _ in range(3))
    yield ("neighborhood_attention 2D 64x64 7x7", (q2, k2, v2),
           lambda q, k, v: fusedops.neighborhood_attention(q, k, v, 7),
           lambda q, k, v: torch.ops.fusedops.neighborhood_attention(q, k, v, [7, 7], [1, 1], [1, 1],
                                                                       [False, False], None, "shifted")[0])
    for n, b, t, d in ((8, 4, 1024, 1024), (4, 2, 4096, 4096)):
        values = torch.randn(n, b, t, d, device=dev, dtype=bf16, requires_grad=True)
        query = torch.zeros(d, device=dev, requires_grad=True)
        weight = torch.ones(d, device=dev, requires_grad=True)
        yield (f"attn_res N{n} {b}x{t} D{d}", (values, query, weight),
               lambda v, q, w: fusedops.attn_res(v, q, w),
               lambda v, q, w: torch.ops.fusedops.attn_res(v, q, w, 1e-6))
    emb = torch.randn(32768, 768, device=dev, dtype=bf16, requires_grad=True)
    idx = torch.randint(0, 32768, (4, 1024), device=dev)
    yield ("embedding V32768 D768 4096 tokens", (emb, idx),
           lambda w, i: fusedops.embedding(i, w),
           lambda w, i: torch.ops.fusedops.embedding(w, i, None, False))


def step_of(fn, inputs):
    req = [t for t in inputs if t.is_floating_point() and t.requires_grad]
    out = fn(*inputs)
    go = torch.randn_like(out)
    return lambda: torch.autograd.grad(fn(*inputs), req, go)


def launch_costs():
    from fusedops.internals import set_wrap_triton_enabled

    from fusedops.launch import launch
    from fusedops.neighborhood_attention import op as na
    from fusedops.neighborhood_attention.kernels import na_fwd_kernel
    from fusedops.targets import target_for

    q, k, v = (torch.randn(2, 12, 4096, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    target = target_for(q.device, q.dtype)
    out, lse = na._forward(q, k, v, [7], [1], [1], [False], 0.125, "shifted", [0], target)
    grid, args, meta = na._forward_spec(q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype,
                                        (7,), (1,), (1,), (False,), 0.125, "shifted", (0,), target, (), False)
    tensors = dict(q_ptr=q, k_ptr=k, v_ptr=v, o_ptr=out, lse_ptr=lse)
    n = len(tensors) + len(args)
    t = wall_ms(lambda: na_fwd_kernel[(grid,)](**tensors, **args, **meta), reps=500)
    print(f"bare Triton launch of na_fwd_kernel ({n} runtime args): {t * 1e3:.1f} us")
    with set_wrap_triton_enabled(False):
        t = wall_ms(lambda: launch(na_fwd_kernel, (grid,), dict(tensors, **args), meta), reps=500)
    print(f"fusedops.launch of na_fwd_kernel (cached compiled kernel): {t * 1e3:.1f} us")
    t = wall_ms(lambda: torch.empty(1, device="cuda").add_(1), reps=500)
    print(f"torch empty + add_ (two tiny eager ops, reference): {t * 1e3:.1f} us")


def embedding_backward_pieces(v: int = 151936, d: int = 4096, tokens: int = 16384) -> None:
    """GPU time of each piece of the embedding backward, and of the alternatives for the run offsets."""
    from fusedops.embedding import op as emb
    from fusedops.targets import target_for

    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, v, (tokens,), generator=gen).cuda()
    g = torch.randn(tokens, d, generator=gen).to("cuda", torch.bfloat16)
    keys32 = idx.to(torch.int32)
    sorted_keys = torch.sort(idx)[0]
    bounds = torch.arange(v + 1, device="cuda")
    ones = torch.ones(tokens, dtype=torch.int64, device="cuda")
    target = target_for(idx.device)
    pieces = {
        "sort int64": lambda: torch.sort(idx, stable=True),
        "sort int32": lambda: torch.sort(keys32, stable=True),
        "clamp+int32 cast": lambda: idx.clamp(-1, v).to(torch.int32),
        "searchsorted": lambda: torch.searchsorted(sorted_keys, bounds),
        "arange(V+1)": lambda: torch.arange(v + 1, device="cuda"),
        "scatter_add histogram + cumsum": lambda: torch.zeros(v + 2, dtype=torch.int64, device="cuda")
        .scatter_add_(0, idx + 1, ones).cumsum(0),
        "backward op (all)": lambda: emb._backward(g, idx, v, -1, False, target),
    }
    from fusedops.internals import set_wrap_triton_enabled

    with set_wrap_triton_enabled(False):
        for name, fn in pieces.items():
            print(f"embedding bwd piece V{v} D{d} T{tokens} {name:32s} GPU {gpu_time_ms(fn) * 1e3:8.1f} us", flush=True)


def l2_flush_effect(n: int = 4, b: int = 2, t: int = 4096, d: int = 4096, reps: int = 50) -> None:
    """The attn_res forward timed like do_bench (CUDA events around each call, a 256 MB buffer touched
    between calls to flush L2) with three flushes: do_bench's memset, a read-only pass over the same
    bytes, and none. A memset leaves the L2 full of dirty lines the timed kernel's reads must evict
    (write back); a read leaves clean lines. TB/s count the forward's (N + 1) x tokens x D x 2 bytes."""
    import triton.testing

    values = torch.randn(n, b, t, d, device="cuda", dtype=torch.bfloat16)
    query, weight = torch.randn(d, device="cuda") * 0.05, torch.ones(d, device="cuda")
    fwd = lambda: fusedops.attn_res(values, query, weight)  # noqa: E731
    cache = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    nbytes = (n + 1) * b * t * d * 2
    for name, flush in (("memset (do_bench)", cache.zero_), ("read-only", lambda: cache.sum(dtype=torch.int32)),
                        ("none", lambda: None)):
        fwd()
        times = []
        for _ in range(reps):
            flush()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fwd()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        ms = sorted(times)[reps // 2]
        print(f"attn_res fwd N{n} {b}x{t} D{d}, flush {name:18s}: {ms:.4f} ms {nbytes / ms / 1e9:.2f} TB/s", flush=True)
    ms = triton.testing.do_bench(fwd, return_mode="median")
    print(f"attn_res fwd N{n} {b}x{t} D{d}, triton.testing.do_bench : {ms:.4f} ms {nbytes / ms / 1e9:.2f} TB/s")


def profile_step(name_part: str) -> None:
    """cProfile of 200 wrapper fwd+bwd steps of the first case whose name holds name_part."""
    name, inputs, wrapper, _ = next(c for c in cases() if name_part in c[0])
    step = step_of(wrapper, inputs)
    print(f"{name}: wall {wall_ms(step):.3f} ms, GPU {gpu_time_ms(step):.3f} ms, host {host_ms(step):.3f} ms")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        step()
    torch.cuda.synchronize()
    prof.disable()
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(25)
        print(s.getvalue())


def main() -> None:
    if os.environ.get("HOST_L2_ONLY") == "1":
        l2_flush_effect()
        return
    if os.environ.get("HOST_PROFILE"):  # e.g. HOST_PROFILE="attn_res N4": that case's profile alone
        profile_step(os.environ["HOST_PROFILE"])
        return
    l2_flush_effect()
    print(f"{'case':38s} {'path':10s} {'wall ms':>8s} {'GPU ms':>8s} {'host ms':>8s}")
    for name, inputs, wrapper, via_ops in cases():
        compiled = torch.compile(wrapper, fullgraph=True)
        for path, fn in (("wrapper", wrapper), ("torch.ops", via_ops), ("compiled", compiled)):
            try:
                step = step_of(fn, inputs)
                print(f"{name:38s} {path + ' fb':10s} {wall_ms(step):8.3f} {gpu_time_ms(step):8.3f} "
                      f"{host_ms(step):8.3f}", flush=True)
                if path == "wrapper":
                    def fwd(fn=fn):
                        with torch.no_grad():
                            return fn(*inputs)
                    print(f"{name:38s} {'wrapper f':10s} {wall_ms(fwd):8.3f} {gpu_time_ms(fwd):8.3f} "
                          f"{host_ms(fwd):8.3f}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"{name:38s} {path:10s} error: {type(e).__name__}: {str(e)[:200]}", flush=True)
        torch._dynamo.reset()
    launch_costs()
    embedding_backward_pieces()
    profile_step(next(cases())[0])


if __name__ == "__main__":
    main()
