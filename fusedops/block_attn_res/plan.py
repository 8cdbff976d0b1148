"""Launch plans of Block AttnRes's kernels: tile sizes, D splits and grids from a hardware Target and the
problem shape. The CUDA forwards follow an H200 sweep (fusedops/bench/tune_block_attn_res.py, bench/NOTES.md);
the backwards and the other targets are first guesses from the on-chip budgets."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusedops.registry import memoize
from fusedops.targets import Target, size_hint

# attn_res_multi keeps [BLOCK_M, BLOCK_D] tiles on chip: the queries and the output accumulator in the
# forward; queries, grad_out and the query-gradient tile in the backward (ACC bytes each).
MULTI_FWD_TILES = 2
MULTI_BWD_TILES = 3
# The merge keeps BLOCK_T x BLOCK_D tiles of p, the addends, out and h (forward), and of P, out, grad_h, dh
# and the gradients (backward), in ACC bytes each.
MERGE_FWD_TILES = 5
MERGE_BWD_TILES = 7
# Largest CUDA tiles (elements) until a GPU sweep says otherwise: registers, not the budget, bound them.
# sm_90 compiles (fusedops_tests/compile_sm90.py-style, no GPU run): 4 warps on 8K-element tiles use 255
# registers, and the multi backward's three [BLOCK_M, BLOCK_D] tiles spill; so warps grow with the tile
# (CUDA_ELEMENTS_PER_WARP elements per warp, up to 16) and the multi backward's tile is capped at 4K.
CUDA_MULTI_TILE_ELEMENTS = 8192
CUDA_MULTI_BWD_TILE_ELEMENTS = 4096
CUDA_MERGE_TILE_ELEMENTS = 8192
CUDA_MERGE_FWD_TILE = 4096
CUDA_NUM_WARPS = 4
CUDA_MAX_WARPS = 16
CUDA_ELEMENTS_PER_WARP = 1024


def cuda_warps(tile_elements: int) -> int:
    return max(CUDA_NUM_WARPS, min(CUDA_MAX_WARPS, tile_elements // CUDA_ELEMENTS_PER_WARP))


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


def prev_pow2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


@dataclass(frozen=True)
class MultiPlan:
    block_m: int  # >= M queries on chip at once
    block_n: int  # >= N sources (the logits of a token are a [block_m, block_n] tile)
    block_d: int  # features per tile
    splits: int  # programs sharing one token (each writes D_CHUNK features): decode
    d_chunk: int  # features per split, a multiple of block_d (of block_d2 in the tensor-core forward)
    grid: int  # programs launched: token programs x splits
    num_warps: int = CUDA_NUM_WARPS
    block_t: int = 1  # tokens a step (the tensor-core forward)
    dot: bool = False  # the forward on tensor cores (attn_res_multi_fwd_dot_kernel)
    num_stages: int = 2
    block_d2: int = 0  # features per tile of the tensor-core forward's output pass


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
    largest = max(prev_pow2(budget), min_row)
    cuda = target.vendor == "cuda" and not target.interpreted
    if cuda:
        elements = CUDA_MULTI_BWD_TILE_ELEMENTS if backward else CUDA_MULTI_TILE_ELEMENTS
        largest = max(min_row, min(largest, prev_pow2(max(1, elements // block_m))))
    block_d = max(min(next_pow2(dim), largest), min_row)
    warps = cuda_warps(block_m * block_d * (2 if backward else 1)) if cuda else CUDA_NUM_WARPS
    d_tiles = -(-dim // block_d)
    slots = target.vector_cores * target.resident
    if backward:
        # One program per core, not per resident slot: each owns a [M, D] ACC row of query-gradient partial
        # sums (M = 24, D = 7168 on 132 SMs: 91 MB), which a GPU sweep may want to shrink further.
        grid = torch.sym_min(target.grid_size(tokens, persistent=True), target.vector_cores)
        return MultiPlan(block_m, block_n, block_d, 1, d_tiles * block_d, grid, warps)
    hint = max(1, size_hint(tokens))
    if dot and target.vendor == "cuda" and elem_size != 8:
        return _dot_plan(target, tokens, hint, sources, queries, dim, tile_t, tile_d)
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
    num_warps: int = CUDA_NUM_WARPS


@memoize
def merge_plan(target: Target, tokens: int, dim: int, elem_size: int, *, backward: bool = False) -> MergePlan:
    """Token blocks of BLOCK_T rows and D tiles of BLOCK_D (a whole row where it fits, else the passes re-read
    the row's tiles). Persistent (a program's query/gain-gradient partial rows are [grid, D]); the forward
    has no D split, so a 1-token decode step is one program."""
    acc = 8 if elem_size == 8 else 4
    tiles = MERGE_BWD_TILES if backward else MERGE_FWD_TILES
    budget = max(1, target.onchip_bytes // (tiles * acc))
    min_row = max(1, target.row_align // elem_size)
    largest = max(prev_pow2(budget), min_row)
    hint = max(1, size_hint(tokens))
    cuda = target.vendor == "cuda" and not target.interpreted
    if cuda and not backward:
        # H200 sweep (bench/NOTES.md, Block AttnRes run 1): one row a step in 4096-wide tiles, 8 warps; 16
        # warps where there are fewer rows than resident programs (1 token: 9.5 us against 46 with 8).
        block_d = min(next_pow2(dim), CUDA_MERGE_FWD_TILE)
        slots = target.vector_cores * target.resident
        return MergePlan(1, block_d, target.grid_size(tokens, persistent=True),
                         cuda_warps(4 * block_d) if hint < slots else min(8, cuda_warps(block_d)))
    if cuda:
        largest = max(min_row, min(largest, CUDA_MERGE_TILE_ELEMENTS))
    block_d = max(min(next_pow2(dim), largest), min_row)
    block_t = max(1, min(prev_pow2(max(1, largest // block_d)), next_pow2(hint)))
    if not target.interpreted:
        slots = target.vector_cores * target.resident
        block_t = max(1, min(block_t, prev_pow2(max(1, hint // slots))))
    blocks = -(-tokens // block_t)
    grid = target.grid_size(blocks, persistent=True)
    return MergePlan(block_t, block_d, grid, cuda_warps(block_t * block_d) if cuda else CUDA_NUM_WARPS)


# The tensor-core forward (attn_res_multi_fwd_dot_kernel). Its dots want >= 16 rows, columns and depth (tiles
# are masked). Measured on the H200 (bench/NOTES.md, Block AttnRes run 1; bench/experiments/
# multi_dot_variants.py) at N <= 16, M <= 32: 4 tokens a step, logit and output tiles 128 wide with >= 32
# query slots, else 64 (8 tokens a step is faster at some shapes and 1.6x slower at others: a register
# cliff). Deeper or wider blocks keep the measured tile sizes: at most DOT_ROWS logit rows (tokens x source
# slots), DOT_ROW_ELEMENTS elements in a [rows, BLOCK_D] tile and DOT_OUT_ELEMENTS in the output tile.
DOT_MIN = 16
DOT_ROWS = 64
DOT_ROW_ELEMENTS = 8192
DOT_OUT_ELEMENTS = 16384


def _dot_plan(target: Target, tokens: int, hint: int, sources: int, queries: int, dim: int, block_t: int,
              block_d: int) -> MultiPlan:
    block_m = max(DOT_MIN, next_pow2(queries))
    block_n = pow2_at_least(sources, DOT_MIN)
    slots = target.vector_cores * target.resident
    block_t = block_t or max(1, DOT_ROWS // block_n)
    rows = block_t * block_n

    def tile(wanted: int, cap: int) -> int:
        return max(DOT_MIN, min(next_pow2(dim), wanted, prev_pow2(max(1, cap))))

    block_d = tile(block_d or (128 if block_m >= 32 else 64), DOT_ROW_ELEMENTS // rows)
    block_d2 = tile(128 if block_m >= 32 else 64,
                    min(DOT_OUT_ELEMENTS // (block_t * block_m), DOT_ROW_ELEMENTS // rows))
    d_tiles = -(-dim // block_d2)
    blocks = -(-hint // block_t)
    splits = max(1, min(d_tiles, slots // blocks)) if blocks < slots else 1
    per_split = -(-d_tiles // splits)
    splits = -(-d_tiles // per_split)
    token_programs = target.grid_size(-(-tokens // block_t), persistent=True)
    return MultiPlan(block_m, block_n, block_d, splits, per_split * block_d2, token_programs * splits,
                     CUDA_NUM_WARPS, block_t, True, 2, block_d2)
