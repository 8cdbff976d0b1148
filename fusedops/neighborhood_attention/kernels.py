"""Triton kernels for neighborhood attention. One source for the CUDA and the Ascend plans.

Every problem is seen as 3-D: the host pads 1-D and 2-D problems with axes of length 1 (kernel 1,
dilation 1, stride 1). A tile is a box of positions BM0 x BM1 x BM2 (flattened row-major into
BLOCK_M = BM0*BM1*BM2 rows) taken inside ONE dilation group per axis, so a tile never mixes groups
and the neighbourhood test is plain interval arithmetic on within-group coordinates:
    original position = within-group index * dilation + group.
A query tile walks only the key boxes (BN0 x BN1 x BN2) that cover the union of its rows' windows,
masks per element (per-axis interval compares, or in 2-D/3-D one AND of per-row bit sets over the key
box: _window_bits; none for a key box inside the window every row shares, with INSIDE: _box_masked), and keeps
an online softmax in base 2. The backward walks, for each key tile,
exactly the queries whose windows reach it (per axis, the closed-form inverse of the monotone
window ends; each query chunk also tested against the box, a test the exact spans make redundant
and the plan may drop: WALK_TESTS), accumulating dK/dV in registers over all query heads of its GQA
group: no atomics. A 1-D problem with a narrow window
takes one fused backward kernel instead (na_bwd_fused_1d_kernel: owned rows plus a halo).

q may hold only a box of the key grid (the op's query_offset): per axis the box's first position QO and length
QL; query tiles cover each dilation group's queries in the box (_query_range), and the dK/dV walk cuts each key
tile's query span to them (_clipped_span). q, out, lse, delta and dq are addressed at box positions. BOX (a
constexpr) is off where q covers the key grid, which then compiles without the offsets.

All tensor offsets are int64; q/k/v/grad_out are read through their own (batch, head, axis) strides,
so a permuted heads-last view runs without a copy. out, lse, delta and the gradients are contiguous.

Non-finite values: tl.dot over a tile multiplies a masked pair's zero weight by the key's (or the query's)
values too, and IEEE's 0 * inf = NaN would leak one inf or NaN into every row of the tile. Each kernel flags
the rows (keys, in dK/dV) whose tile result came out non-finite (a sum per row, _nonfinite_rows); after its
tile loop, if any is flagged, it takes every stored row that holds an inf or NaN again, one window pair at a
time (_exact_out_row, _exact_dq_row, _exact_dkdv_key): results depend only on the window, as in the
reference. F64: float64 inputs, with float64 dots, accumulators and softmax statistics (else float32).
"""

import triton
import triton.language as tl

from fusedops.tl_helpers import float_arg, mask_if

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _window(i, lg, K, ST, CAUSAL, TRUNCATED: tl.constexpr):
    """Inclusive within-group key window [lo, hi] of within-group query index i (scalar or tensor)."""
    if TRUNCATED:
        lo = tl.maximum(i - tl.where(CAUSAL != 0, K - 1, K // 2), 0)
        hi = tl.where(CAUSAL != 0, i, tl.minimum(i + K // 2, lg - 1))
    else:
        c = tl.minimum((i // ST) * ST + tl.where(CAUSAL != 0, ST - 1, ST // 2), lg - 1)
        lo_shift = tl.minimum(tl.maximum(c - K // 2, 0), lg - K)
        lo = tl.where(CAUSAL != 0, tl.maximum(c - K + 1, 0), lo_shift)
        hi = tl.where(CAUSAL != 0, i, lo_shift + K - 1)
    return lo, hi


@triton.jit
def _query_span(jl, jh, lg, K, ST, CAUSAL, TRUNCATED: tl.constexpr):
    """The exact range [first, last] of within-group queries whose windows hold any key in [jl, jh]
    (first > last when none does), in closed form: both window ends of _window are nondecreasing in
    the query, so `first` inverts hi(i) >= jl and `last` inverts lo(i) <= jh. Scalars or tensors."""
    if TRUNCATED:  # stride 1: lo = max(i - before, 0), hi = i (causal) or min(i + K//2, lg - 1)
        first = tl.where(CAUSAL != 0, jl, tl.maximum(jl - K // 2, 0))
        last = tl.minimum(jh + tl.where(CAUSAL != 0, K - 1, K // 2), lg - 1)
    else:
        # Non-causal: hi = lo + K - 1 >= jl <=> lo >= jl - K + 1 =: a; when a > 0 that is
        # c(i) = (i // ST) * ST + ST // 2 >= a + K // 2 (<= lg - 1, so the clamps never decide it).
        a = jl - K + 1
        first_nc = tl.where(a > 0, (a + K // 2 - ST // 2 + ST - 1) // ST * ST, 0)
        # lo <= jh holds for every query once jh >= lg - K; otherwise it is c(i) - K // 2 <= jh.
        # Causal: hi = i, and lo = c(i) - K + 1 <= jh with c(i) = (i // ST) * ST + ST - 1.
        e = jh + tl.where(CAUSAL != 0, K - 1, K // 2)
        group_last = (e - tl.where(CAUSAL != 0, ST - 1, ST // 2)) // ST * ST + ST - 1
        every = (e >= lg - 1) | ((jh >= lg - K) & (CAUSAL == 0))  # tensor first: CAUSAL may be a constant
        first = tl.where(CAUSAL != 0, jl, first_nc)
        last = tl.where(every, lg - 1, tl.minimum(group_last, lg - 1))
    return first, last


@triton.jit
def _clipped_span(jl, jh, lg, g, DL, QO, QL, K, ST, CAUSAL, TRUNCATED: tl.constexpr, BOX: tl.constexpr):
    """_query_span cut to the queries q holds (see _query_range)."""
    first, last = _query_span(jl, jh, lg, K, ST, CAUSAL, TRUNCATED)
    if BOX:
        q_first, q_last = _query_range(g, lg, DL, QO, QL, BOX)
        first, last = tl.maximum(first, q_first), tl.minimum(last, q_last)
    return first, last


@triton.jit
def _group_len(L, DIL, g):
    return L // DIL + tl.cast(g < L % DIL, tl.int32)  # tl.cast: also takes a constant (a padded axis)


@triton.jit
def _tile_axis(a, NB, DL, L, B: tl.constexpr, r):
    """One axis of a tile: (dilation group g, the group's length, the tile's first within-group index,
    the within-group index of each cell, the cell's original position), from the axis's tile index a
    (NB tiles per group) and the cells' in-box offsets r."""
    g = a // NB
    lg = _group_len(L, DL, g)
    start = (a % NB) * B
    i = start + r
    return g, lg, start, i, i * DL + g


@triton.jit
def _query_range(g, lg, DL, QO, QL, BOX: tl.constexpr):
    """Within-group indices [first, last] of dilation group g's queries (lg keys): positions QO .. QO + QL - 1
    of the key axis (the op's query_offset), or the whole group where q covers the key grid (not BOX: no
    runtime offsets in the code, which a measured 1-D forward ran 4-14% slower with). Both numerators stay
    >= 0 (Triton's integer division truncates)."""
    if BOX:
        first, last = (QO - g + DL - 1) // DL, (QO + QL - 1 - g + DL) // DL - 1
    else:
        first, last = 0, lg - 1
    return first, last


@triton.jit
def _query_tile_axis(a, NB, DL, L, QO, QL, B: tl.constexpr, r, BOX: tl.constexpr):
    """One axis of a query tile: (dilation group g, the group's key length, the tile's first within-group index,
    each cell's within-group index, its position in q (the key-axis position less QO), the group's last query),
    from the axis's tile index a (NB tiles per group) and the cells' in-box offsets r."""
    g = a // NB
    lg = _group_len(L, DL, g)
    first, last = _query_range(g, lg, DL, QO, QL, BOX)
    start = first + (a % NB) * B
    i = start + r
    return g, lg, start, i, _box_position(i, DL, g, QO, BOX), last


@triton.jit
def _box_position(i, DL, g, QO, BOX: tl.constexpr):
    """The position in q of within-group index i of dilation group g (its key-axis position less QO)."""
    if BOX:
        position = i * DL + g - QO
    else:
        position = i * DL + g
    return position


@triton.jit
def _tile_windows(i, start, last, lg, K, ST, CAUSAL, B: tl.constexpr, TRUNCATED: tl.constexpr):
    """Per-row key windows [lo, hi] of a query tile's cells (rows up to `last`), the key range [klo, khi] the
    whole tile needs and the keys [slo, shi] every row sees (window ends are nondecreasing in the query, so the
    first and last rows bound both; see _shared_window)."""
    lo, hi = _window(i, lg, K, ST, CAUSAL, TRUNCATED)
    klo, shi = _window(start, lg, K, ST, CAUSAL, TRUNCATED)
    slo, khi = _window(tl.minimum(start + B - 1, last), lg, K, ST, CAUSAL, TRUNCATED)
    return lo, hi, klo, khi, slo, shi


@triton.jit
def _shared_window(first, last, lg, K, ST, CAUSAL, TRUNCATED: tl.constexpr):
    """The keys [lo, hi] in the window of every query from first to last (both ends are nondecreasing in the
    query: the last query's lo, the first one's hi; empty when lo > hi)."""
    lo, _ = _window(last, lg, K, ST, CAUSAL, TRUNCATED)
    _, hi = _window(first, lg, K, ST, CAUSAL, TRUNCATED)
    return lo, hi


@triton.jit
def _box_masked(j00, j01, j02, slo0, shi0, slo1, shi1, slo2, shi2, BN0: tl.constexpr, BN1: tl.constexpr,
                BN2: tl.constexpr, NDIM: tl.constexpr, INSIDE: tl.constexpr):
    """Whether a key box starting at (j00, j01, j02) needs the window mask: always, unless INSIDE (Plan.
    unmasked_inside) and the box lies inside the shared window [slo, shi] on every axis, where every live row
    sees every cell (rows outside the tile read zeros and are not stored)."""
    if INSIDE:
        inside = (j02 >= slo2) & (j02 + BN2 - 1 <= shi2)
        if NDIM >= 2:
            inside = inside & (j01 >= slo1) & (j01 + BN1 - 1 <= shi1)
        if NDIM >= 3:
            inside = inside & (j00 >= slo0) & (j00 + BN0 - 1 <= shi0)
        return inside == 0
    else:
        return True


@triton.jit
def _key_cells(j0, j1, j2, khi0, khi1, khi2, g0, g1, g2, DL0, DL1, DL2, NDIM: tl.constexpr):
    """Which cells of a key box lie inside the key range (up to khi per axis), and their original
    positions per axis (int64)."""
    col_ok = j2 <= khi2
    if NDIM >= 2:
        col_ok = col_ok & (j1 <= khi1)
    if NDIM >= 3:
        col_ok = col_ok & (j0 <= khi0)
    return col_ok, (j0 * DL0 + g0).to(tl.int64), (j1 * DL1 + g1).to(tl.int64), (j2 * DL2 + g2).to(tl.int64)


@triton.jit
def _neighbours(row_ok, col_ok, j0, j1, j2, lo0, hi0, lo1, hi1, lo2, hi2, NDIM: tl.constexpr,
                ONE_COMPARE: tl.constexpr):
    """[query rows, key cells] mask: the key lies in the query's window on every axis. ONE_COMPARE (1-D
    plans only, see Plan.one_compare_mask) computes the same mask with one unsigned compare per element."""
    if ONE_COMPARE:
        # j - lo <= hi - lo as unsigned (below lo, j - lo wraps to a huge value). Cells outside the key
        # range sit at -1, below every window; rows outside the tile get the one-cell window at 2**30,
        # which no within-group position reaches.
        tl.static_assert(NDIM == 1, "ONE_COMPARE tests the last axis only")
        live = row_ok & (hi2 >= lo2)
        lo = tl.where(live, lo2, 1 << 30)
        width = tl.where(live, hi2 - lo2, 0)
        j = tl.where(col_ok, j2, -1)
        return (j[None, :] - lo[:, None]).to(tl.uint32, bitcast=True) <= width[:, None].to(tl.uint32, bitcast=True)
    ok = row_ok[:, None] & col_ok[None, :] & (j2[None, :] >= lo2[:, None]) & (j2[None, :] <= hi2[:, None])
    if NDIM >= 2:
        ok = ok & (j1[None, :] >= lo1[:, None]) & (j1[None, :] <= hi1[:, None])
    if NDIM >= 3:
        ok = ok & (j0[None, :] >= lo0[:, None]) & (j0[None, :] <= hi0[:, None])
    return ok


@triton.jit
def _span_bits(lo, hi, W: tl.constexpr):
    """Bits lo..hi of a W-bit field (W <= 30), clipped to the field; 0 where nothing is left. int32."""
    a = tl.maximum(lo, 0)
    b = tl.minimum(hi, W - 1)
    bits = (2 << tl.maximum(b, 0)) - (1 << tl.minimum(a, W - 1))
    return tl.where(a <= b, bits, 0)


@triton.jit
def _window_bits(row_ok, lo0, hi0, lo1, hi1, lo2, hi2, BN0: tl.constexpr, BN1: tl.constexpr, BN2: tl.constexpr,
                 NDIM: tl.constexpr):
    """Per query row, which cells of a key box its window holds, as one int32 bit set per row: a field
    per axis (axis 2's BN2 bits from bit 0, then axis 1's BN1, then axis 0's BN0), bit c of a field set
    when the box's c-th position on that axis lies in the window. lo/hi are relative to the box's first
    cell. Rows outside the tile hold no bits."""
    tl.static_assert(NDIM >= 2, "1-D plans test the window with one compare (ONE_COMPARE)")
    m = _span_bits(lo2, hi2, BN2) | (_span_bits(lo1, hi1, BN1) << BN2)
    if NDIM >= 3:
        tl.static_assert(BN0 + BN1 + BN2 <= 31, "the bit set is one int32")
        m = m | (_span_bits(lo0, hi0, BN0) << (BN1 + BN2))
    else:
        tl.static_assert(BN1 + BN2 <= 31, "the bit set is one int32")
    return tl.where(row_ok, m, 0)


@triton.jit
def _cell_bits(c0, c1, c2, BN1: tl.constexpr, BN2: tl.constexpr, NDIM: tl.constexpr):
    """Per key-box cell, its bit in each field of _window_bits: a cell is in a row's window when the
    row's bit set holds all of them (the mask is ((~row_bits) & cell_bits) == 0: one AND per element)."""
    bits = (1 << c2) | (1 << (BN2 + c1))
    if NDIM >= 3:
        bits = bits | (1 << (BN1 + BN2 + c0))
    return bits


@triton.jit
def _window_mask(row_ok, col_ok, j0, j1, j2, j00, j01, j02, c0, c1, c2, lo0, hi0, lo1, hi1, lo2, hi2,
                 BN0: tl.constexpr, BN1: tl.constexpr, BN2: tl.constexpr, NDIM: tl.constexpr, ONE_COMPARE: tl.constexpr,
                 MASK_BITS: tl.constexpr):
    """[query rows, key cells] mask of a key box whose first cell is (j00, j01, j02), its cells at offsets
    (c0, c1, c2) and positions (j0, j1, j2): the per-axis compares (_neighbours) or, with MASK_BITS, the rows'
    bit sets against the cells' (_window_bits, _cell_bits; the same mask)."""
    if MASK_BITS:
        m = _window_bits(row_ok, lo0 - j00, hi0 - j00, lo1 - j01, hi1 - j01, lo2 - j02, hi2 - j02, BN0, BN1, BN2,
                         NDIM)
        ok = ((~m)[:, None] & _cell_bits(c0, c1, c2, BN1, BN2, NDIM)[None, :]) == 0
    else:
        ok = _neighbours(row_ok, col_ok, j0, j1, j2, lo0, hi0, lo1, hi1, lo2, hi2, NDIM, ONE_COMPARE)
    return ok


@triton.jit
def _split_tile(t, H, T0, T1, T2):
    """Tile index -> (batch, head, per-axis tile index)."""
    a2 = t % T2
    t = t // T2
    a1 = t % T1
    t = t // T1
    a0 = t % T0
    t = t // T0
    return t // H, t % H, a0, a1, a2


@triton.jit
def _box(B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr):
    """Row-major coordinates of the BLOCK = B0*B1*B2 cells of a box."""
    r = tl.arange(0, B0 * B1 * B2)
    return r // (B1 * B2), (r // B2) % B1, r % B2


@triton.jit
def _finite_or_zero(m):
    """The reference point of an online softmax's exponentials for its running max m: m, or 0 where m is
    +-inf, as torch.logsumexp takes it. A row that has met no key yet (m = -inf) gets exp2(-inf) = 0, not
    exp2(-inf - -inf) = NaN, and lse comes out -inf (every logit -inf) or +inf (an infinite logit) as in
    the reference, where a finite sentinel for "masked" gave 0 and a finite lse."""
    return tl.where(tl.abs(m) == float("inf"), 0.0, m)


@triton.jit
def _nonfinite_rows(x, AXIS: tl.constexpr):
    """1 where a row (AXIS 1) or a column (AXIS 0) of the 2-D tile x may hold an inf or a NaN, else 0 (int32): its
    sum is then inf or NaN (and a NaN fails the compare). One add per element; a finite sum that overflows only
    flags a row for nothing, as do rows past the tile."""
    return tl.where(tl.abs(tl.sum(x, axis=AXIS)) < float("inf"), 0, 1)


@triton.jit
def _stored_nonfinite(row_ptr, n, ok, BLOCK: tl.constexpr):
    """Whether the n values stored at row_ptr hold an inf or a NaN (False where not ok: no row there)."""
    e = tl.arange(0, BLOCK)
    x = tl.load(row_ptr + e, mask=mask_if(ok, e < n), other=0.0)
    return tl.max(tl.where(tl.abs(x) < float("inf"), 0, 1), axis=0) > 0


@triton.jit
def _cell_offset(j0, j1, j2, g0, g1, g2, DL0, DL1, DL2, s0, s1, s2):
    """Element offset of the cell at within-group coordinates (j0, j1, j2) of groups (g0, g1, g2) (scalars)."""
    return (tl.cast(j0 * DL0 + g0, tl.int64) * s0 + tl.cast(j1 * DL1 + g1, tl.int64) * s1
            + tl.cast(j2 * DL2 + g2, tl.int64) * s2)  # tl.cast: padded axes pass constants


@triton.jit
def _tile_row(tile, r, H, G, T0, T1, T2, NB0, NB1, NB2, DL0, DL1, DL2, L0, L1, L2, QO0, QO1, QO2, QL0, QL1, QL2,
              BM0: tl.constexpr, BM1: tl.constexpr, BM2: tl.constexpr, BOX: tl.constexpr):
    """Row r of query tile `tile` in the tile walk of na_fwd_kernel and na_bwd_dq_kernel: its batch, head, kv head,
    within-group coordinates, dilation groups, positions in q (int64), flat row index, and whether it is a query."""
    b, h, a0, a1, a2 = _split_tile(tile, H, T0, T1, T2)
    g0, _, i00, _, _, last0 = _query_tile_axis(a0, NB0, DL0, L0, QO0, QL0, BM0, 0, BOX)
    g1, _, i01, _, _, last1 = _query_tile_axis(a1, NB1, DL1, L1, QO1, QL1, BM1, 0, BOX)
    g2, _, i02, _, _, last2 = _query_tile_axis(a2, NB2, DL2, L2, QO2, QL2, BM2, 0, BOX)
    i0, i1, i2 = i00 + r // (BM1 * BM2), i01 + (r // BM2) % BM1, i02 + r % BM2
    p0 = tl.cast(_box_position(i0, DL0, g0, QO0, BOX), tl.int64)
    p1 = tl.cast(_box_position(i1, DL1, g1, QO1, BOX), tl.int64)
    p2 = tl.cast(_box_position(i2, DL2, g2, QO2, BOX), tl.int64)
    flat = (b * H + h).to(tl.int64) * (QL0 * QL1 * QL2) + p0 * (QL1 * QL2) + p1 * QL2 + p2
    return b, h, h // G, i0, i1, i2, g0, g1, g2, p0, p1, p2, flat, (i0 <= last0) & (i1 <= last1) & (i2 <= last2)


@triton.jit
def _exact_out_row(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, q_row, k_base, v_base, flat, sk0, sk1, sk2, sv0, sv1, sv2,
                   i0, i1, i2, g0, g1, g2, L0, L1, L2, K0, K1, K2, DL0, DL1, DL2, ST0, ST1, ST2, C0, C1, C2, D, DV,
                   qk_scale, TRUNCATED: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """out and lse of one query (within-group coordinates i0..i2) taken key by key over its window, so that
    only its window's keys meet it: the exact path of na_fwd_kernel for a query whose tile result came out
    non-finite. In a tile, tl.dot multiplies every query by every key of the box, a key outside a query's
    window with weight 0, and IEEE's 0 * inf = NaN leaks an inf or NaN of that key into the query: a
    NaN row is thus either the query's own (a non-finite value in its window) or a leak, and this path
    gives the right one. Vectors and scalars only, run after the tile loop: finite inputs never take it, and
    it leaves the tile loop's registers as they were on sm_90 (a second, exact tile pass inside the loop, or
    this path there, raised them: 3 -> 2 programs per SM, kilobytes of spills)."""
    d = tl.arange(0, BLOCK_D)
    e = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + q_row + d, mask=d < D, other=0.0).to(qk_scale.dtype)
    lo0, hi0 = _window(i0, _group_len(L0, DL0, g0), K0, ST0, C0, TRUNCATED)
    lo1, hi1 = _window(i1, _group_len(L1, DL1, g1), K1, ST1, C1, TRUNCATED)
    lo2, hi2 = _window(i2, _group_len(L2, DL2, g2), K2, ST2, C2, TRUNCATED)
    m = tl.full([], float("-inf"), qk_scale.dtype)
    l = tl.zeros([], qk_scale.dtype)
    acc = tl.zeros([BLOCK_DV], qk_scale.dtype)
    for j0 in range(lo0, hi0 + 1):
        for j1 in range(lo1, hi1 + 1):
            for j2 in range(lo2, hi2 + 1):
                k = tl.load(k_ptr + k_base + _cell_offset(j0, j1, j2, g0, g1, g2, DL0, DL1, DL2, sk0, sk1, sk2) + d,
                            mask=d < D, other=0.0)
                v = tl.load(v_ptr + v_base + _cell_offset(j0, j1, j2, g0, g1, g2, DL0, DL1, DL2, sv0, sv1, sv2) + e,
                            mask=e < DV, other=0.0)
                s = tl.sum(q * k.to(qk_scale.dtype)) * qk_scale
                m_new = tl.maximum(m, s)
                ref = _finite_or_zero(m_new)
                alpha = tl.exp2(m - ref)
                p = tl.exp2(s - ref)
                l = l * alpha + p
                acc = acc * alpha + p * v.to(qk_scale.dtype)
                m = m_new
    tl.store(o_ptr + flat * DV + e, (acc / l).to(o_ptr.dtype.element_ty), mask=e < DV)
    tl.store(lse_ptr + flat, (m + tl.log2(l)) * 0.6931471805599453)


@triton.jit
def _query_delta(o_ptr, dlse_ptr, delta_ptr, do, flat, DV, HAS_DLSE: tl.constexpr, STORED: tl.constexpr,
                 BLOCK_DV: tl.constexpr):
    """delta = rowsum(dO * O) - dLSE of one query: from delta_ptr where the dQ kernel STORED it, else from
    its out row (do: its dO row, in the compute dtype)."""
    if STORED:
        delta = tl.load(delta_ptr + flat)
    else:
        e = tl.arange(0, BLOCK_DV)
        delta = tl.sum(do * tl.load(o_ptr + flat * DV + e, mask=e < DV, other=0.0).to(do.dtype))
        if HAS_DLSE:
            delta -= tl.load(dlse_ptr + flat).to(do.dtype)
    return delta


@triton.jit
def _exact_dq_row(q_ptr, k_ptr, v_ptr, do_ptr, o_ptr, lse_ptr, dlse_ptr, dq_ptr, q_row, do_row, k_base, v_base, flat,
                  sk0, sk1, sk2, sv0, sv1, sv2, i0, i1, i2, g0, g1, g2, L0, L1, L2, K0, K1, K2, DL0, DL1, DL2,
                  ST0, ST1, ST2, C0, C1, C2, D, DV, qk_scale, scale, TRUNCATED: tl.constexpr, HAS_DLSE: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """dQ of one query taken key by key over its window (see _exact_out_row): the exact path of the dQ and
    the fused 1-D kernels."""
    d = tl.arange(0, BLOCK_D)
    e = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + q_row + d, mask=d < D, other=0.0).to(qk_scale.dtype)
    do = tl.load(do_ptr + do_row + e, mask=e < DV, other=0.0).to(qk_scale.dtype)
    delta = _query_delta(o_ptr, dlse_ptr, dlse_ptr, do, flat, DV, HAS_DLSE, False, BLOCK_DV)
    lse2 = tl.load(lse_ptr + flat) * 1.4426950408889634
    lo0, hi0 = _window(i0, _group_len(L0, DL0, g0), K0, ST0, C0, TRUNCATED)
    lo1, hi1 = _window(i1, _group_len(L1, DL1, g1), K1, ST1, C1, TRUNCATED)
    lo2, hi2 = _window(i2, _group_len(L2, DL2, g2), K2, ST2, C2, TRUNCATED)
    dq = tl.zeros([BLOCK_D], qk_scale.dtype)
    for j0 in range(lo0, hi0 + 1):
        for j1 in range(lo1, hi1 + 1):
            for j2 in range(lo2, hi2 + 1):
                k = tl.load(k_ptr + k_base + _cell_offset(j0, j1, j2, g0, g1, g2, DL0, DL1, DL2, sk0, sk1, sk2) + d,
                            mask=d < D, other=0.0).to(qk_scale.dtype)
                v = tl.load(v_ptr + v_base + _cell_offset(j0, j1, j2, g0, g1, g2, DL0, DL1, DL2, sv0, sv1, sv2) + e,
                            mask=e < DV, other=0.0).to(qk_scale.dtype)
                p = tl.exp2(tl.sum(q * k) * qk_scale - lse2)
                dq += p * (tl.sum(do * v) - delta) * k
    tl.store(dq_ptr + flat * D + d, (dq * scale).to(dq_ptr.dtype.element_ty), mask=d < D)


@triton.jit
def _exact_dkdv_key(q_ptr, k_ptr, v_ptr, do_ptr, o_ptr, lse_ptr, dlse_ptr, delta_ptr, dk_ptr, dv_ptr, k_row, v_row,
                    flat_k, b, hk, H, G, sqb, sqh, sq0, sq1, sq2, sdb, sdh, sd0, sd1, sd2, j0, j1, j2, g0, g1, g2,
                    L0, L1, L2, QO0, QO1, QO2, QL0, QL1, QL2, K0, K1, K2, DL0, DL1, DL2, ST0, ST1, ST2, C0, C1, C2, D,
                    DV, qk_scale, scale, TRUNCATED: tl.constexpr, HAS_DLSE: tl.constexpr, DELTA_STORED: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BOX: tl.constexpr):
    """dK and dV of one key (within-group coordinates j0..j2) taken query by query over the queries whose
    windows hold it, every query head of its GQA group (see _exact_out_row): the exact path of the dK/dV and
    the fused 1-D kernels."""
    d = tl.arange(0, BLOCK_D)
    e = tl.arange(0, BLOCK_DV)
    k = tl.load(k_ptr + k_row + d, mask=d < D, other=0.0).to(qk_scale.dtype)
    v = tl.load(v_ptr + v_row + e, mask=e < DV, other=0.0).to(qk_scale.dtype)
    qs0, qe0 = _clipped_span(j0, j0, _group_len(L0, DL0, g0), g0, DL0, QO0, QL0, K0, ST0, C0,
                             TRUNCATED, BOX)
    qs1, qe1 = _clipped_span(j1, j1, _group_len(L1, DL1, g1), g1, DL1, QO1, QL1, K1, ST1, C1,
                             TRUNCATED, BOX)
    qs2, qe2 = _clipped_span(j2, j2, _group_len(L2, DL2, g2), g2, DL2, QO2, QL2, K2, ST2, C2,
                             TRUNCATED, BOX)
    dk = tl.zeros([BLOCK_D], qk_scale.dtype)
    dv = tl.zeros([BLOCK_DV], qk_scale.dtype)
    for gh in range(0, G):
        h = hk * G + gh
        for i0 in range(qs0, qe0 + 1):
            for i1 in range(qs1, qe1 + 1):
                for i2 in range(qs2, qe2 + 1):
                    p0 = tl.cast(_box_position(i0, DL0, g0, QO0, BOX), tl.int64)  # the query's position in q
                    p1 = tl.cast(_box_position(i1, DL1, g1, QO1, BOX), tl.int64)
                    p2 = tl.cast(_box_position(i2, DL2, g2, QO2, BOX), tl.int64)
                    q_row = b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + p0 * sq0 + p1 * sq1 + p2 * sq2
                    do_row = b.to(tl.int64) * sdb + h.to(tl.int64) * sdh + p0 * sd0 + p1 * sd1 + p2 * sd2
                    flat = (b * H + h).to(tl.int64) * (QL0 * QL1 * QL2) + p0 * (QL1 * QL2) + p1 * QL2 + p2
                    q = tl.load(q_ptr + q_row + d, mask=d < D, other=0.0).to(qk_scale.dtype)
                    do = tl.load(do_ptr + do_row + e, mask=e < DV, other=0.0).to(qk_scale.dtype)
                    delta = _query_delta(o_ptr, dlse_ptr, delta_ptr, do, flat, DV, HAS_DLSE, DELTA_STORED, BLOCK_DV)
                    p = tl.exp2(tl.sum(q * k) * qk_scale - tl.load(lse_ptr + flat) * 1.4426950408889634)
                    dv += p * do
                    dk += p * (tl.sum(do * v) - delta) * q
    tl.store(dk_ptr + flat_k * D + d, (dk * scale).to(dk_ptr.dtype.element_ty), mask=d < D)
    tl.store(dv_ptr + flat_k * DV + e, dv.to(dv_ptr.dtype.element_ty), mask=e < DV)


@triton.jit
def na_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
    sqb, sqh, sq0, sq1, sq2,
    skb, skh, sk0, sk1, sk2,
    svb, svh, sv0, sv1, sv2,
    H, G, D, DV,
    L0, L1, L2, QO0, QO1, QO2, QL0, QL1, QL2, K0, K1, K2, DL0, DL1, DL2, ST0, ST1, ST2, C0, C1, C2,
    NB0, NB1, NB2, num_tiles, qk_scale, qk_scale_lo,
    TRUNCATED: tl.constexpr, NDIM: tl.constexpr, ONE_COMPARE: tl.constexpr,
    BM0: tl.constexpr, BM1: tl.constexpr, BM2: tl.constexpr,
    BN0: tl.constexpr, BN1: tl.constexpr, BN2: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    MASK_BITS: tl.constexpr, INSIDE: tl.constexpr, F64: tl.constexpr, BOX: tl.constexpr,
):
    """out and lse per query tile: an online softmax over the key boxes that cover the tile's windows."""
    ACC = tl.float64 if F64 else tl.float32
    qk_scale = float_arg(qk_scale, qk_scale_lo, F64)
    pid = tl.program_id(0)
    T0 = DL0 * NB0
    T1 = DL1 * NB1
    T2 = DL2 * NB2
    S = QL0 * QL1 * QL2  # rows of q per head
    dq_off = tl.arange(0, BLOCK_D)
    dv_off = tl.arange(0, BLOCK_DV)
    d_mask = dq_off < D
    dv_mask = dv_off < DV
    r0, r1, r2 = _box(BM0, BM1, BM2)
    c0, c1, c2 = _box(BN0, BN1, BN2)
    redo = tl.zeros([BM0 * BM1 * BM2], tl.int32)  # rows that came out non-finite, in any tile
    for tile in range(pid, num_tiles, tl.num_programs(0)):
        b, h, a0, a1, a2 = _split_tile(tile, H, T0, T1, T2)
        hk = h // G
        g0, lg0, i00, i0, p0, last0 = _query_tile_axis(a0, NB0, DL0, L0, QO0, QL0, BM0, r0, BOX)
        g1, lg1, i01, i1, p1, last1 = _query_tile_axis(a1, NB1, DL1, L1, QO1, QL1, BM1, r1, BOX)
        g2, lg2, i02, i2, p2, last2 = _query_tile_axis(a2, NB2, DL2, L2, QO2, QL2, BM2, r2, BOX)
        row_ok = (i0 <= last0) & (i1 <= last1) & (i2 <= last2)
        q_rows = b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + p0.to(tl.int64) * sq0 + p1.to(tl.int64) * sq1 \
            + p2.to(tl.int64) * sq2
        q = tl.load(q_ptr + q_rows[:, None] + dq_off[None, :], mask=row_ok[:, None] & d_mask[None, :], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        # per-row windows, and the key range of the whole tile (windows are monotone in the query)
        lo2, hi2, klo2, khi2, slo2, shi2 = _tile_windows(i2, i02, last2, lg2, K2, ST2, C2, BM2, TRUNCATED)
        lo1, hi1, klo1, khi1, slo1, shi1 = 0, 0, 0, 0, 0, 0  # axes a 1-D or 2-D problem does not have
        lo0, hi0, klo0, khi0, slo0, shi0 = 0, 0, 0, 0, 0, 0
        if NDIM >= 2:
            lo1, hi1, klo1, khi1, slo1, shi1 = _tile_windows(i1, i01, last1, lg1, K1, ST1, C1, BM1, TRUNCATED)
        if NDIM >= 3:
            lo0, hi0, klo0, khi0, slo0, shi0 = _tile_windows(i0, i00, last0, lg0, K0, ST0, C0, BM0, TRUNCATED)
        kv_base_k = b.to(tl.int64) * skb + hk.to(tl.int64) * skh
        kv_base_v = b.to(tl.int64) * svb + hk.to(tl.int64) * svh
        m_i = tl.full([BM0 * BM1 * BM2], float("-inf"), ACC)
        l_i = tl.zeros([BM0 * BM1 * BM2], ACC)
        acc = tl.zeros([BM0 * BM1 * BM2, BLOCK_DV], ACC)
        for j00 in range(klo0, khi0 + 1, BN0):
            j0 = j00 + c0
            for j01 in range(klo1, khi1 + 1, BN1):
                j1 = j01 + c1
                for j02 in range(klo2, khi2 + 1, BN2):
                    j2 = j02 + c2
                    col_ok, pk0, pk1, pk2 = _key_cells(j0, j1, j2, khi0, khi1, khi2, g0, g1, g2, DL0, DL1, DL2, NDIM)
                    k_cols = kv_base_k + pk0 * sk0 + pk1 * sk1 + pk2 * sk2
                    v_cols = kv_base_v + pk0 * sv0 + pk1 * sv1 + pk2 * sv2
                    kt = tl.load(k_ptr + k_cols[None, :] + dq_off[:, None], mask=col_ok[None, :] & d_mask[:, None],
                                 other=0.0)
                    vt = tl.load(v_ptr + v_cols[:, None] + dv_off[None, :], mask=col_ok[:, None] & dv_mask[None, :],
                                 other=0.0)
                    if DOT_FP32:
                        kt = kt.to(tl.float32)
                        vt = vt.to(tl.float32)
                    s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
                    if _box_masked(j00, j01, j02, slo0, shi0, slo1, shi1, slo2, shi2, BN0, BN1, BN2, NDIM, INSIDE):
                        ok = _window_mask(row_ok, col_ok, j0, j1, j2, j00, j01, j02, c0, c1, c2, lo0, hi0, lo1, hi1,
                                          lo2, hi2, BN0, BN1, BN2, NDIM, ONE_COMPARE, MASK_BITS)
                        s = tl.where(ok, s, float("-inf"))
                    m_new = tl.maximum(m_i, tl.max(s, axis=1))
                    ref = _finite_or_zero(m_new)
                    alpha = tl.exp2(m_i - ref)
                    p = tl.exp2(s - ref[:, None])
                    l_i = l_i * alpha + tl.sum(p, axis=1)
                    acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
                    m_i = m_new
        # l_i = 0: every logit -inf (m_i = -inf) or a row past the tile. out = 0 / 0 = NaN and lse = -inf there, the
        # reference's results, spelt without 0 / 0 and log(0), which the interpreter warns about; NaN stays NaN.
        out = acc / tl.where(l_i == 0, float("nan"), l_i)[:, None]
        redo = tl.maximum(redo, _nonfinite_rows(out, 1))
        flat = (b * H + h).to(tl.int64) * S + (p0 * QL1 * QL2 + p1 * QL2 + p2).to(tl.int64)
        tl.store(o_ptr + flat[:, None] * DV + dv_off[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & dv_mask[None, :])
        lse = (m_i + tl.log2(tl.where(l_i == 0, 1.0, l_i))) * 0.6931471805599453
        tl.store(lse_ptr + flat, lse, mask=row_ok)
    if tl.max(redo, axis=0) > 0:  # maybe a leak: the program's non-finite rows again, exactly (_exact_out_row)
        tl.debug_barrier()  # every thread's stores have landed
        for tile in range(pid, num_tiles, tl.num_programs(0)):
            for r in range(0, BM0 * BM1 * BM2):
                b, h, hk, ri0, ri1, ri2, g0, g1, g2, rp0, rp1, rp2, flat_r, ok = _tile_row(
                    tile, r, H, G, T0, T1, T2, NB0, NB1, NB2, DL0, DL1, DL2, L0, L1, L2, QO0, QO1, QO2, QL0, QL1, QL2,
                    BM0, BM1, BM2, BOX)
                if _stored_nonfinite(o_ptr + flat_r * DV, DV, ok, BLOCK_DV):
                    q_row = b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + rp0 * sq0 + rp1 * sq1 + rp2 * sq2
                    _exact_out_row(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, q_row, b.to(tl.int64) * skb + hk.to(tl.int64)
                                   * skh, b.to(tl.int64) * svb + hk.to(tl.int64) * svh, flat_r, sk0, sk1, sk2, sv0, sv1,
                                   sv2, ri0, ri1, ri2, g0, g1, g2, L0, L1, L2, K0, K1, K2, DL0, DL1, DL2, ST0, ST1, ST2,
                                   C0, C1, C2, D, DV, qk_scale, TRUNCATED, BLOCK_D, BLOCK_DV)


@triton.jit
def na_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, o_ptr, lse_ptr, dlse_ptr, delta_ptr, dq_ptr,
    sqb, sqh, sq0, sq1, sq2,
    skb, skh, sk0, sk1, sk2,
    svb, svh, sv0, sv1, sv2,
    sdb, sdh, sd0, sd1, sd2,
    H, G, D, DV,
    L0, L1, L2, QO0, QO1, QO2, QL0, QL1, QL2, K0, K1, K2, DL0, DL1, DL2, ST0, ST1, ST2, C0, C1, C2,
    NB0, NB1, NB2, num_tiles, qk_scale, qk_scale_lo, scale, scale_lo,
    TRUNCATED: tl.constexpr, NDIM: tl.constexpr, ONE_COMPARE: tl.constexpr,
    BM0: tl.constexpr, BM1: tl.constexpr, BM2: tl.constexpr,
    BN0: tl.constexpr, BN1: tl.constexpr, BN2: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    HAS_DLSE: tl.constexpr, MASK_BITS: tl.constexpr, INSIDE: tl.constexpr, F64: tl.constexpr, BOX: tl.constexpr,
):
    """dQ_i = scale * sum_j p_ij (dO_i.v_j - delta_i) k_j per query tile, walking keys as the forward.
    delta_i = rowsum(dO_i * O_i) - dLSE_i (fp32) is computed here from the tile's own rows and stored
    for the dK/dV kernel, which runs after this one: query tiles cover every row exactly once."""
    ACC = tl.float64 if F64 else tl.float32
    qk_scale = float_arg(qk_scale, qk_scale_lo, F64)
    scale = float_arg(scale, scale_lo, F64)
    pid = tl.program_id(0)
    T0 = DL0 * NB0
    T1 = DL1 * NB1
    T2 = DL2 * NB2
    S = QL0 * QL1 * QL2  # rows of q per head
    dq_off = tl.arange(0, BLOCK_D)
    dv_off = tl.arange(0, BLOCK_DV)
    d_mask = dq_off < D
    dv_mask = dv_off < DV
    r0, r1, r2 = _box(BM0, BM1, BM2)
    c0, c1, c2 = _box(BN0, BN1, BN2)
    redo = tl.zeros([BM0 * BM1 * BM2], tl.int32)  # rows that came out non-finite, in any tile
    for tile in range(pid, num_tiles, tl.num_programs(0)):
        b, h, a0, a1, a2 = _split_tile(tile, H, T0, T1, T2)
        hk = h // G
        g0, lg0, i00, i0, p0, last0 = _query_tile_axis(a0, NB0, DL0, L0, QO0, QL0, BM0, r0, BOX)
        g1, lg1, i01, i1, p1, last1 = _query_tile_axis(a1, NB1, DL1, L1, QO1, QL1, BM1, r1, BOX)
        g2, lg2, i02, i2, p2, last2 = _query_tile_axis(a2, NB2, DL2, L2, QO2, QL2, BM2, r2, BOX)
        row_ok = (i0 <= last0) & (i1 <= last1) & (i2 <= last2)
        pos0 = p0.to(tl.int64)
        pos1 = p1.to(tl.int64)
        pos2 = p2.to(tl.int64)
        q_rows = b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + pos0 * sq0 + pos1 * sq1 + pos2 * sq2
        do_rows = b.to(tl.int64) * sdb + h.to(tl.int64) * sdh + pos0 * sd0 + pos1 * sd1 + pos2 * sd2
        q = tl.load(q_ptr + q_rows[:, None] + dq_off[None, :], mask=row_ok[:, None] & d_mask[None, :], other=0.0)
        do = tl.load(do_ptr + do_rows[:, None] + dv_off[None, :], mask=row_ok[:, None] & dv_mask[None, :], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        flat = (b * H + h).to(tl.int64) * S + (p0 * QL1 * QL2 + p1 * QL2 + p2).to(tl.int64)
        lse2 = tl.load(lse_ptr + flat, mask=row_ok, other=0.0) * 1.4426950408889634
        o = tl.load(o_ptr + flat[:, None] * DV + dv_off[None, :], mask=row_ok[:, None] & dv_mask[None, :], other=0.0)
        delta = tl.sum(o.to(ACC) * do.to(ACC), axis=1)
        if HAS_DLSE:
            delta -= tl.load(dlse_ptr + flat, mask=row_ok, other=0.0).to(ACC)
        tl.store(delta_ptr + flat, delta, mask=row_ok)
        # per-row windows, and the key range of the whole tile (windows are monotone in the query)
        lo2, hi2, klo2, khi2, slo2, shi2 = _tile_windows(i2, i02, last2, lg2, K2, ST2, C2, BM2, TRUNCATED)
        lo1, hi1, klo1, khi1, slo1, shi1 = 0, 0, 0, 0, 0, 0  # axes a 1-D or 2-D problem does not have
        lo0, hi0, klo0, khi0, slo0, shi0 = 0, 0, 0, 0, 0, 0
        if NDIM >= 2:
            lo1, hi1, klo1, khi1, slo1, shi1 = _tile_windows(i1, i01, last1, lg1, K1, ST1, C1, BM1, TRUNCATED)
        if NDIM >= 3:
            lo0, hi0, klo0, khi0, slo0, shi0 = _tile_windows(i0, i00, last0, lg0, K0, ST0, C0, BM0, TRUNCATED)
        kv_base_k = b.to(tl.int64) * skb + hk.to(tl.int64) * skh
        kv_base_v = b.to(tl.int64) * svb + hk.to(tl.int64) * svh
        dq = tl.zeros([BM0 * BM1 * BM2, BLOCK_D], ACC)
        for j00 in range(klo0, khi0 + 1, BN0):
            j0 = j00 + c0
            for j01 in range(klo1, khi1 + 1, BN1):
                j1 = j01 + c1
                for j02 in range(klo2, khi2 + 1, BN2):
                    j2 = j02 + c2
                    col_ok, pk0, pk1, pk2 = _key_cells(j0, j1, j2, khi0, khi1, khi2, g0, g1, g2, DL0, DL1, DL2, NDIM)
                    k_cols = kv_base_k + pk0 * sk0 + pk1 * sk1 + pk2 * sk2
                    v_cols = kv_base_v + pk0 * sv0 + pk1 * sv1 + pk2 * sv2
                    kt = tl.load(k_ptr + k_cols[None, :] + dq_off[:, None], mask=col_ok[None, :] & d_mask[:, None],
                                 other=0.0)
                    vt = tl.load(v_ptr + v_cols[None, :] + dv_off[:, None], mask=col_ok[None, :] & dv_mask[:, None],
                                 other=0.0)
                    if DOT_FP32:
                        kt = kt.to(tl.float32)
                        vt = vt.to(tl.float32)
                    s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
                    p = tl.exp2(s - lse2[:, None])
                    if _box_masked(j00, j01, j02, slo0, shi0, slo1, shi1, slo2, shi2, BN0, BN1, BN2, NDIM, INSIDE):
                        ok = _window_mask(row_ok, col_ok, j0, j1, j2, j00, j01, j02, c0, c1, c2, lo0, hi0, lo1, hi1,
                                          lo2, hi2, BN0, BN1, BN2, NDIM, ONE_COMPARE, MASK_BITS)
                        p = tl.where(ok, p, 0.0)
                    dp = tl.dot(do, vt, input_precision=PRECISION)
                    ds = p * (dp - delta[:, None])
                    dq += tl.dot(ds.to(kt.dtype), tl.trans(kt), input_precision=PRECISION)
        dq = dq * scale
        tl.store(dq_ptr + flat[:, None] * D + dq_off[None, :], dq.to(dq_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_mask[None, :])
        redo = tl.maximum(redo, _nonfinite_rows(dq, 1))
    if tl.max(redo, axis=0) > 0:  # maybe a leak: the program's non-finite rows again, exactly (see na_fwd_kernel)
        tl.debug_barrier()  # every thread's stores have landed
        for tile in range(pid, num_tiles, tl.num_programs(0)):
            for r in range(0, BM0 * BM1 * BM2):
                b, h, hk, ri0, ri1, ri2, g0, g1, g2, rp0, rp1, rp2, flat_r, ok = _tile_row(
                    tile, r, H, G, T0, T1, T2, NB0, NB1, NB2, DL0, DL1, DL2, L0, L1, L2, QO0, QO1, QO2, QL0, QL1, QL2,
                    BM0, BM1, BM2, BOX)
                if _stored_nonfinite(dq_ptr + flat_r * D, D, ok, BLOCK_D):
                    q_row = b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + rp0 * sq0 + rp1 * sq1 + rp2 * sq2
                    do_row = b.to(tl.int64) * sdb + h.to(tl.int64) * sdh + rp0 * sd0 + rp1 * sd1 + rp2 * sd2
                    _exact_dq_row(q_ptr, k_ptr, v_ptr, do_ptr, o_ptr, lse_ptr, dlse_ptr, dq_ptr, q_row, do_row,
                                  b.to(tl.int64) * skb + hk.to(tl.int64) * skh,
                                  b.to(tl.int64) * svb + hk.to(tl.int64) * svh, flat_r, sk0, sk1, sk2, sv0, sv1, sv2,
                                  ri0, ri1, ri2, g0, g1, g2, L0, L1, L2, K0, K1, K2, DL0, DL1, DL2, ST0, ST1, ST2, C0,
                                  C1, C2, D, DV, qk_scale, scale, TRUNCATED, HAS_DLSE, BLOCK_D, BLOCK_DV)


@triton.jit
def na_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
    sqb, sqh, sq0, sq1, sq2,
    skb, skh, sk0, sk1, sk2,
    svb, svh, sv0, sv1, sv2,
    sdb, sdh, sd0, sd1, sd2,
    H, HKV, G, D, DV,
    L0, L1, L2, QO0, QO1, QO2, QL0, QL1, QL2, K0, K1, K2, DL0, DL1, DL2, ST0, ST1, ST2, C0, C1, C2,
    NN0, NN1, NN2, num_tiles, qk_scale, qk_scale_lo, scale, scale_lo,
    TRUNCATED: tl.constexpr, NDIM: tl.constexpr, ONE_COMPARE: tl.constexpr,
    BM0: tl.constexpr, BM1: tl.constexpr, BM2: tl.constexpr,
    BN0: tl.constexpr, BN1: tl.constexpr, BN2: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    DK_BY_KEYS: tl.constexpr, MASK_BITS: tl.constexpr, WALK_TESTS: tl.constexpr, INSIDE: tl.constexpr,
    F64: tl.constexpr, BOX: tl.constexpr, KEYS_MAJOR: tl.constexpr = False,
):
    """Per key tile (BN box in one dilation group, one kv head): dV_j = sum_i p_ij dO_i and
    dK_j = scale sum_i dS_ij q_i over every query head of the GQA group and every query tile that can
    see the tile, in a fixed order (bitwise deterministic). DK_BY_KEYS accumulates dK as [keys, D] (dS^T q)
    instead of [D, keys] (q^T dS): the same sums, another register layout (see Plan.dk_by_keys).
    KEYS_MAJOR computes the scores transposed, [keys, queries] (k q^T, FlexAttention's dK/dV layout): P^T and
    dS^T are then the left operands of the dV and dK dots as computed, and dK is [keys, D] (see Plan.keys_major)."""
    DK_ROWS: tl.constexpr = DK_BY_KEYS or KEYS_MAJOR
    ACC = tl.float64 if F64 else tl.float32
    qk_scale = float_arg(qk_scale, qk_scale_lo, F64)
    scale = float_arg(scale, scale_lo, F64)
    pid = tl.program_id(0)
    T0 = DL0 * NN0
    T1 = DL1 * NN1
    T2 = DL2 * NN2
    S = L0 * L1 * L2
    dq_off = tl.arange(0, BLOCK_D)
    dv_off = tl.arange(0, BLOCK_DV)
    d_mask = dq_off < D
    dv_mask = dv_off < DV
    r0, r1, r2 = _box(BM0, BM1, BM2)
    c0, c1, c2 = _box(BN0, BN1, BN2)
    redo = tl.zeros([BN0 * BN1 * BN2], tl.int32)  # keys that came out non-finite, in any tile
    for tile in range(pid, num_tiles, tl.num_programs(0)):
        b, hk, a0, a1, a2 = _split_tile(tile, HKV, T0, T1, T2)
        g0, lg0, j00, j0, pk0 = _tile_axis(a0, NN0, DL0, L0, BN0, c0)
        g1, lg1, j01, j1, pk1 = _tile_axis(a1, NN1, DL1, L1, BN1, c1)
        g2, lg2, j02, j2, pk2 = _tile_axis(a2, NN2, DL2, L2, BN2, c2)
        col_ok = (j0 < lg0) & (j1 < lg1) & (j2 < lg2)
        k_cols = b.to(tl.int64) * skb + hk.to(tl.int64) * skh + pk0.to(tl.int64) * sk0 + pk1.to(tl.int64) * sk1 \
            + pk2.to(tl.int64) * sk2
        v_cols = b.to(tl.int64) * svb + hk.to(tl.int64) * svh + pk0.to(tl.int64) * sv0 + pk1.to(tl.int64) * sv1 \
            + pk2.to(tl.int64) * sv2
        if KEYS_MAJOR:  # k and v as [keys, D]: the left operands of the score and dP^T dots
            kt = tl.load(k_ptr + k_cols[:, None] + dq_off[None, :], mask=col_ok[:, None] & d_mask[None, :], other=0.0)
            vt = tl.load(v_ptr + v_cols[:, None] + dv_off[None, :], mask=col_ok[:, None] & dv_mask[None, :],
                         other=0.0)
        else:
            kt = tl.load(k_ptr + k_cols[None, :] + dq_off[:, None], mask=col_ok[None, :] & d_mask[:, None], other=0.0)
            vt = tl.load(v_ptr + v_cols[None, :] + dv_off[:, None], mask=col_ok[None, :] & dv_mask[:, None],
                         other=0.0)
        if DOT_FP32:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
        jl0 = j00
        jl1 = j01
        jl2 = j02
        jh0 = tl.minimum(j00 + BN0 - 1, lg0 - 1)
        jh1 = tl.minimum(j01 + BN1 - 1, lg1 - 1)
        jh2 = tl.minimum(j02 + BN2 - 1, lg2 - 1)
        qs2, qe2 = _clipped_span(jl2, jh2, lg2, g2, DL2, QO2, QL2, K2, ST2, C2, TRUNCATED, BOX)
        qs1 = 0
        qe1 = 0
        qs0 = 0
        qe0 = 0
        if NDIM >= 2:
            qs1, qe1 = _clipped_span(jl1, jh1, lg1, g1, DL1, QO1, QL1, K1, ST1, C1, TRUNCATED, BOX)
        if NDIM >= 3:
            qs0, qe0 = _clipped_span(jl0, jh0, lg0, g0, DL0, QO0, QL0, K0, ST0, C0, TRUNCATED, BOX)
        if DK_ROWS:
            dk = tl.zeros([BN0 * BN1 * BN2, BLOCK_D], ACC)
        else:
            dk = tl.zeros([BLOCK_D, BN0 * BN1 * BN2], ACC)
        dv = tl.zeros([BN0 * BN1 * BN2, BLOCK_DV], ACC)
        for gh in range(0, G):
            h = hk * G + gh
            q_base = b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
            do_base = b.to(tl.int64) * sdb + h.to(tl.int64) * sdh
            bh_flat = (b * H + h).to(tl.int64) * (QL0 * QL1 * QL2)
            for i00 in range(qs0, qe0 + 1, BM0):
                hit0 = True
                if NDIM >= 3:
                    lo_t0, _ = _window(i00, lg0, K0, ST0, C0, TRUNCATED)
                    _, hi_t0 = _window(tl.minimum(i00 + BM0 - 1, lg0 - 1), lg0, K0, ST0, C0, TRUNCATED)
                    hit0 = (lo_t0 <= jh0) & (hi_t0 >= jl0)
                if hit0:
                    i0 = i00 + r0
                    slo0, shi0 = _shared_window(i00, tl.minimum(i00 + BM0 - 1, qe0), lg0, K0, ST0, C0, TRUNCATED)
                    for i01 in range(qs1, qe1 + 1, BM1):
                        hit1 = True
                        if NDIM >= 2:
                            lo_t1, _ = _window(i01, lg1, K1, ST1, C1, TRUNCATED)
                            _, hi_t1 = _window(tl.minimum(i01 + BM1 - 1, lg1 - 1), lg1, K1, ST1, C1, TRUNCATED)
                            hit1 = (lo_t1 <= jh1) & (hi_t1 >= jl1)
                        if hit1:
                            i1 = i01 + r1
                            slo1, shi1 = _shared_window(i01, tl.minimum(i01 + BM1 - 1, qe1), lg1, K1, ST1, C1,
                                                        TRUNCATED)
                            for i02 in range(qs2, qe2 + 1, BM2):
                                hit2 = True  # the spans are exact: this test never skips (see WALK_TESTS)
                                if WALK_TESTS:
                                    lo_t2, _ = _window(i02, lg2, K2, ST2, C2, TRUNCATED)
                                    _, hi_t2 = _window(tl.minimum(i02 + BM2 - 1, lg2 - 1), lg2, K2, ST2, C2,
                                                       TRUNCATED)
                                    hit2 = (lo_t2 <= jh2) & (hi_t2 >= jl2)
                                if hit2:
                                    i2 = i02 + r2
                                    slo2, shi2 = _shared_window(i02, tl.minimum(i02 + BM2 - 1, qe2), lg2, K2, ST2,
                                                                C2, TRUNCATED)
                                    row_ok = (i0 <= qe0) & (i1 <= qe1) & (i2 <= qe2)
                                    p0 = _box_position(i0, DL0, g0, QO0, BOX).to(tl.int64)  # positions in q
                                    p1 = _box_position(i1, DL1, g1, QO1, BOX).to(tl.int64)
                                    p2 = _box_position(i2, DL2, g2, QO2, BOX).to(tl.int64)
                                    q_rows = q_base + p0 * sq0 + p1 * sq1 + p2 * sq2
                                    do_rows = do_base + p0 * sd0 + p1 * sd1 + p2 * sd2
                                    if KEYS_MAJOR:  # q as [D, queries]: the right operand of k q^T
                                        q = tl.load(q_ptr + q_rows[None, :] + dq_off[:, None],
                                                    mask=row_ok[None, :] & d_mask[:, None], other=0.0)
                                    else:
                                        q = tl.load(q_ptr + q_rows[:, None] + dq_off[None, :],
                                                    mask=row_ok[:, None] & d_mask[None, :], other=0.0)
                                    do = tl.load(do_ptr + do_rows[:, None] + dv_off[None, :],
                                                 mask=row_ok[:, None] & dv_mask[None, :], other=0.0)
                                    if DOT_FP32:
                                        q = q.to(tl.float32)
                                        do = do.to(tl.float32)
                                    flat = bh_flat + p0 * QL1 * QL2 + p1 * QL2 + p2
                                    lse2 = tl.load(lse_ptr + flat, mask=row_ok, other=0.0) * 1.4426950408889634
                                    delta = tl.load(delta_ptr + flat, mask=row_ok, other=0.0)
                                    if KEYS_MAJOR:
                                        s = tl.dot(kt, q, input_precision=PRECISION) * qk_scale
                                        p = tl.exp2(s - lse2[None, :])
                                    else:
                                        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
                                        p = tl.exp2(s - lse2[:, None])
                                    if _box_masked(j00, j01, j02, slo0, shi0, slo1, shi1, slo2, shi2, BN0, BN1, BN2,
                                                   NDIM, INSIDE):
                                        lo2, hi2 = _window(i2, lg2, K2, ST2, C2, TRUNCATED)
                                        lo1, hi1, lo0, hi0 = 0, 0, 0, 0
                                        if NDIM >= 2:
                                            lo1, hi1 = _window(i1, lg1, K1, ST1, C1, TRUNCATED)
                                        if NDIM >= 3:
                                            lo0, hi0 = _window(i0, lg0, K0, ST0, C0, TRUNCATED)
                                        ok = _window_mask(row_ok, col_ok, j0, j1, j2, j00, j01, j02, c0, c1, c2, lo0,
                                                          hi0, lo1, hi1, lo2, hi2, BN0, BN1, BN2, NDIM, ONE_COMPARE,
                                                          MASK_BITS)
                                        if KEYS_MAJOR:
                                            ok = tl.trans(ok)
                                        p = tl.where(ok, p, 0.0)
                                    if KEYS_MAJOR:
                                        dv += tl.dot(p.to(do.dtype), do, input_precision=PRECISION)
                                        dp = tl.dot(vt, tl.trans(do), input_precision=PRECISION)
                                        ds = p * (dp - delta[None, :])
                                        dk += tl.dot(ds.to(q.dtype), tl.trans(q), input_precision=PRECISION)
                                    else:
                                        dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PRECISION)
                                        dp = tl.dot(do, vt, input_precision=PRECISION)
                                        ds = p * (dp - delta[:, None])
                                        if DK_BY_KEYS:
                                            dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PRECISION)
                                        else:
                                            dk += tl.dot(tl.trans(q), ds.to(q.dtype), input_precision=PRECISION)
        flat_k = (b * HKV + hk).to(tl.int64) * S + (pk0 * L1 * L2 + pk1 * L2 + pk2).to(tl.int64)
        dk = dk * scale
        if DK_ROWS:
            tl.store(dk_ptr + flat_k[:, None] * D + dq_off[None, :], dk.to(dk_ptr.dtype.element_ty),
                     mask=col_ok[:, None] & d_mask[None, :])
        else:
            tl.store(dk_ptr + flat_k[None, :] * D + dq_off[:, None], dk.to(dk_ptr.dtype.element_ty),
                     mask=col_ok[None, :] & d_mask[:, None])
        tl.store(dv_ptr + flat_k[:, None] * DV + dv_off[None, :], dv.to(dv_ptr.dtype.element_ty),
                 mask=col_ok[:, None] & dv_mask[None, :])
        redo = tl.maximum(redo, _nonfinite_rows(dk, 1 if DK_ROWS else 0) | _nonfinite_rows(dv, 1))
    if tl.max(redo, axis=0) > 0:  # maybe a leak: the program's non-finite keys again, exactly (see na_fwd_kernel)
        tl.debug_barrier()  # every thread's stores have landed
        for tile in range(pid, num_tiles, tl.num_programs(0)):
            b, hk, a0, a1, a2 = _split_tile(tile, HKV, T0, T1, T2)
            g0, lg0, j00, _, _ = _tile_axis(a0, NN0, DL0, L0, BN0, 0)
            g1, lg1, j01, _, _ = _tile_axis(a1, NN1, DL1, L1, BN1, 0)
            g2, lg2, j02, _, _ = _tile_axis(a2, NN2, DL2, L2, BN2, 0)
            for c in range(0, BN0 * BN1 * BN2):
                cj0, cj1, cj2 = j00 + c // (BN1 * BN2), j01 + (c // BN2) % BN1, j02 + c % BN2
                flat_c = (b * HKV + hk).to(tl.int64) * S + _cell_offset(cj0, cj1, cj2, g0, g1, g2, DL0, DL1, DL2,
                                                                        L1 * L2, L2, 1)
                cell_ok = (cj0 < lg0) & (cj1 < lg1) & (cj2 < lg2)
                if _stored_nonfinite(dk_ptr + flat_c * D, D, cell_ok, BLOCK_D) | _stored_nonfinite(
                        dv_ptr + flat_c * DV, DV, cell_ok, BLOCK_DV):
                    k_row = b.to(tl.int64) * skb + hk.to(tl.int64) * skh + _cell_offset(
                        cj0, cj1, cj2, g0, g1, g2, DL0, DL1, DL2, sk0, sk1, sk2)
                    v_row = b.to(tl.int64) * svb + hk.to(tl.int64) * svh + _cell_offset(
                        cj0, cj1, cj2, g0, g1, g2, DL0, DL1, DL2, sv0, sv1, sv2)
                    _exact_dkdv_key(q_ptr, k_ptr, v_ptr, do_ptr, delta_ptr, lse_ptr, delta_ptr, delta_ptr, dk_ptr,
                                    dv_ptr, k_row, v_row, flat_c, b, hk, H, G, sqb, sqh, sq0, sq1, sq2, sdb, sdh, sd0,
                                    sd1, sd2, cj0, cj1, cj2, g0, g1, g2, L0, L1, L2, QO0, QO1, QO2, QL0, QL1, QL2, K0,
                                    K1, K2, DL0, DL1, DL2, ST0, ST1, ST2, C0, C1, C2, D, DV, qk_scale, scale, TRUNCATED,
                                    False, True, BLOCK_D, BLOCK_DV, BOX)


@triton.jit
def na_bwd_fused_1d_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, o_ptr, lse_ptr, dlse_ptr, dq_ptr, dk_ptr, dv_ptr,
    sqb, sqh, sq, skb, skh, sk, svb, svh, sv, sdb, sdh, sd,
    H, HKV, G, D, DV, L, K, DL, ST, CAUSAL, HALO, OWN, NB, num_tiles, qk_scale, qk_scale_lo, scale, scale_lo,
    TRUNCATED: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, HAS_DLSE: tl.constexpr, F64: tl.constexpr,
):
    """The whole backward of a 1-D problem with a narrow window, in one launch. A program owns OWN
    consecutive within-group positions of one (batch, kv head, dilation group) and loads the BLOCK =
    OWN + 2 * HALO rows around them, HALO being at least the largest |key - query| of any window: the
    owned queries' keys and the owned keys' queries all lie in the block, so one score block per query
    head gives dQ of the owned queries and dK/dV of the owned keys (summed over the GQA group's heads in
    order). delta = rowsum(dO * O) - dLSE is recomputed per row; nothing goes through memory twice
    except the halo rows. Deterministic: every output row is written once by its owner."""
    ACC = tl.float64 if F64 else tl.float32
    qk_scale = float_arg(qk_scale, qk_scale_lo, F64)
    scale = float_arg(scale, scale_lo, F64)
    pid = tl.program_id(0)
    dq_off = tl.arange(0, BLOCK_D)
    dv_off = tl.arange(0, BLOCK_DV)
    d_mask = dq_off < D
    dv_mask = dv_off < DV
    redo_q = tl.zeros([BLOCK], tl.int32)  # owned rows whose dQ came out non-finite, any head and tile
    redo_k = tl.zeros([BLOCK], tl.int32)  # and owned keys (dK or dV)
    for tile in range(pid, num_tiles, tl.num_programs(0)):
        b, hk, _, g, t = _split_tile(tile, HKV, 1, DL, NB)  # block t of dilation group g
        lg = _group_len(L, DL, g)
        first = t * OWN
        i = first - HALO + tl.arange(0, BLOCK)  # within-group coordinates of the block's rows
        valid = (i >= 0) & (i < lg)
        own = valid & (i >= first) & (i < first + OWN)
        pos = tl.where(valid, i * DL + g, 0).to(tl.int64)
        lo, hi = _window(i, lg, K, ST, CAUSAL, TRUNCATED)
        ok = valid[:, None] & valid[None, :] & (i[None, :] >= lo[:, None]) & (i[None, :] <= hi[:, None])
        k_cols = b.to(tl.int64) * skb + hk.to(tl.int64) * skh + pos * sk
        v_cols = b.to(tl.int64) * svb + hk.to(tl.int64) * svh + pos * sv
        kt = tl.load(k_ptr + k_cols[None, :] + dq_off[:, None], mask=valid[None, :] & d_mask[:, None], other=0.0)
        vt = tl.load(v_ptr + v_cols[None, :] + dv_off[:, None], mask=valid[None, :] & dv_mask[:, None], other=0.0)
        if DOT_FP32:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
        dk = tl.zeros([BLOCK, BLOCK_D], ACC)
        dv = tl.zeros([BLOCK, BLOCK_DV], ACC)
        for gh in range(0, G):
            h = hk * G + gh
            q_rows = b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + pos * sq
            do_rows = b.to(tl.int64) * sdb + h.to(tl.int64) * sdh + pos * sd
            q = tl.load(q_ptr + q_rows[:, None] + dq_off[None, :], mask=valid[:, None] & d_mask[None, :], other=0.0)
            do = tl.load(do_ptr + do_rows[:, None] + dv_off[None, :], mask=valid[:, None] & dv_mask[None, :],
                         other=0.0)
            flat = (b * H + h).to(tl.int64) * L + pos
            o = tl.load(o_ptr + flat[:, None] * DV + dv_off[None, :], mask=valid[:, None] & dv_mask[None, :],
                        other=0.0)
            delta = tl.sum(o.to(ACC) * do.to(ACC), axis=1)
            if HAS_DLSE:
                delta -= tl.load(dlse_ptr + flat, mask=valid, other=0.0).to(ACC)
            lse2 = tl.load(lse_ptr + flat, mask=valid, other=0.0) * 1.4426950408889634
            if DOT_FP32:
                q = q.to(tl.float32)
                do = do.to(tl.float32)
            s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
            p = tl.where(ok, tl.exp2(s - lse2[:, None]), 0.0)
            dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PRECISION)
            dp = tl.dot(do, vt, input_precision=PRECISION)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PRECISION)
            dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), input_precision=PRECISION) * scale
            tl.store(dq_ptr + flat[:, None] * D + dq_off[None, :], dq.to(dq_ptr.dtype.element_ty),
                     mask=own[:, None] & d_mask[None, :])
            redo_q = tl.maximum(redo_q, _nonfinite_rows(dq, 1))
        flat_k = (b * HKV + hk).to(tl.int64) * L + pos
        tl.store(dk_ptr + flat_k[:, None] * D + dq_off[None, :], (dk * scale).to(dk_ptr.dtype.element_ty),
                 mask=own[:, None] & d_mask[None, :])
        tl.store(dv_ptr + flat_k[:, None] * DV + dv_off[None, :], dv.to(dv_ptr.dtype.element_ty),
                 mask=own[:, None] & dv_mask[None, :])
        redo_k = tl.maximum(redo_k, _nonfinite_rows(dk, 1) | _nonfinite_rows(dv, 1))
    if tl.max(redo_q | redo_k, axis=0) > 0:  # maybe a leak: those rows and keys again, exactly (see na_fwd_kernel)
        tl.debug_barrier()  # every thread's stores have landed
        for tile in range(pid, num_tiles, tl.num_programs(0)):
            b, hk, _, g, t = _split_tile(tile, HKV, 1, DL, NB)
            lg = _group_len(L, DL, g)
            first = t * OWN
            for c in range(first, tl.minimum(first + OWN, lg)):  # c: an owned query, then an owned key
                for gh in range(0, G):
                    h = hk * G + gh
                    flat_r = (b * H + h).to(tl.int64) * L + c * DL + g
                    if _stored_nonfinite(dq_ptr + flat_r * D, D, True, BLOCK_D):
                        _exact_dq_row(q_ptr, k_ptr, v_ptr, do_ptr, o_ptr, lse_ptr, dlse_ptr, dq_ptr,
                                      b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + (c * DL + g).to(tl.int64) * sq,
                                      b.to(tl.int64) * sdb + h.to(tl.int64) * sdh + (c * DL + g).to(tl.int64) * sd,
                                      b.to(tl.int64) * skb + hk.to(tl.int64) * skh,
                                      b.to(tl.int64) * svb + hk.to(tl.int64) * svh, flat_r, 0, 0, sk, 0, 0, sv, 0, 0,
                                      c, 0, 0, g, 1, 1, L, 1, 1, K, 1, 1, DL, 1, 1, ST, 0, 0, CAUSAL, D, DV, qk_scale,
                                      scale, TRUNCATED, HAS_DLSE, BLOCK_D, BLOCK_DV)
                flat_c = (b * HKV + hk).to(tl.int64) * L + c * DL + g
                if _stored_nonfinite(dk_ptr + flat_c * D, D, True, BLOCK_D) | _stored_nonfinite(
                        dv_ptr + flat_c * DV, DV, True, BLOCK_DV):
                    _exact_dkdv_key(q_ptr, k_ptr, v_ptr, do_ptr, o_ptr, lse_ptr, dlse_ptr, lse_ptr, dk_ptr, dv_ptr,
                                    b.to(tl.int64) * skb + hk.to(tl.int64) * skh + (c * DL + g).to(tl.int64) * sk,
                                    b.to(tl.int64) * svb + hk.to(tl.int64) * svh + (c * DL + g).to(tl.int64) * sv,
                                    flat_c, b, hk, H, G, sqb, sqh, 0, 0, sq, sdb, sdh, 0, 0, sd, 0, 0, c, 0, 0, g, 1,
                                    1, L, 0, 0, 0, 1, 1, L, 1, 1, K, 1, 1, DL, 1, 1, ST, 0, 0, CAUSAL, D, DV, qk_scale,
                                    scale, TRUNCATED, HAS_DLSE, False, BLOCK_D, BLOCK_DV, False)
