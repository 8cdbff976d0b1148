"""attn_res_multi's backward gradients pass (issue 37) on CUDA cores against the tensor-core kernel it would replace.

The gradients pass contracts only over the small axes (M queries, N sources); D is free. So each program can own a
feature tile and walk its tokens with rank-1 updates in fp32 FMAs, no cross-thread reduction and no tensor-core
padding (N to 16, M to 32, and the bf16 split's 3 products):
    dv_i = sum_l alpha_{l,i} g_l + sum_l coef_{l,i} q_l - ck_i v_i      (l in chunks of CHUNK_M rows, unrolled)
    dq_l += sum_i coef_{l,i} v_i                                         (per token, over its N rows)
The statistics pass runs once as planned; each gradients variant is timed alone as a CUDA-graph replay and checked
against the planned (tensor-core) kernel's dv and dq, beside the flat tensor-core kernel
(attn_res_multi_bwd_grads_flat_kernel, forced rows a step, tiles, warps, stages). % of copy over (N + M) U read + N U
written. Last run with torch 2.11 + Triton 3.6 on an H200 (bench/NOTES.md, Block AttnRes run 4: FMA kernel NOT kept).

    python -m bench.experiments.multi_backward_fma"""

import os

import torch
import triton
import triton.language as tl
import triton.testing

from bench.experiments.multi_backward_tiles import setup

from fusedops.attn_res.kernels import _token_rows
from fusedops.block_attn_res.kernels import attn_res_multi_bwd_grads_flat_kernel as grads_flat_kernel
from fusedops.block_attn_res.kernels import attn_res_multi_bwd_grads_kernel, attn_res_multi_bwd_stats_kernel
from fusedops.block_attn_res.op import _multi_backward
from fusedops.block_attn_res.plan import multi_plan
from fusedops.launch import launch


@triton.jit
def grads_fma_kernel(
    v_ptr, q_ptr, g_ptr, alpha_ptr, coef_ptr, ck_ptr, dv_ptr, partial_ptr,
    N, M, T, D, S1, S2, ST0, ST1, ST2, STRIDE_N, QS, OUT_STEP, DV_STEP, TOKENS_PER_PROGRAM,
    HAS_G: tl.constexpr, NEED_DV: tl.constexpr, NEED_DQ: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK_M: tl.constexpr,
):
    d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = d < D
    n = tl.arange(0, BLOCK_N)
    n_mask = n < N
    m = tl.arange(0, BLOCK_M)
    m_mask = m < M
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    out_step = tl.cast(OUT_STEP, tl.int64)
    t_begin = tl.program_id(1).to(tl.int64) * TOKENS_PER_PROGRAM
    t_end = tl.minimum(t_begin + TOKENS_PER_PROGRAM, T)
    for t in range(t_begin, t_end):
        rows = _token_rows(t, S1, S2, ST0, ST1, ST2) + n.to(tl.int64) * STRIDE_N
        x = tl.load(v_ptr + rows[:, None] + d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        x = x.to(tl.float32)
        w = (t * M) * N
        if NEED_DV:
            dv = -tl.load(ck_ptr + t * N + n, mask=n_mask, other=0.0)[:, None] * x
            for l0 in range(0, M, CHUNK_M):
                for j in tl.static_range(CHUNK_M):
                    ok = l0 + j < M
                    # [BLOCK_N, 1] and [1, BLOCK_D] operands: in dv's layout, so the rank-1 update needs no shuffle
                    c = tl.load(coef_ptr + w + (l0 + j) * N + n[:, None], mask=n_mask[:, None] & ok, other=0.0)
                    q = tl.load(q_ptr + (l0 + j) * QS + d[None, :], mask=d_mask[None, :] & ok, other=0.0)
                    dv += c * q.to(tl.float32)
                    if HAS_G:
                        a = tl.load(alpha_ptr + w + (l0 + j) * N + n[:, None], mask=n_mask[:, None] & ok, other=0.0)
                        g = tl.load(g_ptr + (l0 + j) * out_step + t * D + d[None, :], mask=d_mask[None, :] & ok,
                                    other=0.0)
                        dv += a * g.to(tl.float32)
            tl.store(dv_ptr + n.to(tl.int64)[:, None] * DV_STEP + t * D + d[None, :], dv.to(dv_ptr.dtype.element_ty),
                     mask=n_mask[:, None] & d_mask[None, :])
        if NEED_DQ:
            for i in range(0, N):
                row = _token_rows(t, S1, S2, ST0, ST1, ST2) + i * STRIDE_N
                xi = tl.load(v_ptr + row + d[None, :], mask=d_mask[None, :], other=0.0).to(tl.float32)
                c = tl.load(coef_ptr + w + m[:, None] * N + i, mask=m_mask[:, None], other=0.0)
                dq += c * xi
    if NEED_DQ:
        tl.store(partial_ptr + tl.program_id(1).to(tl.int64) * M * D + m[:, None] * D + d[None, :], dq,
                 mask=m_mask[:, None] & d_mask[None, :])


CASES = [(8, 24, 8192, 7168), (9, 6, 8192, 4096), (4, 16, 32768, 4096), (9, 16, 8192, 7168), (8, 24, 2048, 7168)]
CONFIGS = [dict(block_d=bd, warps=4, chunk=4, per_core=16) for bd in (64, 256)]
# (rows a step, features, warps, stages, programs a core)
FLAT = [(32, 64, 8, 3, 8), (32, 64, 8, 2, 8), (32, 128, 8, 3, 8), (64, 64, 8, 3, 8), (32, 64, 4, 3, 8),
        (32, 64, 8, 3, 4), (64, 128, 8, 2, 4), (16, 64, 4, 3, 8), (16, 64, 8, 3, 8), (32, 32, 4, 3, 8)]


def main():
    dev, target, ceiling, cases = setup("FMA_CASES", CASES)
    configs = CONFIGS
    if os.environ.get("FMA_CONFIGS"):
        configs = [dict(zip(("block_d", "warps", "chunk", "per_core"), (int(x) for x in c.split(","))))
                   for c in os.environ["FMA_CONFIGS"].split(";")]
    summary = []
    for n, m, tokens, dim in cases:
        values = torch.randn(n, tokens, dim, device=dev, dtype=torch.bfloat16)
        queries = 0.05 * torch.randn(m, dim, device=dev)
        grad_out = torch.randn(m, tokens, dim, device=dev, dtype=torch.bfloat16)
        case = f"N{n} M{m} T{tokens} D{dim}"
        nbytes = (2 * n + m) * tokens * dim * 2
        plan = multi_plan(target, tokens, n, m, dim, 2, backward=True)
        walk = dict(N=n, M=m, T=tokens, D=dim, S1=1, S2=1, ST0=dim, ST1=0, ST2=0, STRIDE_N=tokens * dim, QS=dim,
                    OUT_STEP=tokens * dim)
        alpha, coef = (torch.empty(tokens, m, n, device=dev) for _ in range(2))
        ck = torch.empty(tokens, n, device=dev)
        launch(attn_res_multi_bwd_stats_kernel, (-(-tokens // plan.block_t),),
               dict(v_ptr=values, q_ptr=queries, g_ptr=grad_out, glse_ptr=ck, alpha_ptr=alpha, coef_ptr=coef,
                    ck_ptr=ck, **walk, eps=1e-6),
               dict(HAS_G=True, HAS_DLSE=False, BLOCK_T=plan.block_t, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
                    BLOCK_D=plan.block_d, HALF=True, num_warps=plan.num_warps, BF16=True))
        flags = dict(HAS_G=True, NEED_DV=True, NEED_DQ=True)

        def planned():
            step = plan.grad_tokens or plan.block_t
            per = -(-(-(-tokens // plan.grid)) // step) * step
            programs = -(-tokens // per)
            dv = torch.empty_like(values)
            partial = torch.empty(programs, m, dim, device=dev)
            stages = {"num_stages": plan.grad_stages} if plan.grad_stages else {}
            launch(attn_res_multi_bwd_grads_kernel, (-(-dim // plan.block_d2), programs),
                   dict(v_ptr=values, q_ptr=queries, g_ptr=grad_out, alpha_ptr=alpha, coef_ptr=coef, ck_ptr=ck,
                        dv_ptr=dv, partial_ptr=partial, **walk, DV_STEP=tokens * dim, TOKENS_PER_PROGRAM=per),
                   dict(flags, BLOCK_T=step, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_D=plan.block_d2,
                        num_warps=plan.out_warps, BF16=True, **stages))
            return dv, partial.sum(0)

        def fma(cfg):
            tiles = -(-dim // cfg["block_d"])
            programs = max(1, min(tokens, target.vector_cores * cfg["per_core"] // tiles))
            per = -(-tokens // programs)
            programs = -(-tokens // per)
            dv = torch.empty_like(values)
            partial = torch.empty(programs, m, dim, device=dev)
            launch(grads_fma_kernel, (tiles, programs),
                   dict(v_ptr=values, q_ptr=queries, g_ptr=grad_out, alpha_ptr=alpha, coef_ptr=coef, ck_ptr=ck,
                        dv_ptr=dv, partial_ptr=partial, **walk, DV_STEP=tokens * dim, TOKENS_PER_PROGRAM=per),
                   dict(flags, BLOCK_M=triton.next_power_of_2(m), BLOCK_N=triton.next_power_of_2(n),
                        BLOCK_D=cfg["block_d"], CHUNK_M=cfg["chunk"], num_warps=cfg["warps"]))
            return dv, partial.sum(0)

        def flat(cfg):
            rows, block_d, warps, stages, per_core = cfg
            step = max(1, rows // n)
            tiles = -(-dim // block_d)
            programs = max(1, min(-(-tokens // step), target.vector_cores * per_core // tiles))
            per = -(-(-(-tokens // programs)) // step) * step
            programs = -(-tokens // per)
            dv = torch.empty_like(values)
            partial = torch.empty(programs, m, dim, device=dev)
            launch(grads_flat_kernel, (tiles, programs),
                   dict(v_ptr=values, q_ptr=queries, g_ptr=grad_out, alpha_ptr=alpha, coef_ptr=coef, ck_ptr=ck,
                        dv_ptr=dv, partial_ptr=partial, **walk, DV_STEP=tokens * dim, TOKENS_PER_PROGRAM=per,
                        STEP=step),
                   dict(flags, BLOCK_R=rows, BLOCK_K=max(16, triton.next_power_of_2(step * m)),
                        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_D=block_d, BF16=True, num_warps=warps,
                        num_stages=stages))
            return dv, partial.sum(0)

        whole = triton.testing.do_bench_cudagraph(
            lambda: _multi_backward(grad_out, None, values, queries, 1e-6, True, True, target), return_mode="median")
        print(f"{case} whole backward as planned ({plan}): {whole:.3f} ms", flush=True)
        ref_dv, ref_dq = planned()
        ms = triton.testing.do_bench_cudagraph(planned, return_mode="median")
        print(f"{case} tensor-core planned: {ms:.3f} ms ({100 * nbytes / ms / 1e9 / ceiling:.1f}% of copy)", flush=True)
        def sweep(label, run, cfgs):
            """The fastest of run(cfg) over cfgs, each checked against the planned kernel's gradients."""
            best = (float("inf"), None)
            for cfg in cfgs:
                try:
                    dv, dq = run(cfg)
                    err_dv = ((dv.float() - ref_dv.float()).norm() / ref_dv.float().norm()).item()
                    err_dq = ((dq - ref_dq).norm() / ref_dq.norm()).item()
                    t = triton.testing.do_bench_cudagraph(lambda cfg=cfg: run(cfg), return_mode="median")
                except Exception as e:  # noqa: BLE001 - reported, not fatal
                    print(f"{case} {label} {cfg}: {type(e).__name__} {str(e)[:160]}", flush=True)
                    continue
                print(f"{case} {label} {cfg}: {t:.3f} ms ({100 * nbytes / t / 1e9 / ceiling:.1f}%), dv rel diff "
                      f"{err_dv:.1e}, dq {err_dq:.1e}", flush=True)
                best = min(best, (t, str(cfg)))
            return best

        best, best_flat = sweep("fma", fma, configs), sweep("flat", flat, FLAT)
        summary.append((case, ms, best, best_flat))
        del values, grad_out, alpha, coef
        torch.cuda.empty_cache()
    print("\ncase | gradients pass: tensor-core planned ms | best FMA ms (config) | best flat ms (rows, tile, warps, "
          "stages, per core)")
    for case, ms, (t, cfg), (tf, cfg_f) in summary:
        print(f"{case} | {ms:.3f} | {t:.3f} {cfg} {ms / t:.2f}x | {tf:.3f} {cfg_f} {ms / tf:.2f}x")


if __name__ == "__main__":
    main()
