"""Ascend NPU registration: only when torch_npu is there. Importing fusedops on a machine without
torch_npu never imports it, nor renames the PrivateUse1 backend (torch_npu without CANN breaks
`import torch`, so CI never installs it).

With torch_npu installed, torch usually imports it already (device-backend autoload); `register`
imports it otherwise, and gives every fusedops op its "npu" (PrivateUse1) kernel: the op body, which
picks the Ascend plan from the tensors' device type (`fusedops.targets.target_for`).
"""

from __future__ import annotations

import importlib.util
import sys
import warnings

from fusedops.registry import register_npu_kernels


def torch_npu_available() -> bool:
    """torch_npu is imported or importable (looked up on sys.path; not imported)."""
    return "torch_npu" in sys.modules or importlib.util.find_spec("torch_npu") is not None


def register() -> bool:
    """Import torch_npu (when installed) and register every op's npu kernel. Returns False, touching
    nothing, when torch_npu is absent, and False with a warning when it is installed but fails to
    import (e.g. no CANN), so that fusedops stays usable on CPU and CUDA."""
    if not torch_npu_available():
        return False
    try:
        import torch_npu  # noqa: F401  (names the PrivateUse1 backend "npu")
    except Exception as exc:  # pragma: no cover - needs a broken torch_npu install
        warnings.warn(f"fusedops: torch_npu is installed but failed to import ({exc}); no npu kernels registered")
        return False
    register_npu_kernels()
    return True
