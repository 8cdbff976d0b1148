"""Launch plans for neighborhood attention: tile boxes and grids from a hardware Target and the shape.

A tile is a box of positions (3 axes, the unused leading ones of size 1) inside one dilation group.
The query box (BM) and the key box (BN) are chosen per number of spatial axes so that a query box's
neighbourhood is covered by few key boxes, then clamped to the group lengths and shrunk (largest
axis first) until one program's working set fits the target's on-chip budget: registers on CUDA,
the 192 KiB Unified Buffer on Ascend. Ascend launches a persistent grid of one program per AI core
(never more than 65535 programs); CUDA launches one program per tile.

FUSEDOPS_NA_TILES="bm0,bm1,bm2/bn0,bn1,bn2[/warps[/stages]]" overrides the boxes (for benchmark sweeps);
FUSEDOPS_NA_BWD_TILES does the same for the backward kernels only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import torch

from fusedops.targets import Target

# Boxes per number of spatial axes (padded to 3 axes, leading axes first).
# The 2D/3D backward's starting boxes (the budget loop shrinks them; 1D picks its tiles by window width).
CUDA_BACKWARD_BOXES = {
    2: ((1, 8, 8), (1, 8, 16)),
    3: ((4, 4, 8), (4, 4, 8)),
}
NARROW_WINDOW, WIDE_WINDOW = 16, 64  # 1D backward tiles by window width (see make_plan)
# The forward's (query box, key box, warps): H100 sweep of the forward kernel alone in GPU time
# (bench.tune_neighborhood_attention TUNE_FORWARD=1, bench/NOTES.md run 12), every benchmark case.
# Against the previous forward plans (1D k >= 16: 128 x 32 on 8 warps; 2D: 8x8 x 8x16 on 8 warps; 3D:
# 4x4x8 boxes): k33 152 -> 95 us, k129 52 -> 43, 2D 7x7 62 -> 33, 3D 600 -> 468; k7 28 -> 25.
CUDA_FORWARD = {
    1: ((1, 1, 64), (1, 1, 32), 4),
    2: ((1, 8, 8), (1, 8, 8), 4),
    3: ((4, 4, 8), (2, 4, 8), 4),
}
# Ascend and the interpreter: fewer, larger tiles (the budget loop shrinks them to fit the UB).
LARGE_BOXES = {
    1: ((1, 1, 64), (1, 1, 64)),
    2: ((1, 8, 8), (1, 8, 16)),
    3: ((4, 4, 4), (4, 4, 8)),
}
MIN_DOT = 16  # tl.dot on GPUs wants every dim >= 16


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class Plan:
    bm: tuple[int, int, int]  # query box
    bn: tuple[int, int, int]  # key box
    block_d: int
    block_dv: int
    num_warps: int
    dot_fp32: bool  # upcast dot operands in the kernel (the interpreter's bf16 dot is unreliable)
    precision: str  # tl.dot input_precision: "ieee" keeps fp32 inputs exact
    num_stages: int | None = None  # software-pipelining depth of the key/query loops; None: Triton's default

    @property
    def block_m(self) -> int:
        return self.bm[0] * self.bm[1] * self.bm[2]

    @property
    def block_n(self) -> int:
        return self.bn[0] * self.bn[1] * self.bn[2]


def _footprint(bm: int, bn: int, block_d: int, block_dv: int, backward: bool) -> int:
    """fp32 bytes one program keeps live: q, k, v tiles, the score/probability tiles, accumulators."""
    if backward:
        elems = 2 * bm * block_d + 2 * bm * block_dv + 2 * bn * block_d + 2 * bn * block_dv + 3 * bm * bn
    else:
        elems = bm * block_d + bn * block_d + bn * block_dv + 2 * bm * bn + bm * block_dv
    return 4 * elems


def _clamp(box: list[int], limits: Sequence[int], floor: int) -> list[int]:
    """Shrink each axis of the box to the smallest power of two >= its group length, keeping the box's
    volume >= floor."""
    box = list(box)
    for a in range(3):
        want = min(box[a], next_pow2(max(1, limits[a])))
        while box[a] > want:
            vol = box[0] * box[1] * box[2]
            if vol // 2 < floor:
                break
            box[a] //= 2
    return box


def tiles_override() -> str:
    """The raw FUSEDOPS_NA_TILES and FUSEDOPS_NA_BWD_TILES values: part of the launch-spec cache key."""
    return os.environ.get("FUSEDOPS_NA_TILES", "") + "|" + os.environ.get("FUSEDOPS_NA_BWD_TILES", "")


def _override(backward: bool) -> tuple[tuple[int, ...], tuple[int, ...], int | None, int | None] | None:
    forward, backward_raw = tiles_override().split("|")
    raw = (backward_raw if backward and backward_raw.strip() else forward).strip()
    if not raw:
        return None
    parts = raw.split("/")
    bm = tuple(int(x) for x in parts[0].split(","))
    bn = tuple(int(x) for x in parts[1].split(","))
    warps = int(parts[2]) if len(parts) > 2 else None
    stages = int(parts[3]) if len(parts) > 3 else None
    return bm, bn, warps, stages


def make_plan(
    target: Target, spatial: Sequence[int], dilation: Sequence[int], head_dim: int, head_dim_v: int,
    dtype: torch.dtype, ndim: int, *, backward: bool, kernel_volume: int = 0,
) -> Plan:
    """spatial/dilation padded to 3 axes; ndim the caller's number of spatial axes."""
    group_len = [-(-length // d) for length, d in zip(spatial, dilation)]
    block_d = max(MIN_DOT, next_pow2(head_dim))
    block_dv = max(MIN_DOT, next_pow2(head_dim_v))
    interpreted = target.interpreted
    # tl.dot tiles keep M, N, K >= 16 except on the CUDA plan's interpreter (upstream triton's allows
    # any size): triton-ascend 3.2's interpreter asserts 16 (the Ascend CI stage), as GPUs need.
    floor = 1 if interpreted and target.vendor == "cuda" else MIN_DOT
    warps = stages = None
    if target.vendor != "cuda" or interpreted:
        bm, bn = (list(b) for b in LARGE_BOXES[ndim])
    elif not backward:
        box_m, box_n, warps = CUDA_FORWARD[ndim]
        bm, bn = list(box_m), list(box_n)
    elif ndim == 1:
        # H100 sweeps (GPU time of fwd+bwd, bench/NOTES.md runs 9, 12, 13): 64 queries x 32 keys on 4 warps
        # (k33 1.035 -> 0.685 ms against the first plan); 64-key tiles for windows wider than 64 (k129
        # 0.210 -> 0.180 ms; they tie at k33 and cost 5% at k7); 32 x 16 on 2 warps for windows up to 16
        # (k3-k15 at D = 64 and 128: -1% to -6%; +12% at k31)
        if kernel_volume <= NARROW_WINDOW:
            bm, bn, warps = [1, 1, 32], [1, 1, 16], 2
        else:
            bm, bn, warps = [1, 1, 64], [1, 1, 64 if kernel_volume > WIDE_WINDOW else 32], 4
    else:
        bm, bn = (list(b) for b in CUDA_BACKWARD_BOXES[ndim])
        warps = 4 if ndim == 3 else None
    override = _override(backward)
    if override is not None and not interpreted:
        bm, bn, warps, stages = list(override[0]), list(override[1]), override[2], override[3]
    bm = _clamp(bm, group_len, floor)
    bn = _clamp(bn, group_len, floor)
    # shrink to the on-chip budget, the larger of the two boxes first, along its longest axis
    while _footprint(bm[0] * bm[1] * bm[2], bn[0] * bn[1] * bn[2], block_d, block_dv, backward) > target.onchip_bytes:
        vm, vn = bm[0] * bm[1] * bm[2], bn[0] * bn[1] * bn[2]
        box = bm if vm >= vn else bn
        if box[0] * box[1] * box[2] // 2 < floor:
            other = bn if box is bm else bm
            if other[0] * other[1] * other[2] // 2 < floor:
                break  # smallest legal tiles: run anyway (spills on CUDA)
            box = other
        axis = max(range(3), key=lambda a: box[a])
        box[axis] //= 2
    if warps is None:
        warps = 4 if bm[0] * bm[1] * bm[2] * bn[0] * bn[1] * bn[2] <= 64 * 64 else 8
    return Plan(
        bm=tuple(bm), bn=tuple(bn), block_d=block_d, block_dv=block_dv, num_warps=warps, num_stages=stages,
        dot_fp32=interpreted or dtype == torch.float32,
        precision="ieee" if (interpreted or dtype == torch.float32) else "tf32",
    )


def grid(target: Target, tiles: int) -> int:
    """Programs to launch for `tiles` tiles (a persistent grid on Ascend)."""
    return target.grid_size(tiles, matrix=True)
