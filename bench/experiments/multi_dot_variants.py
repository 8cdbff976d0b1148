"""Where attn_res_multi's tensor-core forward spends its time (issue 37), H100/H200: a copy of
attn_res_multi_fwd_dot_kernel with switches, timed on two cases (token-major bank, bf16):
  QNAT   the query tile loaded [BLOCK_M, BLOCK_D] (contiguous along D) and transposed in registers,
         instead of loaded as [BLOCK_D, BLOCK_M];
  PREC   the dots' input precision: tf32x3, or bf16x3 / bf16x2 (the fp32 operand split into three / two bf16
         parts by hand, the bf16 rows used as they are);
  BLOCK_D2  pass 2's feature tile;
  PASS1 / PASS2  skip a pass (the timings of what is left; results then wrong).
Last run with torch 2.11 + Triton 3.6 on an H200.  python -m bench.experiments.multi_dot_variants"""

import itertools

import torch
import triton
import triton.language as tl
import triton.testing

from fusedops.attn_res.kernels import _finite_or_zero, _token_rows


@triton.jit
def multi_variant_kernel(
    v_ptr, q_ptr, out_ptr, lse_ptr, N, M, T, D, STRIDE_T, STRIDE_N, QS, OUT_STEP, eps,
    BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_D2: tl.constexpr, QNAT: tl.constexpr, PREC: tl.constexpr, PASS1: tl.constexpr, PASS2: tl.constexpr,
):
    pid = tl.program_id(0)
    r = tl.arange(0, BLOCK_T * BLOCK_N)
    i_r = r % BLOCK_N
    m = tl.arange(0, BLOCK_M)
    m_mask = m < M
    n = tl.arange(0, BLOCK_N)
    n_mask = n < N
    bt = tl.arange(0, BLOCK_T)
    for block in range(pid, tl.cdiv(T, BLOCK_T), tl.num_programs(0)):
        t0 = tl.cast(block, tl.int64) * BLOCK_T
        t_r = t0 + r // BLOCK_N
        r_mask = (i_r < N) & (t_r < T)
        rows = _token_rows(t_r, 1, 1, STRIDE_T, 0, 0) + i_r * STRIDE_N
        sq = tl.zeros([BLOCK_T * BLOCK_N], tl.float32)
        dot = tl.zeros([BLOCK_T * BLOCK_N, BLOCK_M], tl.float32)
        if PASS1:
            for d0 in range(0, D, BLOCK_D):
                d = d0 + tl.arange(0, BLOCK_D)
                d_mask = d < D
                x = tl.load(v_ptr + rows[:, None] + d[None, :], mask=r_mask[:, None] & d_mask[None, :],
                            other=0.0).to(tl.float32)
                if QNAT:
                    q = tl.trans(tl.load(q_ptr + m[:, None] * QS + d[None, :], mask=m_mask[:, None] & d_mask[None, :],
                                         other=0.0).to(tl.float32))
                else:
                    q = tl.load(q_ptr + m[None, :] * QS + d[:, None], mask=d_mask[:, None] & m_mask[None, :],
                                other=0.0).to(tl.float32)
                sq += tl.sum(x * x, axis=1)
                if PREC == "bf16x3" or PREC == "bf16x2":
                    xb = x.to(tl.bfloat16)
                    q_hi = q.to(tl.bfloat16)
                    rest = q - q_hi.to(tl.float32)
                    q_mid = rest.to(tl.bfloat16)
                    if PREC == "bf16x3":
                        dot = tl.dot(xb, (rest - q_mid.to(tl.float32)).to(tl.bfloat16), dot)
                    dot = tl.dot(xb, q_mid, dot)
                    dot = tl.dot(xb, q_hi, dot)
                else:
                    dot = tl.dot(x, q, dot, input_precision=PREC)
        rstd = tl.rsqrt(sq / D + eps)
        logits = tl.reshape(dot * rstd[:, None], (BLOCK_T, BLOCK_N, BLOCK_M))
        s = tl.where(n_mask[None, :, None], logits, float("-inf"))
        mx = tl.max(s, axis=1)
        p = tl.exp(s - _finite_or_zero(mx)[:, None, :])
        denom = tl.sum(p, axis=1)
        alpha = tl.permute(p / denom[:, None, :], (0, 2, 1))
        t = t0 + bt
        tm_mask = (t < T)[:, None] & m_mask[None, :]
        tl.store(lse_ptr + m[None, :] * T + t[:, None], mx + tl.log(denom), mask=tm_mask)
        if PASS2:
            rows3 = tl.reshape(rows, (BLOCK_T, BLOCK_N))
            rows_mask3 = tl.reshape(r_mask, (BLOCK_T, BLOCK_N))
            out_rows = m[None, :, None].to(tl.int64) * OUT_STEP + t[:, None, None] * D
            if PREC == "bf16x3" or PREC == "bf16x2":
                a_hi = alpha.to(tl.bfloat16)
                a_rest = alpha - a_hi.to(tl.float32)
                a_mid = a_rest.to(tl.bfloat16)
                a_lo = (a_rest - a_mid.to(tl.float32)).to(tl.bfloat16)
            for d0 in range(0, D, BLOCK_D2):
                d = d0 + tl.arange(0, BLOCK_D2)
                d_mask = d < D
                x = tl.load(v_ptr + rows3[:, :, None] + d[None, None, :],
                            mask=rows_mask3[:, :, None] & d_mask[None, None, :], other=0.0)
                if PREC == "bf16x3" or PREC == "bf16x2":
                    o = tl.dot(a_mid, x)
                    if PREC == "bf16x3":
                        o = tl.dot(a_lo, x, o)
                    o = tl.dot(a_hi, x, o)
                else:
                    o = tl.dot(alpha, x.to(tl.float32), input_precision=PREC)
                tl.store(out_ptr + out_rows + d[None, None, :], o.to(out_ptr.dtype.element_ty),
                         mask=tm_mask[:, :, None] & d_mask[None, None, :])


def main():
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    for n, mq, tokens, dim in ((8, 24, 8192, 7168), (9, 6, 8192, 4096), (9, 24, 512, 7168)):
        bank = torch.randn(tokens, n + 2, dim, device=dev, dtype=torch.bfloat16)
        q = 0.05 * torch.randn(mq, dim, device=dev)
        out = torch.empty(mq, tokens, dim, device=dev, dtype=torch.bfloat16)
        lse = torch.empty(mq, tokens, device=dev)
        bm, bn = max(16, triton.next_power_of_2(mq)), max(16, triton.next_power_of_2(n))
        print(f"case N={n} M={mq} tokens={tokens} D={dim}")
        rows = []
        ref = None
        for bt, bd, bd2, prec, passes, warps in itertools.product(
                (4, 8), (64, 128), (64, 128), ("tf32x3", "bf16x3", "bf16x2"), ((1, 1), (1, 0), (0, 1)),
                (4, 8)):
            qnat = True
            if passes != (1, 1) and (bd, bd2) != (64, 64):
                continue
            if warps == 8 and (bt, bd, bd2, passes) != (4, 128, 64, (1, 1)):
                continue
            grid = (min(-(-tokens // bt), 132 * 4),)

            def run():
                multi_variant_kernel[grid](bank, q, out, lse, n, mq, tokens, dim, bank.stride(0), bank.stride(1),
                                           q.stride(0), tokens * dim, 1e-6, BLOCK_T=bt, BLOCK_M=bm, BLOCK_N=bn,
                                           BLOCK_D=bd, BLOCK_D2=bd2, QNAT=qnat, PREC=prec, PASS1=passes[0],
                                           PASS2=passes[1],
                                           num_warps=warps)
            try:
                run()
                err = float("nan")
                if passes == (1, 1):
                    if ref is None:
                        ref = out.float().clone()
                    err = (out.float() - ref).abs().max().item()
                rows.append((triton.testing.do_bench(run, warmup=3, rep=20),
                             f"bt{bt} bd{bd} bd2 {bd2} {prec} passes{passes} w{warps} max|diff| {err:.3g}"))
            except Exception as e:  # noqa: BLE001
                print("  failed", bt, bd, qnat, prec, passes, warps, type(e).__name__, str(e)[:100])
        for ms, name in sorted(rows):
            print(f"  {ms:8.4f} ms  {name}", flush=True)


if __name__ == "__main__":
    main()
