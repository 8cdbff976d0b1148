"""The fast tier (`pytest -m fast`, listed in conftest.FAST_TIER) names tests that exist, and holds every op."""

from __future__ import annotations

import importlib

from fusedops.bench import OPS
from fusedops_tests.conftest import FAST_TIER, in_fast_tier


def test_every_fast_tier_entry_names_a_test():
    for filename, entries in FAST_TIER.items():
        module = importlib.import_module(f"fusedops_tests.{filename.removesuffix('.py')}")
        for entry in entries:
            assert callable(getattr(module, entry.split("[")[0], None)), f"{filename}: no test {entry!r}"
    # every op: its forward and gradients on every path, opcheck and a compiled round trip
    for op in OPS:
        names = FAST_TIER[f"test_{op}.py"]
        assert any(n.startswith("test_matches") for n in names), op
        assert any(n.startswith("test_opcheck") for n in names), op
        assert "test_compile_fullgraph_matches_eager" in names, op
    assert in_fast_tier("test_attn_res.py", "test_opcheck[True-cuda-plan]")
    assert not in_fast_tier("test_attn_res.py", "test_opcheck[False-cuda-plan]")
    assert in_fast_tier("test_embedding.py", "test_opcheck[ascend-plan]")
    assert not in_fast_tier("test_embedding.py", "test_opcheck_extra")
    assert not in_fast_tier("test_embedding.py", "TestGPU::test_matches_torch[dtype0-32768-768-16384]")
