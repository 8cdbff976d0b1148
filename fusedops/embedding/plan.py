"""Launch plans for embedding: 2D tile shapes and grids from a hardware Target and the problem shape.

The kernels move bytes and do almost no arithmetic, so a plan only has to (1) keep a whole tile's
row segment long enough for full-width coalesced accesses, (2) waste few masked lanes when D is not
a power of two, (3) fit the tile in the target's on-chip budget (the Unified Buffer on Ascend) and
(4) on CUDA, put enough bytes in flight per program to hide the gather's latency.

The backward takes one of two paths with the same bits (`backward_plan`): the sort path (`make_plan`), or,
for a batch of at most the table's bwd_scan max_tokens, the sort-free scan kernel (`scan_plan`): fewer
launches where a small batch is bound by host time.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from fusedops.plans import dtype_class, forced, on_reload, resolve
from fusedops.registry import memoize
from fusedops.targets import Target, size_hint

# On-chip bytes per tile element. Forward: the loaded tile, its copy on the way out, and the int64
# gather offsets. Backward: the fp32 accumulator, the loaded gradient upcast to fp32, the raw load,
# and the int64 gather offsets.
FORWARD_FIXED_BYTES = 8
BACKWARD_FIXED_BYTES = 16
MAX_WASTE = 1 / 8  # the most masked-off lanes a feature block may waste
# Tile bytes, feature-block caps, rows, warps, register caps, L2 eviction and run chunks come from plans.json
# (fusedops/plans.py); where each row came from: bench/NOTES.md, "plans as data".
OP = "embedding"


# The backward's run detection: sort keys as narrow as the target's sort is known to take (CUDA: 16-bit
# keys, which CUB sorts in 2 passes instead of 4: h100 embedding run 13), and the elements per program of its
# two small kernels (keys, run offsets).
NARROW_KEY_VENDORS = ("cuda",)
RUN_BLOCK = 1024
OFFSETS_BLOCK = 256
# The backward sums a run of equal indices CHUNK tokens per program; longer runs (a Zipf batch's frequent
# tokens: the most frequent of 64K tokens at V = 32000 is named ~9000 times) are split into chunks whose
# partial sums a second kernel adds up in a fixed order. The interpreter's plans split after 16 tokens so
# that tests reach the split at their sizes (the chunk is a row of plans.json).
RUN_CHUNK = 256
# The scan backward keeps this many gradient rows in flight per program (embedding_bwd_scan_kernel).
SCAN_ROWS = 8
# The run offsets' binary search covers up to 2**31 - 1 tokens whatever the size (a dynamic-shape graph
# serves every batch); its steps longer than the batch cost no loads.
MAX_LOG_TOKENS = 31


def run_key_dtype(target: Target, num_weights: int) -> torch.dtype:
    """The sort keys' dtype: they hold -1 (out of range) and 0 .. V - 1."""
    if num_weights <= 2**15 and target.vendor in NARROW_KEY_VENDORS:
        return torch.int16
    return torch.int32 if num_weights <= 2**31 else torch.int64


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def prev_pow2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


@dataclass(frozen=True)
class Plan:
    block_rows: int  # tokens per tile (forward) or weight rows per tile (backward; 1 for the scan kernel)
    block_d: int  # features per tile
    grid: int  # programs launched; each loops over tiles pid, pid + grid, ...
    num_warps: int
    max_registers: Optional[int] = None  # per thread (CUDA's maxnreg), None: the compiler's choice
    evict: str = ""  # backward: L2 eviction policy of its once-touched loads and stores ("": default)
    run_chunk: int = RUN_CHUNK  # backward: the most tokens of one run a program sums (a power of two)
    scan_tokens: int = 0  # backward: the largest batch the scan kernel takes (0: none; see `scans`)
    scan_block: int = 0  # backward, scan kernel: indices compared a step (a power of two >= 2)

    def tiles(self, rows: int, dim: int) -> int:
        return -(-rows // self.block_rows) * -(-dim // self.block_d)

    def zeros_per_run(self, num_weights: int, tokens: int) -> int:
        """Backward: zero tiles between consecutive run items (both kinds count feature blocks alike),
        so the run items spread evenly over the item order."""
        return -(-num_weights // self.block_rows) // tokens if tokens else 0

    def scans(self, tokens) -> bool:
        """Backward: whether a batch of `tokens` takes the scan kernel: a known size of at most scan_tokens.
        A symbolic one (a dynamic-shape graph serves every batch size) takes the sort path."""
        return isinstance(tokens, int) and 0 < self.scan_tokens and tokens <= self.scan_tokens


def _fit(target: Target, elem_size: int, per_element: int) -> tuple[int, int]:
    """(the shortest feature block: one aligned row, the largest power-of-two tile that fits on chip) for
    tiles of per_element on-chip bytes an element."""
    budget = target.onchip_bytes // per_element
    min_d = max(1, target.row_align // elem_size)
    if budget < min_d:
        raise ValueError(f"embedding: an on-chip budget of {target.onchip_bytes} bytes cannot hold one aligned tile row")
    return min_d, prev_pow2(budget)


def _block_d(dim: int, min_d: int, max_d: int) -> int:
    """The longest power-of-two feature block <= max_d whose padding wastes at most MAX_WASTE of the
    row (D = 768 -> 256, D = 1600 -> 256), never shorter than min_d (one aligned row)."""
    block = max(min_d, min(max_d, next_pow2(dim)))
    while block > min_d:
        padded = -(-dim // block) * block
        if (padded - dim) <= MAX_WASTE * dim:
            break
        block //= 2
    return block


@memoize  # asked on every forward and backward (bench/NOTES.md embedding run 14)
def make_plan(target: Target, rows: int, dim: int, elem_size: int, *, backward: bool, tokens: int = 0) -> Plan:
    """The forward's plan, or the backward's sort path's (which also carries the bwd_scan row's scan_tokens
    and scan_block). rows: tokens (forward) or vocabulary rows V (backward); dim: D; elem_size: weight
    bytes; tokens (backward): the run items, one row x block_d each, that come before the zero tiles."""
    # float64 gradients: the accumulator and the upcast row are 8 bytes, not BACKWARD_FIXED_BYTES' 4 each
    wide = 8 if elem_size == 8 else 0
    per_element = (BACKWARD_FIXED_BYTES + wide + elem_size) if backward else (FORWARD_FIXED_BYTES + 2 * elem_size)
    min_d, largest = _fit(target, elem_size, per_element)
    hint = size_hint(rows)  # tile shapes from the (hinted) size; tiles and the grid from the real one
    features = dict(interpreted=target.interpreted, dtype=dtype_class(elem_size), dim=size_hint(dim), rows=hint)
    row = resolve(OP, "bwd" if backward else "fwd", target, **features)
    max_registers, evict = None, ""
    if backward and row["rows"]:
        # a fixed number of rows a tile (at least min_tile_elements elements), as many as fit
        block_d = _block_d(dim, min_d, min(row["max_block_d"], largest))
        rows_wanted = max(row["rows"], row["min_tile_elements"] // block_d)
        block_rows = max(1, min(rows_wanted, largest // block_d))
    else:
        tile_bytes = 0 if backward else row["tile_bytes"]
        wanted = min(largest, max(tile_bytes // elem_size, 1)) if tile_bytes else largest
        cap = row["max_block_d"]
        block_d = _block_d(dim, min_d, wanted // 2 if cap == -2 else min(cap, wanted) if cap else wanted)
        block_rows = max(1, min(prev_pow2(max(1, wanted // block_d)), next_pow2(max(hint, 1))))
        # Ascend: a one-row tile crashes triton-ascend's adapter (fusedops_tests/compile_ascend.py): >= 2 rows
        block_rows = max(row["min_rows"], block_rows)
    num_warps = min(8, max(1, block_rows * block_d // 1024))
    if backward:
        launch_row = resolve(OP, "bwd_launch", target, block_d=block_d, **features)
        num_warps = launch_row["num_warps"] or num_warps
        max_registers, evict = launch_row["max_registers"] or None, launch_row["evict"]
    tiles = -(-torch.sym_max(rows, 1) // block_rows) * -(-max(dim, 1) // block_d)
    if backward:
        tiles += tokens * -(-max(dim, 1) // block_d)
    scan = _scan_row(target, dim, elem_size) if backward else dict(max_tokens=0, scan_block=0)
    return Plan(block_rows=block_rows, block_d=block_d, grid=target.grid_size(tiles), num_warps=num_warps,
                max_registers=max_registers, evict=evict, run_chunk=row["run_chunk"],
                scan_tokens=scan["max_tokens"], scan_block=scan["scan_block"])


def _scan_row(target: Target, dim: int, elem_size: int) -> dict:
    return resolve(OP, "bwd_scan", target, interpreted=target.interpreted, dtype=dtype_class(elem_size),
                   dim=size_hint(dim))


@memoize
def scan_plan(target: Target, dim: int, elem_size: int, tokens: int, base: Plan) -> Plan:
    """The scan kernel's launch: `base` (the backward's plan: run chunk, scan block) with one program per
    token x feature block, each holding two accumulator rows and SCAN_ROWS gradient rows (raw and upcast)."""
    acc = 8 if elem_size == 8 else 4
    min_d, largest = _fit(target, elem_size, 2 * acc + SCAN_ROWS * (elem_size + acc))
    row = _scan_row(target, dim, elem_size)
    block_d = _block_d(dim, min_d, min(row["max_block_d"], largest) if row["max_block_d"] else largest)
    items = tokens * -(-max(dim, 1) // block_d)
    return replace(base, block_rows=1, block_d=block_d, grid=target.grid_size(items),
                   num_warps=row["num_warps"] or min(8, max(1, block_d // 1024)), max_registers=None, evict="")


def backward_plan(target: Target, num_weights: int, dim: int, elem_size: int, tokens: int,
                  capturing: bool = False) -> Plan:
    """The backward's plan under what fusedops.plan_override("embedding", "bwd", ...) forces: the scan
    kernel's where it `scans` the batch (a forced scan_tokens picks the path: 0 the sort path, at least the
    batch the scan), else the sort path's; the other forced fields on top of either. `capturing` (a CUDA
    graph capture, unless scan_tokens is forced): the sort path. The scan path saves host time, which a
    graph does not replay, and its device time is longer on padded batches (bench/NOTES.md, embedding, the
    scan backward); the two give the same bits."""
    plan = forced_plan(make_plan(target, num_weights, dim, elem_size, backward=True, tokens=tokens), "bwd")
    if capturing and "scan_tokens" not in forced(OP, "bwd"):
        plan = replace(plan, scan_tokens=0)
    return forced_plan(scan_plan(target, dim, elem_size, tokens, plan), "bwd") if plan.scans(tokens) else plan


def forced_plan(plan: Plan, kernel: str) -> Plan:
    """`plan` with what fusedops.plan_override("embedding", kernel, ...) forces on top (taken as given)."""
    fields = forced(OP, kernel)
    return replace(plan, **fields) if fields else plan


on_reload(make_plan.cache_clear)
on_reload(scan_plan.cache_clear)
