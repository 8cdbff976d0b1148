"""The hardware targets and the launch planners that read them: environment overrides, the order in
which the Ascend target's numbers are looked up, grid caps, and planners that keep within the grid cap
and the on-chip (Unified Buffer) budget over many shapes. Pure Python: no kernel runs here, so these
tests also run in the triton-ascend CI stage (marked `ascend`)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from fusedops import targets
from fusedops.targets import (
    ASCEND_DEFAULT_AI_CORES,
    ASCEND_DEFAULT_VECTOR_CORES,
    ASCEND_MAX_GRID,
    ASCEND_UB_BYTES,
    ascend_target,
    cuda_target,
    interpret_mode,
    target_for,
)

pytestmark = pytest.mark.ascend

ENV = (
    "FUSEDOPS_ASCEND_UB_BYTES",
    "FUSEDOPS_ASCEND_VECTOR_CORES",
    "FUSEDOPS_ASCEND_AI_CORES",
    "FUSEDOPS_CUDA_ONCHIP_BYTES",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def no_npu(monkeypatch):
    """A machine with neither an NPU driver nor CANN (what CI has), made explicit."""
    monkeypatch.setattr(targets, "_ascend_driver_cores", lambda index: None)
    monkeypatch.setattr(targets, "_ascend_soc_ub_bytes", lambda: None)


# --- the Ascend target's numbers and where they come from -------------------------------------------


def test_ascend_defaults():
    t = ascend_target(interpreted=True)
    assert t.vendor == "ascend"
    assert t.onchip_bytes == ASCEND_UB_BYTES == 192 * 1024
    assert (t.vector_cores, t.matrix_cores) == (ASCEND_DEFAULT_VECTOR_CORES, ASCEND_DEFAULT_AI_CORES) == (48, 24)
    assert t.max_grid == ASCEND_MAX_GRID == 65535
    assert t.row_align == 32
    assert t.persistent and t.resident == 1 and t.interpreted


def test_ascend_defaults_without_driver_or_cann(no_npu):
    t = ascend_target()
    assert (t.onchip_bytes, t.vector_cores, t.matrix_cores) == (192 * 1024, 48, 24)
    assert not t.interpreted


def test_ascend_env_overrides(monkeypatch, no_npu):
    monkeypatch.setenv("FUSEDOPS_ASCEND_UB_BYTES", "65536")
    monkeypatch.setenv("FUSEDOPS_ASCEND_VECTOR_CORES", "40")
    monkeypatch.setenv("FUSEDOPS_ASCEND_AI_CORES", "20")
    for t in (ascend_target(), ascend_target(interpreted=True)):
        assert (t.onchip_bytes, t.vector_cores, t.matrix_cores) == (65536, 40, 20)


def test_ub_from_cann_unless_overridden(monkeypatch):
    monkeypatch.setattr(targets, "_ascend_driver_cores", lambda index: None)
    monkeypatch.setattr(targets, "_ascend_soc_ub_bytes", lambda: 256 * 1024)
    assert ascend_target().onchip_bytes == 256 * 1024
    # the interpreter's plan never depends on what the machine has installed
    assert ascend_target(interpreted=True).onchip_bytes == ASCEND_UB_BYTES
    monkeypatch.setenv("FUSEDOPS_ASCEND_UB_BYTES", "100000")
    assert ascend_target().onchip_bytes == 100000
    # an empty variable counts as unset
    monkeypatch.setenv("FUSEDOPS_ASCEND_UB_BYTES", "")
    assert ascend_target().onchip_bytes == 256 * 1024


def test_cores_from_driver_before_env(monkeypatch):
    seen = []

    def driver(index):
        seen.append(index)
        return (40, 20)

    monkeypatch.setattr(targets, "_ascend_driver_cores", driver)
    monkeypatch.setattr(targets, "_ascend_soc_ub_bytes", lambda: None)
    monkeypatch.setenv("FUSEDOPS_ASCEND_VECTOR_CORES", "8")
    monkeypatch.setenv("FUSEDOPS_ASCEND_AI_CORES", "4")
    t = ascend_target()
    assert (t.vector_cores, t.matrix_cores) == (40, 20)
    assert seen == [None]
    # under the interpreter the driver is not asked; the overrides apply
    t = ascend_target(interpreted=True)
    assert (t.vector_cores, t.matrix_cores) == (8, 4)
    assert seen == [None]


@pytest.mark.filterwarnings("ignore::UserWarning")  # triton-ascend's driver warns that CANN's ccec is missing
def test_driver_query_without_npu_is_none():
    # CI has no NPU: upstream triton has no active NPU driver, triton-ascend's fails to start. Either
    # way the lookup answers None instead of raising.
    assert targets._ascend_driver_cores(None) is None
    assert targets._ascend_soc_ub_bytes() is None


@pytest.mark.parametrize("name", ENV)
@pytest.mark.parametrize("raw", ["abc", "0", "-5", "1.5", "64k"])
def test_bad_env_values_raise(monkeypatch, no_npu, name, raw):
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=name):
        if name.startswith("FUSEDOPS_CUDA"):
            cuda_target(interpreted=True)
        else:
            ascend_target(interpreted=True)


def test_interpret_mode(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("FUSEDOPS_INTERPRET", "ascend")
    assert interpret_mode() == "ascend"
    assert target_for(torch.device("cpu")).vendor == "ascend"
    monkeypatch.setenv("FUSEDOPS_INTERPRET", "cuda")
    assert target_for(torch.device("cpu")).vendor == "cuda"
    monkeypatch.setenv("FUSEDOPS_INTERPRET", "")
    assert target_for(torch.device("cpu")) is None
    monkeypatch.setenv("FUSEDOPS_INTERPRET", "npu")
    with pytest.raises(ValueError, match="FUSEDOPS_INTERPRET"):
        interpret_mode()
    monkeypatch.setenv("FUSEDOPS_INTERPRET", "ascend")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        interpret_mode()


# --- grids -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("blocks", [0, 1, 23, 24, 47, 48, 49, 1000, 65535, 65536, 10**9])
def test_ascend_grid_size(no_npu, blocks):
    t = ascend_target()
    vector = t.grid_size(blocks)
    matrix = t.grid_size(blocks, matrix=True)
    # persistent: one program per vector core (pure-vector kernels) or AI core (kernels with tl.dot)
    assert vector == max(1, min(blocks, 48))
    assert matrix == max(1, min(blocks, 24))
    # not persistent: one program per block, up to the 65535 cap
    assert t.grid_size(blocks, persistent=False) == max(1, min(blocks, ASCEND_MAX_GRID))


def test_ascend_grid_cap_with_many_cores(monkeypatch, no_npu):
    # a driver or override reporting more cores than the grid cap allows is still capped
    monkeypatch.setenv("FUSEDOPS_ASCEND_VECTOR_CORES", "100000")
    monkeypatch.setenv("FUSEDOPS_ASCEND_AI_CORES", "70000")
    t = ascend_target()
    assert t.grid_size(10**9) == ASCEND_MAX_GRID
    assert t.grid_size(10**9, matrix=True) == ASCEND_MAX_GRID


def test_check_grid_caps_the_product_of_dims():
    t = ascend_target(interpreted=True)
    assert t.check_grid((65535,)) == (65535,)
    assert t.check_grid((1, 1, 65535)) == (1, 1, 65535)
    assert t.check_grid((255, 257)) == (255, 257)  # 65535
    for bad in [(65536,), (256, 256), (2, 32768), (16, 64, 64)]:
        with pytest.raises(ValueError, match="65535"):
            t.check_grid(bad)
    with pytest.raises(ValueError):
        t.check_grid((0, 4))
    assert cuda_target(interpreted=True).check_grid((256, 256, 4)) == (256, 256, 4)


@pytest.mark.parametrize("elem_size", [1, 2, 4, 8])
def test_align_elems(elem_size):
    t = ascend_target(interpreted=True)
    for n in range(1, 200):
        a = t.align_elems(n, elem_size)
        assert a >= n and (a * elem_size) % 32 == 0 and a - n < 32 // elem_size


# --- planners over many shapes: never over the grid cap, never over the on-chip budget --------------

UB_SIZES = [ASCEND_UB_BYTES, 256 * 1024, 64 * 1024, 16 * 1024]


def ascend_targets():
    """The Ascend plan at several UB sizes, as on hardware and under the interpreter."""
    out = []
    for ub, interpreted in itertools.product(UB_SIZES, (False, True)):
        t = dataclasses.replace(ascend_target(interpreted=True), onchip_bytes=ub, interpreted=interpreted)
        out.append(t)
    return out


TOKENS = [1, 7, 48, 1000, 4096, 65535, 65536, 10**6, 2**24 + 3, 2**31 - 1]
DIMS = [1, 3, 16, 100, 512, 768, 1024, 2048, 4096, 5120, 7168, 8192, 16384, 65536]


def test_attn_res_plans_fit():
    from fusedops.attn_res import plan as P

    for target in ascend_targets():
        for tokens, dim, elem, backward in itertools.product(TOKENS, DIMS, (2, 4, 8), (False, True)):
            plan = P.make_plan(target, tokens, dim, elem, backward=backward)
            # float64 values (elem 8) keep every on-chip value in float64: twice the fp32 bytes
            per = (P.BACKWARD_BYTES_PER_ELEMENT if backward else P.FORWARD_BYTES_PER_ELEMENT) * P.acc_scale(elem)
            case = (target.onchip_bytes, tokens, dim, elem, backward, plan)
            assert 1 <= plan.grid <= min(ASCEND_MAX_GRID, target.vector_cores), case
            assert plan.block_t * plan.block_d * per <= target.onchip_bytes, case
            assert (plan.block_d * elem) % target.row_align == 0, case
            if plan.one_tile:
                assert plan.block_d >= dim, case
            # one source row per depth step: the unrolled odd-N tail needs masks that triton-ascend
            # 3.2's interpreter drops when they are one element and False (docs/ascend.md)
            assert plan.unroll == 1, case
            if backward:
                stash = P.stash_rows(target, 8, dim, elem)
                acc = 4 * P.acc_scale(elem)
                block_d, block_p, grid, rewrite_p = P.reduce_plan(target, dim, plan.grid, stash, acc)
                assert 1 <= grid <= ASCEND_MAX_GRID, case
                assert not stash or (stash == 1 or dim % block_d == 0) and block_d * 4 % target.row_align == 0, case
                # (the interpreter's reduction takes 4096-wide rows whatever the budget: not checked)
                if not target.interpreted:
                    assert block_p * block_d * 2 * acc <= target.onchip_bytes, case
                    assert rewrite_p * block_d * 4 * acc <= target.onchip_bytes, case


def test_embedding_plans_fit():
    P = pytest.importorskip("fusedops.embedding.plan")

    for target in ascend_targets():
        for rows, dim, elem, backward in itertools.product(TOKENS, DIMS, (2, 4, 8), (False, True)):
            plan = P.make_plan(target, rows, dim, elem, backward=backward)
            wide = 8 if elem == 8 else 0  # float64: a float64 accumulator and upcast row
            per = (P.BACKWARD_FIXED_BYTES + wide + elem) if backward else (P.FORWARD_FIXED_BYTES + 2 * elem)
            case = (target.onchip_bytes, rows, dim, elem, backward, plan)
            assert 1 <= plan.grid <= min(ASCEND_MAX_GRID, target.vector_cores), case
            assert plan.block_rows * plan.block_d * per <= target.onchip_bytes, case
            assert (plan.block_d * elem) % target.row_align == 0, case
        # the scan backward (forced on Ascend), any batch: one accumulator row, the closed chunks' row and
        # SCAN_ROWS gradient rows (raw and upcast)
        for tokens, dim, elem in itertools.product(TOKENS, DIMS, (2, 4, 8)):
            base = P.make_plan(target, 1000, dim, elem, backward=True, tokens=tokens)
            plan = P.scan_plan(target, dim, elem, tokens, base)
            acc = 8 if elem == 8 else 4
            case = (target.onchip_bytes, tokens, dim, elem, plan)
            assert 1 <= plan.grid <= min(ASCEND_MAX_GRID, target.vector_cores), case
            assert plan.block_d * (2 * acc + P.SCAN_ROWS * (elem + acc)) <= target.onchip_bytes, case
            assert (plan.block_d * elem) % target.row_align == 0, case


def test_neighborhood_attention_plans_fit():
    P = pytest.importorskip("fusedops.neighborhood_attention.plan")

    shapes = {
        1: [(1, 1, 7), (1, 1, 100), (1, 1, 4096), (1, 1, 100000)],
        2: [(1, 7, 9), (1, 56, 56), (1, 128, 128), (1, 1024, 1024)],
        3: [(3, 5, 7), (16, 32, 32), (64, 64, 64)],
    }
    for target in ascend_targets():
        for ndim, spatial_list in shapes.items():
            for spatial, head_dim, dilation, dtype, backward in itertools.product(
                spatial_list, (16, 32, 64, 128), (1, 2), (torch.float16, torch.float32, torch.float64), (False, True)
            ):
                dil = (1,) * (3 - ndim) + (dilation,) * ndim
                plan = P.make_plan(target, spatial, dil, head_dim, head_dim, dtype, ndim, backward=backward)
                case = (target.onchip_bytes, spatial, head_dim, dilation, dtype, backward, plan)
                footprint = P._footprint(plan.block_m, plan.block_n, plan.block_d, plan.block_dv, backward,
                                         P.elem_bytes(dtype))
                # the Ascend plan keeps tl.dot's M, N, K >= 16 (triton-ascend 3.2's interpreter asserts it)
                assert min(plan.block_m, plan.block_n, plan.block_d, plan.block_dv) >= P.MIN_DOT, case
                smallest = plan.block_m // 2 < P.MIN_DOT and plan.block_n // 2 < P.MIN_DOT
                # over budget only with the smallest legal tiles, never at the real UB sizes
                assert footprint <= target.onchip_bytes or smallest, case
                if target.onchip_bytes >= ASCEND_UB_BYTES:
                    assert footprint <= target.onchip_bytes, case
                tiles = 1
                for length, d, box in zip(spatial, dil, plan.bm):
                    group_len = -(-length // d)
                    tiles *= d * -(-group_len // box)
                tiles *= 64  # batch x heads
                grid = P.grid(target, tiles)
                # kernels with tl.dot: one program per AI core
                assert 1 <= grid <= min(ASCEND_MAX_GRID, target.matrix_cores), case
