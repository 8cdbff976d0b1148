"""attn_res_multi's tensor-core forward with its output pass in other forms (issue 37), H100/H200: pass 2 took
2.2-2.4 of 2.86 ms at N=8, M=24, 8192 tokens, D=7168 (Block AttnRes run 1). A copy of
attn_res_multi_fwd_dot_kernel (bf16 rows, the 2+2 bfloat16 split) with switches:
  FORM   "3d": the package's pass 2, one [BLOCK_M, BLOCK_N] x [BLOCK_N, BLOCK_D2] dot per token (batched), BLOCK_N
         >= 16 source slots; "diag": one 2-D dot for the token block, [BLOCK_T * BLOCK_M, BLOCK_T * BLOCK_N] x
         [BLOCK_T * BLOCK_N, BLOCK_D2] with alpha block-diagonal, so BLOCK_N = next_pow2(N) (8 at N = 8) and
         the output tile is one [rows, BLOCK_D2] matrix (wgmma-sized at 128 rows);
  DIM    D as a compile-time constant (0: runtime);
  grid   a persistent grid of k programs per SM, or one token block per program.
Prints per case each variant's time and % of copy ((N + M) U + lse), best first, with its max |diff| against
the package's op.  Last run with torch 2.11 + Triton 3.6.  python -m bench.experiments.multi_output_pass"""

import itertools

import torch
import triton
import triton.language as tl
import triton.testing

from fusedops.attn_res.kernels import _finite_or_zero, _token_rows
from fusedops.bench.common import measure_ceiling
from fusedops.block_attn_res.kernels import _split_dot


@triton.jit
def _dot(a, b, acc, SPLIT_A: tl.constexpr, EXACT: tl.constexpr):
    if EXACT:  # the interpreter's check (its bfloat16 tl.dot is wrong)
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return _split_dot(a, b, acc, SPLIT_A)


@triton.jit
def multi_output_variant_kernel(
    v_ptr, q_ptr, out_ptr, lse_ptr, N, M, T, D, STRIDE_T, STRIDE_N, QS, OUT_STEP, eps,
    BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_D2: tl.constexpr, FORM: tl.constexpr, DIM: tl.constexpr, PERSISTENT: tl.constexpr,
    EXACT: tl.constexpr = False,
):
    if DIM > 0:
        D = DIM
    pid = tl.program_id(0)
    r = tl.arange(0, BLOCK_T * BLOCK_N)
    i_r = r % BLOCK_N
    m = tl.arange(0, BLOCK_M)
    m_mask = m < M
    n = tl.arange(0, BLOCK_N)
    n_mask = n < N
    bt = tl.arange(0, BLOCK_T)
    step = tl.num_programs(0) if PERSISTENT else tl.cdiv(T, BLOCK_T)
    for block in range(pid, tl.cdiv(T, BLOCK_T), step):
        t0 = tl.cast(block, tl.int64) * BLOCK_T
        t_r = t0 + r // BLOCK_N
        r_mask = (i_r < N) & (t_r < T)
        rows = _token_rows(t_r, 1, 1, STRIDE_T, 0, 0) + i_r * STRIDE_N
        sq = tl.zeros([BLOCK_T * BLOCK_N], tl.float32)
        dot = tl.zeros([BLOCK_T * BLOCK_N, BLOCK_M], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            d_mask = d < D
            x = tl.load(v_ptr + rows[:, None] + d[None, :], mask=r_mask[:, None] & d_mask[None, :], other=0.0)
            q = tl.load(q_ptr + m[:, None] * QS + d[None, :], mask=m_mask[:, None] & d_mask[None, :], other=0.0)
            xf = x.to(tl.float32)
            sq += tl.sum(xf * xf, axis=1)
            dot = _dot(x, tl.trans(q), dot, False, EXACT)
        rstd = tl.rsqrt(sq / D + eps)
        logits = tl.reshape(dot * rstd[:, None], (BLOCK_T, BLOCK_N, BLOCK_M))
        s = tl.where(n_mask[None, :, None], logits, float("-inf"))
        mx = tl.max(s, axis=1)
        p = tl.exp(s - _finite_or_zero(mx)[:, None, :])
        denom = tl.sum(p, axis=1)
        alpha = tl.permute(p / denom[:, None, :], (0, 2, 1))  # [BLOCK_T, BLOCK_M, BLOCK_N]
        t = t0 + bt
        tm_mask = (t < T)[:, None] & m_mask[None, :]
        tl.store(lse_ptr + m[None, :] * T + t[:, None], mx + tl.log(denom), mask=tm_mask)
        if FORM == "3d":
            rows3 = tl.reshape(rows, (BLOCK_T, BLOCK_N))
            rows_mask3 = tl.reshape(r_mask, (BLOCK_T, BLOCK_N))
            out_rows = m[None, :, None].to(tl.int64) * OUT_STEP + t[:, None, None] * D
            for d0 in range(0, D, BLOCK_D2):
                d = d0 + tl.arange(0, BLOCK_D2)
                d_mask = d < D
                x = tl.load(v_ptr + rows3[:, :, None] + d[None, None, :],
                            mask=rows_mask3[:, :, None] & d_mask[None, None, :], other=0.0)
                o = _dot(alpha, x, tl.zeros([BLOCK_T, BLOCK_M, BLOCK_D2], tl.float32), True, EXACT)
                tl.store(out_ptr + out_rows + d[None, None, :], o.to(out_ptr.dtype.element_ty),
                         mask=tm_mask[:, :, None] & d_mask[None, None, :])
        else:
            same = bt[:, None, None, None] == bt[None, None, :, None]
            big = tl.reshape(tl.where(same, alpha[:, :, None, :], 0.0), (BLOCK_T * BLOCK_M, BLOCK_T * BLOCK_N))
            o_rows = tl.reshape(m[None, :].to(tl.int64) * OUT_STEP + t[:, None] * D, (BLOCK_T * BLOCK_M,))
            o_mask = tl.reshape(tm_mask, (BLOCK_T * BLOCK_M,))
            for d0 in range(0, D, BLOCK_D2):
                d = d0 + tl.arange(0, BLOCK_D2)
                d_mask = d < D
                x = tl.load(v_ptr + rows[:, None] + d[None, :], mask=r_mask[:, None] & d_mask[None, :], other=0.0)
                o = _dot(big, x, tl.zeros([BLOCK_T * BLOCK_M, BLOCK_D2], tl.float32), True, EXACT)
                tl.store(out_ptr + o_rows[:, None] + d[None, :], o.to(out_ptr.dtype.element_ty),
                         mask=o_mask[:, None] & d_mask[None, :])


def main():
    import fusedops

    dev = torch.device("cuda")
    ceiling = measure_ceiling(dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__,
          f"copy {ceiling:.2f} TB/s", flush=True)
    table = []
    for n, mq, tokens, dim in ((8, 24, 8192, 7168), (9, 6, 8192, 4096), (4, 16, 32768, 4096)):
        bank = torch.randn(tokens, n + 2, dim, device=dev, dtype=torch.bfloat16)
        values = bank[:, :n].movedim(1, 0)
        q = 0.05 * torch.randn(mq, dim, device=dev)
        out = torch.empty(mq, tokens, dim, device=dev, dtype=torch.bfloat16)
        lse = torch.empty(mq, tokens, device=dev)
        nbytes = (n + mq) * tokens * dim * 2 + mq * tokens * 4
        ref = fusedops.attn_res_multi(values, q)[0].float()
        op_ms = triton.testing.do_bench(lambda: fusedops.attn_res_multi(values, q), warmup=5, rep=30)
        bm = max(16, triton.next_power_of_2(mq))
        print(f"case N={n} M={mq} tokens={tokens} D={dim}: op {op_ms:.4f} ms "
              f"{100 * nbytes / (op_ms * 1e-3) / (ceiling * 1e12):.1f}%", flush=True)
        rows = []
        variants = [("3d", 4, 128, 4, dim, 4)]
        for bt, bd2, warps, per_sm in itertools.product((2, 4), (64, 128, 256), (4, 8), (1, 2, 0)):
            variants.append(("diag", bt, bd2, warps, dim, per_sm))
        variants += [("diag", 2, 128, 4, 0, 0), ("diag", 4, 128, 4, 0, 0), ("3d", 4, 128, 4, dim, 0),
                     ("3d", 2, 128, 4, dim, 0)]
        for form, bt, bd2, warps, const, per_sm in variants:
            bn = triton.next_power_of_2(n) if form == "diag" else max(16, triton.next_power_of_2(n))
            if bt * bn < 16:
                continue
            blocks = -(-tokens // bt)
            grid = (min(blocks, sms * per_sm) if per_sm else blocks,)

            def run():
                multi_output_variant_kernel[grid](
                    bank, q, out, lse, n, mq, tokens, dim, bank.stride(0), bank.stride(1), q.stride(0), tokens * dim,
                    1e-6, BLOCK_T=bt, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=128 if bm >= 32 else 64, BLOCK_D2=bd2,
                    FORM=form, DIM=const, PERSISTENT=per_sm > 0, num_warps=warps)
            name = f"{form} bt{bt} bd2 {bd2} w{warps} {'D const' if const else 'D runtime'} " + (
                f"{per_sm}/SM" if per_sm else "1 block/program")
            try:
                out.zero_()
                run()
                err = (out.float() - ref).abs().max().item()
                rows.append((triton.testing.do_bench(run, warmup=3, rep=20), name, err))
            except Exception as e:  # noqa: BLE001
                print("  failed", name, type(e).__name__, str(e)[:160], flush=True)
        for ms, name, err in sorted(rows):
            print(f"  {ms:8.4f} ms {100 * nbytes / (ms * 1e-3) / (ceiling * 1e12):5.1f}%  max|diff| {err:.3g}  {name}",
                  flush=True)
        if rows:
            best = min(rows)
            table.append((n, mq, tokens, dim, op_ms, best[0], best[1]))
        del bank, out
    print("\nN  M  tokens  D     op ms   best ms  op %   best %   best variant")
    for n, mq, tokens, dim, op_ms, best_ms, name in table:
        nbytes = (n + mq) * tokens * dim * 2 + mq * tokens * 4
        pct = [100 * nbytes / (x * 1e-3) / (ceiling * 1e12) for x in (op_ms, best_ms)]
        print(f"{n:<2} {mq:<2} {tokens:<7} {dim:<5} {op_ms:7.3f} {best_ms:8.3f} {pct[0]:5.1f} {pct[1]:7.1f}   {name}")


if __name__ == "__main__":
    main()
