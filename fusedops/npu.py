"""Ascend NPU registration: only when torch_npu imports. Importing fusedops never imports it
otherwise (torch_npu without CANN breaks `import torch`)."""

from __future__ import annotations

import importlib.util

from fusedops.registry import register_npu_kernels


def torch_npu_available() -> bool:
    return importlib.util.find_spec("torch_npu") is not None


def register() -> bool:
    """Import torch_npu and register every op's npu kernel. Returns False when torch_npu is absent."""
    if not torch_npu_available():
        return False
    import torch_npu  # noqa: F401  (names the PrivateUse1 backend "npu")

    register_npu_kernels()
    return True
