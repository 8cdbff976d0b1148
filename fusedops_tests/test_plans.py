"""Launch plans as data (fusedops/plans.py and the ops' plans.json): the resolver, forced configurations, and the
plans of the benchmark and test shapes pinned (fusedops_tests/plan_pins.json, written from the hand-written
planners that the tables replaced; `FUSEDOPS_WRITE_PINS=1 pytest fusedops_tests/test_plans.py -k pinned` rewrites
it after a deliberate table change)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import threading
from pathlib import Path

import pytest
import torch

import fusedops
from fusedops import internals, plans
from fusedops.targets import Target, ascend_target, cuda_arch, cuda_target

from .helpers import execution_path, gpu, recorded_launches

PINS = Path(__file__).with_name("plan_pins.json")
H100 = Target(vendor="cuda", vector_cores=132, matrix_cores=132, onchip_bytes=192 * 1024, max_grid=2**31 - 1,
              row_align=16, resident=4, persistent=False, arch="sm90")


def _table(rows, kernels=None, overrides=None) -> dict:
    return {"op": "toy", "kernels": kernels or {"k": ["x"]}, "overrides": overrides or {"k": ["x"]}, "rows": rows}


@pytest.fixture
def toy_table(monkeypatch):
    """A toy op's table in place of reading plans.json."""
    def install(data):
        plans.validate(data)
        real = plans.table

        def table(op):
            return data if op == "toy" else real(op)

        monkeypatch.setattr(plans, "table", table)
        monkeypatch.setattr(plans, "_override_keys", lambda op: table(op).get("overrides", {}))
    return install


def _row(arch, when, x, vendor="cuda", run="r"):
    return {"kernel": "k", "vendor": vendor, "arch": arch, "when": when, "params": {"x": x}, "run": run}


def test_resolver_prefers_the_specific_row(toy_table):
    toy_table(_table([
        _row("*", {}, "generic"),
        _row("*", {"dtype": "16"}, "generic-16"),
        _row("sm90", {}, "h100"),
        _row("sm90", {"dtype": "16", "dim": [1, 4096]}, "h100-16-narrow"),
        _row("sm90-h200", {"dtype": "16"}, "h200-16"),
        _row("*", {}, "ascend", vendor="ascend"),
    ]))

    def x(arch, vendor="cuda", **features):
        return plans.resolve_row("toy", "k", vendor, arch, dict(dict(dtype="32", dim=8192), **features))["params"]["x"]

    assert x("sm90") == "h100"  # the arch's own row over the generic one, even with fewer when keys
    assert x("sm90", dtype="16", dim=4096) == "h100-16-narrow"  # more when keys, same arch
    assert x("sm90", dtype="16", dim=4097) == "h100"  # outside the range: the next most specific
    assert x("sm90-h200", dtype="16") == "h200-16"
    assert x("sm90-h200", dtype="32") == "h100"  # an H200 falls back on the sm90 rows, then "*"
    assert x("sm100") == "generic" and x("sm100", dtype="16") == "generic-16"  # an unseen GPU: heuristic rows
    assert x("", dtype="16") == "generic-16"
    assert x("", vendor="ascend") == "ascend"


def test_resolver_errors(toy_table):
    toy_table(_table([_row("*", {"dtype": "16"}, 1)]))
    with pytest.raises(ValueError, match="no plan row"):
        plans.resolve_row("toy", "k", "cuda", "sm90", {"dtype": "32"})
    with pytest.raises(ValueError, match="feature 'dtype'"):
        plans.resolve_row("toy", "k", "cuda", "sm90", {"dim": 3})
    with pytest.raises(ValueError, match="repeats"):
        plans.validate(_table([_row("*", {"a": 1}, 1), _row("*", {"a": 1}, 2)]))
    with pytest.raises(ValueError, match="unknown params"):
        plans.validate(_table([{**_row("*", {}, 1), "params": {"y": 1}}]))


@pytest.mark.parametrize("op", ["attn_res", "block_attn_res", "embedding", "neighborhood_attention"])
def test_tables_are_valid_and_name_their_runs(op):
    data = plans.table(op)
    plans.validate(data)
    for row in data["rows"]:
        assert row["run"], row
        if row["vendor"] == "cuda" and row["arch"] == "sm90-h200":
            assert row["run"].startswith("h200"), row  # named as the H200's
    # every H100 row has its H200 twin and a generic CUDA row for unseen GPUs (same kernel and when; the params
    # are today's H100 values in all three until `python -m fusedops.bench tune` retunes a GPU's rows)
    def key(row):
        return row["kernel"], json.dumps(row["when"], sort_keys=True)
    by_arch = {arch: {key(r) for r in data["rows"] if r["vendor"] == "cuda" and r["arch"] == arch}
               for arch in ("*", "sm90", "sm90-h200")}
    assert by_arch["sm90"] and by_arch["sm90"] == by_arch["sm90-h200"]
    assert by_arch["sm90"] <= by_arch["*"]


def test_cuda_arch_names_the_h200():
    gib = 2**30
    assert cuda_arch("NVIDIA H100 80GB HBM3", 9, 0, 80 * gib) == "sm90"
    assert cuda_arch("NVIDIA H200", 9, 0, 141 * gib) == "sm90-h200"
    assert cuda_arch("NVIDIA GH200 480GB", 9, 0, 96 * gib) == "sm90-h200"  # by name
    assert cuda_arch("some sm_90 part", 9, 0, 120 * gib) == "sm90-h200"  # by memory
    assert cuda_arch("NVIDIA A100-SXM4-80GB", 8, 0, 80 * gib) == "sm80"
    assert plans.arch_chain("sm90-h200") == ("sm90-h200", "sm90", "*")
    assert plans.arch_chain("sm100") == ("sm100", "*") and plans.arch_chain("") == ("*",)


def test_h200_resolves_its_own_rows():
    h200 = dataclasses.replace(H100, arch="sm90-h200")
    row = plans.resolve_row("attn_res", "fwd", "cuda", "sm90-h200",
                            dict(interpreted=False, dtype="16", dim=7168, tokens=4096))
    assert row["arch"] == "sm90-h200" and row["run"].startswith("h200")
    from fusedops.attn_res.plan import make_plan
    assert make_plan(h200, 4096, 7168, 2, backward=False) == make_plan(H100, 4096, 7168, 2, backward=False)


def test_h200_forward_takes_whole_groups_where_they_waste_nothing():
    """The H200's depth-tile forward at D 1025-2048 takes 4 rows a group instead of 2 in a prefetching call (past
    the evict-first window) where N is a multiple of 4 and D a power of two (attn_res run 19); elsewhere 2."""
    from fusedops.attn_res.plan import depth_tile_plan

    h200 = dataclasses.replace(H100, arch="sm90-h200")
    rows = {(n, tokens, dim): depth_tile_plan(h200, tokens, n, dim, 2, backward=False).block_n
            for n, tokens, dim in ((12, 32768, 2048), (8, 32768, 2048), (16, 8192, 2048), (6, 32768, 2048),
                                   (9, 32768, 2048), (12, 2048, 2048), (16, 32768, 1536), (12, 32768, 1024))}
    assert rows == {(12, 32768, 2048): 4, (8, 32768, 2048): 4, (16, 8192, 2048): 4, (6, 32768, 2048): 2,
                    (9, 32768, 2048): 2, (12, 2048, 2048): 2, (16, 32768, 1536): 2, (12, 32768, 1024): 2}
    assert depth_tile_plan(H100, 32768, 12, 2048, 2, backward=False).block_n == 2  # the H100 rows: not measured


def test_block_attn_res_plans_come_from_its_table():
    """The H200 sweeps' plans (bench/NOTES.md, Block AttnRes runs 1-3) come out of block_attn_res/plans.json,
    and a row ahead of the table changes them: nothing measured is left in the planner's code."""
    from fusedops.block_attn_res.plan import MergePlan, MultiPlan, merge_plan, multi_plan

    h200 = dataclasses.replace(H100, arch="sm90-h200")
    assert multi_plan(h200, 8192, 9, 8, 7168, 2) == MultiPlan(16, 8, 64, 1, 7168, 576, 8, 128, True, 3, 256,
                                                             two_pass=True, tail_rows=1, out_warps=1,
                                                             constant_dim=True)
    assert multi_plan(h200, 512, 9, 8, 7168, 2) == MultiPlan(16, 16, 64, 4, 1792, 512, 4, 4, True, 2, 64)
    assert multi_plan(h200, 1, 9, 8, 7168, 2) == MultiPlan(16, 16, 64, 112, 64, 112, 4, 4, True, 2, 64)
    assert multi_plan(h200, 8192, 9, 8, 7168, 2, backward=True) == MultiPlan(16, 16, 64, 1, 7168, 9, 8, 8, True,
                                                                             block_d2=128, out_warps=4, grad_tokens=4,
                                                                             grad_rows=32)
    # float64 values keep the CUDA-core backward
    assert multi_plan(h200, 8192, 9, 8, 7168, 8, backward=True) == MultiPlan(8, 16, 512, 1, 7168, 132, 8)
    # deep or wide blocks take fewer tokens a step, 32-bit values half as many; past the caps the CUDA-core kernel
    steps = {(n, m, size): (p.dot, p.block_t, p.grad_tokens) for n, m, size in
             ((40, 33, 2), (8, 24, 4), (128, 24, 2), (128, 24, 4), (8, 65, 2))
             for p in [multi_plan(h200, 8192, n, m, 4096, size, backward=True)]}
    assert steps == {(40, 33, 2): (True, 2, 2), (8, 24, 4): (True, 4, 2), (128, 24, 2): (True, 1, 1),
                     (128, 24, 4): (False, 1, 0), (8, 65, 2): (False, 1, 0)}
    # the flat gradients kernel: 16 rows a step, doubled while whole tokens fill < 3/4 of them; past 32 rows or 128
    # (token, query) columns the batched kernel
    rows = {(n, m): multi_plan(h200, 8192, n, m, 4096, 2, backward=True).grad_rows
            for n, m in ((8, 24), (4, 16), (9, 6), (6, 64), (17, 8), (33, 4), (4, 64))}
    assert rows == {(8, 24): 16, (4, 16): 16, (9, 6): 32, (6, 64): 16, (17, 8): 32, (33, 4): 0, (4, 64): 0}
    # 32-bit values: half the rows and columns (shared memory)
    rows = {(n, m): multi_plan(h200, 8192, n, m, 4096, 4, backward=True).grad_rows
            for n, m in ((8, 24), (9, 6), (4, 33), (17, 8))}
    assert rows == {(8, 24): 16, (9, 6): 16, (4, 33): 0, (17, 8): 0}
    assert merge_plan(h200, 1, 7168, 2) == MergePlan(1, 8192, 1, 16, True, 1, True)
    assert merge_plan(h200, 8192, 7168, 2) == MergePlan(1, 8192, 8192, 8, True, 1, True)
    row = next(r for r in plans.table("block_attn_res")["rows"]
               if (r["kernel"], r["arch"]) == ("multi_dot", "sm90-h200"))
    changed = dict(row, params=dict(row["params"], narrow_tile_d=128, logit_tile_d=128, two_pass_min_tokens=4096))
    with plans.candidate_rows("block_attn_res", [changed]):
        assert multi_plan(h200, 512, 9, 8, 7168, 2).block_d == 128
        assert multi_plan(h200, 8192, 9, 8, 7168, 2).block_d == 128
        assert not multi_plan(h200, 2048, 9, 8, 7168, 2).two_pass
    assert multi_plan(h200, 512, 9, 8, 7168, 2).block_d == 64
    assert multi_plan(h200, 2048, 9, 8, 7168, 2).two_pass


SMEM_99K, SMEM_163K = 99 * 1024, 163 * 1024  # sm_86/sm_89/sm_120 and sm_80 GPUs' shared memory a program


def test_smem_shrink_scales_the_hopper_caps():
    assert [dataclasses.replace(H100, smem_bytes=b).smem_shrink() for b in (227 * 1024, 228 * 1024, SMEM_163K,
                                                                            SMEM_99K, 64 * 1024)] == [1, 1, 2, 4, 4]
    assert cuda_target(interpreted=True).smem_shrink() == 1 and ascend_target(interpreted=True).smem_shrink() == 1


def test_cuda_target_reads_the_device_shared_memory(monkeypatch):
    """The CUDA target takes the device's opt-in shared memory a block (an L40S: 99 KB, so the tile caps shrink 4x)."""
    from types import SimpleNamespace

    from fusedops import targets

    props = SimpleNamespace(multi_processor_count=142, name="NVIDIA L40S", major=8, minor=9, total_memory=48 * 2**30,
                            shared_memory_per_block_optin=SMEM_99K)
    cached = (targets._cuda_sm_count, targets._cuda_arch, targets._cuda_smem_bytes)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    try:
        for fn in cached:
            fn.cache_clear()
        t = cuda_target(torch.device("cuda", 0))
        assert (t.vector_cores, t.arch, t.smem_bytes, t.smem_shrink()) == (142, "sm89", SMEM_99K, 4)
        props.shared_memory_per_block_optin = 0  # a device that reports none: taken as Hopper's
        targets._cuda_smem_bytes.cache_clear()
        assert cuda_target(torch.device("cuda", 0)).smem_bytes == 227 * 1024
    finally:
        for fn in cached:
            fn.cache_clear()


@gpu
def test_gpu_target_reads_the_device_shared_memory():
    props = torch.cuda.get_device_properties(0)
    target = cuda_target(torch.device("cuda", 0))
    assert target.smem_bytes == props.shared_memory_per_block_optin
    assert props.major != 9 or target.smem_shrink() == 1  # Hopper: the tables' own caps


@pytest.mark.parametrize("smem", [SMEM_99K, SMEM_163K])
def test_neighborhood_attention_plans_fit_a_smaller_shared_memory(smem):
    """On a GPU with less shared memory than Hopper the NA plans drop a pipelining stage, then shrink their boxes,
    until the kernels' shared memory (the planner's estimate, held to sm_86 compiles by test_kernels_compile) fits;
    where even the smallest tiles do not (float64 backward at head dim 256 on 99 KB) the planner raises, naming
    shared memory. (Hopper's plans are pinned: test_plans_of_pinned_shapes_are_unchanged.)"""
    from fusedops.neighborhood_attention.plan import DEFAULT_STAGES, make_plan, smem_bytes

    small = dataclasses.replace(H100, arch="sm86", smem_bytes=smem)
    refused = []
    for (spatial, kernel), d, dtype, backward in itertools.product(
            [((1, 1, 8192), (1, 1, 129)), ((1, 1, 8192), (1, 1, 2048)), ((1, 64, 64), (1, 13, 13)),
             ((16, 32, 32), (7, 7, 7))], (32, 64, 128, 256), (torch.bfloat16, torch.float32, torch.float64),
            (False, True)):
        nd = sum(k > 1 for k in kernel)
        args = (spatial, (1, 1, 1), d, d, dtype, nd)
        kw = dict(backward=backward, kernel=kernel, halo=kernel[2] - 1 if backward and nd == 1 else None)
        try:
            plan = make_plan(small, *args, **kw)
        except ValueError as e:
            assert "shared memory" in str(e)
            refused.append((d, dtype, backward))
            continue
        if plan.fused:
            continue
        operand = 8 if dtype == torch.float64 else 4 if dtype == torch.float32 else 2
        for p in (plan, plan.dkdv or plan):
            assert smem_bytes(p.block_m, p.block_n, p.block_d, p.block_dv, p.num_stages or DEFAULT_STAGES, operand,
                              backward) <= smem, (spatial, kernel, d, dtype, backward, p)
    assert set(refused) == ({(256, torch.float64, True)} if smem == SMEM_99K else set())


def test_block_attn_res_plans_shrink_to_a_smaller_shared_memory():
    """The tensor-core kernels' caps, measured with Hopper's 227 KB, divide by Target.smem_shrink: an A100 takes
    half the tokens a step and the flat gradients kernel within half the rows and columns, a 99 KB GPU a quarter of
    the tokens and the batched gradients kernel; the forward narrower tiles (the sm_86 compile of such plans:
    test_kernels_compile)."""
    from fusedops.block_attn_res.plan import multi_plan

    # GPUs the tables have not seen (their "*" rows): a 227 KB one (sm_100), an A100, an L40S
    hopper, a100, small = (dataclasses.replace(H100, arch=arch, smem_bytes=b)
                           for arch, b in (("sm100", 227 * 1024), ("sm80", SMEM_163K), ("sm89", SMEM_99K)))
    wide = {name: multi_plan(t, 8192, 8, 24, 7168, 2, backward=True) for name, t in
            (("hopper", hopper), ("a100", a100), ("small", small))}
    assert [(p.grad_rows, p.block_t, p.grad_tokens) for p in wide.values()] == [(16, 8, 4), (16, 4, 2), (0, 2, 1)]
    narrow = {name: multi_plan(t, 8192, 4, 6, 4096, 2, backward=True).grad_rows for name, t in
              (("hopper", hopper), ("a100", a100), ("small", small))}
    assert narrow == {"hopper": 16, "a100": 16, "small": 0}
    decode = [multi_plan(t, 1, 9, 24, 7168, 2) for t in (hopper, a100, small)]
    assert [p.block_d for p in decode] == [128, 64, 32] and [p.block_d2 for p in decode] == [128, 64, 32]


# ---- forced configurations -------------------------------------------------------------------------------------

def test_override_forces_nests_and_restores():
    from fusedops.attn_res.op import forward_plan
    from fusedops.neighborhood_attention.plan import make_plan

    planned = forward_plan(H100, 8192, 8, 4096, 2)
    with fusedops.plan_override("attn_res", "forward", variant="rows", num_warps=8):
        plan = forward_plan(H100, 8192, 8, 4096, 2)
        assert plan.block_n == 0 and plan.num_warps == 8
        with fusedops.plan_override("attn_res", "forward", num_warps=2, block_t=1):
            inner = forward_plan(H100, 8192, 8, 4096, 2)
            assert (inner.block_n, inner.num_warps, inner.block_t) == (0, 2, 1)  # inner keys win, outer stay
        assert forward_plan(H100, 8192, 8, 4096, 2) == plan
    assert forward_plan(H100, 8192, 8, 4096, 2) == planned
    args = ([1, 64, 64], [1, 1, 1], 64, 64, torch.bfloat16, 2)
    with fusedops.plan_override("neighborhood_attention", "fwd", bm=[1, 4, 16], bn=(1, 16, 4), num_warps=8):
        forced = make_plan(H100, *args, backward=False, kernel_volume=49, kernel=[1, 7, 7])
    assert (forced.bm, forced.bn, forced.num_warps, forced.fwd_registers) == ((1, 4, 16), (1, 16, 4), 8, None)


def test_override_restores_after_an_exception():
    with pytest.raises(RuntimeError):
        with fusedops.plan_override("embedding", "fwd", num_warps=1):
            raise RuntimeError
    assert plans.forced("embedding", "fwd") == {}


def test_invalid_override_keys_raise():
    with pytest.raises(ValueError, match="'block_m'"):
        with fusedops.plan_override("neighborhood_attention", "fwd", block_m=64):
            pass
    with pytest.raises(ValueError, match="'nope'"):
        with fusedops.plan_override("attn_res", "nope", num_warps=4):
            pass
    with pytest.raises(ValueError, match="unknown op 'nope'"):
        with fusedops.plan_override("nope", "fwd"):
            pass
    with pytest.raises(ValueError, match="variant"):
        with fusedops.plan_override("attn_res", "backward", variant="fastest"):
            from fusedops.attn_res.op import backward_plan
            backward_plan(H100, 64, 8, 4096, 2, True)


@pytest.mark.parametrize("path", ["cuda", "ascend"])
def test_override_reaches_the_launched_kernels(path):
    """What plan_override forces is what the kernels are launched with (their meta-parameters)."""
    from fusedops.attn_res import op as ar_op
    from fusedops.embedding import op as em_op
    from fusedops.neighborhood_attention import op as na_op

    gen = torch.Generator().manual_seed(0)
    values, query = torch.randn(4, 3, 64, generator=gen), torch.randn(64, generator=gen)
    with execution_path(path), recorded_launches(ar_op) as launches, \
            fusedops.plan_override("attn_res", "forward", variant="online", block_t=2, num_warps=2):
        fusedops.attn_res(values, query)
    (name, _, meta), = launches
    assert name == "attn_res_fwd_kernel" and (meta["BLOCK_T"], meta["num_warps"]) == (2, 2)
    weight, indices = torch.randn(50, 48, generator=gen), torch.randint(0, 50, (30,), generator=gen)
    with execution_path(path), recorded_launches(em_op) as launches, \
            fusedops.plan_override("embedding", "fwd", block_rows=4, block_d=16, grid=3):
        torch.testing.assert_close(fusedops.embedding(indices, weight), weight[indices])
    (name, _, meta), = launches
    assert (meta["BLOCK_T"], meta["BLOCK_D"]) == (4, 16)
    q = torch.randn(1, 2, 40, 16, generator=gen)
    with execution_path(path), recorded_launches(na_op) as launches, \
            fusedops.plan_override("neighborhood_attention", "fwd", bm=(1, 1, 16), bn=(1, 1, 32), num_warps=2):
        fusedops.neighborhood_attention(q, q, q, 7)
    (name, _, meta), = launches
    assert (meta["BM2"], meta["BN2"], meta["num_warps"]) == (16, 32, 2)


@pytest.mark.parametrize("where", ["after the block", "on another thread"])
def test_backward_runs_under_the_overrides_of_its_forward(where):
    """A backward is planned under the plan_override blocks its forward ran in, wherever it runs: after the
    block, or on a thread that sees none of the caller's contextvars, as the autograd engine runs a CUDA
    backward (a forced backward plan once silently did not apply on GPUs, so a tile sweep measured nothing)."""
    from fusedops.embedding import op as em_op
    from fusedops.neighborhood_attention import op as na_op

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 24, 8, generator=gen).requires_grad_()
    weight = torch.randn(50, 16, generator=gen).requires_grad_()
    indices = torch.randint(0, 50, (30,), generator=gen)

    def backward(loss):
        if where == "after the block":
            loss.backward()
        else:
            thread = threading.Thread(target=loss.backward)
            thread.start()
            thread.join()

    with execution_path("cuda"), recorded_launches(na_op) as launches, recorded_launches(em_op) as em_launches:
        with fusedops.plan_override("neighborhood_attention", "bwd", bm=(1, 1, 8), bn=(1, 1, 4), fused_block=0), \
                fusedops.plan_override("embedding", "bwd", block_rows=2, block_d=16):
            loss = fusedops.neighborhood_attention(q, q, q, 5).sum() + fusedops.embedding(indices, weight).sum()
        backward(loss)
    dq = [meta for name, _, meta in launches if name == "na_bwd_dq_kernel"]
    assert dq and all((m["BM2"], m["BN2"]) == (8, 4) for m in dq)
    assert q.grad is not None and weight.grad is not None
    em_bwd = [meta for name, _, meta in em_launches if "bwd" in name or "backward" in name]
    assert em_bwd and all(m["BLOCK_D"] == 16 for m in em_bwd)


@pytest.mark.parametrize("path", ["cuda", "ascend"])
def test_plans_with_one_reduction_order_give_the_same_bits(path):
    """Configurations that only change how work is split among programs, not the order of any sum, give
    bit-identical results: attn_res's forward with any token block or grid (each token's softmax and sum run
    over depth in one order; D is one tile) and the embedding backward with any zero-tile shape and grid.
    (Other boxes of neighborhood attention change the order its online softmax meets the keys: not claimed.)"""
    gen = torch.Generator().manual_seed(1)
    values, query = torch.randn(5, 37, 96, generator=gen), torch.randn(96, generator=gen)
    with execution_path(path):
        with fusedops.plan_override("attn_res", "forward", variant="online"):
            base = fusedops.attn_res(values, query, return_lse=True)
        for block_t, grid in ((1, 1), (2, 3), (8, 37)):
            with fusedops.plan_override("attn_res", "forward", variant="online", block_t=block_t, grid=grid):
                got = fusedops.attn_res(values, query, return_lse=True)
            assert all(torch.equal(a, b) for a, b in zip(base, got)), (block_t, grid)
    weight = torch.randn(40, 48, generator=gen, requires_grad=True)
    indices = torch.randint(0, 40, (200,), generator=gen)
    grad = torch.randn(200, 48, generator=gen)

    def grad_weight():
        (g,) = torch.autograd.grad(fusedops.embedding(indices, weight), weight, grad)
        return g

    with execution_path(path):
        base = grad_weight()
        for rows, grid in ((2, 1), (4, 5)):
            with fusedops.plan_override("embedding", "bwd", block_rows=rows, grid=grid):
                assert torch.equal(grad_weight(), base), (rows, grid)


def test_override_under_torch_compile():
    """A forced configuration is read on the host while torch.compile traces: the compiled call launches it
    (and gives the eager call's bits)."""
    from fusedops.registry import opaque_triton_ops

    gen = torch.Generator().manual_seed(2)
    values, query = torch.randn(3, 9, 32, generator=gen), torch.randn(32, generator=gen)
    with execution_path("cuda"), opaque_triton_ops():
        with fusedops.plan_override("attn_res", "forward", variant="online", block_t=1):
            eager = fusedops.attn_res(values, query)
            torch._dynamo.reset()
            compiled = torch.compile(fusedops.attn_res, fullgraph=True)(values, query)
        torch._dynamo.reset()
    assert torch.equal(eager, compiled)


def test_launch_by_name_fails_loudly_on_a_wrong_name():
    from fusedops.embedding.kernels import embedding_fwd_kernel
    from fusedops.launch import bind

    args = dict(idx_ptr=0, w_ptr=1, out_ptr=2, N=3, V=4, D=5, IDX_S=6, W_S0=7, W_S1=8)
    assert bind(embedding_fwd_kernel, args) == list(range(9))
    with pytest.raises(TypeError, match=r"missing arguments \['W_S1'\], unknown arguments \['W_S2'\]"):
        bind(embedding_fwd_kernel, dict({k: v for k, v in args.items() if k != "W_S1"}, W_S2=8))
    with pytest.raises(TypeError, match="missing arguments"):
        bind(embedding_fwd_kernel, {k: v for k, v in args.items() if k != "N"})


# ---- the plans of the benchmark and test shapes, pinned -------------------------------------------------------

def pin_targets() -> dict:
    ascend = ascend_target(interpreted=True)
    return {
        "h100": H100,  # (the H200's and unseen GPUs' rows equal the H100's: test_tables_are_valid_and_name_their_runs)
        "interp-cuda": cuda_target(interpreted=True),
        "interp-cuda-12k": dataclasses.replace(cuda_target(interpreted=True), onchip_bytes=12 * 1024),
        "ascend": dataclasses.replace(ascend, interpreted=False), "interp-ascend": ascend,
    }


def plain(x):
    """A plan as plain JSON data: a dataclass as the list of its field values (nested ones too), tuples as lists."""
    if dataclasses.is_dataclass(x):
        return [plain(getattr(x, f.name)) for f in dataclasses.fields(x)]
    if isinstance(x, (tuple, list)):
        return [plain(v) for v in x]
    return x


def compute_pins(ar_plan, forward_plan, backward_plan, em_plan, na_plan) -> dict:
    """{case: plan} over the benchmark shapes, the attn_res grid of issue 31 (a sample) and the test shapes."""
    out = {}
    for tname, t in pin_targets().items():
        for n, dim in itertools.product((2, 4, 9, 16, 128), (300, 1024, 4096, 7168, 16384)):
            for tokens, elem in itertools.product((1, 2048, 32768), (2, 4)):
                key = f"attn_res|{tname}|{n},{dim},{tokens},{elem}"
                out[key + "|fwd"] = plain(forward_plan(t, tokens, n, dim, elem))
                for one_pass in (False, True):
                    plan = backward_plan(t, tokens, n, dim, elem, one_pass)
                    out[key + f"|bwd{int(one_pass)}"] = plain(plan)
                    out[key + f"|reduce{int(one_pass)}"] = plain(ar_plan.reduce_plan(t, dim, plan.grid, ar_plan.stash_rows(t, n, dim, elem), 4 * (elem // 4 or 1)))
        for v, dim, tokens, elem in itertools.product((1000, 151936), (48, 768, 1600, 4096), (64, 16384), (2, 4)):
            key = f"embedding|{tname}|{v},{dim},{tokens},{elem}"
            out[key + "|fwd"] = plain(em_plan.make_plan(t, tokens, dim, elem, backward=False))
            out[key + "|bwd"] = plain(em_plan.make_plan(t, v, dim, elem, backward=True, tokens=tokens))
        na_cases = [((4096,), (7,), 64), ((8192,), (33,), 128), ((16384,), (129,), 64), ((64, 64), (7, 7), 64),
                    ((128, 128), (13, 13), 128), ((16, 32, 32), (7, 7, 7), 64), ((256,), (7,), 32), ((16, 16), (5, 5), 32),
                    ((37,), (6,), 8), ((9, 7), (3, 4), 8), ((64, 64), (11, 11), 64), ((64, 64), (3, 3), 128),
                    ((256,), (33,), 256), ((32768,), (2048,), 128), ((16384,), (513,), 64), ((256, 256), (80, 80), 128),
                    ((30, 48, 80), (18, 24, 24), 128)]
        for (spatial, kernel, d), dtype in itertools.product(na_cases, (torch.bfloat16, torch.float32, torch.float64)):
            nd = len(spatial)
            pad = (1,) * (3 - nd)
            kv = 1
            for k in kernel:
                kv *= k
            for backward, tf32 in itertools.product((False, True), (False, True) if dtype == torch.float32 else (False,)):
                halo = kernel[0] - 1 if backward and nd == 1 else None
                plan = na_plan.make_plan(t, pad + spatial, (1, 1, 1), d, d, dtype, nd, backward=backward,
                                         kernel_volume=kv, halo=halo, tf32=tf32, kernel=pad + kernel)
                out[f"na|{tname}|{spatial},{kernel},{d},{str(dtype)[6:]},{int(backward)},{int(tf32)}"] = plain(plan)
    return out


def write_pins(pins: dict) -> None:
    PINS.write_text("{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}"
                                        for k, v in sorted(pins.items())) + "\n}\n")


def _current_pins() -> dict:
    from fusedops.attn_res import plan as ar_plan
    from fusedops.attn_res.op import backward_plan, forward_plan
    from fusedops.embedding import plan as em_plan
    from fusedops.neighborhood_attention import plan as na_plan

    return compute_pins(ar_plan, forward_plan, backward_plan, em_plan, na_plan)


def test_plans_of_pinned_shapes_are_unchanged():
    got = _current_pins()
    if os.environ.get("FUSEDOPS_WRITE_PINS") == "1":
        write_pins(got)
    pinned = json.loads(PINS.read_text())
    assert set(got) == set(pinned)
    changed = [k for k in pinned if got[k] != pinned[k]]
    assert not changed, f"{len(changed)} plans changed, e.g. {changed[:3]}: {[got[k] for k in changed[:1]]} " \
                        f"pinned {[pinned[k] for k in changed[:1]]}"


@pytest.mark.parametrize("op", ["neighborhood_attention", "block_attn_res"])
def test_tuner_smoke_writes_rows(op, tmp_path, monkeypatch, capsys):
    """`python -m fusedops.bench tune <op>` on a CPU (the interpreter, a tiny sweep): it prints table rows for the
    device's arch, named by the run, and writes them into a copy of the table; the package's table is untouched."""
    monkeypatch.setenv("FUSEDOPS_INTERPRET", "cuda")
    from fusedops.bench import tune

    path = tmp_path / "plans.json"
    assert tune.main([op, "--device", "cpu", "--table", str(path), "--run", "ci-smoke"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert rows and all(r["run"] == "ci-smoke" and r["vendor"] == "cuda" for r in rows)
    table = json.loads(path.read_text())
    plans.validate(table)
    assert sum(r["run"] == "ci-smoke" for r in table["rows"]) == len(rows)
    assert all(r["run"] != "ci-smoke" for r in plans.table(op)["rows"])
    with pytest.raises(SystemExit, match="--write"):
        tune.main([op, "--device", "cpu", "--write"])


def test_tuner_replaces_a_row_only_for_a_clear_win():
    """A candidate replaces the table's row only when its median beats the row's by the margin (timing drift
    between candidates is larger than the differences it would otherwise rank); a failed row gives way."""
    from fusedops.bench.tune import MARGIN, choose

    row, other = {"num_warps": 4}, {"num_warps": 8}
    assert choose([(1.0, row), (1.0 - MARGIN / 2, other)], row) == (1.0, row)
    assert choose([(1.0, row), (1.0 - 2 * MARGIN, other)], row) == (1.0 - 2 * MARGIN, other)
    assert choose([(1.0, other)], row) == (1.0, other)


def test_keyword_launches_take_the_cached_fast_path(monkeypatch):
    """launch() by name binds the arguments to positions and then runs the same CUDA launch cache as before: the
    first launch compiles, the next ones call the compiled launcher positionally (stand-ins for Triton and the
    device, as in test_dispatch.py)."""
    from types import SimpleNamespace

    from fusedops import launch as launch_mod

    from .test_dispatch import _StandInKernel, _StandInTensor

    if internals._knobs is None:
        pytest.skip("this Triton has no knobs module: launches go through the runner")
    monkeypatch.setattr(internals, "CACHED_LAUNCHES", True)  # a CPU torch has no CUDA stream functions

    class Kernel(_StandInKernel):
        params = [SimpleNamespace(name=n, is_constexpr=n == "BLOCK") for n in _StandInKernel.arg_names]

    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(launch_mod, "_CACHE", {})
    monkeypatch.setattr(launch_mod, "is_wrap_triton_enabled", lambda: False)
    kernel = Kernel()
    x, out = _StandInTensor(4096), _StandInTensor(8192)
    for _ in range(3):
        launch_mod.launch(kernel, (3,), dict(n=10, out_ptr=out, x_ptr=x), {"BLOCK": 64, "num_warps": 4})
    assert len(kernel.compiles) == 1 and len(kernel.launches) == 2
    assert kernel.launches[-1][-4:] == (4096, 8192, 10, 64)  # x, out, n, BLOCK: bound by name
    with pytest.raises(TypeError, match=r"unknown arguments \['m'\]"):
        launch_mod.launch(kernel, (3,), dict(m=10, out_ptr=out, x_ptr=x), {"BLOCK": 64})
    with pytest.raises(TypeError, match=r"unknown constexpr/launch options \['BLOCK_X'\]"):
        launch_mod.launch(kernel, (3,), dict(n=11, out_ptr=out, x_ptr=x), {"BLOCK_X": 64})
