"""Which property of fla-core's attn_res forward makes it faster than ours on the H200 at D not a power of two:
one program per token without a token loop (NO_LOOP) or a persistent grid, the load pipeline (num_stages),
evict_first loads, the multiple_of / max_contiguous hints, or D as a compile-time constant (CONST_D). A
stand-alone copy of the grouped depth-tile forward with each of those as a switch inside its loop (so it cannot
call the package's kernel), contiguous [N, tokens, D] bf16 values, CUDA-graph replays, % of the copy bandwidth
measured in the same run, fla timed beside (its autotuned config printed). Last run with torch 2.11 + Triton 3.6
on an H200, in two parts, each sweeping some of these switches (bench/results/h200-2026-11-27-attn-res-fwd-
variants.txt; bench/NOTES.md, attn_res run 12: D constant and no token loop together).

    python -m bench.experiments.attn_res_fwd_variants"""

import itertools

import torch
import triton
import triton.language as tl
import triton.testing

from fusedops.bench.common import measure_ceiling, optional_import

SHAPES = [(9, 32768, 3072), (8, 8192, 7168)]


@triton.jit
def _token(t, v_ptr, u, out_ptr, lse_ptr, N, D, STRIDE_N, eps, d, d_mask, EVICT: tl.constexpr, HINTS: tl.constexpr,
           BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    n = tl.arange(0, BLOCK_N)
    rows = v_ptr + (t * D)[:, None] + n.to(tl.int64)[:, None] * STRIDE_N + d[None, :]
    m = tl.full([1], float("-inf"), tl.float32)
    denom = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for n0 in range(0, N, BLOCK_N):
        g = n < N - n0
        if HINTS:
            rows = tl.multiple_of(rows, (1, 16))
        if EVICT:
            x = tl.load(rows, mask=g[:, None] & d_mask[None, :], other=0.0, eviction_policy="evict_first")
        else:
            x = tl.load(rows, mask=g[:, None] & d_mask[None, :], other=0.0)
        x = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
        s = tl.where(g, tl.sum(x * u[None, :], axis=1) * rstd, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        rescale = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        denom = denom * rescale + tl.sum(p, axis=0)
        acc = acc * rescale + tl.sum(p[:, None] * x, axis=0)
        m = m_new
        rows += BLOCK_N * STRIDE_N
    tl.store(out_ptr + (t * D)[:, None] + d[None, :], (acc / denom)[None, :].to(out_ptr.dtype.element_ty),
             mask=d_mask[None, :])
    tl.store(lse_ptr + t, m + tl.log(denom))


@triton.jit
def _fwd(v_ptr, q_ptr, out_ptr, lse_ptr, N, T, D_RT, STRIDE_N, eps, D_CT: tl.constexpr, CONST_D: tl.constexpr,
         PERSISTENT: tl.constexpr, EVICT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
         NO_LOOP: tl.constexpr = False, HINTS: tl.constexpr = False):
    D = D_CT if CONST_D else D_RT
    d = tl.arange(0, BLOCK_D)
    if HINTS:
        d = tl.max_contiguous(tl.multiple_of(d, BLOCK_D), BLOCK_D)
    d_mask = d < D
    u = tl.load(q_ptr + d, mask=d_mask, other=0.0)
    pid = tl.program_id(0)
    if NO_LOOP:
        _token(pid + tl.arange(0, 1).to(tl.int64), v_ptr, u, out_ptr, lse_ptr, N, D, STRIDE_N, eps, d, d_mask,
               EVICT, HINTS, BLOCK_N, BLOCK_D)
    else:
        step = tl.num_programs(0) if PERSISTENT else T
        for token in range(pid, T, step):
            _token(token + tl.arange(0, 1).to(tl.int64), v_ptr, u, out_ptr, lse_ptr, N, D, STRIDE_N, eps, d, d_mask,
                   EVICT, HINTS, BLOCK_N, BLOCK_D)


def main():
    dev = torch.device("cuda")
    ceiling = measure_ceiling(dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__,
          f"copy {ceiling:.2f} TB/s", flush=True)
    fla_mod = optional_import("fla.ops.attnres")
    summary = []
    for n, tokens, dim in SHAPES:
        v = torch.randn(n, tokens, dim, device=dev, dtype=torch.bfloat16)
        q = 0.05 * torch.randn(dim, device=dev)
        w = torch.ones(dim, device=dev)
        out = torch.empty(tokens, dim, device=dev, dtype=torch.bfloat16)
        lse = torch.empty(tokens, device=dev)
        nbytes = (n + 1) * tokens * dim * 2
        pct = lambda ms: 100 * nbytes / ms / 1e9 / ceiling  # noqa: E731
        fla = lambda: fla_mod.fused_attnres(q, list(v.unbind(0)), w, rms_eps=1e-6)  # noqa: E731
        fla()
        t_fla = triton.testing.do_bench_cudagraph(fla, return_mode="median")
        from fla.ops.attnres import fused as fla_fused
        cfg = getattr(fla_fused.attnres_fwd_kernel, "best_config", None)
        print(f"N{n} T{tokens} D{dim} fla {t_fla:.4f} ms {pct(t_fla):.1f}% config {cfg}", flush=True)
        ref = fla()
        ref = ref[0] if isinstance(ref, tuple) else ref
        results = []
        for rows, warps, stages, no_loop, hints, const_d, persistent, evict in itertools.product(
                (2, 4), (4, 8), (1, 3), (False, True), (False, True), (False, True), (False, True), (False, True)):
            if (persistent and no_loop) or (evict and not (no_loop and const_d)):
                continue  # a persistent grid needs the token loop; evict_first only on the fastest launch shape
            grid = (4 * sms,) if persistent else (tokens,)
            call = lambda: _fwd[grid](v, q, out, lse, n, tokens, dim, tokens * dim, 1e-6, D_CT=dim,  # noqa: E731
                                       CONST_D=const_d, PERSISTENT=persistent, EVICT=evict, BLOCK_N=rows,
                                       BLOCK_D=triton.next_power_of_2(dim), num_warps=warps, num_stages=stages,
                                       NO_LOOP=no_loop, HINTS=hints)
            call()
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            ms = triton.testing.do_bench_cudagraph(call, return_mode="median")
            label = (f"rows {rows} w{warps} s{stages}{' noloop' if no_loop else ''}{' hints' if hints else ''}"
                     f"{' constD' if const_d else ''}{' 4/SM' if persistent else ''}{' evict' if evict else ''}")
            print(f"  {label}: {ms:.4f} ms {pct(ms):.1f}% err {err:.1e}", flush=True)
            results.append((ms, label))
        results.sort()
        summary.append((f"N{n} T{tokens} D{dim}", t_fla, results[:3]))
        del v
        torch.cuda.empty_cache()
    print("\ncase | fla ms (%) | best three (ms, %)")
    for case, t_fla, best in summary:
        print(f"{case} | {t_fla:.4f} | " + "; ".join(f"{label} {ms:.4f}" for ms, label in best))


if __name__ == "__main__":
    main()
