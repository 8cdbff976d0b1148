"""Triton kernels of Block AttnRes: attn_res_multi (phase 1, M queries over N sources) and attn_res_merge
(phase 2, one more source merged by its logsumexp), forward and backward. One source for the CUDA and the
Ascend plans.

Sources are addressed as in fusedops.attn_res (up to three strided batch dims S0 x S1 x S2 with strides
ST0..ST2, depth step STRIDE_N), so a token-major bank view `bank[:, :n].movedim(1, 0)` is read in place.
Every kernel computes in ACC: float32, or float64 for float64 inputs (F64). No atomics: query/gain
gradients are per-program partial rows, summed in a fixed order afterwards.
"""

import triton
import triton.language as tl

from fusedops.attn_res.kernels import _finite_or_zero, _token_rows
from fusedops.tl_helpers import float_arg, mask_if


@triton.jit
def _column(x, n, i):
    """Column i of x [BLOCK_M, BLOCK_N] as [BLOCK_M] (n: the column indices)."""
    return tl.sum(tl.where((n == i)[None, :], x, 0.0), axis=1)


@triton.jit
def _multi_stats(v_ptr, q_ptr, g_ptr, row, t, M, N, D, T, QS, STRIDE_N, OUT_STEP, m, m_mask, n,
                 HAS_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 ACC: tl.constexpr):
    """One pass over a token's N rows (all of D): (sum of squares [BLOCK_N], <q_l, v_i> [BLOCK_M, BLOCK_N],
    <g_l, v_i> [BLOCK_M, BLOCK_N] (zeros without HAS_G))."""
    sq = tl.zeros([BLOCK_N], ACC)
    dot = tl.zeros([BLOCK_M, BLOCK_N], ACC)
    gv = tl.zeros([BLOCK_M, BLOCK_N], ACC)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        d_mask = d < D
        md_mask = m_mask[:, None] & d_mask[None, :]
        q = tl.load(q_ptr + m.to(tl.int64)[:, None] * QS + d[None, :], mask=md_mask, other=0.0).to(ACC)
        if HAS_G:
            g = tl.load(g_ptr + m.to(tl.int64)[:, None] * OUT_STEP + t * D + d[None, :], mask=md_mask,
                        other=0.0).to(ACC)
        src = v_ptr + row
        for i in range(N):
            x = tl.load(src + d, mask=d_mask, other=0.0).to(ACC)
            sel = n == i
            sq += tl.where(sel, tl.sum(x * x, axis=0), 0.0)
            dot += tl.where(sel[None, :], tl.sum(q * x[None, :], axis=1)[:, None], 0.0)
            if HAS_G:
                gv += tl.where(sel[None, :], tl.sum(g * x[None, :], axis=1)[:, None], 0.0)
            src += STRIDE_N
    return sq, dot, gv


@triton.jit
def _multi_softmax(sq, dot, n_mask, D, eps):
    """(alpha [BLOCK_M, BLOCK_N], lse [BLOCK_M], logits, rstd [BLOCK_N]) of the softmax over depth."""
    rstd = tl.rsqrt(sq / D + eps)
    logits = dot * rstd[None, :]
    s = tl.where(n_mask[None, :], logits, float("-inf"))
    mx = tl.max(s, axis=1)
    p = tl.exp(s - _finite_or_zero(mx)[:, None])
    denom = tl.sum(p, axis=1)
    return p / denom[:, None], mx + tl.log(denom), logits, rstd


@triton.jit
def attn_res_multi_fwd_kernel(
    v_ptr, q_ptr, out_ptr, lse_ptr,
    N, M, T, D, S1, S2, ST0, ST1, ST2, STRIDE_N, QS, OUT_STEP, D_CHUNK, eps, eps_lo,
    SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, F64: tl.constexpr,
):
    """out[l, t] = sum_i softmax_i(rstd_i <q_l, v_i[t]>) v_i[t] and lse[l, t] for every query l at once.

    Program pid is split pid % SPLITS of token program pid // SPLITS, which takes tokens p, p + programs, ...
    Pass 1 reads the token's N rows over all of D and gets every (l, i) logit; pass 2 re-reads its split's
    D_CHUNK features of the rows (from cache: just read) and writes the M output rows there. SPLITS > 1
    spreads one token over several programs (decode), each re-deriving the logits: no cross-program sync.
    out is [M, T, D] contiguous (OUT_STEP = T * D), lse [M, T]."""
    ACC = tl.float64 if F64 else tl.float32
    eps = float_arg(eps, eps_lo, F64)
    pid = tl.program_id(0)
    split = pid % SPLITS
    programs = tl.num_programs(0) // SPLITS
    m = tl.arange(0, BLOCK_M)
    m_mask = m < M
    n = tl.arange(0, BLOCK_N)
    n_mask = n < N
    d_lo = split * D_CHUNK
    d_hi = tl.minimum(d_lo + D_CHUNK, D)
    for token in range(pid // SPLITS, T, programs):
        t = tl.cast(token, tl.int64)
        row = _token_rows(t, S1, S2, ST0, ST1, ST2)
        sq, dot, _ = _multi_stats(v_ptr, q_ptr, q_ptr, row, t, M, N, D, T, QS, STRIDE_N, OUT_STEP, m, m_mask, n,
                                  False, BLOCK_M, BLOCK_N, BLOCK_D, ACC)
        alpha, lse, _, _ = _multi_softmax(sq, dot, n_mask, D, eps)
        tl.store(lse_ptr + m * T + t, lse, mask=mask_if(split == 0, m_mask))
        for d0 in range(d_lo, d_hi, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            d_mask = d < d_hi
            acc = tl.zeros([BLOCK_M, BLOCK_D], ACC)
            src = v_ptr + row
            for i in range(N):
                x = tl.load(src + d, mask=d_mask, other=0.0).to(ACC)
                acc += _column(alpha, n, i)[:, None] * x[None, :]
                src += STRIDE_N
            tl.store(out_ptr + m.to(tl.int64)[:, None] * OUT_STEP + t * D + d[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@triton.jit
def _split_dot(a, b, acc, SPLIT_A: tl.constexpr):
    """acc + a @ b on bfloat16 tensor cores, one operand bfloat16 and the other (a with SPLIT_A, else b)
    float32, split into two bfloat16 terms, the smaller first: each product is exact in the float32 sum, and
    the split keeps ~16 bits of the float32 operand."""
    f = a if SPLIT_A else b
    hi = f.to(tl.bfloat16)
    lo = (f - hi.to(tl.float32)).to(tl.bfloat16)
    acc = tl.dot(lo, b, acc) if SPLIT_A else tl.dot(a, lo, acc)
    return tl.dot(hi, b, acc) if SPLIT_A else tl.dot(a, hi, acc)


@triton.jit
def _logit_terms(x, q, dot, sq, BF16: tl.constexpr):
    """(dot + x q^T, sq + the rows' sums of squares) for rows x as stored and float32 queries q (split into
    bfloat16 terms with BF16, else tf32x3)."""
    xf = x.to(tl.float32)
    sq += tl.sum(xf * xf, axis=1)
    if BF16:
        return _split_dot(x, tl.trans(q), dot, False), sq
    return tl.dot(xf, tl.trans(q), dot, input_precision="tf32x3"), sq


@triton.jit
def _logit_tile(v_ptr, q_ptr, rows, r_mask, m, m_mask, D, QS, eps, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_D: tl.constexpr, BF16: tl.constexpr):
    """Logits [BLOCK_R, BLOCK_M] of source rows `rows` (element offsets, masked by r_mask) against every query,
    rstd(row) <q_l, row>, on tensor cores (see attn_res_multi_fwd_dot_kernel for the split), summed over D in
    BLOCK_D tiles."""
    sq = tl.zeros([BLOCK_R], tl.float32)
    dot = tl.zeros([BLOCK_R, BLOCK_M], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        d_mask = d < D
        x = tl.load(v_ptr + rows[:, None] + d[None, :], mask=r_mask[:, None] & d_mask[None, :], other=0.0)
        q = tl.load(q_ptr + m.to(tl.int64)[:, None] * QS + d[None, :], mask=m_mask[:, None] & d_mask[None, :],
                    other=0.0).to(tl.float32)
        dot, sq = _logit_terms(x, q, dot, sq, BF16)
    return dot * tl.rsqrt(sq / D + eps)[:, None]


@triton.jit
def attn_res_multi_fwd_dot_kernel(
    v_ptr, q_ptr, out_ptr, lse_ptr,
    N, M, T, D, S1, S2, ST0, ST1, ST2, STRIDE_N, QS, OUT_STEP, D_CHUNK, eps, eps_lo,
    SPLITS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr, BF16: tl.constexpr,
):
    """attn_res_multi_fwd_kernel's result with the two contractions on tensor cores, for BLOCK_T tokens a step
    (every dot dimension, BLOCK_M, BLOCK_N, BLOCK_D and BLOCK_D2, >= 16; float32/float16/bfloat16 values).

    Pass 1: the token block's rows (token-major, BLOCK_N source slots a token) times the query tile, [BLOCK_T *
    BLOCK_N, BLOCK_D] x [BLOCK_D, BLOCK_M], summed over D; each query tile is read once per BLOCK_T tokens.
    Pass 2, over this split's D_CHUNK in BLOCK_D2 tiles, in reverse (the tiles pass 1 read last are the
    likeliest still in cache): out[t] = alpha[t]^T [BLOCK_M, BLOCK_N] x rows[t] [BLOCK_N, BLOCK_D2].
    The rows enter the dots exactly; the float32 queries and alpha are split: with BF16 (bfloat16 rows) into
    two bfloat16 terms each (_split_dot: ~16 bits, a logit's error ~2^-17 of sum_d |q_d x_d|, far below the
    bfloat16 output's rounding; a third term costs 23% at N=8, M=24, D=7168 on the H200), else by tf32x3
    (float16 and float32 rows, ~22 bits). Sums are float32."""
    eps = float_arg(eps, eps_lo, False)
    pid = tl.program_id(0)
    split = pid % SPLITS
    programs = tl.num_programs(0) // SPLITS
    r = tl.arange(0, BLOCK_T * BLOCK_N)
    i_r = r % BLOCK_N
    m = tl.arange(0, BLOCK_M)
    m_mask = m < M
    n = tl.arange(0, BLOCK_N)
    n_mask = n < N
    bt = tl.arange(0, BLOCK_T)
    d_lo = split * D_CHUNK
    d_hi = tl.minimum(d_lo + D_CHUNK, D)
    d_tiles = tl.cdiv(d_hi - d_lo, BLOCK_D2)
    for block in range(pid // SPLITS, tl.cdiv(T, BLOCK_T), programs):
        t0 = tl.cast(block, tl.int64) * BLOCK_T
        t_r = t0 + r // BLOCK_N
        r_mask = (i_r < N) & (t_r < T)
        rows = _token_rows(t_r, S1, S2, ST0, ST1, ST2) + i_r.to(tl.int64) * STRIDE_N
        logits = _logit_tile(v_ptr, q_ptr, rows, r_mask, m, m_mask, D, QS, eps, BLOCK_T * BLOCK_N, BLOCK_M, BLOCK_D,
                             BF16)
        logits = tl.reshape(logits, (BLOCK_T, BLOCK_N, BLOCK_M))
        s = tl.where(n_mask[None, :, None], logits, float("-inf"))
        mx = tl.max(s, axis=1)
        p = tl.exp(s - _finite_or_zero(mx)[:, None, :])
        denom = tl.sum(p, axis=1)
        alpha = tl.permute(p / denom[:, None, :], (0, 2, 1))  # [BLOCK_T, BLOCK_M, BLOCK_N]
        t = t0 + bt
        t_mask = t < T
        tm_mask = t_mask[:, None] & m_mask[None, :]
        tl.store(lse_ptr + m[None, :] * T + t[:, None], mx + tl.log(denom), mask=mask_if(split == 0, tm_mask))
        rows3 = tl.reshape(rows, (BLOCK_T, BLOCK_N))
        rows_mask3 = tl.reshape(r_mask, (BLOCK_T, BLOCK_N))
        out_rows = m[None, :, None].to(tl.int64) * OUT_STEP + t[:, None, None] * D
        for k in range(0, d_tiles):
            d = d_lo + (d_tiles - 1 - k) * BLOCK_D2 + tl.arange(0, BLOCK_D2)
            d_mask = d < d_hi
            x = tl.load(v_ptr + rows3[:, :, None] + d[None, None, :],
                        mask=rows_mask3[:, :, None] & d_mask[None, None, :], other=0.0)
            if BF16:
                o = _split_dot(alpha, x, tl.zeros([BLOCK_T, BLOCK_M, BLOCK_D2], tl.float32), True)
            else:
                o = tl.dot(alpha, x.to(tl.float32), input_precision="tf32x3")
            tl.store(out_ptr + out_rows + d[None, None, :], o.to(out_ptr.dtype.element_ty),
                     mask=tm_mask[:, :, None] & d_mask[None, None, :])


@triton.jit
def attn_res_multi_logits_kernel(
    v_ptr, q_ptr, logits_ptr,
    N, M, T, D, S1, S2, ST0, ST1, ST2, STRIDE_N, QS, eps, eps_lo,
    BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BF16: tl.constexpr, DIM: tl.constexpr = 0,
):
    """The two-pass forward's first pass over the rows: the logits s_{l,i}[t] = rstd(v_i[t]) <q_l, v_i[t]> into
    logits [T, M, N] float32, for BLOCK_R of the T x N (token, source) rows a program, taken in order (a token's
    rows may straddle two programs: no padding of N). One [BLOCK_R, D] x [D, BLOCK_M] product: each query tile
    is read once per BLOCK_R rows (16/32-bit values; every dot dimension >= 16). DIM > 0: D as a compile-time
    constant."""
    if DIM > 0:
        D = DIM
    eps = float_arg(eps, eps_lo, False)
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    t_r = r // N
    i_r = r % N
    r_mask = t_r < T
    m = tl.arange(0, BLOCK_M)
    m_mask = m < M
    rows = _token_rows(t_r, S1, S2, ST0, ST1, ST2) + i_r * STRIDE_N
    logits = _logit_tile(v_ptr, q_ptr, rows, r_mask, m, m_mask, D, QS, eps, BLOCK_R, BLOCK_M, BLOCK_D, BF16)
    tl.store(logits_ptr + (t_r[:, None] * M + m[None, :]) * N + i_r[:, None], logits,
             mask=r_mask[:, None] & m_mask[None, :])


@triton.jit
def attn_res_multi_softmax_kernel(
    logits_ptr, lse_ptr, N, M, T,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Between the two passes over the rows: the softmax over depth of BLOCK_R of the T x M (token, query) rows
    of logits [T, M, N] a program, written over them (alpha[t, l, i] = softmax_i(s_{l,i})), and lse[l, t]."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    n = tl.arange(0, BLOCK_N)
    r_mask = r < tl.cast(T, tl.int64) * M
    at = logits_ptr + r[:, None] * N + n[None, :]
    s = tl.load(at, mask=r_mask[:, None] & (n < N)[None, :], other=0.0)
    s = tl.where((n < N)[None, :], s, float("-inf"))
    mx = tl.max(s, axis=1)
    p = tl.exp(s - _finite_or_zero(mx)[:, None])
    denom = tl.sum(p, axis=1)
    tl.store(at, p / denom[:, None], mask=r_mask[:, None] & (n < N)[None, :])
    tl.store(lse_ptr + (r % M) * T + r // M, mx + tl.log(denom), mask=r_mask)


@triton.jit
def _source_tile(v_ptr, rows, d, d_mask, N, STRIDE_N, FIRST: tl.constexpr, COUNT: tl.constexpr):
    """Rows FIRST .. FIRST + COUNT - 1 (those < N) of a token, features d, as [BLOCK_D, COUNT] float32."""
    n = FIRST + tl.arange(0, COUNT)
    mask = d_mask[:, None] & (n < N)[None, :]
    return tl.load(v_ptr + rows + n.to(tl.int64)[None, :] * STRIDE_N + d[:, None], mask=mask,
                   other=0.0).to(tl.float32)


@triton.jit
def attn_res_multi_out_kernel(
    v_ptr, alpha_ptr, out_ptr,
    N, M, T, D, S1, S2, ST0, ST1, ST2, STRIDE_N, OUT_STEP,
    HEAD: tl.constexpr, TAIL: tl.constexpr, BLOCK_D: tl.constexpr, DIM: tl.constexpr = 0,
):
    """The two-pass forward's second pass over the rows, one token and BLOCK_D features a program (program pid:
    token pid // cdiv(D, BLOCK_D)): the token's N rows are held as a [BLOCK_D, HEAD] tile and, past HEAD, a [BLOCK_D,
    TAIL] one (N = 9 holds 8 + 1 rows, not 16); then each query's output row out[l, t, d] = sum_i alpha[t, l, i]
    v_i[t, d] is summed over the rows and written before the next query's (exact products, float32 sums). With
    BLOCK_D a multiple of the threads' 16-byte vectors a thread holds all the rows of its features, so the sums
    stay in its registers. out is [M, T, D] contiguous (OUT_STEP = T * D). DIM > 0: D as a compile-time
    constant (D == DIM)."""
    if DIM > 0:
        D = DIM
    tiles = tl.cdiv(D, BLOCK_D)
    t = tl.program_id(0).to(tl.int64) // tiles
    d = (tl.program_id(0) % tiles) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = d < D
    rows = _token_rows(t, S1, S2, ST0, ST1, ST2)
    x = _source_tile(v_ptr, rows, d, d_mask, N, STRIDE_N, 0, HEAD)
    head = tl.arange(0, HEAD)
    if TAIL > 0:
        x_tail = _source_tile(v_ptr, rows, d, d_mask, N, STRIDE_N, HEAD, TAIL)
        tail = HEAD + tl.arange(0, TAIL)
    weights = alpha_ptr + t * M * N
    dst = out_ptr + t * D + d
    for _ in range(M):
        o = tl.sum(x * tl.load(weights + head, mask=head < N, other=0.0)[None, :], axis=1)
        if TAIL > 0:
            o += tl.sum(x_tail * tl.load(weights + tail, mask=tail < N, other=0.0)[None, :], axis=1)
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=d_mask)
        weights += N
        dst += OUT_STEP


@triton.jit
def attn_res_multi_bwd_kernel(
    g_ptr, glse_ptr, v_ptr, q_ptr, dv_ptr, partial_ptr,
    N, M, T, D, S1, S2, ST0, ST1, ST2, STRIDE_N, QS, OUT_STEP, DV_STEP, eps, eps_lo,
    HAS_G: tl.constexpr, HAS_DLSE: tl.constexpr, NEED_DV: tl.constexpr, NEED_DQ: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, F64: tl.constexpr,
):
    """Gradients of attn_res_multi for a persistent program's tokens pid, pid + grid, ...

    Pass 1 re-derives the softmax and <g_l, v_i> from the rows (exact in ACC: neither out nor lse is read);
    ds_{l,i} = alpha_{l,i} (<g_l, v_i> - sum_j alpha_{l,j} <g_l, v_j> + g_lse_l). Pass 2 writes
      dv_i = sum_l alpha_{l,i} g_l + coef_{l,i} q_l - (sum_l coef_{l,i} k_{l,i}) v_i,
    coef = ds rstd, k = s rstd / D, and adds coef_{l,i} v_i into this program's [M, D] row of
    `partial_ptr` ([grid, M, D] ACC, zeros on entry; read-modified-written by its owner only)."""
    ACC = tl.float64 if F64 else tl.float32
    eps = float_arg(eps, eps_lo, F64)
    pid = tl.program_id(0)
    m = tl.arange(0, BLOCK_M)
    m_mask = m < M
    n = tl.arange(0, BLOCK_N)
    n_mask = n < N
    part = partial_ptr + pid.to(tl.int64) * M * D + m[:, None] * D
    for token in range(pid, T, tl.num_programs(0)):
        t = tl.cast(token, tl.int64)
        row = _token_rows(t, S1, S2, ST0, ST1, ST2)
        sq, dot, gv = _multi_stats(v_ptr, q_ptr, g_ptr, row, t, M, N, D, T, QS, STRIDE_N, OUT_STEP, m, m_mask, n,
                                   HAS_G, BLOCK_M, BLOCK_N, BLOCK_D, ACC)
        alpha, _, logits, rstd = _multi_softmax(sq, dot, n_mask, D, eps)
        alpha = tl.where(m_mask[:, None] & n_mask[None, :], alpha, 0.0)
        g_out = tl.sum(alpha * gv, axis=1)
        if HAS_DLSE:
            g_out -= tl.load(glse_ptr + m * T + t, mask=m_mask, other=0.0).to(ACC)
        coef = alpha * (gv - g_out[:, None]) * rstd[None, :]
        coef = tl.where(m_mask[:, None] & n_mask[None, :], coef, 0.0)
        ck = tl.sum(coef * logits * rstd[None, :], axis=0) / D  # [BLOCK_N]
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            d_mask = d < D
            md_mask = m_mask[:, None] & d_mask[None, :]
            q = tl.load(q_ptr + m.to(tl.int64)[:, None] * QS + d[None, :], mask=md_mask, other=0.0).to(ACC)
            if HAS_G:
                g = tl.load(g_ptr + m.to(tl.int64)[:, None] * OUT_STEP + t * D + d[None, :], mask=md_mask,
                            other=0.0).to(ACC)
            du = tl.zeros([BLOCK_M, BLOCK_D], ACC)
            src = v_ptr + row
            dst = dv_ptr + t * D + d
            for i in range(N):
                x = tl.load(src + d, mask=d_mask, other=0.0).to(ACC)
                c = _column(coef, n, i)
                if NEED_DV:
                    dx = tl.sum(c[:, None] * q, axis=0) - tl.sum(tl.where(n == i, ck, 0.0), axis=0) * x
                    if HAS_G:
                        dx += tl.sum(_column(alpha, n, i)[:, None] * g, axis=0)
                    tl.store(dst, dx.to(dv_ptr.dtype.element_ty), mask=d_mask)
                if NEED_DQ:
                    du += c[:, None] * x[None, :]
                src += STRIDE_N
                dst += DV_STEP
            if NEED_DQ:
                at = part + d[None, :]
                tl.store(at, tl.load(at, mask=md_mask, other=0.0) + du, mask=md_mask)


@triton.jit
def _dot_f32(a, b, acc, BF16: tl.constexpr):
    """acc + a @ b of two float32 operands: with BF16 on bfloat16 tensor cores, each split into two bfloat16 terms
    and the three largest products summed (~16 bits each, as _split_dot); else tf32x3."""
    if BF16:
        a_hi = a.to(tl.bfloat16)
        acc = tl.dot((a - a_hi.to(tl.float32)).to(tl.bfloat16), b.to(tl.bfloat16), acc)
        return _split_dot(a_hi, b, acc, False)  # a_hi b_lo, then a_hi b_hi
    return tl.dot(a, b, acc, input_precision="tf32x3")


@triton.jit
def _dot_rows(a, x, acc, BF16: tl.constexpr):
    """acc + a @ x for float32 weights a and rows x as stored (bfloat16 with BF16: _split_dot, the rows exact)."""
    if BF16:
        return _split_dot(a, x, acc, True)
    return tl.dot(a, x.to(tl.float32), acc, input_precision="tf32x3")


@triton.jit
def attn_res_multi_bwd_stats_kernel(
    v_ptr, q_ptr, g_ptr, glse_ptr, alpha_ptr, coef_ptr, ck_ptr,
    N, M, T, D, S1, S2, ST0, ST1, ST2, STRIDE_N, QS, OUT_STEP, eps, eps_lo,
    HAS_G: tl.constexpr, HAS_DLSE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BF16: tl.constexpr, HALF: tl.constexpr,
):
    """The tensor-core backward's first pass, BLOCK_T tokens a program: the token block's rows ([BLOCK_T x
    BLOCK_N source slots, D], token-major) against the query tile ([D, BLOCK_M], read once per BLOCK_T tokens)
    give the logits; each token's grad_out rows against its own rows ([BLOCK_M, D] x [D, BLOCK_N], a batched
    dot) give <g_l, v_i>. Then per token, as attn_res_multi_bwd_kernel's pass 1: alpha, coef = ds rstd and
    ck_i = sum_l coef_{l,i} s_{l,i} rstd_i / D, written to alpha_ptr and coef_ptr ([T, M, N] float32) and ck_ptr
    ([T, N]). The rows enter the dots exactly; the queries are split (BF16: bfloat16 rows, _split_dot) or tf32x3.
    HALF: 16-bit rows and grad_out, whose products are exact on tensor cores."""
    eps = float_arg(eps, eps_lo, False)
    t0 = tl.program_id(0).to(tl.int64) * BLOCK_T
    r = tl.arange(0, BLOCK_T * BLOCK_N)
    i_r = r % BLOCK_N
    t_r = t0 + r // BLOCK_N
    r_mask = (i_r < N) & (t_r < T)
    rows = _token_rows(t_r, S1, S2, ST0, ST1, ST2) + i_r.to(tl.int64) * STRIDE_N
    t = t0 + tl.arange(0, BLOCK_T)
    m = tl.arange(0, BLOCK_M)
    n = tl.arange(0, BLOCK_N)
    tm_mask = (t < T)[:, None] & (m < M)[None, :]
    g_rows = m.to(tl.int64)[None, :] * OUT_STEP + t[:, None] * D
    sq = tl.zeros([BLOCK_T * BLOCK_N], tl.float32)
    qv = tl.zeros([BLOCK_T * BLOCK_N, BLOCK_M], tl.float32)
    gv = tl.zeros([BLOCK_T, BLOCK_M, BLOCK_N], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        d_mask = d < D
        x = tl.load(v_ptr + rows[:, None] + d[None, :], mask=r_mask[:, None] & d_mask[None, :], other=0.0)
        q = tl.load(q_ptr + m.to(tl.int64)[:, None] * QS + d[None, :], mask=(m < M)[:, None] & d_mask[None, :],
                    other=0.0).to(tl.float32)
        qv, sq = _logit_terms(x, q, qv, sq, BF16)
        if HAS_G:
            g = tl.load(g_ptr + g_rows[:, :, None] + d[None, None, :],
                        mask=tm_mask[:, :, None] & d_mask[None, None, :], other=0.0)
            xt = tl.permute(tl.reshape(x, (BLOCK_T, BLOCK_N, BLOCK_D)), (0, 2, 1))
            if HALF:
                gv = tl.dot(g, xt, gv)
            else:
                gv = tl.dot(g.to(tl.float32), xt.to(tl.float32), gv, input_precision="tf32x3")
    rstd = tl.reshape(tl.rsqrt(sq / D + eps), (BLOCK_T, BLOCK_N))
    logits = tl.permute(tl.reshape(qv, (BLOCK_T, BLOCK_N, BLOCK_M)), (0, 2, 1)) * rstd[:, None, :]
    s = tl.where((n < N)[None, None, :], logits, float("-inf"))
    mx = tl.max(s, axis=2)
    p = tl.exp(s - _finite_or_zero(mx)[:, :, None])
    alpha = p / tl.sum(p, axis=2)[:, :, None]
    g_out = tl.sum(alpha * gv, axis=2)
    if HAS_DLSE:
        g_out -= tl.load(glse_ptr + m[None, :] * T + t[:, None], mask=tm_mask, other=0.0).to(tl.float32)
    mask = tm_mask[:, :, None] & (n < N)[None, None, :]
    coef = tl.where(mask, alpha * (gv - g_out[:, :, None]) * rstd[:, None, :], 0.0)
    ck = tl.sum(coef * logits * rstd[:, None, :], axis=1) / D
    at = (t[:, None, None] * M + m[None, :, None]) * N + n[None, None, :]
    tl.store(alpha_ptr + at, alpha, mask=mask)
    tl.store(coef_ptr + at, coef, mask=mask)
    tl.store(ck_ptr + t[:, None] * N + n[None, :], ck, mask=(t < T)[:, None] & (n < N)[None, :])


@triton.jit
def attn_res_multi_bwd_grads_kernel(
    v_ptr, q_ptr, g_ptr, alpha_ptr, coef_ptr, ck_ptr, dv_ptr, partial_ptr,
    N, M, T, D, S1, S2, ST0, ST1, ST2, STRIDE_N, QS, OUT_STEP, DV_STEP, TOKENS_PER_PROGRAM,
    HAS_G: tl.constexpr, NEED_DV: tl.constexpr, NEED_DQ: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BF16: tl.constexpr,
):
    """The tensor-core backward's second pass: program (c, p) owns features [c BLOCK_D, (c + 1) BLOCK_D) of
    tokens [p, p + 1) x TOKENS_PER_PROGRAM, BLOCK_T a step, from the first pass's alpha, coef and ck:
      dv_i = sum_l alpha_{l,i} g_l + sum_l coef_{l,i} q_l - ck_i v_i   (per token, batched dots; the query tile
      is loaded once), and the query gradient's partial sums sum_t sum_i coef_{l,i} v_i (one dot over the
    block's token x source rows), written once to row p of partial_ptr ([programs, M, D] float32)."""
    d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = d < D
    m = tl.arange(0, BLOCK_M)
    n = tl.arange(0, BLOCK_N)
    q = tl.load(q_ptr + m.to(tl.int64)[:, None] * QS + d[None, :], mask=(m < M)[:, None] & d_mask[None, :],
                other=0.0).to(tl.float32)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    r = tl.arange(0, BLOCK_T * BLOCK_N)
    i_r = r % BLOCK_N
    t_begin = tl.program_id(1).to(tl.int64) * TOKENS_PER_PROGRAM
    t_end = tl.minimum(t_begin + TOKENS_PER_PROGRAM, T)
    for t0 in range(t_begin, t_end, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_mask = t < t_end
        t_r = t0 + r // BLOCK_N
        r_mask = (i_r < N) & (t_r < t_end)
        rows = _token_rows(t_r, S1, S2, ST0, ST1, ST2) + i_r.to(tl.int64) * STRIDE_N
        x = tl.load(v_ptr + rows[:, None] + d[None, :], mask=r_mask[:, None] & d_mask[None, :], other=0.0)
        at = (t[:, None, None] * M + m[None, None, :]) * N + n[None, :, None]  # [BLOCK_T, BLOCK_N, BLOCK_M]
        w_mask = t_mask[:, None, None] & (n < N)[None, :, None] & (m < M)[None, None, :]
        coef_t = tl.load(coef_ptr + at, mask=w_mask, other=0.0)
        if NEED_DV:
            ck = tl.load(ck_ptr + t_r * N + i_r, mask=r_mask, other=0.0)
            dv = _dot_f32(tl.reshape(coef_t, (BLOCK_T * BLOCK_N, BLOCK_M)), q,
                          tl.zeros([BLOCK_T * BLOCK_N, BLOCK_D], tl.float32), BF16)
            dv -= ck[:, None] * x.to(tl.float32)
            if HAS_G:
                alpha_t = tl.load(alpha_ptr + at, mask=w_mask, other=0.0)
                g = tl.load(g_ptr + m.to(tl.int64)[None, :, None] * OUT_STEP + t[:, None, None] * D + d[None, None, :],
                            mask=t_mask[:, None, None] & (m < M)[None, :, None] & d_mask[None, None, :], other=0.0)
                dv = tl.reshape(_dot_rows(alpha_t, g, tl.reshape(dv, (BLOCK_T, BLOCK_N, BLOCK_D)), BF16),
                                (BLOCK_T * BLOCK_N, BLOCK_D))
            tl.store(dv_ptr + i_r.to(tl.int64)[:, None] * DV_STEP + t_r[:, None] * D + d[None, :],
                     dv.to(dv_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])
        if NEED_DQ:
            coef_rows = tl.reshape(tl.permute(coef_t, (2, 0, 1)), (BLOCK_M, BLOCK_T * BLOCK_N))
            dq = _dot_rows(coef_rows, x, dq, BF16)
    if NEED_DQ:
        tl.store(partial_ptr + tl.program_id(1).to(tl.int64) * M * D + m[:, None] * D + d[None, :], dq,
                 mask=(m < M)[:, None] & d_mask[None, :])


@triton.jit
def attn_res_multi_bwd_grads_flat_kernel(
    v_ptr, q_ptr, g_ptr, alpha_ptr, coef_ptr, ck_ptr, dv_ptr, partial_ptr,
    N, M, T, D, S1, S2, ST0, ST1, ST2, STRIDE_N, QS, OUT_STEP, DV_STEP, TOKENS_PER_PROGRAM, STEP,
    HAS_G: tl.constexpr, NEED_DV: tl.constexpr, NEED_DQ: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BF16: tl.constexpr,
):
    """attn_res_multi_bwd_grads_kernel's work on 2-D tiles only: a step's STEP tokens as flat (token, source) rows r
    (N not padded) and flat (token, query) columns k, alpha as a block-diagonal [rows, columns] tile, so every dot
    operand is a direct load (no 3-D dot, reshape or permute, which kept the batched kernel at the register cap):
      dv[r] = sum_k alpha[r, k] g[k] + sum_l coef[r, l] q_l - ck[r] v[r];   dq_l += sum_r coef[r, l] v[r]
    (the query gradient's partial sums over the program's tokens, written once to row p of partial_ptr)."""
    d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = d < D
    m = tl.arange(0, BLOCK_M)
    m_mask = m < M
    q = tl.load(q_ptr + m.to(tl.int64)[:, None] * QS + d[None, :], mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    q = q.to(tl.float32)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    r = tl.arange(0, BLOCK_R)
    r_t = r // N
    r_n = r % N
    r_in = r < STEP * N
    k = tl.arange(0, BLOCK_K)
    k_t = k // M
    k_m = k % M
    k_in = k < STEP * M
    t_begin = tl.program_id(1).to(tl.int64) * TOKENS_PER_PROGRAM
    t_end = tl.minimum(t_begin + TOKENS_PER_PROGRAM, T)
    for t0 in range(t_begin, t_end, STEP):
        t_r = t0 + r_t
        r_mask = r_in & (t_r < t_end)
        rows = _token_rows(t_r, S1, S2, ST0, ST1, ST2) + r_n.to(tl.int64) * STRIDE_N
        x = tl.load(v_ptr + rows[:, None] + d[None, :], mask=r_mask[:, None] & d_mask[None, :], other=0.0)
        w_r = t_r * M * N + r_n
        if NEED_DV:
            c = tl.load(coef_ptr + w_r[:, None] + m[None, :] * N, mask=r_mask[:, None] & m_mask[None, :], other=0.0)
            dv = _dot_f32(c, q, tl.zeros([BLOCK_R, BLOCK_D], tl.float32), BF16)
            dv -= tl.load(ck_ptr + t_r * N + r_n, mask=r_mask, other=0.0)[:, None] * x.to(tl.float32)
            if HAS_G:
                t_k = t0 + k_t
                k_mask = k_in & (t_k < t_end)
                a = tl.load(alpha_ptr + w_r[:, None] + k_m[None, :] * N,
                            mask=r_mask[:, None] & k_mask[None, :] & (r_t[:, None] == k_t[None, :]), other=0.0)
                gk = tl.load(g_ptr + k_m.to(tl.int64)[:, None] * OUT_STEP + t_k[:, None] * D + d[None, :],
                             mask=k_mask[:, None] & d_mask[None, :], other=0.0)
                dv = _dot_rows(a, gk, dv, BF16)
            tl.store(dv_ptr + r_n.to(tl.int64)[:, None] * DV_STEP + t_r[:, None] * D + d[None, :],
                     dv.to(dv_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])
        if NEED_DQ:
            ct = tl.load(coef_ptr + w_r[None, :] + m[:, None] * N, mask=m_mask[:, None] & r_mask[None, :], other=0.0)
            dq = _dot_rows(ct, x, dq, BF16)
    if NEED_DQ:
        tl.store(partial_ptr + tl.program_id(1).to(tl.int64) * M * D + m[:, None] * D + d[None, :], dq,
                 mask=m_mask[:, None] & d_mask[None, :])


@triton.jit
def _merged_tile(p_ptr, a1_ptr, a2_ptr, t, d, mask, P_ST, A1_ST, A2_ST, NUM_ADD: tl.constexpr, ACC: tl.constexpr):
    """(p + a1 + a2) of rows t, features d, summed in ACC and rounded once to p's dtype, then as ACC."""
    x = tl.load(p_ptr + t[:, None] * P_ST + d[None, :], mask=mask, other=0.0).to(ACC)
    if NUM_ADD >= 1:
        x += tl.load(a1_ptr + t[:, None] * A1_ST + d[None, :], mask=mask, other=0.0).to(ACC)
    if NUM_ADD >= 2:
        x += tl.load(a2_ptr + t[:, None] * A2_ST + d[None, :], mask=mask, other=0.0).to(ACC)
    if NUM_ADD >= 1:
        x = x.to(p_ptr.dtype.element_ty).to(ACC)
    return x


@triton.jit
def _merge_weights(lse, s):
    """(w_out, w_partial): the softmax over the two logits (lse, s), per token."""
    ref = _finite_or_zero(tl.maximum(lse, s))
    e_o = tl.exp(lse - ref)
    e_p = tl.exp(s - ref)
    denom = e_o + e_p
    return e_o / denom, e_p / denom


@triton.jit
def _merged_logit(p_ptr, a1_ptr, a2_ptr, pn_ptr, q_ptr, t, t_mask, D, P_ST, A1_ST, A2_ST, PN_ST, eps,
                  NUM_ADD: tl.constexpr, STORE_P: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                  ACC: tl.constexpr):
    """(s, rstd(P)) of rows t: one pass over P = p + addends (with STORE_P also written to pn), s = rstd(P) <q, P>."""
    sq = tl.zeros([BLOCK_T], ACC)
    dot = tl.zeros([BLOCK_T], ACC)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        d_mask = d < D
        mask = t_mask[:, None] & d_mask[None, :]
        x = _merged_tile(p_ptr, a1_ptr, a2_ptr, t, d, mask, P_ST, A1_ST, A2_ST, NUM_ADD, ACC)
        if STORE_P:
            tl.store(pn_ptr + t[:, None] * PN_ST + d[None, :], x.to(pn_ptr.dtype.element_ty), mask=mask)
        q = tl.load(q_ptr + d, mask=d_mask, other=0.0).to(ACC)
        sq += tl.sum(x * x, axis=1)
        dot += tl.sum(x * q[None, :], axis=1)
    rstd = tl.rsqrt(sq / D + eps)
    return dot * rstd, rstd


@triton.jit
def _mixed_tile(o_ptr, t, d, mask, O_ST, w_o, w_p, x, ACC: tl.constexpr):
    """(out, h = w_o out + w_p x) tiles of rows t, features d, for the merged partial sum's tile x."""
    o = tl.load(o_ptr + t[:, None] * O_ST + d[None, :], mask=mask, other=0.0).to(ACC)
    return o, w_o[:, None] * o + w_p[:, None] * x


@triton.jit
def _grad_h(gy, h, gain_ptr, d, d_mask, r, c, D, HAS_GAIN: tl.constexpr, ACC: tl.constexpr):
    """dh from the output gradient gy: gy, or through the output RMSNorm r gain gy - h r^3 c / D."""
    dh = gy
    if HAS_GAIN:
        gain = tl.load(gain_ptr + d, mask=d_mask, other=0.0).to(ACC)
        dh = r[:, None] * gain[None, :] * gy - h * (r * r * r * c / D)[:, None]
    return dh


@triton.jit
def _merge_whole_rows(o_ptr, lse_ptr, p_ptr, a1_ptr, a2_ptr, q_ptr, gain_ptr, y_ptr, pn_ptr, t, t_mask, D, O_ST, P_ST,
                      A1_ST, A2_ST, PN_ST, eps, norm_eps, NUM_ADD: tl.constexpr, STORE_P: tl.constexpr,
                      HAS_GAIN: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr):
    """attn_res_merge_fwd_kernel's work for rows t when BLOCK_D >= D: every input tile is loaded once."""
    d = tl.arange(0, BLOCK_D)
    d_mask = d < D
    mask = t_mask[:, None] & d_mask[None, :]
    x = _merged_tile(p_ptr, a1_ptr, a2_ptr, t, d, mask, P_ST, A1_ST, A2_ST, NUM_ADD, ACC)
    if STORE_P:
        tl.store(pn_ptr + t[:, None] * PN_ST + d[None, :], x.to(pn_ptr.dtype.element_ty), mask=mask)
    q = tl.load(q_ptr + d, mask=d_mask, other=0.0).to(ACC)
    rp = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    s = tl.sum(x * q[None, :], axis=1) * rp
    w_o, w_p = _merge_weights(tl.load(lse_ptr + t, mask=t_mask, other=0.0).to(ACC), s)
    o, h = _mixed_tile(o_ptr, t, d, mask, O_ST, w_o, w_p, x, ACC)
    if HAS_GAIN:
        r = tl.rsqrt(tl.sum(h * h, axis=1) / D + norm_eps)
        h = h * r[:, None] * tl.load(gain_ptr + d, mask=d_mask, other=0.0).to(ACC)[None, :]
    tl.store(y_ptr + t[:, None] * D + d[None, :], h.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _merge_tiled_rows(o_ptr, lse_ptr, p_ptr, a1_ptr, a2_ptr, q_ptr, gain_ptr, y_ptr, pn_ptr, t, t_mask, D, O_ST, P_ST,
                      A1_ST, A2_ST, PN_ST, eps, norm_eps, NUM_ADD: tl.constexpr, STORE_P: tl.constexpr,
                      HAS_GAIN: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr):
    """attn_res_merge_fwd_kernel's work for rows t in D tiles of BLOCK_D: pass 1 gets s (and writes P), pass 2
    (HAS_GAIN) the norm of h, the last pass writes y; each later pass re-reads the tiles the first one just
    read (so pn must not overlap the inputs)."""
    s, rp = _merged_logit(p_ptr, a1_ptr, a2_ptr, pn_ptr, q_ptr, t, t_mask, D, P_ST, A1_ST, A2_ST, PN_ST, eps,
                          NUM_ADD, STORE_P, BLOCK_T, BLOCK_D, ACC)
    lse = tl.load(lse_ptr + t, mask=t_mask, other=0.0).to(ACC)
    w_o, w_p = _merge_weights(lse, s)
    r = tl.zeros([BLOCK_T], ACC) + 1.0
    if HAS_GAIN:
        hsq = tl.zeros([BLOCK_T], ACC)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            mask = t_mask[:, None] & (d < D)[None, :]
            x = _merged_tile(p_ptr, a1_ptr, a2_ptr, t, d, mask, P_ST, A1_ST, A2_ST, NUM_ADD, ACC)
            o, h = _mixed_tile(o_ptr, t, d, mask, O_ST, w_o, w_p, x, ACC)
            hsq += tl.sum(h * h, axis=1)
        r = tl.rsqrt(hsq / D + norm_eps)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        d_mask = d < D
        mask = t_mask[:, None] & d_mask[None, :]
        x = _merged_tile(p_ptr, a1_ptr, a2_ptr, t, d, mask, P_ST, A1_ST, A2_ST, NUM_ADD, ACC)
        o, h = _mixed_tile(o_ptr, t, d, mask, O_ST, w_o, w_p, x, ACC)
        if HAS_GAIN:
            h = h * r[:, None] * tl.load(gain_ptr + d, mask=d_mask, other=0.0).to(ACC)[None, :]
        tl.store(y_ptr + t[:, None] * D + d[None, :], h.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _merge_block(o_ptr, lse_ptr, p_ptr, a1_ptr, a2_ptr, q_ptr, gain_ptr, y_ptr, pn_ptr, block, T, D, O_ST, P_ST,
                 A1_ST, A2_ST, PN_ST, eps, norm_eps, NUM_ADD: tl.constexpr, STORE_P: tl.constexpr,
                 HAS_GAIN: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, WHOLE_ROW: tl.constexpr,
                 ACC: tl.constexpr):
    t = block * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    t_mask = t < T
    if WHOLE_ROW:
        _merge_whole_rows(o_ptr, lse_ptr, p_ptr, a1_ptr, a2_ptr, q_ptr, gain_ptr, y_ptr, pn_ptr, t, t_mask, D, O_ST,
                          P_ST, A1_ST, A2_ST, PN_ST, eps, norm_eps, NUM_ADD, STORE_P, HAS_GAIN, BLOCK_D, ACC)
    else:
        _merge_tiled_rows(o_ptr, lse_ptr, p_ptr, a1_ptr, a2_ptr, q_ptr, gain_ptr, y_ptr, pn_ptr, t, t_mask, D, O_ST,
                          P_ST, A1_ST, A2_ST, PN_ST, eps, norm_eps, NUM_ADD, STORE_P, HAS_GAIN, BLOCK_T, BLOCK_D, ACC)


@triton.jit
def attn_res_merge_fwd_kernel(
    o_ptr, lse_ptr, p_ptr, a1_ptr, a2_ptr, q_ptr, gain_ptr, y_ptr, pn_ptr,
    T, D, O_ST, P_ST, A1_ST, A2_ST, PN_ST, eps, eps_lo, norm_eps, norm_eps_lo,
    NUM_ADD: tl.constexpr, STORE_P: tl.constexpr, HAS_GAIN: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr, F64: tl.constexpr, WHOLE_ROW: tl.constexpr = False, DIM: tl.constexpr = 0,
    BLOCKS: tl.constexpr = 0,
):
    """Phase 2 of Block AttnRes for blocks of BLOCK_T tokens:
      P = p + a1 + a2 (rounded once to p's dtype; with STORE_P written to pn, rows PN_ST apart: a new tensor
      or a slot of the caller's bank),
      s = rstd(P) <q, P>,  h = w_o out + w_p P  with (w_o, w_p) = softmax(lse, s),
      y = h, or with HAS_GAIN rmsnorm(h, norm_eps) * gain.
    Rows of o, p, a1, a2 are O_ST.. elements apart (a bank slot is read in place); y is [T, D] contiguous.
    WHOLE_ROW (BLOCK_D >= D): each input tile is loaded once; else the row is walked in BLOCK_D tiles, once
    per pass. BLOCKS > 0: program pid takes token blocks pid * BLOCKS ... + BLOCKS - 1 (grid = cdiv(T,
    BLOCK_T * BLOCKS)); 0: blocks pid, pid + grid, ... DIM > 0: D as a compile-time constant (D == DIM)."""
    if DIM > 0:
        D = DIM
    ACC = tl.float64 if F64 else tl.float32
    eps = float_arg(eps, eps_lo, F64)
    norm_eps = float_arg(norm_eps, norm_eps_lo, F64)
    pid = tl.program_id(0)
    if BLOCKS > 0:
        for i in tl.static_range(BLOCKS):
            block = pid.to(tl.int64) * BLOCKS + i
            if block * BLOCK_T < T:
                _merge_block(o_ptr, lse_ptr, p_ptr, a1_ptr, a2_ptr, q_ptr, gain_ptr, y_ptr, pn_ptr, block, T, D,
                             O_ST, P_ST, A1_ST, A2_ST, PN_ST, eps, norm_eps, NUM_ADD, STORE_P, HAS_GAIN, BLOCK_T,
                             BLOCK_D, WHOLE_ROW, ACC)
    else:
        for block in range(pid, tl.cdiv(T, BLOCK_T), tl.num_programs(0)):
            _merge_block(o_ptr, lse_ptr, p_ptr, a1_ptr, a2_ptr, q_ptr, gain_ptr, y_ptr, pn_ptr, block, T, D, O_ST,
                         P_ST, A1_ST, A2_ST, PN_ST, eps, norm_eps, NUM_ADD, STORE_P, HAS_GAIN, BLOCK_T, BLOCK_D,
                         WHOLE_ROW, ACC)


@triton.jit
def attn_res_merge_bwd_kernel(
    gy_ptr, gp_ptr, o_ptr, lse_ptr, p_ptr, q_ptr, gain_ptr, do_ptr, dlse_ptr, dp_ptr, dq_part_ptr, dg_part_ptr,
    T, D, O_ST, P_ST, eps, eps_lo, norm_eps, norm_eps_lo,
    HAS_GP: tl.constexpr, HAS_GAIN: tl.constexpr, NEED_DO: tl.constexpr, NEED_DP: tl.constexpr,
    NEED_DQ: tl.constexpr, NEED_DG: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, F64: tl.constexpr,
):
    """Gradients of attn_res_merge (p_ptr: the merged partial sum P the forward used):
      dh = gy, or with HAS_GAIN r gain gy - h r^3 <gain gy, h> / D,
      ds = w_o w_p <dh, P - o>,  dlse = -ds,  do = w_o dh,
      dP = w_p dh + ds rstd(P) (q - s rstd(P) P / D) + gp,
    and this program's rows of the query and gain gradients' partial sums (dq_part, dg_part: [grid, D] ACC,
    zeros on entry): ds rstd(P) P and gy h r summed over its tokens. do, dlse and dP are contiguous."""
    ACC = tl.float64 if F64 else tl.float32
    eps = float_arg(eps, eps_lo, F64)
    norm_eps = float_arg(norm_eps, norm_eps_lo, F64)
    pid = tl.program_id(0)
    for block in range(pid, tl.cdiv(T, BLOCK_T), tl.num_programs(0)):
        t = block * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
        t_mask = t < T
        s, rp = _merged_logit(p_ptr, p_ptr, p_ptr, p_ptr, q_ptr, t, t_mask, D, P_ST, P_ST, P_ST, P_ST, eps, 0, False,
                              BLOCK_T, BLOCK_D, ACC)
        lse = tl.load(lse_ptr + t, mask=t_mask, other=0.0).to(ACC)
        w_o, w_p = _merge_weights(lse, s)
        r = tl.zeros([BLOCK_T], ACC)
        c = tl.zeros([BLOCK_T], ACC)
        if HAS_GAIN:
            hsq = tl.zeros([BLOCK_T], ACC)
            for d0 in range(0, D, BLOCK_D):
                d = d0 + tl.arange(0, BLOCK_D)
                d_mask = d < D
                mask = t_mask[:, None] & d_mask[None, :]
                x = tl.load(p_ptr + t[:, None] * P_ST + d[None, :], mask=mask, other=0.0).to(ACC)
                o, h = _mixed_tile(o_ptr, t, d, mask, O_ST, w_o, w_p, x, ACC)
                gy = tl.load(gy_ptr + t[:, None] * D + d[None, :], mask=mask, other=0.0).to(ACC)
                gain = tl.load(gain_ptr + d, mask=d_mask, other=0.0).to(ACC)
                hsq += tl.sum(h * h, axis=1)
                c += tl.sum(gain[None, :] * gy * h, axis=1)
            r = tl.rsqrt(hsq / D + norm_eps)
        # <dh, P - o>, and the gain gradient's partial sums
        dw = tl.zeros([BLOCK_T], ACC)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            d_mask = d < D
            mask = t_mask[:, None] & d_mask[None, :]
            x = tl.load(p_ptr + t[:, None] * P_ST + d[None, :], mask=mask, other=0.0).to(ACC)
            o = tl.load(o_ptr + t[:, None] * O_ST + d[None, :], mask=mask, other=0.0).to(ACC)
            gy = tl.load(gy_ptr + t[:, None] * D + d[None, :], mask=mask, other=0.0).to(ACC)
            h = w_o[:, None] * o + w_p[:, None] * x
            dh = _grad_h(gy, h, gain_ptr, d, d_mask, r, c, D, HAS_GAIN, ACC)
            if HAS_GAIN and NEED_DG:
                at = dg_part_ptr + pid * D + d
                tl.store(at, tl.load(at, mask=d_mask, other=0.0) + tl.sum(gy * h * r[:, None], axis=0),
                         mask=d_mask)
            dw += tl.sum(dh * (x - o), axis=1)
        ds = w_o * w_p * dw
        tl.store(dlse_ptr + t, (-ds).to(dlse_ptr.dtype.element_ty), mask=t_mask)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            d_mask = d < D
            mask = t_mask[:, None] & d_mask[None, :]
            io = t[:, None] * D + d[None, :]
            x = tl.load(p_ptr + t[:, None] * P_ST + d[None, :], mask=mask, other=0.0).to(ACC)
            o = tl.load(o_ptr + t[:, None] * O_ST + d[None, :], mask=mask, other=0.0).to(ACC)
            gy = tl.load(gy_ptr + io, mask=mask, other=0.0).to(ACC)
            h = w_o[:, None] * o + w_p[:, None] * x
            dh = _grad_h(gy, h, gain_ptr, d, d_mask, r, c, D, HAS_GAIN, ACC)
            if NEED_DO:
                tl.store(do_ptr + io, (w_o[:, None] * dh).to(do_ptr.dtype.element_ty), mask=mask)
            if NEED_DP:
                q = tl.load(q_ptr + d, mask=d_mask, other=0.0).to(ACC)
                dp = w_p[:, None] * dh + (ds * rp)[:, None] * (q[None, :] - (s * rp / D)[:, None] * x)
                if HAS_GP:
                    dp += tl.load(gp_ptr + io, mask=mask, other=0.0).to(ACC)
                tl.store(dp_ptr + io, dp.to(dp_ptr.dtype.element_ty), mask=mask)
            if NEED_DQ:
                at = dq_part_ptr + pid * D + d
                tl.store(at, tl.load(at, mask=d_mask, other=0.0) + tl.sum((ds * rp)[:, None] * x, axis=0),
                         mask=d_mask)
