"""Hardware targets: the data that the launch planners read.

A kernel source serves every vendor; what differs between an H100 and an Ascend 910B is a handful of
numbers (how many programs run at once, how many bytes one program may keep on chip, how large a grid
may be). Each op's planner turns a `Target` plus the problem shape into block sizes and a grid.

Environment overrides (read at every launch, so tests can force small budgets):
  FUSEDOPS_INTERPRET            cuda | ascend: run the Triton kernels on CPU tensors in the Triton
                                interpreter (needs TRITON_INTERPRET=1) under that vendor's plan.
  FUSEDOPS_CUDA_ONCHIP_BYTES    per-program on-chip budget of the CUDA plan.
  FUSEDOPS_ASCEND_UB_BYTES      Unified Buffer bytes of one Ascend vector core (default 192 KiB).
  FUSEDOPS_ASCEND_VECTOR_CORES  vector cores, when no Ascend driver reports them (default 48).
  FUSEDOPS_ASCEND_AI_CORES      AI (cube) cores, likewise (default 24).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch

INTERPRET_ENV = "FUSEDOPS_INTERPRET"

# Ascend (Atlas A2/A3, 910B/910C): 192 KiB of Unified Buffer per vector core; the runtime refuses a
# launch whose grid holds more than 65535 programs in total; vector loads want 32-byte aligned rows.
ASCEND_UB_BYTES = 192 * 1024
ASCEND_MAX_GRID = 65535
ASCEND_ROW_ALIGN = 32
ASCEND_DEFAULT_VECTOR_CORES = 48
ASCEND_DEFAULT_AI_CORES = 24

# CUDA: one program may hold about half an SM's 256 KiB register file, so two programs share an SM.
CUDA_ONCHIP_BYTES = 128 * 1024
CUDA_MAX_GRID = 2**31 - 1


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

    def grid_size(self, blocks: int, *, matrix: bool = False, persistent: bool | None = None) -> int:
        """Programs to launch for `blocks` independent work items (>= 1, <= max_grid). A persistent
        grid has one program per resident slot; kernels loop over blocks pid, pid + grid, ..."""
        persistent = self.persistent if persistent is None else persistent
        cores = self.matrix_cores if matrix else self.vector_cores
        limit = cores * self.resident if persistent else self.max_grid
        return max(1, min(blocks, limit, self.max_grid))


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


def cuda_target(device: torch.device | None = None, *, interpreted: bool = False) -> Target:
    """The CUDA plan's target; under the interpreter, a 4-SM stand-in so persistent loops loop."""
    if interpreted:
        sms = 4
    else:
        index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
        sms = _cuda_sm_count(index)
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
    )


def _ascend_driver_cores() -> tuple[int, int] | None:
    """(vector cores, AI cores) from triton-ascend's active driver, when an NPU is there."""
    try:
        from triton.runtime import driver

        active = driver.active
        props = active.utils.get_device_properties(active.get_current_device())
        return int(props["num_vectorcore"]), int(props["num_aicore"])
    except Exception:  # no triton-ascend, no NPU, or a driver without these properties
        return None


def _ascend_soc_ub_bytes() -> int | None:
    """Unified Buffer size from CANN's platform query, when CANN is installed."""
    try:
        from tbe.common.platform import get_soc_spec  # CANN's Python package

        return int(get_soc_spec("UB_SIZE"))
    except Exception:
        return None


def ascend_target(*, interpreted: bool = False) -> Target:
    ub = os.environ.get("FUSEDOPS_ASCEND_UB_BYTES")
    ub_bytes = _env_int("FUSEDOPS_ASCEND_UB_BYTES", ASCEND_UB_BYTES) if ub else (
        (None if interpreted else _ascend_soc_ub_bytes()) or ASCEND_UB_BYTES
    )
    cores = None if interpreted else _ascend_driver_cores()
    vector, ai = cores if cores else (
        _env_int("FUSEDOPS_ASCEND_VECTOR_CORES", ASCEND_DEFAULT_VECTOR_CORES),
        _env_int("FUSEDOPS_ASCEND_AI_CORES", ASCEND_DEFAULT_AI_CORES),
    )
    return Target(
        vendor="ascend",
        vector_cores=vector,
        matrix_cores=ai,
        onchip_bytes=ub_bytes,
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


def target_for(device: torch.device) -> Target | None:
    """The target whose plan runs on `device`, or None where the PyTorch reference runs (plain CPU)."""
    if device.type == "cuda":
        return cuda_target(device)
    if device.type == "npu":
        return ascend_target()
    if device.type == "cpu":
        mode = interpret_mode()
        if mode == "cuda":
            return cuda_target(interpreted=True)
        if mode == "ascend":
            return ascend_target(interpreted=True)
        return None
    raise NotImplementedError(f"fusedops has no kernels for device type {device.type!r}")


def with_onchip_bytes(target: Target, onchip_bytes: int) -> Target:
    return replace(target, onchip_bytes=onchip_bytes)
