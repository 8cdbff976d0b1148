"""Launch plans for neighborhood attention: tile boxes and grids from a hardware Target and the shape.

A tile is a box of positions (3 axes, the unused leading ones of size 1) inside one dilation group.
The query box (BM) and the key box (BN) are chosen per number of spatial axes so that a query box's
neighbourhood is covered by few key boxes, then clamped to the group lengths and shrunk (largest
axis first) until one program's working set fits the target's on-chip budget: registers on CUDA,
the 192 KiB Unified Buffer on Ascend; on a CUDA GPU with less shared memory than Hopper's, also the
shared memory the kernels stage their dot operands in (smem_bytes; one pipelining stage fewer first).
Ascend launches a persistent grid of one program per AI core (never more than 65535 programs); CUDA
launches one program per tile.

A 1-D backward whose windows are narrow runs as one fused kernel (dQ, dK and dV from one score block
of OWN owned rows plus a halo on each side, see na_bwd_fused_1d_kernel); its plan has fused=True and
bm = bn = (1, 1, BLOCK).

The starting boxes, warps, register caps and mask forms come from plans.json (fusedops/plans.py); the
budget shrink, clamping and the fused block's fit stay here. `fusedops.plan_override("neighborhood_attention",
"fwd" | "bwd" | "dkdv", bm=..., bn=..., num_warps=..., ...)` forces a configuration (the tuner's and the
tests' way): forced boxes are taken as given (only clamped to the group lengths: no budget shrink, no
register cap unless `registers` is named); `fused_block` asks for the fused 1-D backward with that block
(0: never).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch

from fusedops.plans import dtype_class, forced, resolve
from fusedops.targets import Target

OP = "neighborhood_attention"
# the first axis of the query box the 2-D tall-box rows assume: its rows plus the window's reach pick them
TALL_QUERY_ROWS = 8
MIN_DOT = 16  # tl.dot on GPUs wants every dim >= 16
# The 2-D/3-D window mask as per-row bit sets over the key box fits in one int32 (Plan.mask_bits, _window_bits).
MASK_BITS_WIDTH = 31
# Where each table row came from: bench/NOTES.md, "plans as data".


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _volume(box: Sequence[int]) -> int:
    """Positions in a 3-axis box."""
    return box[0] * box[1] * box[2]


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
    # dK accumulated as [keys, D] (dS^T q) rather than [D, keys] (q^T dS) in the dK/dV kernel (h100 run 20).
    dk_by_keys: bool = False
    # The 1-D window mask as one unsigned compare per element (the same mask; h100 run 16). Not for CUDA's fp32
    # (ieee) kernels, whose spills it reshuffles.
    one_compare_mask: bool = False
    # The 2-D/3-D window mask as per-row bit sets over the key box (_window_bits): one AND per element.
    mask_bits: bool = False
    # The dK/dV kernel tests each innermost query chunk against its key box before computing it.
    walk_tests: bool = True
    # Key boxes inside the window every row of the query tile shares skip the window mask (the kernels' INSIDE).
    unmasked_inside: bool = False
    # The dK/dV kernel computes scores as [keys, queries] (k q^T; dK as [keys, D] whatever dk_by_keys).
    keys_major: bool = False
    # The dK/dV kernel's own boxes, warps and stages where they differ from the dQ kernel's (bm, bn); its
    # register cap is its own dkdv_registers.
    dkdv: Plan | None = None

    @property
    def block_m(self) -> int:
        return _volume(self.bm)

    @property
    def block_n(self) -> int:
        return _volume(self.bn)


def _footprint(bm: int, bn: int, block_d: int, block_dv: int, backward: bool, elem_bytes: int = 4) -> int:
    """Bytes one program keeps live: q, k, v tiles, the score/probability tiles, accumulators; 4 bytes an
    element (fp32 compute), 8 for float64 inputs."""
    if backward:
        elems = 2 * bm * block_d + 2 * bm * block_dv + 2 * bn * block_d + 2 * bn * block_dv + 3 * bm * bn
    else:
        elems = bm * block_d + bn * block_d + bn * block_dv + 2 * bm * bn + bm * block_dv
    return elem_bytes * elems


# Triton's software-pipelining depth on CUDA when a plan names none (Plan.num_stages None).
DEFAULT_STAGES = 3
SMEM_SLACK = 1024  # what the compiles take beyond the tiles (128-256 bytes: barriers, reduction scratch), rounded up


def smem_bytes(bm: int, bn: int, block_d: int, block_dv: int, stages: int, operand_bytes: int, backward: bool) -> int:
    """Shared memory one program takes at most (a fit to sm_80/sm_86 compiles, bench/NOTES.md "shared memory"),
    operand_bytes the dot operands' element size: the forward keeps the query tile and stages - 1 key/value tiles in
    flight, the dQ kernel dO's tile besides; the dK/dV kernel a query and a key tile of both widths whatever its
    stages; each a score tile; and SMEM_SLACK."""
    forward = bm * block_d + max(1, stages - 1) * bn * (block_d + block_dv)
    kernels = max(forward + bm * block_dv, (bm + bn) * (block_d + block_dv)) if backward else forward
    return operand_bytes * (kernels + bm * bn) + SMEM_SLACK


def _clamp(box: list[int], limits: Sequence[int], floor: int) -> list[int]:
    """Shrink each axis of the box to the smallest power of two >= its group length, keeping the box's
    volume >= floor."""
    box = list(box)
    for a in range(3):
        want = min(box[a], next_pow2(max(1, limits[a])))
        while box[a] > want:
            if _volume(box) // 2 < floor:
                break
            box[a] //= 2
    return box


def _fused_footprint(block: int, block_d: int, block_dv: int, elem_bytes: int = 4) -> int:
    """Bytes the fused 1-D backward keeps live: q, k, dK (D wide), dO, O, v, dV (Dv wide), and two block x
    block score tiles; 4 bytes an element (fp32 compute), 8 for float64 inputs."""
    return elem_bytes * (3 * block * block_d + 4 * block * block_dv + 2 * block * block)


def fused_1d_block(target: Target, halo: int, block_d: int, block_dv: int, dtype: torch.dtype
                   ) -> tuple[int, int | None, int | None] | None:
    """(rows per program, warps, stages) of the fused 1-D backward, or None where the two-kernel
    backward is the better or the only choice (the table's "fused" rows: a fixed block up to a window
    reach on CUDA GPUs, 16-bit only, as fp32 and float64 ieee dots spill at every block size; elsewhere the
    smallest block holding 4 x halo rows whose working set fits on chip)."""
    row = resolve(OP, "fused", target, interpreted=target.interpreted, dtype=dtype_class(dtype.itemsize),
                  head=max(block_d, block_dv))
    if row["block"]:
        return (row["block"], row["num_warps"] or None, row["num_stages"]) if halo <= row["max_halo"] else None
    block = next((b for b in row["blocks"] if b >= 4 * halo), None)
    if block is None or _fused_footprint(block, block_d, block_dv, elem_bytes(dtype)) > target.onchip_bytes:
        return None
    return block, row["num_warps"] or None, row["num_stages"]


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
    (fusedops.numerics.tf32_allowed), taken on CUDA GPUs only. What fusedops.plan_override forces on
    "fwd", "bwd" and "dkdv" applies on top."""
    group_len = [-(-length // d) for length, d in zip(spatial, dilation)]
    block_d = max(MIN_DOT, next_pow2(head_dim))
    block_dv = max(MIN_DOT, next_pow2(head_dim_v))
    head = max(block_d, block_dv)
    interpreted = target.interpreted
    cuda_gpu = target.vendor == "cuda" and not interpreted
    f64 = dtype == torch.float64
    dot_fp32 = (interpreted or dtype == torch.float32) and not f64
    wide = dot_fp32 or f64  # 32- or 64-bit dot operands: CUDA's exact (ieee) plans, not the 16-bit ones
    # "tf32" on a GPU (ignored by 16-bit dots, TF32 for fp32 ones where allowed); triton-ascend refuses it
    # (its "hf32" is not taken: fp32 dots stay exact on Ascend), and 16-bit dots there take "ieee".
    precision = "ieee" if f64 else "tf32" if cuda_gpu and (not dot_fp32 or tf32) else "ieee"
    features = dict(
        interpreted=interpreted, dtype=dtype_class(dtype.itemsize), ndim=ndim, head=head,
        dots="16" if not wide else "tf32" if precision == "tf32" else "ieee",  # "ieee": fp32 exact, fp64
        width=head * elem_bytes(dtype) // 4,  # a float64 element takes two registers
        kernel_volume=kernel_volume,
        # the rows of keys an 8-row query box can need on a 2-D problem's outer axis (the tall-box rows)
        span=TALL_QUERY_ROWS + kernel[1] + stride[1] - 2,
    )
    row = resolve(OP, "bwd" if backward else "fwd", target, **features)
    floor = row["min_tile"]  # tl.dot's M, N, K >= 16, except on the CUDA plan's interpreter (any size)
    force = forced(OP, "bwd" if backward else "fwd")
    force_dkdv = forced(OP, "dkdv") if backward else {}
    boxes_forced = "bm" in force or "bn" in force or bool(force.get("fused_block"))
    if backward and ndim == 1 and halo is not None and force.get("fused_block", None) != 0:
        fused = None
        if force.get("fused_block"):
            fused = force["fused_block"], force.get("num_warps"), force.get("num_stages")
        elif not boxes_forced:
            fused = fused_1d_block(target, halo, block_d, block_dv, dtype)
        if fused is not None:
            block, fused_warps, fused_stages = fused
            return Plan(bm=(1, 1, block), bn=(1, 1, block), block_d=block_d, block_dv=block_dv,
                        num_warps=fused_warps or (4 if block <= 64 else 8), num_stages=fused_stages, fused=True,
                        dot_fp32=dot_fp32, precision=precision, f64=f64)
    bm, bn = list(force.get("bm", row["bm"])), list(force.get("bn", row["bn"]))
    warps = force.get("num_warps", row["num_warps"] or None)
    stages = force.get("num_stages")
    bm = _clamp(bm, group_len, floor)
    bn = _clamp(bn, group_len, floor)
    # A GPU with less shared memory than the Hopper parts the rows were measured on (Target.smem_shrink): one
    # pipelining stage fewer, then smaller boxes, until the kernels fit (plans that force boxes or stages excepted).
    operand = 8 if f64 else 4 if dot_fp32 else 2
    fit_smem = cuda_gpu and target.smem_shrink() > 1 and stages is None and not boxes_forced

    def smem_over(box_m, box_n, depth) -> bool:
        return fit_smem and smem_bytes(_volume(box_m), _volume(box_n), block_d, block_dv, depth, operand,
                                       backward) > target.smem_bytes

    if smem_over(bm, bn, DEFAULT_STAGES):
        stages = DEFAULT_STAGES - 1
    # shrink to the on-chip budget, the larger of the two boxes first, along its longest axis (forced boxes
    # are taken as given: a sweep times exactly the tiles it names, or fails to compile them; rows with
    # shrink false are taken as they are, except to fit shared memory)
    while not boxes_forced and (row["shrink"] and _footprint(
            _volume(bm), _volume(bn), block_d, block_dv, backward, elem_bytes(dtype)) > target.onchip_bytes
            or smem_over(bm, bn, stages or DEFAULT_STAGES)):
        box = bm if _volume(bm) >= _volume(bn) else bn
        if _volume(box) // 2 < floor:
            other = bn if box is bm else bm
            if _volume(other) // 2 < floor:
                if smem_over(bm, bn, stages or DEFAULT_STAGES):
                    raise ValueError(
                        f"neighborhood_attention: head dim {head_dim} of {dtype} needs more than this GPU's "
                        f"{target.smem_bytes} bytes of shared memory a program at the smallest tiles")
                break  # smallest legal tiles: run anyway (spills on CUDA)
            box = other
        axis = max(range(3), key=lambda a: box[a])
        box[axis] //= 2
    if warps is None:
        warps = 4 if _volume(bm) * _volume(bn) <= 64 * 64 else 8
    # register caps: measured on 4-warp tiles only; never on forced boxes unless named
    capped = warps == 4 and not boxes_forced
    cap = force.get("registers", row["registers"] or None if capped else None)
    dkdv_cap = row["dkdv_registers"] or None if backward and capped else None
    plan = Plan(bm=tuple(bm), bn=tuple(bn), block_d=block_d, block_dv=block_dv, num_warps=warps, num_stages=stages,
                dot_fp32=dot_fp32, precision=precision, f64=f64, dq_registers=cap if backward else None,
                dkdv_registers=dkdv_cap, fwd_registers=None if backward else cap,
                one_compare_mask=ndim == 1 and not (cuda_gpu and wide),
                mask_bits=force.get("mask_bits", row["mask_bits"]) and mask_bits_fit(bn, ndim),
                walk_tests=row["walk_tests"], dk_by_keys=backward and row["dk_by_keys_block_d"] == block_d,
                unmasked_inside=force.get("unmasked_inside", row["unmasked_inside"]))
    if not backward:
        return plan
    # the dK/dV kernel's own plan: the row's boxes (2-D tall plans), or what plan_override(..., "dkdv") forces
    dkdv = None
    own_boxes = (row["dkdv_bm"], row["dkdv_bn"]) if row["dkdv_bm"] is not None and not boxes_forced else None
    if own_boxes is not None and smem_over(*(_clamp(list(b), group_len, floor) for b in own_boxes),
                                           stages or DEFAULT_STAGES):
        own_boxes = None  # the dQ plan's boxes, which fit
    # (its own boxes run uncapped; forced mask or launch keys alone keep the dQ plan's boxes and dK/dV cap)
    dkdv_regs = None if own_boxes is not None or "bm" in force_dkdv or "bn" in force_dkdv else plan.dkdv_registers
    if any(k in force_dkdv for k in ("bm", "bn", "num_warps", "num_stages", "registers", "mask_bits")):
        box_m, box_n = own_boxes or (plan.bm, plan.bn)
        own_warps = (row["dkdv_num_warps"] or None) if own_boxes is not None else None
        dkdv = (force_dkdv.get("bm", box_m), force_dkdv.get("bn", box_n), force_dkdv.get("num_warps", own_warps),
                force_dkdv.get("num_stages", stages))
    elif own_boxes is not None:
        dkdv = (*own_boxes, row["dkdv_num_warps"] or warps, stages)
    if dkdv is not None:
        box_m, box_n, dkdv_warps, dkdv_stages = dkdv
        plan = replace(plan, dkdv=replace(plan, bm=tuple(_clamp(list(box_m), group_len, floor)),
                                          bn=tuple(_clamp(list(box_n), group_len, floor)),
                                          num_warps=dkdv_warps or warps, num_stages=dkdv_stages,
                                          dkdv_registers=force_dkdv.get("registers", dkdv_regs)))
        bits = force_dkdv.get("mask_bits", row["dkdv_mask_bits"])
        plan = replace(plan, dkdv=replace(plan.dkdv, mask_bits=bits and mask_bits_fit(plan.dkdv.bn, ndim)))
    extra = {k: force_dkdv[k] for k in ("walk_tests", "dk_by_keys", "unmasked_inside", "keys_major")
             if k in force_dkdv}
    if cuda_gpu and _miscompiled_dk(replace(plan.dkdv or plan, **extra)):
        extra["dk_by_keys"] = False
    if extra:  # read by the dK/dV kernel only
        plan = replace(plan, dkdv=replace(plan.dkdv, **extra)) if plan.dkdv is not None else replace(plan, **extra)
    return plan


def _miscompiled_dk(plan: Plan) -> bool:
    """dK as [keys, D] on the pipelined walk (walk_tests off) of 8-warp programs with fewer than 64 query rows a
    step: Triton 3.6 compiled it to wrong dK on the H100 (h100-2026-12-07-na-run-33: 16 or 32 queries x 128 keys,
    8-45% off), where dK as [D, keys] gave the plan's bits. No table row makes it; a forced plan gets [D, keys]."""
    return plan.dk_by_keys and not plan.keys_major and not plan.walk_tests and plan.num_warps >= 8 \
        and plan.block_m < 64


def mask_bits_fit(key_box: Sequence[int], ndim: int) -> bool:
    """Whether the window mask can be per-row bit sets over the key box (Plan.mask_bits): 2-D or 3-D, one
    field per axis, all in one int32 (see _window_bits)."""
    return ndim >= 2 and (sum(key_box) if ndim == 3 else key_box[1] + key_box[2]) <= MASK_BITS_WIDTH


def grid(target: Target, tiles: int) -> int:
    """Programs to launch for `tiles` tiles (a persistent grid on Ascend)."""
    return target.grid_size(tiles, matrix=True)


def tiles_from_string(spec: str) -> dict:
    """plan_override keys from the sweep notation of bench/NOTES.md: "bm0,bm1,bm2/bn0,bn1,bn2[/warps[/stages]]",
    or "fused/BLOCK[/warps[/stages]]" (the fused 1-D backward, for kernel "bwd")."""
    parts = spec.strip().split("/")
    if parts[0] == "fused":
        out: dict = {"fused_block": int(parts[1])}
    else:
        out = {"bm": tuple(int(x) for x in parts[0].split(",")), "bn": tuple(int(x) for x in parts[1].split(","))}
    tail = parts[2:]
    if tail:
        out["num_warps"] = int(tail[0])
    if len(tail) > 1:
        out["num_stages"] = int(tail[1])
    return out
