"""Launch plans for attn_res: block sizes and grids from a hardware Target and the problem shape."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from fusedops.plans import dtype_class, on_reload, resolve
from fusedops.registry import memoize
from fusedops.targets import Target, size_hint

OP = "attn_res"

# Bytes of on-chip state per tile element: the forward keeps the fp32 accumulator, the loaded row and
# the folded query; the backward keeps grad_out, the query, the loaded row and the gradient row.
# Two source rows are in flight when a row fits (UNROLL = 2), hence 4 more bytes per element.
FORWARD_BYTES_PER_ELEMENT = 20
BACKWARD_BYTES_PER_ELEMENT = 28
# The one-pass backward (the forward's out and lse known) keeps grad_out, the query, two source rows,
# the gradient row and the sum of early rows (see the kernel); its per-program query-gradient
# accumulator is left out of the count, so that D = 8192 keeps one pass on 8 warps.
ONEPASS_BYTES_PER_ELEMENT = 24
# Tile sizes, warps, unrolling and programs per core come from plans.json (fusedops/plans.py); where
# each row came from: bench/NOTES.md, "plans as data".


def _features(target: Target, elem_size: int, dim, tokens) -> dict:
    return dict(interpreted=target.interpreted, dtype=dtype_class(elem_size), dim=size_hint(dim),
                tokens=size_hint(tokens))


def acc_scale(elem_size: int) -> int:
    """How much wider the kernels' on-chip values are than the fp32 the byte counts here assume: 2 for
    float64 values (computed in float64), else 1."""
    return 2 if elem_size == 8 else 1


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def prev_pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1)


@dataclass(frozen=True)
class Plan:
    block_t: int  # tokens per tile
    block_d: int  # features per tile
    one_tile: bool  # a whole row fits in one tile: the forward makes a single pass over values
    grid: int  # programs launched; each loops over token blocks pid, pid + grid, ...
    num_warps: int
    unroll: int = 1  # source rows loaded per depth step (2: two independent loads in flight)
    num_stages: int = 1
    one_pass: bool = False  # a plan of the one-pass backward kernel
    block_n: int = 0  # > 0: a plan of a depth-tile kernel (forward or backward) of block_n rows a step
    tokens_per_program: int = 0  # depth-tile forward: > 0 launches cdiv(tokens, it) programs, 0 a persistent grid
    constant_dim: bool = False  # depth-tile forward, one-pass backward: D a compile-time constant (one compile per D)
    prefetch: bool = False  # one-pass backward, depth-tile forward: each depth step's rows are loaded one step ahead
    evict_first: bool = False  # depth-tile forward: rows loaded with the evict-first cache policy (read once)
    fused_sums: bool = False  # one-pass backward: a row's three sums in one reduction
    split: int = 0  # > 1: depth-tile forward, a token's row groups over this many programs (then a merge); two-phase
    # backward, a token block's sources in this many slices (two launches)


@memoize
def make_plan(target: Target, tokens: int, dim: int, elem_size: int, *, backward: bool, one_pass: bool = False) -> Plan:
    """one_pass: the plan of attn_res_bwd_onepass_kernel, which only runs when `one_tile` comes out True
    (a whole row on chip); otherwise of the two-phase attn_res_bwd_kernel or of the forward."""
    kernel = "bwd_onepass" if one_pass else "bwd" if backward else "fwd"
    row = resolve(OP, kernel, target, **_features(target, elem_size, dim, tokens))
    if one_pass:
        per_element = ONEPASS_BYTES_PER_ELEMENT
    else:
        per_element = BACKWARD_BYTES_PER_ELEMENT if backward else FORWARD_BYTES_PER_ELEMENT
    budget = target.onchip_bytes // (per_element * acc_scale(elem_size))
    min_row = max(1, target.row_align // elem_size)
    if budget < min_row:
        raise ValueError(
            f"attn_res: an on-chip budget of {target.onchip_bytes} bytes cannot hold one aligned tile row"
        )
    largest = prev_pow2(budget)
    full_row = max(next_pow2(dim), min_row)
    one_tile = full_row <= largest
    block_d = full_row if one_tile else largest
    wanted = row["tile_elements"] if one_tile or kernel != "bwd" else row["tiled_tile_elements"]
    wanted = max(wanted, block_d) if wanted else largest  # 0: the largest tile that fits
    hint = size_hint(tokens)  # tile shapes from the (hinted) size; blocks and grids from the real one
    block_t = max(1, min(prev_pow2(max(1, wanted // block_d)), next_pow2(max(hint, 1))))
    if row["fill_cores"]:
        # Small rows: shrink the token block until every core has work (the interpreter, which runs
        # programs one by one, keeps large blocks).
        slots = target.vector_cores * target.resident
        block_t = max(1, min(block_t, prev_pow2(max(1, hint // slots))))
    blocks = -(-tokens // block_t)
    # The backward is always persistent: each program owns one row of fp32 partial sums for the
    # query/weight gradient, reduced in a fixed order afterwards (deterministic, no atomics).
    persistent = True if backward or one_pass else None
    grid = target.grid_size(blocks, persistent=persistent)
    num_warps = row["num_warps"]
    if one_pass and row["elements_per_thread"]:
        grid = torch.sym_min(blocks, target.vector_cores * row["programs_per_core"])
        per_warp = 32 * row["elements_per_thread"]
        num_warps = min(row["max_warps"], max(row["num_warps"], block_t * block_d // per_warp))
    elif backward:
        grid = torch.sym_min(grid, target.vector_cores * row["programs_per_core"])
    # Ascend's rows load one row per depth step: its odd-N tail relies on masks that triton-ascend 3.2's
    # interpreter drops when a mask is one element and False (`if not mask` in its store/load), which
    # BLOCK_T == 1 tiles hit.
    unroll = row["unroll"] if one_tile else 1
    return Plan(block_t=block_t, block_d=block_d, one_tile=one_tile, grid=grid, num_warps=num_warps, unroll=unroll,
                one_pass=one_pass, constant_dim=bool(one_pass and row["constant_dim"]),
                prefetch=bool(one_pass and row["prefetch"]),
                fused_sums=bool(one_pass and row["fused_sums"]))


@memoize
def two_phase_plan(target: Target, tokens: int, sources: int, dim: int, elem_size: int) -> Plan:
    """The plan of the two-phase attn_res_bwd_kernel. Where the token blocks are too few to give every core the
    row's split_per_core programs, each block's N sources are split into `split` slices of one program each
    (two launches: the statistics, then the gradients), if that shortens a program's chain of rows by at least
    split_min_saved (the second launch and the longer reduction cost about that much). Needs concrete sizes.
    Where the rule came from: bench/NOTES.md, attn_res run 17."""
    plan = make_plan(target, tokens, dim, elem_size, backward=True)
    if not (isinstance(tokens, int) and isinstance(sources, int)) or tokens <= 0:
        return plan
    row = resolve(OP, "bwd", target, **_features(target, elem_size, dim, tokens))
    if not row.get("split_per_core"):
        return plan
    blocks = -(-tokens // plan.block_t)
    slices = min(sources, target.vector_cores * row["split_per_core"] // blocks)
    if slices > 1 and sources - -(-sources // slices) >= row.get("split_min_saved", 0):
        return replace(plan, one_tile=False, grid=blocks, split=slices)
    return plan


# The depth tiles hold all N source rows of a token at once. On CUDA the fp32 rows are the only
# full-size live tile (the backward's gradient is computed and stored element by element), so a tile
# costs 4 + elem_size register bytes per element; Ascend keeps every element-wise temporary in UB.
CUDA_DEPTH_TILE_EXTRA_BYTES = 4
ASCEND_DEPTH_TILE_BYTES_PER_ELEMENT = 16


@memoize
def depth_tile_plan(target: Target, tokens: int, sources: int, dim: int, elem_size: int, *,
                    backward: bool = True) -> Plan | None:
    """The plan of attn_res_bwd_depth_tile_kernel (or, backward=False, attn_res_fwd_depth_tile_kernel)
    for `sources` (N, a plain int) rows per token, or None when its [next_pow2(N), next_pow2(D)] tile
    does not fit on chip (or, on CUDA, is a shape that the other kernels run faster). A forward row with
    group_rows > 0 takes that many rows a step instead (see _grouped_forward_plan)."""
    block_n = next_pow2(sources)
    block_d = max(next_pow2(dim), max(1, target.row_align // elem_size))
    tile = block_n * block_d
    cuda = target.vendor == "cuda"
    wide = acc_scale(elem_size)
    per_element = CUDA_DEPTH_TILE_EXTRA_BYTES * wide + elem_size if cuda else ASCEND_DEPTH_TILE_BYTES_PER_ELEMENT * wide
    features = dict(_features(target, elem_size, dim, tokens), sources=sources, tile=tile)
    row = resolve(OP, "bwd_depth" if backward else "fwd_depth", target, **features)
    if not backward and row.get("group_rows"):
        call_bytes = (sources + 1) * size_hint(tokens) * size_hint(dim) * elem_size  # a choice, not a grid: hinted
        full_lanes = block_d == size_hint(dim)  # a power-of-two D: no masked lanes in a row's tile
        return _grouped_forward_plan(target, tokens, sources, block_d, per_element, row, call_bytes, full_lanes)
    if tile * per_element > target.onchip_bytes:
        return None
    if not cuda:
        return Plan(block_t=1, block_d=block_d, one_tile=True, grid=target.grid_size(tokens, persistent=True),
                    num_warps=row["num_warps"], block_n=block_n)
    if tile > row["max_tile_elements"] and block_n > row["wide_rows"]:
        return None
    if not backward:
        num_warps = max(row["num_warps"], tile // (32 * row["elements_per_thread"]))
        if tile <= row["per_token_elements"]:
            grid = target.grid_size(tokens, persistent=False)
        else:
            grid = torch.sym_min(tokens, target.vector_cores * row["programs_per_core"])
        return Plan(block_t=1, block_d=block_d, one_tile=True, grid=grid, num_warps=num_warps, block_n=block_n)
    per_warp = 32 * row["elements_per_thread"]
    num_warps = max(row["num_warps"], tile // per_warp, min(row["max_warps"], block_d // row["row_per_warp"]))
    grid = torch.sym_min(tokens, target.vector_cores * row["programs_per_core"])
    return Plan(block_t=1, block_d=block_d, one_tile=True, grid=grid, num_warps=num_warps, block_n=block_n)


def split_count(target: Target, tokens: int, groups: int, per_core: int) -> int:
    """Programs a token's `groups` row groups are split over so that every core has `per_core` programs (at
    most one group each)."""
    return min(groups, target.vector_cores * per_core // tokens)


def _grouped_forward_plan(target: Target, tokens: int, sources: int, block_d: int, per_element: int,
                          row: dict, call_bytes: int, full_lanes: bool) -> Plan | None:
    """The depth-tile forward in groups of row["group_rows"] source rows a step (fewer where N is smaller), on
    row["num_warps"]; one program per row["tokens_per_program"] tokens, or (0) row["programs_per_core"]
    persistent programs per core; None when a group does not fit on chip. Where the tokens are too few to give
    every core row["split_per_core"] programs, each token's groups are split over up to that many programs
    a core (`split`; a merge launch folds them), where that shortens a token's chain of groups by at least
    row["split_min_saved"] (the merge costs about that much). row["prefetch"]: each group's rows are loaded while
    the group before is summed, except in calls moving more than row["evict_first_min_bytes"] and at most
    row["evict_first_max_bytes"] ((N + 1) rows of every token: past the L2, not far past it), which load rows
    evict-first instead: two groups live cost a program slot a core, which a short grid's tail wave pays, and
    evict-first keeps part of such a call's rows in L2 for the next (a call within L2 keeps them anyway). Prefetching
    calls take row["whole_group_rows"] rows a group instead where those waste nothing: N a multiple of them and D
    a power of two (full_lanes). Where the rows came from: bench/NOTES.md, attn_res run 12 (split: run 15; prefetch:
    run 16; evict-first: run 18; whole groups: run 19)."""
    block_n = min(row["group_rows"], next_pow2(sources))
    prefetch, evict_first = bool(row.get("prefetch")), False
    if prefetch and row.get("evict_first_max_bytes"):
        evict_first = bool(row["evict_first_min_bytes"] < call_bytes <= row["evict_first_max_bytes"])
        prefetch = not evict_first
    whole = row.get("whole_group_rows", 0)
    if prefetch and whole and full_lanes and size_hint(sources) % whole == 0:
        block_n = whole
    if block_n * block_d * per_element > target.onchip_bytes:
        return None
    splits, groups = 0, -(-sources // block_n)
    if row.get("split_per_core") and isinstance(tokens, int) and tokens > 0:
        splits = split_count(target, tokens, groups, row["split_per_core"])
    if splits > 1 and groups - -(-groups // splits) >= row.get("split_min_saved", 0):
        return Plan(block_t=1, block_d=block_d, one_tile=True, grid=tokens * splits, num_warps=row["num_warps"],
                    block_n=block_n, tokens_per_program=1, constant_dim=row["constant_dim"], split=splits,
                    prefetch=prefetch, evict_first=evict_first)
    per_program = row["tokens_per_program"]
    if per_program and isinstance(tokens, int) and -(-tokens // per_program) > target.max_grid:
        per_program = 0  # Ascend's grid cap: a persistent grid instead
    if per_program:
        grid = torch.sym_max(1, -(-tokens // per_program))
    else:
        grid = torch.sym_min(tokens, target.vector_cores * row["programs_per_core"])
    return Plan(block_t=1, block_d=block_d, one_tile=True, grid=grid, num_warps=row["num_warps"], block_n=block_n,
                tokens_per_program=per_program, constant_dim=row["constant_dim"], prefetch=prefetch,
                evict_first=evict_first)


SPLIT_MERGE_BLOCK_D = 1024  # features per program of attn_res_fwd_merge_kernel (a few KB per token: latency-bound)


# The partial-sum reduction is latency-bound (a few MB, just written, in L2): on CUDA, narrow feature
# blocks give many programs, and tall program blocks few dependent steps each. Rewriting the rows under
# a stash holds four fp32 tiles (stash, g, v and the gradient), so it walks them in blocks of its own
# height; the sum keeps its blocks, so a stash changes no bit of the parameter gradients.
REDUCE_BYTES_PER_ELEMENT = 8
REWRITE_BYTES_PER_ELEMENT = 16


@memoize
def reduce_plan(target: Target, dim: int, programs: int, stash: int = 0, acc_bytes: int = 4
                ) -> tuple[int, int, int, int]:
    """(BLOCK_D, BLOCK_P, grid, REWRITE_P) for summing the backward's [programs, dim] partial sums (acc_bytes
    each: 4, 8 for float64 values) and, with a stash (see stash_rows), rewriting REWRITE_P stashed tokens at a
    time. With a stash of two 16-bit rows BLOCK_D divides dim, so each program owns whole columns of it."""
    row = resolve(OP, "reduce", target, interpreted=target.interpreted, dtype=dtype_class(acc_bytes),
                  dim=size_hint(dim), tokens=size_hint(programs))
    widest = row["block_d"]
    if stash == 2:
        block_d = min(dim & -dim, widest)  # the largest power of two dividing dim
    else:
        block_d = max(min(next_pow2(dim), widest), max(1, target.row_align // 4))
    tallest = row["max_block_p"]
    heights = []
    for per_element in (REDUCE_BYTES_PER_ELEMENT, REWRITE_BYTES_PER_ELEMENT):
        budget = max(1, target.onchip_bytes // (per_element * acc_bytes // 4 * block_d))
        heights.append(max(1, min(prev_pow2(budget), next_pow2(size_hint(programs)), tallest)))
    grid = target.grid_size(-(-dim // block_d))
    return block_d, heights[0], grid, heights[1]


@memoize
def stash_rows(target: Target, sources: int, dim: int, elem_size: int) -> int:
    """How many source rows of a program's first token hold its fp32 partial-sum row (4 / elem_size),
    or 0 when they cannot, in which case the partial sums get their own [programs, dim] buffer.

    The stash keeps the backward's peak memory at grad_values plus O(programs) scalars: the buffer
    is 4-8 MB at D = 4096-8192, more than Liger-Kernel's saved statistics (2 N tokens fp32). Rows are
    written by the backward kernel, overwritten by the partial sums, and rewritten by the reduction.
    Needs concrete sizes (no guard on a symbolic N or D), N >= 4 / elem_size rows, and for 16-bit rows
    a reduction block that divides D and is even (each half of it holds one row's columns). Not for float64
    values, whose partial sums are float64 (4 // 8 = 0 rows)."""
    rows = 4 // elem_size
    if not (isinstance(sources, int) and isinstance(dim, int)) or rows not in (1, 2) or sources < rows:
        return 0
    if rows == 2 and target.vendor == "ascend":
        # triton-ascend's adapter cannot bitcast a 16-bit pointer to an fp32 one (its ttadapter stage
        # rejects the stash, fusedops_tests/compile_ascend.py): the partial sums get their own buffer.
        return 0
    if rows == 2 and reduce_plan(target, dim, 1, 2)[0] < max(2, target.row_align // elem_size):
        return 0
    return rows


on_reload(make_plan.cache_clear)
on_reload(depth_tile_plan.cache_clear)
on_reload(reduce_plan.cache_clear)
on_reload(two_phase_plan.cache_clear)
on_reload(stash_rows.cache_clear)
