"""Launch plans of Block AttnRes's kernels: tile sizes, D splits and grids from a hardware Target and the
problem shape, the measured choices read from plans.json. The CUDA forwards follow an H200 sweep
(fusedops/bench/tune_block_attn_res.py, bench/NOTES.md); the backwards and the other targets are first
guesses from the on-chip budgets."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from fusedops.plans import forced, on_reload, resolve
from fusedops.registry import memoize
from fusedops.targets import Target, size_hint

OP = "block_attn_res"

# attn_res_multi keeps [BLOCK_M, BLOCK_D] tiles on chip: the queries and the output accumulator in the
# forward; queries, grad_out and the query-gradient tile in the backward (ACC bytes each).
MULTI_FWD_TILES = 2
MULTI_BWD_TILES = 3
# The merge keeps BLOCK_T x BLOCK_D tiles of p, the addends, out and h (forward), and of P, out, grad_h, dh
# and the gradients (backward), in ACC bytes each.
MERGE_FWD_TILES = 5
MERGE_BWD_TILES = 7
# Tile caps, warps and kernel variants come from plans.json (fusedops/plans.py); where each row came from:
# bench/NOTES.md, "Block AttnRes".


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def pow2_at_least(n, floor: int) -> int:
    """The smallest power of two >= n and >= floor, found by comparisons only: for a symbolic n (the depth N
    under torch.compile with dynamic shapes) the trace then holds N within (block / 2, block] rather than at
    one value, so a compiled graph serves every depth of its bucket."""
    block = floor
    while n > block:
        block *= 2
    return block


def pow2_at_most(n) -> int:
    """The largest power of two <= n (n >= 1), by comparisons only (see pow2_at_least)."""
    block = 1
    while n >= 2 * block:
        block *= 2
    return block


def prev_pow2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _row(kernel: str, target: Target) -> dict:
    return resolve(OP, kernel, target, interpreted=target.interpreted)


def _warps(params: dict, elements: int) -> int:
    """num_warps, or one warp per elements_per_warp tile elements within [num_warps, max_warps]."""
    if not params["elements_per_warp"]:
        return params["num_warps"]
    return max(params["num_warps"], min(params["max_warps"], elements // params["elements_per_warp"]))


def _capped(largest: int, min_row: int, tile_elements: int, rows: int) -> int:
    """The widest tile row the budget allows (`largest`), within tile_elements for `rows` rows (0: no cap)."""
    if not tile_elements:
        return largest
    return max(min_row, min(largest, prev_pow2(max(1, tile_elements // rows))))


@dataclass(frozen=True)
class MultiPlan:
    block_m: int  # >= M queries on chip at once
    block_n: int  # >= N sources (the logits of a token are a [block_m, block_n] tile)
    block_d: int  # features per tile
    splits: int  # programs sharing one token (each writes D_CHUNK features): decode
    d_chunk: int  # features per split, a multiple of block_d (of block_d2 in the tensor-core forward)
    grid: int  # programs launched: token programs x splits
    num_warps: int = 4
    block_t: int = 1  # tokens a step (the tensor-core forward)
    dot: bool = False  # the forward on tensor cores (attn_res_multi_fwd_dot_kernel)
    num_stages: int = 2
    block_d2: int = 0  # features per tile of the tensor-core forward's output pass
    # The two-pass forward (its fields above: block_t (token, source) rows a logits program, block_d2 features an
    # outputs program, block_n the power of two of a token's rows that program holds, then tail_rows more)
    two_pass: bool = False
    tail_rows: int = 0
    out_warps: int = 4  # the outputs kernel's warps
    constant_dim: bool = False  # its kernels take D as a compile-time constant
    # The tensor-core backward's gradients kernel (block_d2 features, out_warps): tokens a step (0: block_t) and its
    # software-pipelining stages (0: Triton's default)
    grad_tokens: int = 0
    grad_stages: int = 0
    # >0: attn_res_multi_bwd_grads_flat_kernel instead, grad_rows (token, source) rows a step (grad_rows // N tokens)
    grad_rows: int = 0


@memoize
def multi_plan(target: Target, tokens: int, sources: int, queries: int, dim: int, elem_size: int, *,
               backward: bool = False, dot: bool = True, tile_t: int = 0, tile_d: int = 0) -> MultiPlan:
    """One token per program step. The forward splits D across programs when there are fewer tokens than
    programs that run at once (decode: 1-512 tokens), so that one token's output rows are written by many
    programs; each re-derives the token's logits from all of D (a re-read from L2), the price of needing no
    cross-program reduction. On CUDA the forward of 16/32-bit values runs on tensor cores (_dot_plan; `dot`,
    `tile_t` and `tile_d` (block_t, block_d) force the tuner's choices there). The backward is persistent,
    one program per core (its query-gradient partial rows are [grid, M, D])."""
    acc = 8 if elem_size == 8 else 4
    block_m = next_pow2(queries)
    block_n = pow2_at_least(sources, 1)
    tiles = MULTI_BWD_TILES if backward else MULTI_FWD_TILES
    budget = max(1, target.onchip_bytes // (tiles * acc * block_m))
    min_row = max(1, target.row_align // elem_size)
    row = _row("multi_bwd" if backward else "multi_fwd", target)
    largest = _capped(max(prev_pow2(budget), min_row), min_row, row["tile_elements"], block_m)
    block_d = max(min(next_pow2(dim), largest), min_row)
    warps = _warps(row, block_m * block_d)
    d_tiles = -(-dim // block_d)
    slots = target.vector_cores * target.resident
    if backward and row.get("dot") and elem_size != 8:  # float64 never runs on tensor cores
        plan = _dot_backward_plan(target, row, tokens, sources, queries, dim, elem_size)
        if plan is not None:
            return plan
    if backward:
        # One program per core, not per resident slot: each owns a [M, D] ACC row of query-gradient partial
        # sums (M = 24, D = 7168 on 132 SMs: 91 MB), which a GPU sweep may want to shrink further.
        grid = torch.sym_min(target.grid_size(tokens, persistent=True), target.vector_cores)
        return MultiPlan(block_m, block_n, block_d, 1, d_tiles * block_d, grid, warps)
    hint = max(1, size_hint(tokens))
    if dot and row["dot"] and elem_size != 8:  # float64 never runs on tensor cores
        return _dot_plan(target, tokens, hint, sources, queries, dim, elem_size, tile_t, tile_d)
    splits = max(1, min(d_tiles, slots // hint)) if hint < slots else 1
    per_split = -(-d_tiles // splits)
    splits = -(-d_tiles // per_split)  # no empty split
    token_programs = target.grid_size(tokens, persistent=True) if target.persistent else torch.sym_min(
        torch.sym_max(tokens, 1), max(1, target.max_grid // splits))
    return MultiPlan(block_m, block_n, block_d, splits, per_split * block_d, token_programs * splits, warps)


@dataclass(frozen=True)
class MergePlan:
    block_t: int
    block_d: int
    grid: int
    num_warps: int = 4
    whole_row: bool = False  # forward: block_d >= D, each input tile loaded once (else one walk per pass)
    blocks_per_program: int = 0  # forward: > 0 launches cdiv(token blocks, it) programs, 0 a persistent grid
    constant_dim: bool = False  # forward: D a compile-time constant (one compile per D)


@memoize
def merge_plan(target: Target, tokens: int, dim: int, elem_size: int, *, backward: bool = False) -> MergePlan:
    """Token blocks of BLOCK_T rows and D tiles of BLOCK_D (a whole row where it fits, else the passes re-read
    the row's tiles). Persistent (a program's query/gain-gradient partial rows are [grid, D]); the forward
    has no D split, so a 1-token decode step is one program."""
    acc = 8 if elem_size == 8 else 4
    tiles = MERGE_BWD_TILES if backward else MERGE_FWD_TILES
    budget = max(1, target.onchip_bytes // (tiles * acc))
    min_row = max(1, target.row_align // elem_size)
    hint = max(1, size_hint(tokens))
    slots = target.vector_cores * target.resident
    row = _row("merge_bwd" if backward else "merge_fwd", target)
    if not backward and row["one_row"]:
        # One row a step: the whole row where next_pow2(D) <= whole_row_d (one program per token, a grid of
        # `tokens`), else tiles of at most tile_d features on a persistent grid; more warps where there are
        # fewer rows than resident programs (a decode step).
        whole = next_pow2(dim) <= row["whole_row_d"]
        block_d = next_pow2(dim) if whole else min(next_pow2(dim), row["tile_d"])
        few = dict(row, elements_per_warp=row["few_rows_elements_per_warp"])
        warps = _warps(few, block_d) if hint < slots else min(row["many_rows_max_warps"], _warps(row, block_d))
        grid = tokens if whole else target.grid_size(tokens, persistent=True)
        return MergePlan(1, block_d, grid, warps, whole_row=whole, blocks_per_program=1 if whole else 0,
                         constant_dim=row["constant_dim"])
    largest = _capped(max(prev_pow2(budget), min_row), min_row, row["tile_elements"], 1)
    block_d = max(min(next_pow2(dim), largest), min_row)
    block_t = max(1, min(prev_pow2(max(1, largest // block_d)), next_pow2(hint)))
    if not target.interpreted:
        block_t = max(1, min(block_t, prev_pow2(max(1, hint // slots))))
    blocks = -(-tokens // block_t)
    grid = target.grid_size(blocks, persistent=True)
    return MergePlan(block_t, block_d, grid, _warps(row, block_t * block_d))


# The tensor-core forward (attn_res_multi_fwd_dot_kernel). Its dots want >= 16 rows, columns and depth (tiles
# are masked). Its row ("multi_dot") holds the measured tile sizes: tokens a step as `rows` logit rows (tokens x
# source slots), logit and output tiles wide_tile_d wide with >= wide_queries query slots, else narrow_tile_d;
# deeper or wider blocks keep at most row_elements elements in a [rows, BLOCK_D] tile and out_elements in the
# output tile.
DOT_MIN = 16


def _dot_plan(target: Target, tokens: int, hint: int, sources: int, queries: int, dim: int, elem_size: int,
              block_t: int, block_d: int) -> MultiPlan:
    row = _row("multi_dot", target)
    block_m = max(DOT_MIN, next_pow2(queries))
    if (row["two_pass_min_tokens"] and hint >= row["two_pass_min_tokens"]
            and sources <= row["two_pass_max_sources"]):
        return _two_pass_plan(target, row, tokens, hint, sources, block_m, dim, elem_size, block_t, block_d)
    block_n = pow2_at_least(sources, DOT_MIN)
    slots = target.vector_cores * target.resident
    block_t = block_t or max(1, row["rows"] // block_n)
    rows = block_t * block_n

    def tile(wanted: int, cap: int) -> int:
        return max(DOT_MIN, min(next_pow2(dim), wanted, prev_pow2(max(1, cap))))

    # the tiles' element caps were measured with Hopper's shared memory (Target.smem_shrink)
    row_elements, out_elements = (row[cap] // target.smem_shrink() for cap in ("row_elements", "out_elements"))
    width = row["wide_tile_d"] if block_m >= row["wide_queries"] else row["narrow_tile_d"]
    block_d = tile(block_d or width, row_elements // rows)
    block_d2 = tile(width, min(out_elements // (block_t * block_m), row_elements // rows))
    d_tiles = -(-dim // block_d2)
    blocks = -(-hint // block_t)
    splits = max(1, min(d_tiles, slots // blocks)) if blocks < slots else 1
    per_split = -(-d_tiles // splits)
    splits = -(-d_tiles // per_split)
    token_programs = target.grid_size(-(-tokens // block_t), persistent=True)
    return MultiPlan(block_m, block_n, block_d, splits, per_split * block_d2, token_programs * splits,
                     row["num_warps"], block_t, True, row["num_stages"], block_d2)


def _two_pass_plan(target: Target, row: dict, tokens: int, hint: int, sources: int, block_m: int, dim: int,
                   elem_size: int, block_t: int, block_d: int) -> MultiPlan:
    """The forward in two passes over the rows (three kernels). The logits: logit_rows of the tokens x N (token,
    source) rows a program (fewer where the rows would not give every core a program) as one [rows, D] x [D,
    block_m] product, so each query tile serves many tokens. Their softmax. The outputs: one token and block_d2
    features a program, a 16-byte vector of each of the token's rows a thread (narrower vectors spread the rows
    over threads and ran 4-40x slower), the rows held as a power of two and a tail (N = 9: 8 + 1). The rows
    are read twice because a token's logits need all of D before any output, and the one-kernel forward keeps
    only a few tokens' rows in cache for its output pass (bench/NOTES.md, Block AttnRes run 2)."""
    head = pow2_at_most(sources)
    tail = pow2_at_least(sources - head, 1) if sources > head else 0
    per_core = max(1, hint * size_hint(sources) // target.vector_cores)
    rows = block_t or max(DOT_MIN, min(row["logit_rows"], prev_pow2(per_core)))
    block_d = max(DOT_MIN, min(next_pow2(dim), block_d or row["logit_tile_d"]))
    block_d2 = min(next_pow2(dim), 32 * row["out_warps"] * max(1, 16 // elem_size))
    return MultiPlan(block_m, head, block_d, 1, dim, -(-tokens * sources // rows), row["logit_warps"], rows, True,
                     row["logit_stages"], block_d2, two_pass=True, tail_rows=tail, out_warps=row["out_warps"],
                     constant_dim=row["constant_dim"])


def _dot_backward_plan(target: Target, row: dict, tokens: int, sources: int, queries: int, dim: int,
                       elem_size: int) -> MultiPlan | None:
    """The tensor-core backward (16/32-bit values): a statistics pass of block_t tokens a program over D in block_d
    tiles (num_warps), then a gradients pass whose program (c, p) owns block_d2 features of the p-th of `grid`
    token ranges (out_warps, grad_tokens a step, grad_stages): enough ranges that every core has
    row["dot_programs_per_core"] programs, each range a row of [grid, M, D] query-gradient partial sums. A step's
    tiles hold at most row["dot_max_rows"] source rows and row["dot_max_query_rows"] grad_out rows
    (row["dot_max_grad_query_rows"] in the gradients kernel) of 16-bit values, half as many of 32-bit ones (the
    kernels' shared memory), so deep or wide blocks take fewer tokens a step; None (the CUDA-core kernel) where one
    token's rows exceed that or M exceeds row["dot_max_queries"]. Where flat_grad_rows allows, the gradients pass is
    the flat kernel instead (grad_rows rows a step, row["dot_flat_tile_d"] features, row["dot_flat_programs_per_core"]).
    Where the rows came from: bench/NOTES.md, Block AttnRes runs 3 and 4; the caps: the sm_90 compile's shared memory
    (227 KB a program on the H100 and the H200; a device with less divides them by Target.smem_shrink)."""
    block_m, block_n = pow2_at_least(queries, DOT_MIN), pow2_at_least(sources, DOT_MIN)
    shrink = target.smem_shrink()

    def tokens_fitting(query_rows: int) -> int:
        return min(row["dot_max_rows"] // block_n, query_rows // block_m) * 2 // elem_size // shrink

    fits, grad_fits = tokens_fitting(row["dot_max_query_rows"]), tokens_fitting(row["dot_max_grad_query_rows"])
    if grad_fits < 1 or block_m > row["dot_max_queries"]:
        return None
    block_t = min(row["dot_tokens"], prev_pow2(fits))
    grad_tokens = min(row["dot_grad_tokens"] or block_t, prev_pow2(grad_fits))
    grad_rows = flat_grad_rows(row, sources, queries, elem_size, shrink)
    block_d2 = max(DOT_MIN, min(next_pow2(dim), row["dot_flat_tile_d" if grad_rows else "dot_grad_tile_d"]))
    blocks = -(-tokens // block_t)
    per_core = row["dot_flat_programs_per_core" if grad_rows else "dot_programs_per_core"]
    wanted = max(1, target.vector_cores * per_core // -(-dim // block_d2))
    return MultiPlan(block_m, block_n, max(DOT_MIN, min(next_pow2(dim), row["dot_tile_d"])), 1, dim,
                     torch.sym_max(1, torch.sym_min(blocks, wanted)), row["dot_warps"], block_t, True,
                     block_d2=block_d2, out_warps=row["dot_grad_warps"], grad_tokens=grad_tokens,
                     grad_stages=row["dot_grad_stages"], grad_rows=grad_rows)


def flat_grad_rows(row: dict, sources: int, queries: int, elem_size: int, shrink: int = 1) -> int:
    """The flat gradients kernel's rows a step: row["dot_grad_rows"], at least one token's N, doubled while whole
    tokens fill less than row["dot_grad_min_fill"] of them (N=9: 32 rows, 3 tokens); 0 (the batched kernel) where
    the row asks none, or past row["dot_grad_max_rows"] rows or row["dot_grad_max_cols"] (token, query) columns of
    16-bit values, half as many of 32-bit ones, both divided by `shrink` (Target.smem_shrink) (its block-diagonal
    alpha tile and the grad_out rows it multiplies, staged in shared memory: fp32 values at 16 rows, 128 columns,
    64 queries take 256 KB in the sm_90 compile)."""
    if not row["dot_grad_rows"]:
        return 0
    max_rows, max_cols = (row[cap] * 2 // elem_size // shrink for cap in ("dot_grad_max_rows", "dot_grad_max_cols"))
    rows = max(row["dot_grad_rows"], next_pow2(sources))
    while rows // sources * sources < row["dot_grad_min_fill"] * rows and 2 * rows <= max_rows:
        rows *= 2
    fits = rows <= max_rows and flat_grad_cols(rows, sources, queries) <= max_cols
    return rows if fits else 0


def flat_grad_step(rows: int, sources: int) -> int:
    """The flat gradients kernel's tokens a step: as many whole tokens as its rows hold, at least one."""
    return max(1, rows // sources)


def flat_grad_cols(rows: int, sources: int, queries: int) -> int:
    """The flat gradients kernel's (token, query) columns a step: its tokens a step x M queries."""
    return max(DOT_MIN, next_pow2(flat_grad_step(rows, sources) * queries))


def forced_plan(plan, kernel: str, *, sources: int, queries: int, dim: int):
    """`plan` (a MultiPlan or MergePlan) with what fusedops.plan_override("block_attn_res", kernel, ...) forces on
    top, taken as given (no budget shrink), kernel being multi_fwd, multi_bwd, merge_fwd or merge_bwd. A forced
    plan that would leave sources, queries or features out raises ValueError: the kernels mask what their tiles
    do not cover, so it would be a wrong answer, not an error."""
    fields = forced(OP, kernel)
    if not fields:
        return plan
    plan = replace(plan, **fields)
    if all(isinstance(x, int) for x in (sources, queries, dim)):
        gaps = _gaps(plan, kernel, sources, queries, dim)
        if gaps:
            raise ValueError(f"plan_override: block_attn_res {kernel} plan {plan} leaves out {', '.join(gaps)}")
    return plan


def _gaps(plan, kernel: str, sources: int, queries: int, dim: int) -> list:
    if kernel.startswith("merge"):
        return [f"features past block_d = {plan.block_d} of D = {dim} (whole_row)"] if (
            kernel == "merge_fwd" and plan.whole_row and plan.block_d < dim) else []
    gaps = []
    rows = plan.block_n + plan.tail_rows if plan.two_pass else plan.block_n
    if rows < sources:
        gaps.append(f"sources past {rows} of N = {sources}")
    if plan.block_m < queries:
        gaps.append(f"queries past block_m = {plan.block_m} of M = {queries}")
    if kernel == "multi_fwd" and (plan.two_pass or plan.dot) and min(plan.block_t, plan.block_d2) < 1:
        gaps.append(f"everything: the {'two-pass' if plan.two_pass else 'tensor-core'} forward needs block_t and "
                    f"block_d2 >= 1 (this target's plan has {plan.block_t} and {plan.block_d2}: force them too)")
    if kernel == "multi_fwd" and not plan.two_pass and (plan.splits * plan.d_chunk < dim or plan.grid % plan.splits):
        gaps.append(f"features: splits x d_chunk = {plan.splits} x {plan.d_chunk} must cover D = {dim} and divide "
                    f"grid = {plan.grid}")
    return gaps


on_reload(multi_plan.cache_clear)
on_reload(merge_plan.cache_clear)
