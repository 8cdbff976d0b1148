"""Triton kernels for attn_res. One source for the CUDA and the Ascend plans.

Tokens are addressed through up to three strided batch dims (sizes S0 x S1 x S2, strides ST0..ST2),
so a slice of a preallocated bank or a permuted batch runs without a copy. Offsets are int64;
depth steps advance pointers by STRIDE_N so no i * stride product can overflow.

Every kernel computes in ACC: float32, or float64 for float64 values (F64), logits, softmax statistics,
lse and partial sums included. Softmaxes over depth take their exponentials relative to the running max
(_finite_or_zero), so infinite logits give what torch.softmax and torch.logsumexp give.
"""

import triton
import triton.language as tl

from fusedops.tl_helpers import as_stored, float_arg, mask_if


@triton.jit
def _token_rows(t, S1, S2, ST0, ST1, ST2):
    """Element offset of each token's row, for token indices `t` (int64) over the batch dims."""
    b2 = t % S2
    rest = t // S2
    return (rest // S1) * ST0 + (rest % S1) * ST1 + b2 * ST2


@triton.jit
def _folded_query(q_ptr, w_ptr, d, d_mask, HAS_WEIGHT: tl.constexpr, ACC: tl.constexpr):
    u = tl.load(q_ptr + d, mask=d_mask, other=0.0).to(ACC)
    if HAS_WEIGHT:
        u = u * tl.load(w_ptr + d, mask=d_mask, other=0.0).to(ACC)
    return u


@triton.jit
def _row_logit(x, u, D, eps):
    """(logit, rstd) of fp32 rows x [BLOCK_T, BLOCK_D] against the folded query u [BLOCK_D]."""
    return _logit_of_sums(tl.sum(x * x, axis=1), tl.sum(x * u[None, :], axis=1), D, eps)


@triton.jit
def _logit_of_sums(squares, dot_u, D, eps):
    """(logit, rstd) of rows from their sums of x * x and of x * u."""
    rstd = tl.rsqrt(squares / D + eps)
    return dot_u * rstd, rstd


@triton.jit
def _finite_or_zero(m):
    """The reference point of a softmax's exponentials for its (running) max m: m, or 0 where m is +-inf, as
    torch.logsumexp takes it. With every logit -inf the exponentials are then exp(-inf) = 0, not exp(-inf -
    -inf) = NaN, so lse = m + log(denom) comes out -inf (and out 0 / 0 = NaN); with a +inf logit lse is
    +inf: the reference's results, where NaN came out for both."""
    return tl.where(tl.abs(m) == float("inf"), 0.0, m)


@triton.jit
def _mix(acc, m, denom, x, logit):
    """One online-softmax step of the forward: fold row x with weight exp(logit) into acc."""
    m_new = tl.maximum(m, logit)
    ref = _finite_or_zero(m_new)
    rescale = tl.exp(m - ref)
    p = tl.exp(logit - ref)
    return acc * rescale[:, None] + p[:, None] * x, m_new, denom * rescale + p


@triton.jit
def attn_res_fwd_kernel(
    v_ptr, q_ptr, w_ptr, out_ptr, lse_ptr, logits_ptr,
    N, T, D, S1, S2, ST0, ST1, ST2, STRIDE_N, eps, eps_lo,
    HAS_WEIGHT: tl.constexpr, ONE_TILE: tl.constexpr, UNROLL: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, F64: tl.constexpr,
):
    """out[t] = sum_i softmax_i(rstd_i * <u, v_i[t]>) v_i[t], and lse[t] = logsumexp_i of the logits
    (fp32, [T]), which lets the backward make one pass over values.

    ONE_TILE: the row fits on chip; one pass over values with an online softmax over depth.
    Otherwise: pass 1 walks D tiles to get the logits (kept in `logits_ptr`, [N, T] fp32), pass 2
    walks D tiles again and sums the weighted rows (the re-read mostly hits L2 / is local on Ascend).
    """
    ACC = tl.float64 if F64 else tl.float32
    eps = float_arg(eps, eps_lo, F64)
    pid = tl.program_id(0)
    num_blocks = tl.cdiv(T, BLOCK_T)
    for block in range(pid, num_blocks, tl.num_programs(0)):
        t = block * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
        t_mask = t < T
        rows = _token_rows(t, S1, S2, ST0, ST1, ST2)
        m = tl.full([BLOCK_T], float("-inf"), ACC)
        denom = tl.zeros([BLOCK_T], ACC)
        if ONE_TILE:
            d = tl.arange(0, BLOCK_D)
            d_mask = d < D
            mask = t_mask[:, None] & d_mask[None, :]
            u = _folded_query(q_ptr, w_ptr, d, d_mask, HAS_WEIGHT, ACC)
            acc = tl.zeros([BLOCK_T, BLOCK_D], ACC)
            ptrs = v_ptr + rows[:, None] + d[None, :]
            # UNROLL == 2 keeps two independent rows in flight: the loop is latency-bound otherwise.
            for i in range(0, N, UNROLL):
                x = tl.load(ptrs, mask=mask, other=0.0).to(ACC)
                if UNROLL == 2:
                    has_next = i + 1 < N
                    x_next = tl.load(ptrs + STRIDE_N, mask=mask_if(has_next, mask), other=0.0).to(ACC)
                logit, _ = _row_logit(x, u, D, eps)
                acc, m, denom = _mix(acc, m, denom, x, logit)
                if UNROLL == 2:
                    logit, _ = _row_logit(x_next, u, D, eps)
                    acc, m, denom = _mix(acc, m, denom, x_next, tl.where(has_next, logit, float("-inf")))
                ptrs += tl.cast(STRIDE_N, tl.int64) * UNROLL
            out = acc / denom[:, None]
            tl.store(out_ptr + t[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(lse_ptr + t, m + tl.log(denom), mask=t_mask)
        else:
            base = v_ptr + rows
            lptrs = logits_ptr + t
            for _ in range(N):
                sq = tl.zeros([BLOCK_T], ACC)
                dot = tl.zeros([BLOCK_T], ACC)
                for d0 in range(0, D, BLOCK_D):
                    d = d0 + tl.arange(0, BLOCK_D)
                    d_mask = d < D
                    u = _folded_query(q_ptr, w_ptr, d, d_mask, HAS_WEIGHT, ACC)
                    x = tl.load(base[:, None] + d[None, :], mask=t_mask[:, None] & d_mask[None, :], other=0.0)
                    x = x.to(ACC)
                    sq += tl.sum(x * x, axis=1)
                    dot += tl.sum(x * u[None, :], axis=1)
                logit = dot * tl.rsqrt(sq / D + eps)
                tl.store(lptrs, logit, mask=t_mask)
                m_new = tl.maximum(m, logit)
                ref = _finite_or_zero(m_new)
                denom = denom * tl.exp(m - ref) + tl.exp(logit - ref)
                m = m_new
                base += STRIDE_N
                lptrs += T
            tl.store(lse_ptr + t, m + tl.log(denom), mask=t_mask)
            inv_denom = 1.0 / denom
            for d0 in range(0, D, BLOCK_D):
                d = d0 + tl.arange(0, BLOCK_D)
                mask = t_mask[:, None] & (d < D)[None, :]
                acc = tl.zeros([BLOCK_T, BLOCK_D], ACC)
                ptrs = v_ptr + rows[:, None] + d[None, :]
                lptrs = logits_ptr + t
                for _ in range(N):
                    logit = tl.load(lptrs, mask=t_mask, other=0.0)
                    alpha = tl.exp(logit - m) * inv_denom
                    x = tl.load(ptrs, mask=mask, other=0.0).to(ACC)
                    acc += alpha[:, None] * x
                    ptrs += STRIDE_N
                    lptrs += T
                tl.store(out_ptr + t[:, None] * D + d[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _depth_tile(N, D, STRIDE_N, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """The indices a depth-tile program keeps for every token: features and sources with their masks, and
    the offsets of a token's [BLOCK_N, BLOCK_D] rows from its first row. (No pointer argument: torch <
    2.13's mutation analysis would count one that reaches a store address through a call as written.)"""
    d = tl.arange(0, BLOCK_D)
    d_mask = d < D
    n = tl.arange(0, BLOCK_N)
    n_mask = n < N
    mask = n_mask[:, None] & d_mask[None, :]
    return d, d_mask, n, n_mask, mask, n.to(tl.int64)[:, None] * STRIDE_N + d[None, :]


@triton.jit
def _group_rows(rows, mask, EVICT_FIRST: tl.constexpr):
    """A group's rows, read once: with EVICT_FIRST their cache lines go first (what else is in L2 stays)."""
    if EVICT_FIRST:
        x = tl.load(rows, mask=mask, other=0.0, eviction_policy="evict_first")
    else:
        x = tl.load(rows, mask=mask, other=0.0)
    return x


@triton.jit
def _depth_tile_softmax(rows, u, N, D, STRIDE_N, eps, d_mask, n, first, step, ACC: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PREFETCH: tl.constexpr,
                        EVICT_FIRST: tl.constexpr):
    """(m [1], denom [1], acc [BLOCK_D]) of the online softmax over the groups of BLOCK_N source rows that start at
    rows first, first + step, ... (step a multiple of BLOCK_N) of the token whose row 0 is at `rows`. PREFETCH:
    each group's rows are loaded one step ahead, while the group before is summed (two groups live)."""
    m = tl.full([1], float("-inf"), ACC)
    denom = tl.zeros([1], ACC)
    acc = tl.zeros([BLOCK_D], ACC)
    rows += tl.cast(STRIDE_N, tl.int64) * first
    if PREFETCH:
        x_next = _group_rows(rows, (n < N - first)[:, None] & d_mask[None, :], EVICT_FIRST)
    for n0 in range(first, N, step):
        in_group = n < N - n0
        if PREFETCH:
            x = x_next.to(ACC)
            rows += tl.cast(STRIDE_N, tl.int64) * step
            x_next = _group_rows(rows, (n < N - n0 - step)[:, None] & d_mask[None, :], EVICT_FIRST)
        else:
            x = _group_rows(rows, in_group[:, None] & d_mask[None, :], EVICT_FIRST).to(ACC)
            rows += tl.cast(STRIDE_N, tl.int64) * step
        s = tl.where(in_group, _row_logit(x, u, D, eps)[0], float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        ref = _finite_or_zero(m_new)
        rescale = tl.exp(m - ref)
        p = tl.exp(s - ref)
        denom = denom * rescale + tl.sum(p, axis=0)
        acc = acc * rescale + tl.sum(p[:, None] * x, axis=0)
        m = m_new
    return m, denom, acc


@triton.jit
def _depth_tile_token(t, rows, u, out_ptr, lse_ptr, N, D, STRIDE_N, eps, d, d_mask, n, ACC: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PREFETCH: tl.constexpr, EVICT_FIRST: tl.constexpr):
    """attn_res_fwd_depth_tile_kernel's work for token t ([1]) whose first source row starts at `rows`."""
    m, denom, acc = _depth_tile_softmax(rows, u, N, D, STRIDE_N, eps, d_mask, n, 0, BLOCK_N, ACC, BLOCK_N, BLOCK_D,
                                        PREFETCH, EVICT_FIRST)
    tl.store(out_ptr + (t * D)[:, None] + d[None, :], (acc / denom)[None, :].to(out_ptr.dtype.element_ty),
             mask=d_mask[None, :])
    tl.store(lse_ptr + t, m + tl.log(denom))


@triton.jit
def attn_res_fwd_depth_tile_kernel(
    v_ptr, q_ptr, w_ptr, out_ptr, lse_ptr, part_ptr,
    N, T, D, S1, S2, ST0, ST1, ST2, STRIDE_N, eps, eps_lo, splits,
    HAS_WEIGHT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, F64: tl.constexpr,
    DIM: tl.constexpr = 0, TOKENS: tl.constexpr = 0, SPLIT: tl.constexpr = False, PREFETCH: tl.constexpr = False,
    EVICT_FIRST: tl.constexpr = False,
):
    """attn_res_fwd_kernel's out and lse with BLOCK_N source rows of one token loaded at once
    ([BLOCK_N, BLOCK_D]): every row's load of a group is in flight together. BLOCK_N >= N: one group and a
    plain softmax over depth; else an online softmax across groups of BLOCK_N rows.
    TOKENS > 0: program pid takes tokens pid * TOKENS ... + TOKENS - 1 (grid = cdiv(T, TOKENS)); 0: tokens
    pid, pid + grid, ... DIM > 0: D as a compile-time constant (D == DIM). PREFETCH: a group's rows are loaded
    while the group before it is summed. EVICT_FIRST: the rows are loaded with the evict-first cache policy.
    SPLIT: a token's groups are split over `splits` programs (grid = T * splits; program pid takes token
    pid // splits and its groups pid % splits, + splits, ...), each writing its acc to part_ptr ([splits, T, D]
    ACC) and its (m, denom) after them ([splits, T, 2]) for attn_res_fwd_merge_kernel; out and lse are not
    written."""
    if DIM > 0:
        D = DIM
    ACC = tl.float64 if F64 else tl.float32
    eps = float_arg(eps, eps_lo, F64)
    pid = tl.program_id(0)
    d, d_mask, n, _, _, src = _depth_tile(N, D, STRIDE_N, BLOCK_N, BLOCK_D)
    u = _folded_query(q_ptr, w_ptr, d, d_mask, HAS_WEIGHT, ACC)
    if SPLIT:
        token = (pid // splits).to(tl.int64)
        segment = pid % splits
        t = token + tl.arange(0, 1).to(tl.int64)
        rows = v_ptr + _token_rows(t, S1, S2, ST0, ST1, ST2)[:, None] + src
        m, denom, acc = _depth_tile_softmax(rows, u, N, D, STRIDE_N, eps, d_mask, n, segment * BLOCK_N,
                                            splits * BLOCK_N, ACC, BLOCK_N, BLOCK_D, PREFETCH, EVICT_FIRST)
        at = segment * T + token
        tl.store(part_ptr + at * D + d, acc, mask=d_mask)
        stats = part_ptr + tl.cast(splits, tl.int64) * T * D + at * 2 + tl.arange(0, 1)
        tl.store(stats, m)
        tl.store(stats + 1, denom)
    elif TOKENS > 0:
        for i in tl.static_range(TOKENS):
            token = pid.to(tl.int64) * TOKENS + i
            if token < T:
                t = token + tl.arange(0, 1).to(tl.int64)  # [1]: the token as a tensor, on every frontend
                rows = v_ptr + _token_rows(t, S1, S2, ST0, ST1, ST2)[:, None] + src
                _depth_tile_token(t, rows, u, out_ptr, lse_ptr, N, D, STRIDE_N, eps, d, d_mask, n, ACC, BLOCK_N,
                                  BLOCK_D, PREFETCH, EVICT_FIRST)
    else:
        for token in range(pid, T, tl.num_programs(0)):
            t = token + tl.arange(0, 1).to(tl.int64)
            rows = v_ptr + _token_rows(t, S1, S2, ST0, ST1, ST2)[:, None] + src
            _depth_tile_token(t, rows, u, out_ptr, lse_ptr, N, D, STRIDE_N, eps, d, d_mask, n, ACC, BLOCK_N,
                              BLOCK_D, PREFETCH, EVICT_FIRST)


@triton.jit
def attn_res_fwd_merge_kernel(part_ptr, out_ptr, lse_ptr, T, D, splits, BLOCK_D: tl.constexpr, F64: tl.constexpr):
    """out and lse from the `splits` partial softmaxes of attn_res_fwd_depth_tile_kernel's SPLIT programs
    (part_ptr: their acc [splits, T, D], then their (m, denom) [splits, T, 2]), folded in segment order as the
    online softmax folds groups. Grid (T, cdiv(D, BLOCK_D))."""
    ACC = tl.float64 if F64 else tl.float32
    token = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = d < D
    m = tl.full([1], float("-inf"), ACC)
    denom = tl.zeros([1], ACC)
    acc = tl.zeros([BLOCK_D], ACC)
    part = part_ptr + token * D
    stats = part_ptr + tl.cast(splits, tl.int64) * T * D + token * 2 + tl.arange(0, 1)
    for _ in range(splits):
        m_s = tl.load(stats)
        denom_s = tl.load(stats + 1)
        acc_s = tl.load(part + d, mask=d_mask, other=0.0)
        m_new = tl.maximum(m, m_s)
        ref = _finite_or_zero(m_new)
        rescale = tl.exp(m - ref)
        weight = tl.exp(m_s - ref)
        denom = denom * rescale + denom_s * weight
        acc = acc * rescale + acc_s * weight
        m = m_new
        part += tl.cast(T, tl.int64) * D
        stats += tl.cast(T, tl.int64) * 2
    tl.store(out_ptr + token * D + d, (acc / denom).to(out_ptr.dtype.element_ty), mask=d_mask)
    if tl.program_id(1) == 0:
        tl.store(lse_ptr + token + tl.arange(0, 1), m + tl.log(denom))


@triton.jit
def _softmax_step(m, denom, g_out, logit, gv):
    """Online softmax over depth of the backward: running max, denominator and sum of p * <g, v>."""
    m_new = tl.maximum(m, logit)
    ref = _finite_or_zero(m_new)
    rescale = tl.exp(m - ref)
    p = tl.exp(logit - ref)
    return m_new, denom * rescale + p, g_out * rescale + p * gv


@triton.jit
def _row_grad(alpha, coef, k, x, g, u):
    """dL/dv_i = alpha_i g + coef_i (u - k_i v_i), with coef_i = ds_i rstd_i and k_i = s_i rstd_i / D."""
    return alpha[:, None] * g + coef[:, None] * (u[None, :] - k[:, None] * x)


@triton.jit
def _grad_row(x, g, u, logit, rstd, gv, lse, g_out, D):
    """(dL/dv_i, coef_i = ds_i * rstd_i, alpha_i, k_i) of one source row (see _row_grad). lse >= every
    logit, so the clamp changes nothing for a real row; a masked-off row (logit 0, rstd 0) then weighs
    at most 1 instead of overflowing exp(0 - lse) to inf when every logit is below -88, which would turn
    its zero terms into NaN. A select, not tl.minimum, whose NaN handling differs by backend: a NaN
    logit or lse gives alpha NaN (the reference's softmax), not 1 (a GPU's min(NaN, 0) is 0)."""
    alpha = tl.exp(tl.where(logit - lse > 0.0, 0.0, logit - lse))
    coef = alpha * (gv - g_out) * rstd
    k = logit * rstd / D
    return _row_grad(alpha, coef, k, x, g, u), coef, alpha, k


@triton.jit
def _stash_offsets(t0, d, D, DV_STEP, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """fp32 offsets from grad_values' start where the program whose first token is t0 stashes its
    partial sums of features d: in source rows 0..ROWS-1 of that token (ROWS = 4 / element size), laid
    out so that the reduction's program for features [c * BLOCK, (c + 1) * BLOCK) finds them in exactly
    those columns of those rows, which it then rewrites with their gradients."""
    if ROWS == 1:
        return t0 * D + d
    half: tl.constexpr = BLOCK // 2
    return ((d // half) % 2 * DV_STEP + t0 * D) // 2 + (d // BLOCK) * half + d % half


@triton.jit
def _keep_row_scalars(stats_ptr, pid, row, ok, alpha, coef, k, ROWS: tl.constexpr):
    """Where `ok`, keep the scalars (alpha, coef, k) of source row `row` of the program's first token in
    `stats_ptr` ([programs + 1, ROWS, 3] fp32) if that row will hold the stash: the reduction rewrites it.
    Elsewhere the address is the spare last entry: triton-ascend 3.2's interpreter ignores a one-element
    mask that is False (BLOCK_T = 1, N = 1), so no address may depend on the mask alone."""
    ok = ok & (row < ROWS)
    at = stats_ptr + tl.where(ok, pid * (3 * ROWS) + row * 3, tl.num_programs(0) * (3 * ROWS))
    tl.store(at, alpha, mask=ok)
    tl.store(at + 1, coef, mask=ok)
    tl.store(at + 2, k, mask=ok)


@triton.jit
def _store_partial(partial_ptr, dv_ptr, du, pid, t0, d, d_mask, D, DV_STEP,
                   STASH: tl.constexpr, STASH_BLOCK: tl.constexpr):
    """The program's fp32 partial sums of the query/weight gradient: its row of partial_ptr ([programs,
    D]), or with STASH > 0 its stash in grad_values (see _stash_offsets), once every thread's stores to
    those rows have landed."""
    if STASH > 0:
        tl.debug_barrier()
        stash = dv_ptr.to(tl.pointer_type(tl.float32), bitcast=True)
        tl.store(stash + _stash_offsets(t0, d, D, DV_STEP, STASH, STASH_BLOCK), du, mask=d_mask)
    else:
        tl.store(partial_ptr + pid * D + d, du, mask=d_mask)


@triton.jit
def attn_res_bwd_kernel(
    g_ptr, glse_ptr, v_ptr, q_ptr, w_ptr, dv_ptr, partial_ptr, stats_ptr,
    N, T, D, S1, S2, ST0, ST1, ST2, STRIDE_N, STAT_PLANE, DV_STEP, SLICE, eps, eps_lo,
    HAS_WEIGHT: tl.constexpr, HAS_DLSE: tl.constexpr, NEED_DV: tl.constexpr, NEED_DU: tl.constexpr,
    ONE_TILE: tl.constexpr,
    UNROLL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, F64: tl.constexpr,
    PHASE: tl.constexpr = 0,
):
    """Gradients of attn_res for a persistent program's token blocks, without the forward's statistics.

    Phase 1 reads each v_i once and recomputes rstd_i, the logit s_i and gv_i = <g, v_i> (kept in
    `stats_ptr`, [3, N, T] fp32), with an online softmax giving <g, out> = sum_j alpha_j gv_j in fp32
    (never from the rounded forward output). Phase 2 walks depth backwards, so the rows read last in
    phase 1 are read first again while they are still in L2, and writes
      dv_i = alpha_i g + ds_i rstd_i (u - s_i rstd_i v_i / D),  ds_i = alpha_i (gv_i - <g, out>),
    adding ds_i rstd_i v_i into this program's row of `partial_ptr` ([programs, D] fp32).
    ONE_TILE: a row fits on chip, so grad_out and the query are loaded once per token block, and
    UNROLL == 2 keeps two source rows in flight. Otherwise both phases walk D tiles.
    HAS_DLSE: glse_ptr holds the gradient of the forward's lse ([T] fp32).
    STAT_PLANE = N * T and DV_STEP = T * D are passed from the host so they cannot overflow int32; depth N-1's (or
    a slice's last row's) offsets are computed in int64.
    PHASE (D-tiled only; 0: both phases): few token blocks split their sources into slices of SLICE rows,
    program (p, s) owning slice s of block p, over two launches: PHASE 1 writes the slice's statistics, PHASE 2
    re-derives the softmax from all N and writes the slice's gradients, its partial sums in row
    p * num_programs(1) + s of `partial_ptr`.
    """
    ACC = tl.float64 if F64 else tl.float32
    eps = float_arg(eps, eps_lo, F64)
    pid = tl.program_id(0)
    num_blocks = tl.cdiv(T, BLOCK_T)
    for block in range(pid, num_blocks, tl.num_programs(0)):
        t = block * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
        t_mask = t < T
        rows = _token_rows(t, S1, S2, ST0, ST1, ST2)
        g_rows = g_ptr + t * D
        m = tl.full([BLOCK_T], float("-inf"), ACC)
        denom = tl.zeros([BLOCK_T], ACC)
        g_out = tl.zeros([BLOCK_T], ACC)
        sptrs = stats_ptr + t
        if ONE_TILE:
            d = tl.arange(0, BLOCK_D)
            d_mask = d < D
            mask = t_mask[:, None] & d_mask[None, :]
            u = _folded_query(q_ptr, w_ptr, d, d_mask, HAS_WEIGHT, ACC)
            g = tl.load(g_rows[:, None] + d[None, :], mask=mask, other=0.0).to(ACC)
            ptrs = v_ptr + rows[:, None] + d[None, :]
            for i in range(0, N, UNROLL):
                x = tl.load(ptrs, mask=mask, other=0.0).to(ACC)
                if UNROLL == 2:
                    has_next = i + 1 < N
                    x_next = tl.load(ptrs + STRIDE_N, mask=mask_if(has_next, mask), other=0.0).to(ACC)
                logit, rstd = _row_logit(x, u, D, eps)
                gv = tl.sum(x * g, axis=1)
                tl.store(sptrs, logit, mask=t_mask)
                tl.store(sptrs + STAT_PLANE, rstd, mask=t_mask)
                tl.store(sptrs + 2 * STAT_PLANE, gv, mask=t_mask)
                m, denom, g_out = _softmax_step(m, denom, g_out, logit, gv)
                if UNROLL == 2:
                    logit, rstd = _row_logit(x_next, u, D, eps)
                    gv = tl.sum(x_next * g, axis=1)
                    next_mask = mask_if(has_next, t_mask)
                    tl.store(sptrs + T, logit, mask=next_mask)
                    tl.store(sptrs + T + STAT_PLANE, rstd, mask=next_mask)
                    tl.store(sptrs + T + 2 * STAT_PLANE, gv, mask=next_mask)
                    m, denom, g_out = _softmax_step(m, denom, g_out, tl.where(has_next, logit, float("-inf")), gv)
                ptrs += tl.cast(STRIDE_N, tl.int64) * UNROLL
                sptrs += UNROLL * T
            g_out = g_out / denom
            if HAS_DLSE:  # d lse / d s_i = alpha_i: a gradient of lse shifts every ds_i by alpha_i * g_lse
                g_out -= tl.load(glse_ptr + t, mask=t_mask, other=0.0)
            lse = m + tl.log(denom)
            du = tl.zeros([BLOCK_D], ACC)
            last = tl.cast(N - 1, tl.int64)
            ptrs = v_ptr + last * STRIDE_N + rows[:, None] + d[None, :]
            dptrs = dv_ptr + last * DV_STEP + t[:, None] * D + d[None, :]
            sptrs = stats_ptr + last * T + t
            for j in range(0, N, UNROLL):
                x = tl.load(ptrs, mask=mask, other=0.0).to(ACC)
                logit = tl.load(sptrs, mask=t_mask, other=0.0)
                rstd = tl.load(sptrs + STAT_PLANE, mask=t_mask, other=0.0)
                gv = tl.load(sptrs + 2 * STAT_PLANE, mask=t_mask, other=0.0)
                if UNROLL == 2:
                    has_prev = j + 1 < N
                    prev_mask = mask_if(has_prev, t_mask)
                    x_prev = tl.load(ptrs - STRIDE_N, mask=mask_if(has_prev, mask), other=0.0).to(ACC)
                    logit_prev = tl.load(sptrs - T, mask=prev_mask, other=0.0)
                    rstd_prev = tl.load(sptrs - T + STAT_PLANE, mask=prev_mask, other=0.0)
                    gv_prev = tl.load(sptrs - T + 2 * STAT_PLANE, mask=prev_mask, other=0.0)
                dx, coef, _, _ = _grad_row(x, g, u, logit, rstd, gv, lse, g_out, D)
                if NEED_DV:
                    tl.store(dptrs, dx.to(dv_ptr.dtype.element_ty), mask=mask)
                if NEED_DU:
                    du += tl.sum(coef[:, None] * x, axis=0)
                if UNROLL == 2:
                    dx, coef, _, _ = _grad_row(x_prev, g, u, logit_prev, rstd_prev, gv_prev, lse, g_out, D)
                    if NEED_DV:
                        tl.store(dptrs - DV_STEP, dx.to(dv_ptr.dtype.element_ty), mask=mask_if(has_prev, mask))
                    if NEED_DU:
                        du += tl.sum(coef[:, None] * x_prev, axis=0)  # x_prev is 0 where masked
                ptrs -= tl.cast(STRIDE_N, tl.int64) * UNROLL
                dptrs -= tl.cast(DV_STEP, tl.int64) * UNROLL
                sptrs -= UNROLL * T
            if NEED_DU:
                pptrs = partial_ptr + pid * D + d
                tl.store(pptrs, tl.load(pptrs, mask=d_mask, other=0.0) + du, mask=d_mask)
        else:
            if PHASE == 0:
                lo = 0
                hi = N
                row_of = pid
            else:
                lo = tl.program_id(1) * SLICE
                hi = tl.minimum(lo + SLICE, N)
                row_of = pid * tl.num_programs(1) + tl.program_id(1)
            if PHASE != 2:
                base = v_ptr + rows + tl.cast(lo, tl.int64) * STRIDE_N
                sptrs = stats_ptr + t + tl.cast(lo, tl.int64) * T
                # not `_`: the body unpacks into `_` (Triton 3.2: one variable, two types)
                for _source in range(lo, hi):
                    sq = tl.zeros([BLOCK_T], ACC)
                    dot = tl.zeros([BLOCK_T], ACC)
                    gv = tl.zeros([BLOCK_T], ACC)
                    for d0 in range(0, D, BLOCK_D):
                        d = d0 + tl.arange(0, BLOCK_D)
                        d_mask = d < D
                        mask = t_mask[:, None] & d_mask[None, :]
                        u = _folded_query(q_ptr, w_ptr, d, d_mask, HAS_WEIGHT, ACC)
                        x = tl.load(base[:, None] + d[None, :], mask=mask, other=0.0).to(ACC)
                        g = tl.load(g_rows[:, None] + d[None, :], mask=mask, other=0.0).to(ACC)
                        sq += tl.sum(x * x, axis=1)
                        dot += tl.sum(x * u[None, :], axis=1)
                        gv += tl.sum(x * g, axis=1)
                    rstd = tl.rsqrt(sq / D + eps)
                    logit = dot * rstd
                    tl.store(sptrs, logit, mask=t_mask)
                    tl.store(sptrs + STAT_PLANE, rstd, mask=t_mask)
                    tl.store(sptrs + 2 * STAT_PLANE, gv, mask=t_mask)
                    if PHASE == 0:
                        m, denom, g_out = _softmax_step(m, denom, g_out, logit, gv)
                    base += STRIDE_N
                    sptrs += T
            if PHASE == 2:  # the softmax from every slice's statistics (launch 1), in depth order
                for _source in range(N):
                    logit = tl.load(sptrs, mask=t_mask, other=0.0)
                    gv = tl.load(sptrs + 2 * STAT_PLANE, mask=t_mask, other=0.0)
                    m, denom, g_out = _softmax_step(m, denom, g_out, logit, gv)
                    sptrs += T
            if PHASE != 1:
                g_out = g_out / denom
                if HAS_DLSE:  # d lse / d s_i = alpha_i: a gradient of lse shifts every ds_i by alpha_i * g_lse
                    g_out -= tl.load(glse_ptr + t, mask=t_mask, other=0.0)
                lse = m + tl.log(denom)
                last = tl.cast(hi - 1, tl.int64)
                for d0 in range(0, D, BLOCK_D):
                    d = d0 + tl.arange(0, BLOCK_D)
                    d_mask = d < D
                    mask = t_mask[:, None] & d_mask[None, :]
                    u = _folded_query(q_ptr, w_ptr, d, d_mask, HAS_WEIGHT, ACC)
                    g = tl.load(g_rows[:, None] + d[None, :], mask=mask, other=0.0).to(ACC)
                    du = tl.zeros([BLOCK_D], ACC)
                    ptrs = v_ptr + last * STRIDE_N + rows[:, None] + d[None, :]
                    dptrs = dv_ptr + last * DV_STEP + t[:, None] * D + d[None, :]
                    sptrs = stats_ptr + last * T + t
                    for _source in range(lo, hi):  # not `_` (above)
                        logit = tl.load(sptrs, mask=t_mask, other=0.0)
                        rstd = tl.load(sptrs + STAT_PLANE, mask=t_mask, other=0.0)
                        gv = tl.load(sptrs + 2 * STAT_PLANE, mask=t_mask, other=0.0)
                        x = tl.load(ptrs, mask=mask, other=0.0).to(ACC)
                        dx, coef, _, _ = _grad_row(x, g, u, logit, rstd, gv, lse, g_out, D)
                        if NEED_DV:
                            tl.store(dptrs, dx.to(dv_ptr.dtype.element_ty), mask=mask)
                        if NEED_DU:
                            du += tl.sum(coef[:, None] * x, axis=0)
                        ptrs -= STRIDE_N
                        dptrs -= DV_STEP
                        sptrs -= T
                    if NEED_DU:
                        pptrs = partial_ptr + row_of * D + d
                        tl.store(pptrs, tl.load(pptrs, mask=d_mask, other=0.0) + du, mask=d_mask)


# The one-pass backward defers rows whose weight alpha_i >= DEFER_ALPHA to the end of their token: at
# most WAITING_SLOTS of them (the weights sum to one). Their statistics wait in memory, in each
# program's [WAITING_SLOTS, 4, BLOCK_T] slots of `wait_ptr` (logit, rstd, <g, v_i> and the row index i,
# whose integer bits are stored as they are: exact for any N).
WAITING_SLOTS = 8
DEFER_ALPHA = tl.constexpr(0.125)
MAX_DEFERRED = tl.constexpr(WAITING_SLOTS)


def waiting_slots_elements(programs: int, block_t: int) -> int:
    """The size of the one-pass backward's `wait_ptr`."""
    return programs * WAITING_SLOTS * 4 * block_t


@triton.jit
def _add3(a0, a1, a2, b0, b1, b2):
    return a0 + b0, a1 + b1, a2 + b2


@triton.jit
def _one_pass_row(x, row_ok, g, u, lse, g_out, D, eps, count, g_out_exact, DEFER: tl.constexpr,
                  FUSED_SUMS: tl.constexpr = False):
    """One source row of the one-pass backward: its gradient against the rounded <g, out>, its term of
    the exact <g, out>, and whether it is a heavy row (alpha_i >= DEFER_ALPHA) to defer while a slot is
    free (coef 0, `written` False: the caller stores its statistics instead of its gradient). `early` =
    alpha_i rstd_i for a row written now (0 otherwise): the query gradient adds (<g, out>~ - <g, out>)
    early_i v_i later. Returns (dx, coef, written, early, defer, logit, rstd, <g, v_i>, the exact
    <g, out> so far, alpha_i, k_i (see _row_grad))."""
    if FUSED_SUMS:
        squares, dot_u, gv = tl.reduce((x * x, x * u[None, :], x * g), 1, _add3)
        logit, rstd = _logit_of_sums(squares, dot_u, D, eps)
    else:
        logit, rstd = _row_logit(x, u, D, eps)
        gv = tl.sum(x * g, axis=1)
    dx, coef, alpha, k = _grad_row(x, g, u, logit, rstd, gv, lse, g_out, D)
    g_out_exact += tl.where(row_ok, alpha * gv, 0.0)
    # `written` is spelled out rather than row_ok & ~defer: triton-ascend 3.2's interpreter cannot invert
    # (or combine with a constexpr) a boolean tensor. A NaN alpha fails both comparisons: such a row is not
    # deferred, so it is written (alpha != alpha), its gradient NaN.
    if DEFER:
        defer = row_ok & (alpha >= DEFER_ALPHA) & (count < MAX_DEFERRED)
        written = row_ok & ((alpha < DEFER_ALPHA) | (alpha != alpha) | (count >= MAX_DEFERRED))
    else:
        defer = count < 0
        written = row_ok
    early = tl.where(written, alpha * rstd, 0.0)
    return dx, tl.where(written, coef, 0.0), written, early, defer, logit, rstd, gv, g_out_exact, alpha, k


@triton.jit
def _waiting_row(wait_ptr, pid, w, ok, BLOCK_T: tl.constexpr):
    """(row index as int64, logit, rstd, <g, v>) in waiting slot w of each token of the program (zeros
    where not `ok`)."""
    slot = wait_ptr + (pid * MAX_DEFERRED + w) * (4 * BLOCK_T) + tl.arange(0, BLOCK_T)
    logit = tl.load(slot, mask=ok, other=0.0)
    rstd = tl.load(slot + BLOCK_T, mask=ok, other=0.0)
    gv = tl.load(slot + 2 * BLOCK_T, mask=ok, other=0.0)
    bits = tl.load(slot + 3 * BLOCK_T, mask=ok, other=0.0)
    return bits.to(tl.int64 if bits.dtype == tl.float64 else tl.int32, bitcast=True).to(tl.int64), logit, rstd, gv


@triton.jit
def _token_loads(g_ptr, out_ptr, v_ptr, io, src, mask, d, N, STRIDE_N, UNROLL: tl.constexpr):
    """A token block's grad_out and out tiles (at offsets io) and its first one or two source rows (at
    src, a [BLOCK_T] column of row offsets), as stored, zeros outside `mask` and past N; all loads issued
    before any is used."""
    g = tl.load(g_ptr + io, mask=mask, other=0.0)
    out = tl.load(out_ptr + io, mask=mask, other=0.0)
    x = tl.load(v_ptr + src[:, None] + d[None, :], mask=mask, other=0.0)
    x_next = x
    if UNROLL == 2:
        x_next = tl.load(v_ptr + (src + STRIDE_N)[:, None] + d[None, :], mask=mask_if(1 < N, mask), other=0.0)
    return g, out, x, x_next


@triton.jit
def attn_res_bwd_onepass_kernel(
    g_ptr, glse_ptr, out_ptr, lse_ptr, v_ptr, q_ptr, w_ptr, dv_ptr, partial_ptr, wait_ptr,
    N, T, D, S1, S2, ST0, ST1, ST2, STRIDE_N, DV_STEP, eps, eps_lo,
    HAS_WEIGHT: tl.constexpr, HAS_DLSE: tl.constexpr, NEED_DV: tl.constexpr, NEED_DU: tl.constexpr,
    DEFER: tl.constexpr, UNROLL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    STASH: tl.constexpr, STASH_BLOCK: tl.constexpr, F64: tl.constexpr, DIM: tl.constexpr = 0,
    PREFETCH: tl.constexpr = False, FUSED_SUMS: tl.constexpr = False,
):
    """Gradients of attn_res in one pass over values, given the forward's out and lse.

    sum_j alpha_j <g, v_j> = <g, out>, so with lse known each row's gradient
      dv_i = alpha_i g + ds_i rstd_i (u - s_i rstd_i v_i / D),  ds_i = alpha_i (<g, v_i> - <g, out> + g_lse)
    needs only that row: values are read once and grad_values written once. A whole row is on chip.
    The stored out is rounded (bf16: 2^-9), and <g, v_i> - <g, out> cancels for a row that dominates
    the softmax, so the rounding alone would cost such a row ~10% of its gradient. DEFER (out not fp32):
    a row with alpha_i >= 1/8 is not written in the pass; its statistics wait in the program's slots of
    `wait_ptr` (waiting_slots_elements) until the pass has summed the exact <g, out> = sum_j alpha_j
    <g, v_j> in fp32, then it is re-read (it was just read, from L2) and written once. The rows written
    early carry alpha_i < 1/8 of the rounding in grad_values; the query gradient gets none of it: their
    summed alpha_i rstd_i v_i ([BLOCK_T, BLOCK_D], fp16: it is only ever scaled by that ~2^-9 error, and
    |alpha_i rstd_i v_i| <= sqrt(D)) is scaled by the error of the rounded <g, out> once it is known.
    Without that, the softmax gradients would no longer sum to zero and a query gradient that cancels
    would lose all precision.
    Each persistent program sums ds_i rstd_i v_i over its tokens in registers and writes its row of
    `partial_ptr` ([programs, D] fp32) once at the end, zeros if it had no token. STASH > 0: that row goes
    to grad_values instead (_store_partial; every program has a token) and partial_ptr keeps the scalars
    of the rows it overwrites. DIM > 0: D as a compile-time constant (D == DIM). PREFETCH: each step's
    loads are issued one step ahead. FUSED_SUMS: a row's three sums (x.x, x.u, x.g) in one reduction.
    """
    if DIM > 0:
        D = DIM
    ACC = tl.float64 if F64 else tl.float32
    INDEX = tl.int64 if F64 else tl.int32  # a waiting row's index, stored as ACC's bits
    eps = float_arg(eps, eps_lo, F64)
    pid = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < D
    # The folded query is loaded here, not through _folded_query: torch < 2.13's mutation analysis of a
    # traced kernel walks back from each store's address through helper calls (not through loads), and
    # the waiting rows' addresses derive from u; through a call it would count query and norm_weight as
    # written, which torch.compile then refuses for leaf inputs ("leaf Variable ... in-place operation").
    u = tl.load(q_ptr + d, mask=d_mask, other=0.0).to(ACC)
    if HAS_WEIGHT:
        u = u * tl.load(w_ptr + d, mask=d_mask, other=0.0).to(ACC)
    du = tl.zeros([BLOCK_D], ACC)
    for block in range(pid, tl.cdiv(T, BLOCK_T), tl.num_programs(0)):
        t = block * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
        t_mask = t < T
        mask = t_mask[:, None] & d_mask[None, :]
        io = t[:, None] * D + d[None, :]
        row0 = _token_rows(t, S1, S2, ST0, ST1, ST2)  # [BLOCK_T] offsets: no pointer tile is loop-carried
        if PREFETCH:  # the first rows are loaded beside g and out, each depth step's rows one step ahead
            g, out_tile, ahead, ahead_next = _token_loads(g_ptr, out_ptr, v_ptr, io, row0, mask, d, N, STRIDE_N, UNROLL)
        else:
            g = tl.load(g_ptr + io, mask=mask, other=0.0)
            out_tile = tl.load(out_ptr + io, mask=mask, other=0.0)
        g_out = tl.sum(g.to(ACC) * out_tile.to(ACC), axis=1)
        g_lse = tl.zeros([BLOCK_T], ACC)
        if HAS_DLSE:
            g_lse = tl.load(glse_ptr + t, mask=t_mask, other=0.0)
        g_out -= g_lse
        lse = tl.load(lse_ptr + t, mask=t_mask, other=0.0)
        g_out_exact = tl.zeros([BLOCK_T], ACC)
        count = tl.zeros([BLOCK_T], tl.int32)
        early_sum = tl.zeros([BLOCK_T, BLOCK_D], tl.float16)
        src = row0
        dst = t * D
        first = t == pid * BLOCK_T  # the program's first token, where the stash goes
        # UNROLL == 2 keeps two independent rows in flight: the loop is latency-bound otherwise.
        for i in range(0, N, UNROLL):
            if UNROLL == 2:
                has_next = i + 1 < N
            if PREFETCH:
                x_raw = ahead
                step = src + tl.cast(STRIDE_N, tl.int64) * UNROLL
                ahead = tl.load(v_ptr + step[:, None] + d[None, :], mask=mask_if(i + UNROLL < N, mask), other=0.0)
                if UNROLL == 2:
                    x_next = ahead_next
                    ahead_next = tl.load(v_ptr + (step + STRIDE_N)[:, None] + d[None, :],
                                         mask=mask_if(i + 3 < N, mask), other=0.0)
            else:
                x_raw = tl.load(v_ptr + src[:, None] + d[None, :], mask=mask, other=0.0)
                if UNROLL == 2:
                    x_next = tl.load(v_ptr + (src + STRIDE_N)[:, None] + d[None, :], mask=mask_if(has_next, mask),
                                     other=0.0)
            x = x_raw.to(ACC)
            dx, coef, written, early, defer, logit, rstd, gv, g_out_exact, alpha, k = _one_pass_row(
                x, t_mask, g, u, lse, g_out, D, eps, count, g_out_exact, DEFER, FUSED_SUMS)
            if DEFER:
                slot = wait_ptr + (pid * MAX_DEFERRED + count) * (4 * BLOCK_T) + tl.arange(0, BLOCK_T)
                tl.store(slot, logit, mask=defer)
                tl.store(slot + BLOCK_T, rstd, mask=defer)
                tl.store(slot + 2 * BLOCK_T, gv, mask=defer)
                tl.store(slot + 3 * BLOCK_T, (tl.zeros([BLOCK_T], INDEX) + i).to(ACC, bitcast=True), mask=defer)
                count += defer.to(tl.int32)
            if NEED_DV:
                tl.store(dv_ptr + dst[:, None] + d[None, :], dx.to(dv_ptr.dtype.element_ty),
                         mask=mask & written[:, None])
                if STASH > 0:
                    if block == pid:  # uniform branches: once per program
                        if i < STASH:
                            _keep_row_scalars(partial_ptr, pid, i + tl.zeros([BLOCK_T], tl.int32), first & written,
                                              alpha, coef, k, STASH)
            if NEED_DU:
                du += tl.sum(coef[:, None] * x, axis=0)
                if DEFER:
                    early_sum = (early_sum + early[:, None] * x).to(tl.float16)
            if UNROLL == 2:
                x_next = x_next.to(ACC)
                dx, coef, written, early, defer, logit, rstd, gv, g_out_exact, alpha, k = _one_pass_row(
                    x_next, mask_if(has_next, t_mask), g, u, lse, g_out, D, eps, count, g_out_exact, DEFER, FUSED_SUMS)
                if DEFER:
                    slot = wait_ptr + (pid * MAX_DEFERRED + count) * (4 * BLOCK_T) + tl.arange(0, BLOCK_T)
                    tl.store(slot, logit, mask=defer)
                    tl.store(slot + BLOCK_T, rstd, mask=defer)
                    tl.store(slot + 2 * BLOCK_T, gv, mask=defer)
                    tl.store(slot + 3 * BLOCK_T, (tl.zeros([BLOCK_T], INDEX) + i + 1).to(ACC, bitcast=True),
                             mask=defer)
                    count += defer.to(tl.int32)
                if NEED_DV:
                    tl.store(dv_ptr + (dst + DV_STEP)[:, None] + d[None, :], dx.to(dv_ptr.dtype.element_ty),
                             mask=mask & written[:, None])
                    if STASH > 0:
                        if block == pid:
                            if i + 1 < STASH:
                                _keep_row_scalars(partial_ptr, pid, i + 1 + tl.zeros([BLOCK_T], tl.int32),
                                                  first & written, alpha, coef, k, STASH)
                if NEED_DU:
                    du += tl.sum(coef[:, None] * x_next, axis=0)  # x_next is 0 where masked
                    if DEFER:
                        early_sum = (early_sum + early[:, None] * x_next).to(tl.float16)
            src += tl.cast(STRIDE_N, tl.int64) * UNROLL
            dst += tl.cast(DV_STEP, tl.int64) * UNROLL
        if DEFER:
            g_out_exact -= g_lse
            if NEED_DU:
                du += tl.sum((g_out - g_out_exact)[:, None] * early_sum, axis=0)
            # Two waiting rows in flight per step (their re-reads come from L2; the tail is latency-bound).
            # The barriers: the slots are written and read by different threads.
            tl.debug_barrier()
            for w in range(0, tl.max(count, axis=0), 2):
                j, logit, rstd, gv = _waiting_row(wait_ptr, pid, w, t_mask & (w < count), BLOCK_T)
                j2, logit2, rstd2, gv2 = _waiting_row(wait_ptr, pid, w + 1, t_mask & (w + 1 < count), BLOCK_T)
                ok = mask & (w < count)[:, None]
                ok2 = mask & (w + 1 < count)[:, None]
                x = tl.load(v_ptr + (row0 + j * STRIDE_N)[:, None] + d[None, :], mask=ok, other=0.0).to(ACC)
                x2 = tl.load(v_ptr + (row0 + j2 * STRIDE_N)[:, None] + d[None, :], mask=ok2, other=0.0)
                dx, coef, alpha, k = _grad_row(x, g, u, logit, rstd, gv, lse, g_out_exact, D)
                if NEED_DV:
                    tl.store(dv_ptr + (t * D + j * DV_STEP)[:, None] + d[None, :], dx.to(dv_ptr.dtype.element_ty),
                             mask=ok)
                    if STASH > 0:
                        if block == pid:
                            _keep_row_scalars(partial_ptr, pid, j, first & t_mask & (w < count), alpha, coef, k,
                                              STASH)
                if NEED_DU:
                    du += tl.sum(coef[:, None] * x, axis=0)  # x is 0 where no row waits
                x2 = x2.to(ACC)
                dx, coef, alpha, k = _grad_row(x2, g, u, logit2, rstd2, gv2, lse, g_out_exact, D)
                if NEED_DV:
                    tl.store(dv_ptr + (t * D + j2 * DV_STEP)[:, None] + d[None, :], dx.to(dv_ptr.dtype.element_ty),
                             mask=ok2)
                    if STASH > 0:
                        if block == pid:
                            _keep_row_scalars(partial_ptr, pid, j2, first & t_mask & (w + 1 < count), alpha, coef, k,
                                              STASH)
                if NEED_DU:
                    du += tl.sum(coef[:, None] * x2, axis=0)
            tl.debug_barrier()
    if NEED_DU:
        t0 = pid.to(tl.int64) * BLOCK_T
        _store_partial(partial_ptr, dv_ptr, du, pid, t0, d, d_mask, D, DV_STEP, STASH, STASH_BLOCK)


@triton.jit
def attn_res_bwd_depth_tile_kernel(
    g_ptr, glse_ptr, v_ptr, q_ptr, w_ptr, dv_ptr, partial_ptr,
    N, T, D, S1, S2, ST0, ST1, ST2, STRIDE_N, DV_STEP, eps, eps_lo,
    HAS_WEIGHT: tl.constexpr, HAS_DLSE: tl.constexpr, NEED_DV: tl.constexpr, NEED_DU: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, STASH: tl.constexpr, STASH_BLOCK: tl.constexpr, F64: tl.constexpr,
):
    """Gradients of attn_res with all N source rows of one token on chip at once ([BLOCK_N, BLOCK_D],
    BLOCK_N >= N): the softmax over depth is exact in fp32 from the rows themselves, so neither the
    forward's out nor its lse is read; per token N + 1 rows are read and N written, the byte floor.
    Persistent: program pid takes tokens pid, pid + grid, ... and writes its row of fp32 partial sums
    of the query/weight gradient (partial_ptr, [grid, D]; with STASH > 0 in grad_values, as in the
    one-pass kernel)."""
    ACC = tl.float64 if F64 else tl.float32
    eps = float_arg(eps, eps_lo, F64)
    pid = tl.program_id(0)
    d, d_mask, n, n_mask, mask, src = _depth_tile(N, D, STRIDE_N, BLOCK_N, BLOCK_D)
    u = _folded_query(q_ptr, w_ptr, d, d_mask, HAS_WEIGHT, ACC)
    du = tl.zeros([BLOCK_D], ACC)
    dst = n.to(tl.int64)[:, None] * DV_STEP + d[None, :]
    for token in range(pid, T, tl.num_programs(0)):
        t = token + tl.arange(0, 1).to(tl.int64)  # [1]: the token as a tensor, on every frontend
        g = tl.load(g_ptr + t[:, None] * D + d[None, :], mask=d_mask[None, :], other=0.0).to(ACC)
        x = tl.load(v_ptr + _token_rows(t, S1, S2, ST0, ST1, ST2)[:, None] + src, mask=mask, other=0.0)
        x = x.to(ACC)
        logit, rstd = _row_logit(x, u, D, eps)
        gv = tl.sum(x * g, axis=1)
        s = tl.where(n_mask, logit, float("-inf"))
        p = tl.exp(s - _finite_or_zero(tl.max(s, axis=0)))
        alpha = p / tl.sum(p, axis=0)
        # d loss / d logit_i = alpha_i * (<g, v_i> - <g, out> + grad_lse)
        g_out = tl.sum(alpha * gv, axis=0)
        if HAS_DLSE:
            g_out -= tl.sum(tl.load(glse_ptr + t), axis=0)
        coef = alpha * (gv - g_out) * rstd
        if NEED_DV:
            k = logit * rstd / D
            tl.store(dv_ptr + (t * D)[:, None] + dst, _row_grad(alpha, coef, k, x, g, u).to(dv_ptr.dtype.element_ty),
                     mask=mask)
            if STASH > 0:
                if token == pid:  # uniform: once per program
                    _keep_row_scalars(partial_ptr, pid, n, n_mask, alpha, coef, k, STASH)
        if NEED_DU:
            du += tl.sum(coef[:, None] * x, axis=0)
    if NEED_DU:
        _store_partial(partial_ptr, dv_ptr, du, pid, pid.to(tl.int64), d, d_mask, D, DV_STEP, STASH, STASH_BLOCK)


@triton.jit
def attn_res_param_grad_kernel(
    partial_ptr, q_ptr, w_ptr, dq_ptr, dw_ptr, g_ptr, v_ptr, dv_ptr,
    P, D, T0_STEP, S1, S2, ST0, ST1, ST2, STRIDE_N, DV_STEP,
    HAS_WEIGHT: tl.constexpr, NEED_DQ: tl.constexpr, NEED_DW: tl.constexpr, STASH: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, REWRITE_P: tl.constexpr, F64: tl.constexpr,
):
    """du = sum over programs of the partial rows, in a fixed order; dq = du * w, dw = du * q.

    STASH > 0: program p's row is stashed in grad_values, in source rows 0..STASH-1 of its first token
    p * T0_STEP (see _stash_offsets), and partial_ptr holds those rows' scalars ([P, STASH, 3]). This
    program reads its BLOCK_D columns of the stash and then rewrites exactly those columns of those rows
    with their gradients (g and v are grad_out and values, v walked as in the backward kernels),
    REWRITE_P tokens at a time."""
    ACC = tl.float64 if F64 else tl.float32
    pid = tl.program_id(0)
    stash = dv_ptr.to(tl.pointer_type(tl.float32), bitcast=True)
    for d0 in range(pid * BLOCK_D, D, tl.num_programs(0) * BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        d_mask = d < D
        du = tl.zeros([BLOCK_D], ACC)
        for p0 in range(0, P, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)
            mask = (p < P)[:, None] & d_mask[None, :]
            if STASH > 0:
                at = stash + _stash_offsets((p.to(tl.int64) * T0_STEP)[:, None], d[None, :], D, DV_STEP, STASH,
                                            BLOCK_D)
            else:
                at = partial_ptr + p[:, None] * D + d[None, :]
            du += tl.sum(tl.load(at, mask=mask, other=0.0), axis=0)
        if NEED_DQ:
            dq = du
            if HAS_WEIGHT:
                dq = du * tl.load(w_ptr + d, mask=d_mask, other=0.0).to(ACC)
            tl.store(dq_ptr + d, as_stored(dq, dq_ptr), mask=d_mask)
        if NEED_DW:
            dw = du * tl.load(q_ptr + d, mask=d_mask, other=0.0).to(ACC)
            tl.store(dw_ptr + d, as_stored(dw, dw_ptr), mask=d_mask)
        if STASH > 0:
            tl.debug_barrier()  # every thread has read its part of the stash before any row is rewritten
            u = _folded_query(q_ptr, w_ptr, d, d_mask, HAS_WEIGHT, ACC)
            for p0 in range(0, P, REWRITE_P):
                p = p0 + tl.arange(0, REWRITE_P)
                p_ok = p < P
                mask = p_ok[:, None] & d_mask[None, :]
                t = p.to(tl.int64) * T0_STEP
                g = tl.load(g_ptr + t[:, None] * D + d[None, :], mask=mask, other=0.0).to(ACC)
                src = _token_rows(t, S1, S2, ST0, ST1, ST2)
                for r in tl.static_range(STASH):
                    x = tl.load(v_ptr + (src + r * STRIDE_N)[:, None] + d[None, :], mask=mask, other=0.0)
                    at = partial_ptr + p * (3 * STASH) + 3 * r
                    alpha = tl.load(at, mask=p_ok, other=0.0)
                    coef = tl.load(at + 1, mask=p_ok, other=0.0)
                    k = tl.load(at + 2, mask=p_ok, other=0.0)
                    dx = _row_grad(alpha, coef, k, x.to(ACC), g, u)
                    tl.store(dv_ptr + (r * DV_STEP + t * D)[:, None] + d[None, :], dx.to(dv_ptr.dtype.element_ty),
                             mask=mask)
