"""Every kernel launch the H100 plan makes compiles for sm_90 with Inductor's argument types, on a
machine without a GPU (fusedops_tests/compile_sm90.py, in a process without the interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_kernels_compile_for_sm90_with_inductor_argument_types():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FUSEDOPS_INTERPRET")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, str(ROOT / "fusedops_tests" / "compile_sm90.py")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert "0 failed" in proc.stdout
