"""Hardware targets: the data that the launch planners read.

A kernel source serves every vendor; what differs between an H100 and an Ascend 910B is a handful of
numbers (how many programs run at once, how many bytes one program may keep on chip, how large a grid
may be). Each op's planner turns a `Target` plus the problem shape into block sizes and a grid.

Environment overrides (looked up at every launch, so tests can force small budgets):
  FUSEDOPS_INTERPRET            cuda | ascend: run the Triton kernels on CPU tensors in the Triton
                                interpreter (needs TRITON_INTERPRET=1) under that vendor's plan.
  FUSEDOPS_CUDA_ONCHIP_BYTES    per-program on-chip budget of the CUDA plan.
  FUSEDOPS_ASCEND_UB_BYTES      Unified Buffer bytes of one Ascend core. Wins over CANN's SoC query
                                (tbe.common.platform.get_soc_spec("UB_SIZE")); default 192 KiB.
  FUSEDOPS_ASCEND_VECTOR_CORES  vector cores, when no triton-ascend driver reports them (default 48).
  FUSEDOPS_ASCEND_AI_CORES      AI (cube) cores, likewise (default 24).
On a real NPU the driver's `get_device_properties` (num_vectorcore, num_aicore) wins over the two
core overrides; under the interpreter neither the driver nor CANN is asked, so plans are reproducible.
Each value must be a positive integer; anything else raises ValueError naming the variable.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

INTERPRET_ENV = "FUSEDOPS_INTERPRET"

# Ascend (Atlas A2/A3, 910B/910C): 192 KiB of Unified Buffer per vector core; the runtime refuses a
# launch whose grid holds more than 65535 programs in total; vector loads want 32-byte aligned rows.
ASCEND_UB_BYTES = 192 * 1024
ASCEND_MAX_GRID = 65535
ASCEND_ROW_ALIGN = 32
ASCEND_DEFAULT_VECTOR_CORES = 48
ASCEND_DEFAULT_AI_CORES = 24

# CUDA: one program may hold up to three quarters of an SM's 256 KiB register file (a D = 8192 bf16
# row with two rows in flight); smaller tiles leave room for more programs per SM.
CUDA_ONCHIP_BYTES = 192 * 1024
CUDA_MAX_GRID = 2**31 - 1
# Shared memory one CUDA program may use (the opt-in per-block limit): 227 KiB on sm_90 (H100, H200), the
# GPUs the plan tables' tile caps were measured on; 163 KiB on sm_80 (A100), 99 KiB on sm_86/sm_89 (RTX 30xx/
# 40xx, A10, L4, L40S) and sm_120. Planners of the tensor-core kernels shrink their tiles to the device's.
CUDA_SMEM_BYTES = 227 * 1024


def size_hint(n, fallback: int = 4096) -> int:
    """A plain int for a size that torch.compile may trace as symbolic (dynamic shapes), read without
    installing a guard. Planners pick tile shapes from it and compute grids from the real size, so one
    compiled graph stays correct for every size (tiles are masked, kernels loop over their blocks)
    instead of being recompiled per sequence length. `fallback` serves a data-dependent size with no
    hint at all."""
    if not isinstance(n, torch.SymInt):
        return n
    from torch.fx.experimental import symbolic_shapes

    hint = getattr(symbolic_shapes, "optimization_hint", None) or getattr(symbolic_shapes, "hint_int", None)
    return hint(n, fallback=fallback) if hint is not None else int(n)  # int(): guards, but stays correct


@dataclass(frozen=True)
class Target:
    """What a launch planner needs to know about a device.

    vendor:        "cuda" or "ascend".
    vector_cores:  programs that run at once for pure-vector kernels (SMs; Ascend vector cores).
    matrix_cores:  programs that run at once for kernels with tl.dot (SMs; Ascend AI cores).
    onchip_bytes:  bytes one program may keep on chip (registers on CUDA, Unified Buffer on Ascend).
    max_grid:      the largest product of all grid dims a launch may have.
    row_align:     bytes a tile row's length is rounded up to.
    resident:      programs of one kernel that one core runs at once (latency hiding on CUDA).
    persistent:    launch only as many programs as run at once, each looping over its share.
    interpreted:   kernels run in the Triton interpreter on CPU tensors.
    arch:          the architecture name the plan tables key on (fusedops.plans): "sm90", "sm90-h200" (an
                   H200: the H100's chip with more, faster memory), "sm<major><minor>" for other CUDA GPUs;
                   "" where unknown (the interpreter, Ascend for now): the tables' generic "*" rows.
    smem_bytes:    shared memory one program may use (CUDA's opt-in per-block limit; the tensor-core kernels
                   stage their dot operands there). Ascend keeps the default: its plans size tiles by the UB.
    """

    vendor: str
    vector_cores: int
    matrix_cores: int
    onchip_bytes: int
    max_grid: int
    row_align: int
    resident: int
    persistent: bool
    interpreted: bool = False
    arch: str = ""
    smem_bytes: int = CUDA_SMEM_BYTES

    def grid_size(self, blocks: int, *, matrix: bool = False, persistent: bool | None = None) -> int:
        """Programs to launch for `blocks` independent work items (>= 1, <= max_grid). A persistent
        grid has one program per resident slot; kernels loop over blocks pid, pid + grid, ..."""
        persistent = self.persistent if persistent is None else persistent
        cores = self.matrix_cores if matrix else self.vector_cores
        limit = cores * self.resident if persistent else self.max_grid
        # sym_max/sym_min: a symbolic `blocks` gives a symbolic grid, with no guard on its value.
        return torch.sym_max(1, torch.sym_min(blocks, min(limit, self.max_grid)))

    def check_grid(self, grid: tuple[int, ...]) -> tuple[int, ...]:
        """`grid` itself, after checking that the product of its dims is within max_grid (Ascend counts
        every program of a multi-dim grid against its 65535 cap)."""
        total = 1
        for dim in grid:
            if dim < 1:
                raise ValueError(f"grid dims must be >= 1, got {tuple(grid)}")
            total *= dim
        if total > self.max_grid:
            raise ValueError(f"a grid of {tuple(grid)} = {total} programs exceeds {self.vendor}'s cap of {self.max_grid}")
        return tuple(grid)

    def align_elems(self, elems: int, elem_size: int) -> int:
        """`elems` rounded up so that a row of them spans a multiple of row_align bytes (the row pitch
        of a scratch buffer that Ascend vector loads read)."""
        step = max(1, self.row_align // elem_size) if self.row_align % elem_size == 0 else self.row_align
        return -(-elems // step) * step

    def smem_shrink(self) -> int:
        """The power of two by which a tile cap measured with CUDA_SMEM_BYTES of shared memory (the H100's and
        H200's) is divided so that the tile fits this device's smem_bytes: 1 on Hopper, 2 on an A100, 4 where a
        program has 99 KiB."""
        ratio = -(-CUDA_SMEM_BYTES // max(1, self.smem_bytes))
        return 1 << (ratio - 1).bit_length()


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be a positive integer, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {raw!r}")
    return value


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


H200_MIN_MEMORY = 100 * 2**30  # an sm_90 part with more memory than this is an H200 (141 GB; the H100 has 80-94)


def cuda_arch(name: str, major: int, minor: int, total_memory: int) -> str:
    """The plan tables' name of a CUDA GPU: "sm<major><minor>", "sm90-h200" for an H200 (by name, or an
    sm_90 part with over 100 GiB of memory)."""
    arch = f"sm{major}{minor}"
    if arch == "sm90" and ("H200" in name.upper() or total_memory > H200_MIN_MEMORY):
        return "sm90-h200"
    return arch


@functools.lru_cache(maxsize=None)
def _cuda_smem_bytes(index: int) -> int:
    # a torch build without the property, or a device reporting none, is taken as Hopper, as before it was read
    smem = getattr(torch.cuda.get_device_properties(index), "shared_memory_per_block_optin", 0)
    return smem if smem > 0 else CUDA_SMEM_BYTES


@functools.lru_cache(maxsize=None)
def _cuda_arch(index: int) -> str:
    props = torch.cuda.get_device_properties(index)
    return cuda_arch(props.name, props.major, props.minor, props.total_memory)


def cuda_target(device: torch.device | None = None, *, interpreted: bool = False) -> Target:
    """The CUDA plan's target; under the interpreter, a 4-SM stand-in so persistent loops loop."""
    if interpreted:
        sms, arch, smem = 4, "", CUDA_SMEM_BYTES
    else:
        index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
        sms, arch, smem = _cuda_sm_count(index), _cuda_arch(index), _cuda_smem_bytes(index)
    return Target(
        vendor="cuda",
        vector_cores=sms,
        matrix_cores=sms,
        onchip_bytes=_env_int("FUSEDOPS_CUDA_ONCHIP_BYTES", CUDA_ONCHIP_BYTES),
        max_grid=CUDA_MAX_GRID,
        row_align=16,
        resident=4,
        persistent=False,
        interpreted=interpreted,
        arch=arch,
        smem_bytes=smem,
    )


@functools.lru_cache(maxsize=None)
def _ascend_driver_cores(index: int | None) -> tuple[int, int] | None:
    """(vector cores, AI cores) from triton-ascend's active driver, when an NPU is there; else None.
    Asked once per device index (the answer, or its absence, is cached)."""
    try:
        from triton.runtime import driver

        active = driver.active
        props = active.utils.get_device_properties(active.get_current_device() if index is None else index)
        vector, ai = int(props["num_vectorcore"]), int(props["num_aicore"])
    except Exception:  # no triton-ascend, no NPU, or a driver without these properties
        return None
    return (vector, ai) if vector > 0 and ai > 0 else None


@functools.lru_cache(maxsize=None)
def _ascend_soc_ub_bytes() -> int | None:
    """Unified Buffer bytes from CANN's platform query (`tbe.common.platform.get_soc_spec`), when CANN
    is installed; None otherwise. CANN answers for the SoC it was told to compile for, so when it has
    none set, the SoC name comes from pyACL (`acl.get_soc_name`)."""
    try:
        from tbe.common import platform  # CANN's Python package
    except Exception:
        return None
    try:
        ub = int(platform.get_soc_spec("UB_SIZE"))
        if ub > 0:
            return ub
    except Exception:
        pass
    try:
        import acl  # pyACL, shipped with CANN

        platform.set_current_compile_soc_info(acl.get_soc_name())
        ub = int(platform.get_soc_spec("UB_SIZE"))
        return ub if ub > 0 else None
    except Exception:
        return None


def ascend_ub_bytes(*, interpreted: bool = False) -> int:
    """FUSEDOPS_ASCEND_UB_BYTES if set; else CANN's SoC query (not under the interpreter, whose plan
    must not depend on what the machine has installed); else 192 KiB."""
    if os.environ.get("FUSEDOPS_ASCEND_UB_BYTES", "") != "":
        return _env_int("FUSEDOPS_ASCEND_UB_BYTES", ASCEND_UB_BYTES)
    soc = None if interpreted else _ascend_soc_ub_bytes()
    return soc or ASCEND_UB_BYTES


def ascend_core_counts(device: torch.device | None = None, *, interpreted: bool = False) -> tuple[int, int]:
    """(vector cores, AI cores): triton-ascend's driver when there is one (not under the interpreter);
    else FUSEDOPS_ASCEND_VECTOR_CORES / FUSEDOPS_ASCEND_AI_CORES; else 48 and 24 (Atlas A2, 910B)."""
    cores = None
    if not interpreted:
        cores = _ascend_driver_cores(device.index if device is not None else None)
    if cores is not None:
        return cores
    return (
        _env_int("FUSEDOPS_ASCEND_VECTOR_CORES", ASCEND_DEFAULT_VECTOR_CORES),
        _env_int("FUSEDOPS_ASCEND_AI_CORES", ASCEND_DEFAULT_AI_CORES),
    )


def ascend_target(device: torch.device | None = None, *, interpreted: bool = False) -> Target:
    """The Ascend plan's target: UB budget, core counts, the 65535-program grid cap, 32-byte rows.
    Persistent: one program per core (vector cores, or AI cores for kernels with tl.dot)."""
    vector, ai = ascend_core_counts(device, interpreted=interpreted)
    return Target(
        vendor="ascend",
        vector_cores=vector,
        matrix_cores=ai,
        onchip_bytes=ascend_ub_bytes(interpreted=interpreted),
        max_grid=ASCEND_MAX_GRID,
        row_align=ASCEND_ROW_ALIGN,
        resident=1,
        persistent=True,
        interpreted=interpreted,
    )


def interpret_mode() -> str | None:
    """The plan named by FUSEDOPS_INTERPRET ("cuda" or "ascend"), or None."""
    mode = os.environ.get(INTERPRET_ENV, "").strip().lower()
    if mode in ("", "0", "none", "off"):
        return None
    if mode not in ("cuda", "ascend"):
        raise ValueError(f"{INTERPRET_ENV} must be 'cuda' or 'ascend', got {mode!r}")
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"{INTERPRET_ENV}={mode} runs Triton kernels on CPU tensors, which needs TRITON_INTERPRET=1 "
            "set before triton is imported"
        )
    return mode


# The variables each device kind's Target depends on: target_for caches one Target per device and
# their values, and looks up only its kind's variables (the lookups are a measurable share of the
# host time of a small eager call).
_ENV_KEYS = {
    "cuda": ("FUSEDOPS_CUDA_ONCHIP_BYTES",),
    "npu": ("FUSEDOPS_ASCEND_UB_BYTES", "FUSEDOPS_ASCEND_VECTOR_CORES", "FUSEDOPS_ASCEND_AI_CORES"),
    "cpu": (INTERPRET_ENV, "TRITON_INTERPRET", "FUSEDOPS_CUDA_ONCHIP_BYTES", "FUSEDOPS_ASCEND_UB_BYTES",
            "FUSEDOPS_ASCEND_VECTOR_CORES", "FUSEDOPS_ASCEND_AI_CORES"),
}


def target_for(device: torch.device, dtype: torch.dtype | None = None) -> Target | None:
    """The target whose plan runs on `device` for tensors of `dtype`, or None where the PyTorch reference
    runs (plain CPU, meta; float64 under the Ascend plan, as triton-ascend has no float64).
    Cached per device and environment (it is asked on every launch)."""
    kind, index = device.type, device.index
    if kind == "cuda" and index is None:
        index = torch.cuda.current_device()
    env = tuple(map(os.environ.get, _ENV_KEYS.get(kind, ())))
    target = _target_for(kind, index, env)
    if target is not None and target.vendor == "ascend" and dtype == torch.float64:
        return None
    return target


@functools.lru_cache(maxsize=64)
def _target_for(kind: str, index: int | None, env: tuple) -> Target | None:
    del env  # part of the cache key only: the builders below read the same variables
    device = torch.device(kind, index) if index is not None else torch.device(kind)
    if kind == "cuda":
        return cuda_target(device)
    if kind == "npu":
        return ascend_target(device)
    if kind == "cpu":
        mode = interpret_mode()
        if mode == "cuda":
            return cuda_target(interpreted=True)
        if mode == "ascend":
            return ascend_target(interpreted=True)
        return None
    if kind == "meta":
        return None  # no data, shapes only: the PyTorch reference runs on meta tensors as on CPU ones
    raise NotImplementedError(f"fusedops has no kernels for device type {kind!r}")
