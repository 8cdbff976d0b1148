"""npu registration, each check in a fresh interpreter (renaming the PrivateUse1 backend cannot be
undone). torch_npu is never installed: one test puts a stub package named torch_npu, which only renames
the backend as the real one does, on the subprocess's sys.path."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.ascend

ROOT = Path(__file__).resolve().parents[1]


def run_python(*parts: str, extra_path: str | None = None) -> str:
    """Run the dedented, concatenated code parts in a fresh interpreter; returns its stdout."""
    code = "\n".join(textwrap.dedent(p) for p in parts)
    env = dict(os.environ)
    paths = [str(ROOT)] + ([extra_path] if extra_path else []) + [env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"subprocess failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


CHECK_ALL = """
    names = fusedops.op_names()
    assert {"attn_res", "attn_res_backward"} <= set(names), names
    missing = [n for n in names if not torch._C._dispatch_has_kernel_for_dispatch_key(f"fusedops::{n}", "PrivateUse1")]
    assert not missing, f"no PrivateUse1 kernel for {missing}"
    print("registered", len(names))
"""


def test_register_npu_kernels_after_rename():
    out = run_python(
        """
        import sys, torch
        torch.utils.rename_privateuse1_backend("npu")
        import fusedops
        from fusedops.registry import register_npu_kernels

        # no torch_npu here: importing fusedops registered nothing for PrivateUse1
        assert "torch_npu" not in sys.modules
        names = fusedops.op_names()
        have = [n for n in names if torch._C._dispatch_has_kernel_for_dispatch_key(f"fusedops::{n}", "PrivateUse1")]
        assert not have, have
        assert register_npu_kernels() == names
        assert register_npu_kernels() == names  # idempotent
        """,
        CHECK_ALL,
        """
        # an "npu" tensor's device picks the Ascend plan (cores from the driver when there is one)
        from fusedops import targets
        targets._ascend_driver_cores = lambda index: (40, 20) if index == 1 else None
        t = targets.target_for(torch.device("npu", 1))
        assert (t.vendor, t.vector_cores, t.matrix_cores, t.interpreted) == ("ascend", 40, 20, False), t
        t = targets.target_for(torch.device("npu", 0))
        assert (t.vector_cores, t.matrix_cores) == (48, 24), t

        # an op defined after registration registers its npu kernel when it is defined
        from fusedops.registry import fused_op

        @fused_op("late_test_op", fake=torch.empty_like)
        def late(x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        assert torch._C._dispatch_has_kernel_for_dispatch_key("fusedops::late_test_op", "PrivateUse1")
        """
    )
    assert "registered" in out


def test_import_without_torch_npu_never_touches_it():
    run_python(
        """
        import importlib.util, sys

        assert importlib.util.find_spec("torch_npu") is None  # never installed here
        import torch
        import fusedops
        assert "torch_npu" not in sys.modules
        assert torch._C._get_privateuse1_backend_name() == "privateuseone"
        assert not fusedops.npu.register()
        assert not any(torch._C._dispatch_has_kernel_for_dispatch_key(f"fusedops::{n}", "PrivateUse1")
                       for n in fusedops.op_names())

        # explicit registration without the "npu" backend name is refused, naming the fix
        from fusedops.registry import register_npu_kernels
        try:
            register_npu_kernels()
        except RuntimeError as e:
            assert "torch_npu" in str(e)
        else:
            raise AssertionError("registered without an npu backend")
        """
    )


def test_import_registers_when_torch_npu_imports(tmp_path):
    stub = tmp_path / "torch_npu"
    stub.mkdir()
    (stub / "__init__.py").write_text(
        "# test stub: does only what the real torch_npu does that fusedops relies on\n"
        "import torch\n"
        "torch.utils.rename_privateuse1_backend('npu')\n"
    )
    out = run_python(
        """
        import sys
        import torch
        import fusedops
        assert "torch_npu" in sys.modules
        """,
        CHECK_ALL,
        extra_path=str(tmp_path),
    )
    assert "registered" in out
