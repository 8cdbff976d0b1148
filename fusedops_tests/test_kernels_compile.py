"""Every kernel launch the H100 plan makes compiles for sm_90 with Inductor's argument types within its shared
memory (and the tensor-core launches of a 99 KB GPU's plan for sm_86 within its), and every launch the Ascend plan
makes lowers through triton-ascend's adapter, on a machine without a GPU or NPU (fusedops_tests/compile_sm90.py and
compile_ascend.py, in processes without the interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _compile_script(name: str, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FUSEDOPS_INTERPRET")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, str(ROOT / "fusedops_tests" / name), *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, f"{proc.stdout[-6000:]}\n{proc.stderr[-4000:]}"
    assert "0 failed" in proc.stdout
    return proc.stdout


@pytest.mark.slow
def test_kernels_compile_for_sm90_with_inductor_argument_types():
    pytest.importorskip("triton.backends.nvidia")
    _compile_script("compile_sm90.py")


@pytest.mark.slow
def test_tensor_core_kernels_fit_the_shared_memory_of_a_99_kb_gpu():
    """The plans for a GPU with 99 KB of shared memory a program (sm_86/sm_89: A10, L4, L40S, RTX 30xx/40xx)
    compile for sm_86 within it: the tile caps measured on Hopper shrink (Target.smem_shrink) and the NA planner's
    shared-memory estimate holds (a launch past the limit would fail on such a GPU)."""
    pytest.importorskip("triton.backends.nvidia")
    _compile_script("compile_sm90.py", "--capability", "86")


@pytest.mark.slow
@pytest.mark.ascend
def test_kernels_lower_through_the_ascend_adapter():
    """triton-ascend's own compiler, up to its Ascend-specific stage (no CANN needed), at every launch the
    Ascend plan makes (the CI stage with triton-ascend runs it)."""
    pytest.importorskip("triton.backends.ascend")
    out = _compile_script("compile_ascend.py")
    assert "lowered to triton-ascend's ttadapter IR" in out
