"""Launch plans for neighborhood attention: tile boxes and grids from a hardware Target and the shape.

A tile is a box of positions (3 axes, the unused leading ones of size 1) inside one dilation group.
The query box (BM) and the key box (BN) are chosen per number of spatial axes so that a query box's
neighbourhood is covered by few key boxes, then clamped to the group lengths and shrunk (largest
axis first) until one program's working set fits the target's on-chip budget: registers on CUDA,
the 192 KiB Unified Buffer on Ascend. Ascend launches a persistent grid of one program per AI core
(never more than 65535 programs); CUDA launches one program per tile.

A 1-D backward whose windows are narrow runs as one fused kernel (dQ, dK and dV from one score block
of OWN owned rows plus a halo on each side, see na_bwd_fused_1d_kernel); its plan has fused=True and
bm = bn = (1, 1, BLOCK).

FUSEDOPS_NA_TILES="bm0,bm1,bm2/bn0,bn1,bn2[/warps[/stages]]" overrides the boxes for benchmark sweeps
(taken as given, only clamped to the group lengths: no budget shrink, no register cap);
FUSEDOPS_NA_BWD_TILES does the same for the backward kernels only, where "fused/BLOCK[/warps[/stages]]"
asks for the fused 1-D backward with that block; FUSEDOPS_NA_DKDV_TILES for the dK/dV kernel alone (its
query box is the one it walks, its key box the one it owns).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
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
# CUDA float32 with exact (ieee) dots, which Triton computes with FMAs in registers: the 16-bit plans' tiles
# spill kilobytes there (sm_90 compile, cuobjdump). {widest padded head dim: (query tile, key tile, warps)},
# the largest tiles compiling without spills; the boxes of a tile per number of axes in IEEE_BOXES. H100
# fwd+bwd against the 16-bit tiles (bench/NOTES.md run 18): k129 23.7 -> 2.5 ms, 2D 7x7 12.0 -> 1.5,
# 13x13 D128 229 -> 42, 3D 369 -> 30, k33 D128 7.2 -> 6.6; 1-D windows up to NARROW_WINDOW keep their
# tiles (k7: 0.72 ms, against 0.82 with these).
CUDA_IEEE = {64: (32, 32, 4), 128: (16, 32, 4), 256: (16, 16, 8)}
IEEE_BOXES = {32: {1: (1, 1, 32), 2: (1, 4, 8), 3: (2, 4, 4)}, 16: {1: (1, 1, 16), 2: (1, 4, 4), 3: (2, 2, 4)}}
# 2-D, 16-bit, heads up to 128 (H100 sweep, bench/NOTES.md run 20): key boxes 16 or 32 rows tall and 2 wide,
# so a query box's walk over its key rows is the innermost loop (the one Triton pipelines) and covers
# 8 + kernel - 1 (+ stride - 1) rows with little waste; dK/dV walks 16 x 4 query boxes over an 8 x 8 key box
# when those rows fit 16, else owns a 16 x 4 key box and walks 8 x 8 query boxes. Per kernel against the
# 8 x 8 boxes (device us, fwd / dQ / dK/dV): 7x7 D64 35.5 / 37.3 / 47.7 -> 30.8 / 33.6 / 44.5; 7x7 D128
# 48.5 / 89.2 / 130.1 -> 44.5 / 56.7 / 87.7; 13x13 D128 (4 x 8 boxes) 406 / 811 / 1327 -> 400 / 483 / 824.
# {rows the query box's keys span at most: (forward key box, dQ key box, dK/dV query box, dK/dV key box)}
CUDA_2D_QUERY_BOX = (1, 8, 8)
CUDA_2D_TALL = {
    16: ((1, 16, 2), (1, 16, 2), (1, 16, 4), (1, 8, 8)),
    32: ((1, 32, 2), (1, 16, 2), (1, 8, 8), (1, 16, 4)),
}
# Ascend and the interpreter: fewer, larger tiles (the budget loop shrinks them to fit the UB).
LARGE_BOXES = {
    1: ((1, 1, 64), (1, 1, 64)),
    2: ((1, 8, 8), (1, 8, 16)),
    3: ((4, 4, 4), (4, 4, 8)),
}
MIN_DOT = 16  # tl.dot on GPUs wants every dim >= 16
# The fused 1-D backward. CUDA (H100 sweeps, bench/NOTES.md run 14): 64-row blocks on 4 warps without
# software pipelining (one stage: -10% against Triton's default; 128-row blocks overflow shared memory),
# 16-bit inputs only, up to a window reach (halo) by padded head dim: {head dim: widest halo}. fwd+bwd
# against the two-kernel backward: D 64 k3 -36%, k7 -34%, k11 -31%, k15 -23%, k17 -20%, k31 +274%;
# D 128 k7 -22%, k15 -12%.
CUDA_FUSED = {64: 16, 128: 14}
CUDA_FUSED_LAUNCH = (4, 1)  # warps, stages
CUDA_FUSED_BLOCK = 64
# The per-thread register cap of the two-kernel backward (and of the tall 2-D forward at D 64) on CUDA (direct
# launches; torch.compile's launches run uncapped): 168 fits three 4-warp programs on an SM instead of two.
# H100 sweep of the planner's tiles, bf16 (bench/NOTES.md run 16), device time per kernel uncapped -> capped:
# dQ k33 D128 176 -> 171 us, 13x13 D128 912 -> 811, 3D 408 -> 384, 2D 7x7 37.9 -> 37.3, k129 61.9 -> 61.8;
# dK/dV k33 248 -> 226, k129 77.1 -> 68.1, but 2D 7x7 47.5 -> 53.0, 13x13 1315 -> 1541 and 3D 611 -> 622, so
# dK/dV is capped in 1-D only (run 20: the tall 2-D plans' dK/dV loses under every cap too). Heads wider than
# 128, fp32 and 2-warp tiles were not measured and run uncapped.
CUDA_REGISTER_CAP = 168
# The tall 2-D plan's forward and dQ at D 64 fit 128 registers (24 / 56 bytes of stack on sm_90) and 32 / 40 KB
# of shared memory: four programs per SM, so 1024 programs run in two waves instead of three (or four).
# H100 (bench/NOTES.md run 22), device us per kernel, 168 -> 128: forward 3x3 23.1 -> 20.8, 7x7 27.8 -> 25.2,
# 9x9 29.3 -> 27.4, 11x11 (32-row key boxes) 49.9 -> 50.7; dQ 3x3 25.6 -> 24.0, 7x7 30.1 -> 27.7, 11x11
# 48.7 -> 47.1. The 3-D forward and dQ lose 20-65% at 128 (spills), k129's dQ 6%.
CUDA_2D_NARROW_CAP = 128
# The 2-D/3-D window mask as per-row bit sets over the key box (Plan.mask_bits, _window_bits in kernels.py): one
# AND per element instead of two compares per axis and the selects the compiler splits them into (sm_90, 7x7 D64:
# inner-loop instructions forward 321 -> 294, dK/dV 510 -> 434). The dK/dV kernel's walk without its per-chunk test
# (Plan.walk_tests False; the closed-form query spans are exact, so the test never skips) lets Triton pipeline the
# walk's loads. H100, bf16, device us per kernel (bench/NOTES.md run 25): 2-D 16-row plans, forward 7x7 D64 25.6 ->
# 24.5, D128 44.3 -> 43.7; dK/dV 7x7 D64 45.7 -> 43.3 -> 40.0 unguarded (3x3 39.0 -> 36.2, 9x9 61.6 -> 52.5), D128
# 87.1 -> 82.0 (unguarded: 142.6, spills). 3-D 7x7x7 D64: dQ 390 -> 366, dK/dV 623 -> 564. Measured and not taken:
# dQ in 2-D (27.8 -> 28.6: 88 bytes of stack under its 128 cap), the 3-D forward (478 -> 488), the 13x13 plan's
# dK/dV (808 -> 827). CUDA fp32 and Ascend keep the compares (not measured).
MASK_BITS_WIDTH = 31
# Ascend and the interpreter: the smallest block holding 4 x halo rows whose working set fits on chip.
FUSED_BLOCKS = {"ascend": (64, 128), "interpreter": (16, 32, 64, 128)}


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
    precision: str  # tl.dot input_precision of fp32 operands: "ieee" (exact) or "tf32"
    f64: bool = False  # float64 inputs: float64 dots, accumulators and statistics (the kernels' F64)
    num_stages: int | None = None  # software-pipelining depth of the key/query loops; None: Triton's default
    fused: bool = False  # backward only: the fused 1-D kernel, BLOCK = bm[2] rows per program
    dq_registers: int | None = None  # per-thread register caps of the two backward kernels (CUDA's maxnreg)
    dkdv_registers: int | None = None
    fwd_registers: int | None = None  # and of the forward
    # dK accumulated as [keys, D] (dS^T q) rather than [D, keys] (q^T dS) in the dK/dV kernel. H100, bf16 (bench/
    # NOTES.md run 20), dK/dV us: D 128 k33 221 -> 165, 13x13 821 -> 804, 7x7 87.3 -> 87.0; D 64 k129 69.7 -> 71.3,
    # 3D 616 -> 626, 7x7 even: CUDA's 16-bit plans with 128-wide heads.
    dk_by_keys: bool = False
    # The 1-D window mask as one unsigned compare per element (the same mask). H100, bf16 (bench/NOTES.md
    # run 16): k129 fwd+bwd -7% (dQ -18%); in 2-D/3-D its selects cost 3-11%. Not for CUDA's fp32 (ieee)
    # kernels, whose spills it reshuffles: k33 fwd+bwd 7.7 -> 27.5 ms.
    one_compare_mask: bool = False
    # The 2-D/3-D window mask as per-row bit sets over the key box (_window_bits): one AND per element.
    mask_bits: bool = False
    # The dK/dV kernel tests each innermost query chunk against its key box before computing it.
    walk_tests: bool = True
    # The dK/dV kernel's own boxes, warps and stages where they differ from the dQ kernel's (bm, bn); its
    # register cap is its own dkdv_registers.
    dkdv: Plan | None = None

    @property
    def block_m(self) -> int:
        return self.bm[0] * self.bm[1] * self.bm[2]

    @property
    def block_n(self) -> int:
        return self.bn[0] * self.bn[1] * self.bn[2]


def _footprint(bm: int, bn: int, block_d: int, block_dv: int, backward: bool, elem_bytes: int = 4) -> int:
    """Bytes one program keeps live: q, k, v tiles, the score/probability tiles, accumulators; 4 bytes an
    element (fp32 compute), 8 for float64 inputs."""
    if backward:
        elems = 2 * bm * block_d + 2 * bm * block_dv + 2 * bn * block_d + 2 * bn * block_dv + 3 * bm * bn
    else:
        elems = bm * block_d + bn * block_d + bn * block_dv + 2 * bm * bn + bm * block_dv
    return elem_bytes * elems


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


def _fused_footprint(block: int, block_d: int, block_dv: int, elem_bytes: int = 4) -> int:
    """Bytes the fused 1-D backward keeps live: q, k, dK (D wide), dO, O, v, dV (Dv wide), and two block x
    block score tiles; 4 bytes an element (fp32 compute), 8 for float64 inputs."""
    return elem_bytes * (3 * block * block_d + 4 * block * block_dv + 2 * block * block)


def tiles_override() -> str:
    """The raw FUSEDOPS_NA_TILES, FUSEDOPS_NA_BWD_TILES and FUSEDOPS_NA_DKDV_TILES values: part of the
    launch-spec cache key."""
    return "|".join(os.environ.get(f"FUSEDOPS_NA_{name}TILES", "") for name in ("", "BWD_", "DKDV_"))


def _override(backward: bool, dkdv: bool = False
              ) -> tuple[tuple[int, ...], tuple[int, ...], int | None, int | None] | None:
    forward, backward_raw, dkdv_raw = tiles_override().split("|")
    if dkdv:
        raw = dkdv_raw.strip()
    else:
        raw = (backward_raw if backward and backward_raw.strip() else forward).strip()
    if not raw:
        return None
    parts = raw.split("/")
    if parts[0] == "fused":
        block = int(parts[1])
        return (0, 0, block), (0, 0, block), *_override_launch(parts[2:])
    bm = tuple(int(x) for x in parts[0].split(","))
    bn = tuple(int(x) for x in parts[1].split(","))
    return bm, bn, *_override_launch(parts[2:])


def _override_launch(parts: list[str]) -> tuple[int | None, int | None]:
    """(warps, stages) from the optional tail of an override."""
    return (int(parts[0]) if parts else None), (int(parts[1]) if len(parts) > 1 else None)


def fused_1d_block(target: Target, halo: int, block_d: int, block_dv: int, dtype: torch.dtype
                   ) -> tuple[int, int | None, int | None] | None:
    """(rows per program, warps, stages) of the fused 1-D backward, or None where the two-kernel
    backward is the better or the only choice (see CUDA_FUSED and FUSED_BLOCKS). On CUDA never for
    fp32 or float64: their ieee dots compile to kilobytes of register spills at every block size."""
    if target.vendor == "cuda" and not target.interpreted:
        widest = next((w for d, w in sorted(CUDA_FUSED.items()) if max(block_d, block_dv) <= d), None)
        if widest is None or dtype in (torch.float32, torch.float64) or halo > widest:
            return None
        return (CUDA_FUSED_BLOCK, *CUDA_FUSED_LAUNCH)
    kind = "interpreter" if target.interpreted and target.vendor == "cuda" else target.vendor
    block = next((b for b in FUSED_BLOCKS[kind] if b >= 4 * halo), None)
    if block is None or _fused_footprint(block, block_d, block_dv, elem_bytes(dtype)) > target.onchip_bytes:
        return None
    return block, None, None


def elem_bytes(dtype: torch.dtype) -> int:
    """Bytes of one on-chip element of the kernels' compute: 8 for float64 inputs, else 4 (fp32)."""
    return 8 if dtype == torch.float64 else 4


def make_plan(
    target: Target, spatial: Sequence[int], dilation: Sequence[int], head_dim: int, head_dim_v: int,
    dtype: torch.dtype, ndim: int, *, backward: bool, kernel_volume: int = 0, halo: int | None = None,
    tf32: bool = False, kernel: Sequence[int] = (1, 1, 1), stride: Sequence[int] = (1, 1, 1),
) -> Plan:
    """spatial/dilation (and kernel/stride, which pick the 2-D tiles) padded to 3 axes; ndim the caller's
    number of spatial axes; halo (1-D backward) the largest |key - query| distance of any window, which
    decides the fused 1-D backward; tf32: float32 dots may round their inputs to TF32
    (fusedops.numerics.tf32_allowed), taken on CUDA GPUs only."""
    group_len = [-(-length // d) for length, d in zip(spatial, dilation)]
    block_d = max(MIN_DOT, next_pow2(head_dim))
    block_dv = max(MIN_DOT, next_pow2(head_dim_v))
    interpreted = target.interpreted
    cuda_gpu = target.vendor == "cuda" and not interpreted  # the measured H100 plans below
    # tl.dot tiles keep M, N, K >= 16 except on the CUDA plan's interpreter (upstream triton's allows
    # any size): triton-ascend 3.2's interpreter asserts 16 (the Ascend CI stage), as GPUs need.
    floor = 1 if interpreted and target.vendor == "cuda" else MIN_DOT
    f64 = dtype == torch.float64
    dot_fp32 = (interpreted or dtype == torch.float32) and not f64
    wide = dot_fp32 or f64  # 32- or 64-bit dot operands: CUDA's exact (ieee) plans, not the 16-bit ones
    # "tf32" on a GPU (ignored by 16-bit dots, TF32 for fp32 ones where allowed); triton-ascend refuses it
    # (its "hf32" is not taken: fp32 dots stay exact on Ascend), and 16-bit dots there take "ieee".
    precision = "ieee" if f64 else "tf32" if cuda_gpu and (not dot_fp32 or tf32) else "ieee"
    warps = stages = None
    dkdv_boxes = None
    # the rows of keys an 8-row query box can need on a 2-D problem's outer axis (or queries an 8-row key box)
    span = CUDA_2D_QUERY_BOX[1] + kernel[1] + stride[1] - 2
    tall = next((rows for rows in sorted(CUDA_2D_TALL) if span <= rows), None)
    tall = tall if cuda_gpu and ndim == 2 and not wide and max(block_d, block_dv) <= 128 else None
    if tall is not None:
        forward_keys, dq_keys, dkdv_queries, dkdv_keys = CUDA_2D_TALL[tall]
        bm, bn, warps = list(CUDA_2D_QUERY_BOX), list(dq_keys if backward else forward_keys), 4
        if backward:
            dkdv_boxes = (dkdv_queries, dkdv_keys)
    elif not cuda_gpu:
        bm, bn = (list(b) for b in LARGE_BOXES[ndim])
    elif precision == "ieee" and not (ndim == 1 and kernel_volume <= NARROW_WINDOW):
        # a float64 element takes two registers: the tiles of a head twice as wide (the smallest past 256)
        width = max(block_d, block_dv) * elem_bytes(dtype) // 4
        query, key, warps = next((plan for d, plan in sorted(CUDA_IEEE.items()) if width <= d),
                                 CUDA_IEEE[max(CUDA_IEEE)])
        bm, bn = list(IEEE_BOXES[query][ndim]), list(IEEE_BOXES[key][ndim])
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
    override = _override(backward) if not interpreted else None
    if override is not None and override[0][0] == 0 and not (backward and ndim == 1):
        override = None  # a fused-block override speaks to the 1-D backward only
    if backward and ndim == 1 and halo is not None:
        fused = None
        if override is not None and override[0][0] == 0:
            fused = override[0][2], override[2], override[3]
        elif override is None:
            fused = fused_1d_block(target, halo, block_d, block_dv, dtype)
        if fused is not None:
            block, fused_warps, fused_stages = fused
            return Plan(bm=(1, 1, block), bn=(1, 1, block), block_d=block_d, block_dv=block_dv,
                        num_warps=fused_warps or (4 if block <= 64 else 8), num_stages=fused_stages, fused=True,
                        dot_fp32=dot_fp32, precision=precision, f64=f64)
    if override is not None:
        bm, bn, warps, stages = list(override[0]), list(override[1]), override[2], override[3]
    bm = _clamp(bm, group_len, floor)
    bn = _clamp(bn, group_len, floor)
    # shrink to the on-chip budget, the larger of the two boxes first, along its longest axis (an
    # override is taken as given: a sweep times exactly the tiles it names, or fails to compile them; the
    # measured 2-D tiles are taken as they are)
    while override is None and tall is None and _footprint(bm[0] * bm[1] * bm[2], bn[0] * bn[1] * bn[2], block_d,
                                                           block_dv, backward, elem_bytes(dtype)) > target.onchip_bytes:
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
    cap = None
    if backward and cuda_gpu and override is None and not wide and warps == 4 and max(block_d, block_dv) <= 128:
        cap = CUDA_REGISTER_CAP
    if tall is not None and max(block_d, block_dv) > 64:
        cap = None  # the tall 2-D dQ tiles at D 128: 488 us uncapped, 537 capped (13x13, bench/NOTES.md run 20)
    elif tall is not None and cap is not None:
        cap = CUDA_2D_NARROW_CAP
    # The tall 2-D forward at D 64 capped (uncapped it holds 188 registers, two programs per SM): 128 with
    # 16-row key boxes, 168 with 32-row ones (run 22: 128 gains nothing there); at D 128 any cap costs up to
    # 32% (13x13, bench/NOTES.md run 20).
    fwd_cap = None
    if tall is not None and not backward and override is None and max(block_d, block_dv) <= 64:
        fwd_cap = CUDA_2D_NARROW_CAP if tall <= 16 else CUDA_REGISTER_CAP
    fwd_bits, dq_bits, dkdv_bits, walk_tests = _mask_choices(target, tall, ndim, wide, max(block_d, block_dv))
    plan = Plan(bm=tuple(bm), bn=tuple(bn), block_d=block_d, block_dv=block_dv, num_warps=warps, num_stages=stages,
                dot_fp32=dot_fp32, precision=precision, f64=f64, dq_registers=cap,
                dkdv_registers=cap if ndim == 1 else None, fwd_registers=fwd_cap,
                one_compare_mask=ndim == 1 and not (cuda_gpu and wide),
                mask_bits=(dq_bits if backward else fwd_bits) and mask_bits_fit(bn, ndim), walk_tests=walk_tests,
                dk_by_keys=backward and cuda_gpu and not wide and block_d == 128)
    dkdv = _override(True, dkdv=True) if backward and not interpreted else None
    if dkdv is None and dkdv_boxes is not None and override is None:
        dkdv = (*dkdv_boxes, warps, stages)
    if dkdv is not None:
        box_m, box_n, dkdv_warps, dkdv_stages = dkdv
        plan = replace(plan, dkdv=replace(plan, bm=tuple(_clamp(list(box_m), group_len, floor)),
                                          bn=tuple(_clamp(list(box_n), group_len, floor)),
                                          num_warps=dkdv_warps or warps, num_stages=dkdv_stages, dkdv_registers=None))
    if plan.dkdv is not None:  # without boxes of its own, the dK/dV kernel takes the dQ kernel's choice
        plan = replace(plan, dkdv=replace(plan.dkdv, mask_bits=dkdv_bits and mask_bits_fit(plan.dkdv.bn, ndim)))
    return plan


def mask_bits_fit(key_box: Sequence[int], ndim: int) -> bool:
    """Whether the window mask can be per-row bit sets over the key box (Plan.mask_bits): 2-D or 3-D, one
    field per axis, all in one int32 (see _window_bits)."""
    return ndim >= 2 and (sum(key_box) if ndim == 3 else key_box[1] + key_box[2]) <= MASK_BITS_WIDTH


def _mask_choices(target: Target, tall: int | None, ndim: int, wide: bool, head_dim: int
                  ) -> tuple[bool, bool, bool, bool]:
    """(forward, dQ, dK/dV) bit-set window masks and the dK/dV walk's chunk tests (see MASK_BITS_WIDTH); wide:
    32- or 64-bit dot operands."""
    if target.interpreted and target.vendor == "cuda":
        return True, True, True, False  # the interpreter's CUDA plan runs these paths, the Ascend plan the others
    if target.vendor != "cuda" or wide:
        return False, False, False, True
    narrow = head_dim <= 64
    return tall == 16, ndim == 3 and narrow, tall == 16 or (ndim == 3 and narrow), not (tall == 16 and narrow)


def grid(target: Target, tiles: int) -> int:
    """Programs to launch for `tiles` tiles (a persistent grid on Ascend)."""
    return target.grid_size(tiles, matrix=True)
