"""Triton kernels for embedding. One source for the CUDA and the Ascend plans.

Both kernels walk a flat list of 2D tiles with a grid-stride loop (tile = pid, pid + grid, ...):
the CUDA plan launches one program per tile (the loop runs once), the Ascend plan launches one
program per vector core and each loops over its share. Tiles are (rows x features); a tile index
splits into (row block, feature block) with the feature block fastest, so neighbouring programs
share the same indices. Every offset is int64, so tokens x D and V x stride never overflow.

Only masked tl.load / tl.store, tl.where, tl.sum / tl.max and loops over range: the kernels run
unchanged under the Triton interpreter and triton-ascend.
"""

import triton
import triton.language as tl


@triton.jit
def embedding_fwd_kernel(
    idx_ptr, w_ptr, out_ptr,
    N, V, D, W_S0, W_S1,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """out[t, d] = weight[idx[t], d] for t < N, d < D; out is contiguous [N, D].

    An index outside [0, V) is never dereferenced: its lanes are masked off and its row of out is
    written as zeros (the wrapper raises before launch unless its bounds check is off).
    """
    pid = tl.program_id(0)
    d_blocks = tl.cdiv(D, BLOCK_D)
    num_tiles = tl.cdiv(N, BLOCK_T) * d_blocks
    for tile in range(pid, num_tiles, tl.num_programs(0)):
        tb = tile // d_blocks
        db = tile - tb * d_blocks
        t = tb.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        t_mask = t < N
        idx = tl.load(idx_ptr + t, mask=t_mask, other=0).to(tl.int64)
        ok = t_mask & (idx >= 0) & (idx < V)
        idx = tl.where(ok, idx, 0)
        d = db.to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
        d_mask = d < D
        x = tl.load(w_ptr + idx[:, None] * W_S0 + d[None, :] * W_S1, mask=ok[:, None] & d_mask[None, :], other=0.0)
        tl.store(out_ptr + t[:, None] * D + d[None, :], x, mask=t_mask[:, None] & d_mask[None, :])


@triton.jit
def embedding_bwd_kernel(
    g_ptr, perm_ptr, offs_ptr, gw_ptr,
    V, D, G_S0, G_S1, PAD,
    SCALE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """grad_weight[v, d] = s_v * sum_k grad_out[perm[offs[v] + k], d], k < offs[v + 1] - offs[v].

    perm lists the token positions sorted (stably) by index, offs[v] is where index v's run starts
    in that order. Each tile of BLOCK_R rows x BLOCK_D features sums its rows' runs in fp32, one
    run in token order, then stores the tile once: rows no token names (and the
    PAD row) are stored as zeros in the same store, so grad_weight needs no memset, every element is
    written exactly once, and the result does not depend on scheduling (no atomics).
    """
    pid = tl.program_id(0)
    d_blocks = tl.cdiv(D, BLOCK_D)
    num_tiles = tl.cdiv(V, BLOCK_R) * d_blocks
    for tile in range(pid, num_tiles, tl.num_programs(0)):
        rb = tile // d_blocks
        db = tile - rb * d_blocks
        # Row vectors are kept as [BLOCK_R, 1] columns: every tensor in the loop is 2D, so all share
        # one layout (1D row vectors beside 2D tiles trip a layout-conversion bug in Triton 3.6/3.7).
        r = rb.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
        r_mask = r < V
        start = tl.load(offs_ptr + r, mask=r_mask, other=0)
        stop = tl.load(offs_ptr + r + 1, mask=r_mask, other=0)
        stop = tl.where(r == PAD, start, stop)  # the padding row's run is empty
        d = db.to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)[None, :]
        d_mask = d < D
        cols = d * G_S1
        acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        # Four tokens per row per step, their loads issued before the adds (a row named by many tokens
        # keeps four gathers in flight); the adds stay in token order, so the bits do not depend on it.
        for k in range(0, tl.max(tl.max(stop - start, axis=1), axis=0), 4):
            p0 = start + k
            h0 = p0 < stop
            h1 = p0 + 1 < stop
            h2 = p0 + 2 < stop
            h3 = p0 + 3 < stop
            t0 = tl.load(perm_ptr + p0, mask=h0, other=0).to(tl.int64)
            t1 = tl.load(perm_ptr + p0 + 1, mask=h1, other=0).to(tl.int64)
            t2 = tl.load(perm_ptr + p0 + 2, mask=h2, other=0).to(tl.int64)
            t3 = tl.load(perm_ptr + p0 + 3, mask=h3, other=0).to(tl.int64)
            g0 = tl.load(g_ptr + t0 * G_S0 + cols, mask=h0 & d_mask, other=0.0)
            g1 = tl.load(g_ptr + t1 * G_S0 + cols, mask=h1 & d_mask, other=0.0)
            g2 = tl.load(g_ptr + t2 * G_S0 + cols, mask=h2 & d_mask, other=0.0)
            g3 = tl.load(g_ptr + t3 * G_S0 + cols, mask=h3 & d_mask, other=0.0)
            acc += g0.to(tl.float32)
            acc += g1.to(tl.float32)
            acc += g2.to(tl.float32)
            acc += g3.to(tl.float32)
        if SCALE:
            acc = acc / tl.maximum(stop - start, 1).to(tl.float32)
        tl.store(gw_ptr + r * D + d, acc.to(gw_ptr.dtype.element_ty), mask=r_mask & d_mask)
