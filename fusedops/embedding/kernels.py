"""Triton kernels for embedding. One source for the CUDA and the Ascend plans.

The kernels walk a flat list of 2D tiles or work items with a grid-stride loop (tile = pid, pid + grid,
...): the CUDA plan launches one program per tile (the loop runs once), the Ascend plan launches one
program per vector core and each loops over its share. Tiles are (rows x features); a tile index
splits into (row block, feature block) with the feature block fastest, so neighbouring programs
share the same indices. Every offset is int64, so tokens x D and V x stride never overflow.

Only tl.load / tl.store, tl.where, tl.sum / tl.cumsum, scalar branches and loops (for, while): the
kernels run unchanged under the Triton interpreter and triton-ascend.

The backward has two paths with the same bits: the sort path (run keys, torch's stable sort, run
offsets, embedding_bwd_kernel and, for runs longer than a chunk, embedding_bwd_merge_kernel) and, for
small batches, embedding_bwd_scan_kernel alone on a zeroed grad_weight.

The kernels that read the indices (the forward, the backward's sort keys and its scan) are compiled in
Triton's debug mode for their one `tl.device_assert`: an index outside [0, V) stops the kernel with a
device-side assert, as torch's own embedding does, without the host ever reading the indices. The launch turns
Triton's integer-overflow checks (also part of debug mode) back off. The interpreter compiles asserts
out; CPU tensors are checked on the host instead, where that costs no synchronisation.
"""

import triton
import triton.language as tl

from fusedops.tl_helpers import mask_if


@triton.jit(debug=True)
def embedding_fwd_kernel(
    idx_ptr, w_ptr, out_ptr,
    N, V, D, IDX_S, W_S0, W_S1,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """out[t, d] = weight[idx[t * IDX_S], d] for t < N, d < D; out is contiguous [N, D].

    An index outside [0, V) fails the device assert; where asserts are compiled out it is still never
    dereferenced: its lanes are masked off and its row of out is written as zeros.
    """
    pid = tl.program_id(0)
    d_blocks = tl.cdiv(D, BLOCK_D)
    num_tiles = tl.cdiv(N, BLOCK_T) * d_blocks
    for tile in range(pid, num_tiles, tl.num_programs(0)):
        tb = tile // d_blocks
        db = tile - tb * d_blocks
        t = tb.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        t_mask = t < N
        idx = tl.load(idx_ptr + t * IDX_S, mask=t_mask, other=0).to(tl.int64)
        ok = t_mask & (idx >= 0) & (idx < V)
        # (t >= N) rather than ~t_mask: triton-ascend 3.2's interpreter cannot invert a boolean tensor
        tl.device_assert(ok | (t >= N), "fusedops.embedding: an index is outside the weight's rows [0, V)")
        idx = tl.where(ok, idx, 0)
        d = db.to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
        d_mask = d < D
        x = tl.load(w_ptr + idx[:, None] * W_S0 + d[None, :] * W_S1, mask=ok[:, None] & d_mask[None, :], other=0.0)
        tl.store(out_ptr + t[:, None] * D + d[None, :], x, mask=t_mask[:, None] & d_mask[None, :])


@triton.jit
def _four_rows(g_ptr, perm_ptr, p0, stop, N, G_S0, cols, d_mask, EVICT: tl.constexpr):
    """The gradient rows of sorted positions p0 .. p0 + 3 ([1, BLOCK_D] each; zeros from stop on), read
    with the L2 eviction policy EVICT ("" is the default)."""
    t0 = tl.load(perm_ptr + tl.minimum(p0, N - 1)).to(tl.int64)
    t1 = tl.load(perm_ptr + tl.minimum(p0 + 1, N - 1)).to(tl.int64)
    t2 = tl.load(perm_ptr + tl.minimum(p0 + 2, N - 1)).to(tl.int64)
    t3 = tl.load(perm_ptr + tl.minimum(p0 + 3, N - 1)).to(tl.int64)
    g0 = tl.load(g_ptr + t0 * G_S0 + cols, mask=mask_if(p0 < stop, d_mask), other=0.0, eviction_policy=EVICT)
    g1 = tl.load(g_ptr + t1 * G_S0 + cols, mask=mask_if(p0 + 1 < stop, d_mask), other=0.0, eviction_policy=EVICT)
    g2 = tl.load(g_ptr + t2 * G_S0 + cols, mask=mask_if(p0 + 2 < stop, d_mask), other=0.0, eviction_policy=EVICT)
    g3 = tl.load(g_ptr + t3 * G_S0 + cols, mask=mask_if(p0 + 3 < stop, d_mask), other=0.0, eviction_policy=EVICT)
    return g0, g1, g2, g3


@triton.jit
def _add4(acc, g0, g1, g2, g3):
    """acc + g0 + g1 + g2 + g3 in acc's dtype (fp32; fp64 for float64 gradients), in that order."""
    acc += g0.to(acc.dtype)
    acc += g1.to(acc.dtype)
    acc += g2.to(acc.dtype)
    acc += g3.to(acc.dtype)
    return acc


@triton.jit
def _run_item(g_ptr, keys_ptr, perm_ptr, offs_ptr, gw_ptr, part_ptr, item, V, D, N, G_S0, G_S1, PAD,
              SCALE: tl.constexpr, BLOCK_D: tl.constexpr, EVICT: tl.constexpr, CHUNK: tl.constexpr, ACC: tl.constexpr):
    """Run item `item` (sorted position x feature block) of embedding_bwd_kernel. A position that heads a
    chunk (every CHUNK-th position of a run, from its start) of an in-range, non-padding index sums the
    chunk's gradient rows in fp32, in token order. A run of at most CHUNK tokens is one chunk, whose sum
    is the row: it is stored to grad_weight. A longer run's chunks store their sums to `part`, slot
    2 * (pos // CHUNK) + (pos is the run's start), for embedding_bwd_merge_kernel: two chunk heads
    never share a slot (a run longer than CHUNK has no other run's start in its block, and consecutive
    heads of one run are CHUNK apart). Any other position does nothing."""
    d_blocks = tl.cdiv(D, BLOCK_D)
    pos = item // d_blocks
    d = (item - pos * d_blocks).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)[None, :]
    d_mask = d < D
    key = tl.load(keys_ptr + pos).to(tl.int64)
    row = tl.minimum(tl.maximum(key, 0), V - 1)  # out-of-range keys (-1) load a harmless row's offsets
    start = tl.load(offs_ptr + row)
    run_stop = tl.load(offs_ptr + row + 1)
    heads = (key >= 0) & (key < V) & (key != PAD) & ((pos - start) % CHUNK == 0)
    stop = tl.where(heads, tl.minimum(pos + CHUNK, run_stop), pos)
    cols = d * G_S1
    acc = tl.zeros([1, BLOCK_D], dtype=ACC)
    # Loads are issued before the adds, which stay in token order: four tokens first (nearly every run
    # of a uniform batch), then eight per step, so the long chunks of frequent tokens keep eight gathers
    # in flight. H100 (bench/NOTES.md, embedding v9): Zipf batches -23..-38%, uniform +2%.
    g0, g1, g2, g3 = _four_rows(g_ptr, perm_ptr, pos, stop, N, G_S0, cols, d_mask, EVICT)
    acc = _add4(acc, g0, g1, g2, g3)
    for p0 in range(pos + 4, stop, 8):
        g0, g1, g2, g3 = _four_rows(g_ptr, perm_ptr, p0, stop, N, G_S0, cols, d_mask, EVICT)
        g4, g5, g6, g7 = _four_rows(g_ptr, perm_ptr, p0 + 4, stop, N, G_S0, cols, d_mask, EVICT)
        acc = _add4(_add4(acc, g0, g1, g2, g3), g4, g5, g6, g7)
    split = run_stop - start > CHUNK
    if SCALE:  # a split run is scaled once its chunks are summed
        acc = acc / tl.where(split, 1, tl.maximum(run_stop - start, 1)).to(ACC)
    whole = heads & (run_stop - start <= CHUNK)
    tl.store(gw_ptr + key * D + d, acc.to(gw_ptr.dtype.element_ty), mask=mask_if(whole, d_mask),
             eviction_policy=EVICT)
    slot = 2 * (pos // CHUNK) + (pos == start).to(tl.int64)
    tl.store(part_ptr + slot * D + d, acc, mask=mask_if(heads & split, d_mask))


@triton.jit
def _zero_tile(offs_ptr, gw_ptr, tile, V, D, PAD,
               BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, EVICT: tl.constexpr):
    """Zero tile `tile` (BLOCK_R rows x BLOCK_D features) of embedding_bwd_kernel: zeros to the rows no
    token names (an empty run in offs) and to the padding row."""
    d_blocks = tl.cdiv(D, BLOCK_D)
    rb = tile // d_blocks
    cols = (tile - rb * d_blocks).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)[None, :]
    rows = rb.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
    in_range = rows < V
    first = tl.load(offs_ptr + rows, mask=in_range, other=0)
    last = tl.load(offs_ptr + rows + 1, mask=in_range, other=0)
    empty = (first == last) | (rows == PAD)
    zeros = tl.zeros([BLOCK_R, BLOCK_D], dtype=gw_ptr.dtype.element_ty)
    tl.store(gw_ptr + rows * D + cols, zeros, mask=in_range & empty & (cols < D), eviction_policy=EVICT)


@triton.jit
def embedding_bwd_kernel(
    g_ptr, keys_ptr, perm_ptr, offs_ptr, gw_ptr, part_ptr,
    V, D, N, G_S0, G_S1, PAD, ZEROS_PER_RUN,
    SCALE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, EVICT: tl.constexpr, CHUNK: tl.constexpr,
    F64: tl.constexpr = False,  # the op passes it (wrap_triton takes no defaults); direct launches may not
):
    """grad_weight[v, d] = s_v * sum over tokens t with idx[t] == v of grad_out[t, d], in token order.

    keys: the N indices sorted stably (out-of-range ones clamped to -1 or V); perm: the token
    positions in that order; offs[v]: where index v's run starts in it ([V + 1]). One grid-stride loop
    walks two kinds of work item, so grad_weight is written exactly once in one launch, with no memset
    and no atomics (the bits do not depend on scheduling):
    - run items (N sorted positions x feature blocks): a position that heads a chunk of CHUNK tokens of
      the run of an in-range, non-padding index sums the chunk's gradient rows in fp32, in token order,
      and stores the row (a run of at most CHUNK tokens) or a partial sum that
      embedding_bwd_merge_kernel adds up in chunk order (longer runs: a Zipf batch's frequent tokens,
      which one program would otherwise sum alone while the rest of the grid idles); any other
      position does nothing;
    - zero items (BLOCK_R rows x BLOCK_D features): zeros go to the rows no token names and to the
      padding row.
    Zero tiles, nearly all of grad_weight, wait on one load of offsets (just written, in L2) and carry
    no gathers: they are bound by store bandwidth, run items by the gathers' latency. The item order
    interleaves them (one run item, then ZEROS_PER_RUN zero tiles, repeated; the leftover zero tiles
    last) so programs of both kinds are resident together and the gathers hide under the stores.
    Gradient rows are read once and grad_weight rows written once: both go through L2 with the
    eviction policy EVICT (the plan's: "evict_first" leaves L2 to the keys, perm and offsets every
    program reads where that measured faster). Sums are fp32, fp64 for float64 gradients (F64).
    """
    ACC = tl.float64 if F64 else tl.float32
    pid = tl.program_id(0)
    d_blocks = tl.cdiv(D, BLOCK_D)
    run_items = N * d_blocks
    items = run_items + tl.cdiv(V, BLOCK_R) * d_blocks
    # Every tensor is 2D ([1, BLOCK_D] rows, [BLOCK_R, 1] columns): 1D vectors beside 2D tiles trip a
    # layout-conversion bug in Triton 3.6/3.7. Scalar loads clamp their address instead of masking:
    # triton-ascend 3.2's interpreter ignores a one-element False mask.
    period = ZEROS_PER_RUN + 1
    mixed = run_items * period  # items before this interleave one run item per period
    for item in range(pid, items, tl.num_programs(0)):
        group = item // period
        slot = item - group * period
        if (item < mixed) & (slot == 0):
            _run_item(g_ptr, keys_ptr, perm_ptr, offs_ptr, gw_ptr, part_ptr, group, V, D, N, G_S0, G_S1, PAD,
                      SCALE, BLOCK_D, EVICT, CHUNK, ACC)
        else:
            tile = tl.where(item < mixed, group * ZEROS_PER_RUN + slot - 1, item - run_items)
            _zero_tile(offs_ptr, gw_ptr, tile, V, D, PAD, BLOCK_R, BLOCK_D, EVICT)


@triton.jit
def embedding_bwd_merge_kernel(part_ptr, keys_ptr, offs_ptr, gw_ptr, V, D, N, PAD,
                               SCALE: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr):
    """The rows of runs longer than CHUNK: grad_weight[v] = the sum of the run's chunk partial sums in
    chunk order (divided by the run's length under SCALE), stored once. Item = block k of CHUNK sorted positions x
    feature block; the item whose position k * CHUNK is the first multiple of CHUNK in a long run
    merges that run, so each long run is merged by exactly one item."""
    d_blocks = tl.cdiv(D, BLOCK_D)
    for item in range(tl.program_id(0), tl.cdiv(N, CHUNK) * d_blocks, tl.num_programs(0)):
        k = item // d_blocks
        d = (item - k * d_blocks).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)[None, :]
        d_mask = d < D
        pos = k.to(tl.int64) * CHUNK
        key = tl.load(keys_ptr + pos).to(tl.int64)
        row = tl.minimum(tl.maximum(key, 0), V - 1)
        start = tl.load(offs_ptr + row)
        stop = tl.load(offs_ptr + row + 1)
        merges = (key >= 0) & (key < V) & (key != PAD) & (stop - start > CHUNK) & (pos - start < CHUNK)
        if merges:
            acc = tl.load(part_ptr + (2 * (start // CHUNK) + 1) * D + d, mask=d_mask, other=0.0)
            for head in range(start + CHUNK, stop, CHUNK):
                acc += tl.load(part_ptr + 2 * (head // CHUNK) * D + d, mask=d_mask, other=0.0)
            if SCALE:
                acc = acc / (stop - start).to(acc.dtype)
            tl.store(gw_ptr + key * D + d, acc.to(gw_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def _match_row(g_ptr, pos, hit, rank, k, count, G_S0, cols, d_mask):
    """The gradient row ([1, BLOCK_D]) of the k-th hit (from 0) of a scanned block of tokens, zeros when
    k >= count: pos, hit and rank ([1, SCAN_BLOCK] each) are the block's token positions, which of them
    hold the index, and how many hits come before each."""
    t = tl.sum(tl.where(hit & (rank == k), pos, 0)).to(tl.int64)  # 0 where there is no k-th hit: a valid row
    return tl.load(g_ptr + t * G_S0 + cols, mask=mask_if(k < count, d_mask), other=0.0)


@triton.jit
def _four_matches(g_ptr, pos, hit, rank, k0, count, G_S0, cols, d_mask):
    """The gradient rows of hits k0 .. k0 + 3 of a scanned block (see _match_row), loads issued together."""
    g0 = _match_row(g_ptr, pos, hit, rank, k0, count, G_S0, cols, d_mask)
    g1 = _match_row(g_ptr, pos, hit, rank, k0 + 1, count, G_S0, cols, d_mask)
    g2 = _match_row(g_ptr, pos, hit, rank, k0 + 2, count, G_S0, cols, d_mask)
    g3 = _match_row(g_ptr, pos, hit, rank, k0 + 3, count, G_S0, cols, d_mask)
    return g0, g1, g2, g3


@triton.jit
def _take(acc, total, g, n, valid, CHUNK: tl.constexpr):
    """(acc, total) after adding gradient row g, the run's n-th token (from 0; nothing unless valid), the
    way the sort path sums a run: acc is the sum of the current chunk of CHUNK tokens, from zero in token
    order; when n starts a new chunk, the finished one goes into total (the finished chunks' sum, added in
    chunk order as embedding_bwd_merge_kernel adds them) and acc restarts from zero."""
    close = valid & (n > 0) & (n % CHUNK == 0)
    total = tl.where(close, tl.where(n == CHUNK, acc, total + acc), total)
    acc = tl.where(close, 0.0, acc) + g.to(acc.dtype)  # an invalid g is a masked zero: acc + 0 is acc
    return acc, total


@triton.jit
def _take4(acc, total, g0, g1, g2, g3, n0, stop, CHUNK: tl.constexpr):
    """_take of the run's tokens n0 .. n0 + 3 (those below stop), in that order."""
    acc, total = _take(acc, total, g0, n0, n0 < stop, CHUNK)
    acc, total = _take(acc, total, g1, n0 + 1, n0 + 1 < stop, CHUNK)
    acc, total = _take(acc, total, g2, n0 + 2, n0 + 2 < stop, CHUNK)
    acc, total = _take(acc, total, g3, n0 + 3, n0 + 3 < stop, CHUNK)
    return acc, total


@triton.jit
def _first_occurrence(idx_ptr, i, t, IDX_S, lanes, SCAN_BLOCK: tl.constexpr):
    """Whether no token before t holds index i: idx[0 .. t) read SCAN_BLOCK indices a step (lanes:
    arange(SCAN_BLOCK) as a [1, SCAN_BLOCK] row), up to the first step that finds i."""
    first = t >= 0
    start = t * 0
    while first & (start < t):
        pos = start + lanes
        before = tl.load(idx_ptr + pos.to(tl.int64) * IDX_S, mask=pos < t, other=0)
        first = tl.sum(((before == i) & (pos < t)).to(tl.int32)) == 0
        start += SCAN_BLOCK
    return first


@triton.jit
def _scan_row(idx_ptr, g_ptr, i, t, N, D, IDX_S, G_S0, G_S1, d, lanes,
              SCALE: tl.constexpr, BLOCK_D: tl.constexpr, SCAN_BLOCK: tl.constexpr, CHUNK: tl.constexpr,
              ACC: tl.constexpr):
    """Row i of grad_weight (feature columns d, [1, BLOCK_D]) from the tokens t' >= t with idx[t'] == i,
    t being i's first token: the sort path's bits (see _take), divided by the run's length under SCALE.
    idx[t .. N) is read SCAN_BLOCK indices a step; the hits of a step are summed in token order, four,
    then eight gradient rows loaded before they are added, as embedding_bwd_kernel does."""
    cols = d * G_S1
    d_mask = d < D
    acc = tl.zeros([1, BLOCK_D], dtype=ACC)
    total = tl.zeros([1, BLOCK_D], dtype=ACC)
    n = t * 0  # the run's tokens summed so far
    for start in range(t, N, SCAN_BLOCK):
        pos = start + lanes
        later = tl.load(idx_ptr + pos.to(tl.int64) * IDX_S, mask=pos < N, other=0)
        hits = ((later == i) & (pos < N)).to(tl.int32)
        hit = hits != 0
        rank = tl.cumsum(hits, axis=1) - hits  # hits before each position of the step
        count = tl.sum(hits)
        if count > 0:
            g0, g1, g2, g3 = _four_matches(g_ptr, pos, hit, rank, 0, count, G_S0, cols, d_mask)
            acc, total = _take4(acc, total, g0, g1, g2, g3, n, n + count, CHUNK)
            for k in range(4, count, 8):
                g0, g1, g2, g3 = _four_matches(g_ptr, pos, hit, rank, k, count, G_S0, cols, d_mask)
                g4, g5, g6, g7 = _four_matches(g_ptr, pos, hit, rank, k + 4, count, G_S0, cols, d_mask)
                acc, total = _take4(acc, total, g0, g1, g2, g3, n + k, n + count, CHUNK)
                acc, total = _take4(acc, total, g4, g5, g6, g7, n + k + 4, n + count, CHUNK)
        n += count
    row = tl.where(n > CHUNK, total + acc, acc)  # a run of at most CHUNK tokens is its one chunk sum
    if SCALE:
        row = row / n.to(ACC)
    return row


@triton.jit(debug=True)
def embedding_bwd_scan_kernel(
    idx_ptr, g_ptr, gw_ptr,
    N, V, D, IDX_S, G_S0, G_S1, PAD,
    SCALE: tl.constexpr, BLOCK_D: tl.constexpr, SCAN_BLOCK: tl.constexpr, CHUNK: tl.constexpr,
    F64: tl.constexpr = False,  # the op passes it (wrap_triton takes no defaults); direct launches may not
):
    """The backward without a sort, for small batches: grad_weight (zeroed by the caller, [V, D]
    contiguous) gets, in the row of each index named by the N tokens idx[t * IDX_S], exactly the bits
    embedding_bwd_kernel and embedding_bwd_merge_kernel store there (the run summed in token order in
    chunks of CHUNK tokens, fp32, fp64 under F64; divided by its length under SCALE).

    Work item = token t x feature block, in a grid-stride loop. The item of the first token naming an
    index (it scans the tokens before it) owns that row: it walks the later tokens for the others and
    stores the row once; every other item stores nothing. Rows no token names and the padding row (PAD,
    -1 for none) keep the caller's zeros. An index outside [0, V) fails the device assert; where asserts
    are compiled out it contributes nothing. Index scans cost O(N) per item and a run is summed by one
    program: the plan takes this path for small batches only.
    """
    ACC = tl.float64 if F64 else tl.float32
    d_blocks = tl.cdiv(D, BLOCK_D)
    # 2D rows only, as in embedding_bwd_kernel (Triton 3.6/3.7's layout bug with 1D vectors beside 2D tiles)
    lanes = tl.arange(0, SCAN_BLOCK)[None, :]
    for item in range(tl.program_id(0), N * d_blocks, tl.num_programs(0)):
        t = item // d_blocks
        d = (item - t * d_blocks).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)[None, :]
        i = tl.load(idx_ptr + t.to(tl.int64) * IDX_S).to(tl.int64)
        ok = (i >= 0) & (i < V)
        tl.device_assert(ok, "fusedops.embedding_backward: an index is outside [0, num_weights)")
        if ok & (i != PAD):
            if _first_occurrence(idx_ptr, i, t, IDX_S, lanes, SCAN_BLOCK):
                row = _scan_row(idx_ptr, g_ptr, i, t, N, D, IDX_S, G_S0, G_S1, d, lanes,
                                SCALE, BLOCK_D, SCAN_BLOCK, CHUNK, ACC)
                tl.store(gw_ptr + i * D + d, row.to(gw_ptr.dtype.element_ty), mask=d < D)


@triton.jit(debug=True)
def embedding_run_keys_kernel(idx_ptr, keys_ptr, N, V, IDX_S, BLOCK: tl.constexpr):
    """keys[t] = idx[t * IDX_S] where 0 <= idx < V, else -1, in keys' dtype: the sort keys of the
    backward. An out-of-range index fails the device assert; where asserts are compiled out it becomes
    -1, so it sorts before every run (and the keys fit int16 up to V = 2**15)."""
    pid = tl.program_id(0)
    # an int64 counter: past 2**30 tokens the first start plus the stride passes 2**31 (compile_sm90 checks)
    for start in range(pid.to(tl.int64) * BLOCK, N, tl.num_programs(0) * BLOCK):
        t = start + tl.arange(0, BLOCK)
        in_range = t < N
        i = tl.load(idx_ptr + t.to(tl.int64) * IDX_S, mask=in_range, other=0)
        ok = (i >= 0) & (i < V)
        tl.device_assert(ok | (t >= N), "fusedops.embedding_backward: an index is outside [0, num_weights)")
        k = tl.where(ok, i, -1)
        tl.store(keys_ptr + t, k.to(keys_ptr.dtype.element_ty), mask=in_range)


@triton.jit
def embedding_run_offsets_kernel(keys_ptr, offs_ptr, N, V, LOG_N: tl.constexpr, BLOCK: tl.constexpr):
    """offs[v] = how many of the N sorted keys are below v, for v in [0, V]: where row v's run starts
    (and, at v + 1, stops). A branchless binary search per row in LOG_N halvings (2**LOG_N > N); the
    steps longer than N load nothing."""
    pid = tl.program_id(0)
    for start in range(pid.to(tl.int64) * BLOCK, V + 1, tl.num_programs(0) * BLOCK):  # int64, as above
        v = start + tl.arange(0, BLOCK).to(tl.int64)
        pos = tl.zeros([BLOCK], tl.int64)
        for b in tl.static_range(LOG_N):
            cand = pos + (1 << (LOG_N - 1 - b))
            ok = cand <= N
            k = tl.load(keys_ptr + tl.where(ok, cand - 1, 0), mask=ok, other=0).to(tl.int64)
            pos = tl.where(ok & (k < v), cand, pos)
        tl.store(offs_ptr + v, pos, mask=v <= V)

