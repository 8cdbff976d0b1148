"""Sweep Block AttnRes launch plans on a GPU (not part of `python -m fusedops.bench`): times
attn_res_multi's forward (multi: the one-kernel tensor-core forward's configurations against the planner's choice
and the CUDA-core kernel; two-pass: the two-pass forward's logits and outputs kernels each alone, then whole) and
attn_res_merge's forward (merge: D tiles and whole rows), each configuration forced through
fusedops.plan_override and checked against the planner's result.

    python -m fusedops.bench.tune_block_attn_res [multi] [two-pass] [merge]   (TUNE_S: seconds before it stops, 400)

Prints, per case, every configuration's time and % of the copy bandwidth (bytes as the block bench counts
them), best first."""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys
import time

import torch
import triton.testing
from fusedops.internals import set_wrap_triton_enabled

from fusedops.bench.common import measure_ceiling
from fusedops import plans
from fusedops.block_attn_res.op import _merge_forward, _multi_forward, _multi_logits, _multi_outputs, _multi_weights
from fusedops.layout import sources_walk
from fusedops.block_attn_res.plan import merge_plan, multi_plan
from fusedops.targets import cuda_target

EPS = 1e-6
# (N, M, tokens, D)
MULTI_CASES = [(8, 24, 8192, 7168), (9, 6, 8192, 4096), (4, 16, 32768, 4096), (9, 24, 2048, 7168),
               (9, 24, 512, 7168), (9, 24, 64, 7168), (9, 24, 8, 7168), (9, 24, 1, 7168)]
MERGE_CASES = [(8192, 7168), (2048, 4096), (32768, 4096), (2048, 7168), (8192, 12288), (1, 7168), (64, 7168)]
DEADLINE = time.monotonic() + float(os.environ.get("TUNE_S", "400"))


def _forcing(kernel: str, plan):
    """fusedops.plan_override forcing every field of `plan` on `kernel` of block_attn_res."""
    keys = plans.override_keys("block_attn_res")[kernel]
    return plans.plan_override("block_attn_res", kernel, **{k: v for k, v in dataclasses.asdict(plan).items()
                                                            if k in keys})


def _multi(values, queries, target, plan):
    with _forcing("multi_fwd", plan):
        return _multi_forward(values, queries, EPS, target)


def _time(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=30)


def _report(case, nbytes, ceiling, results) -> None:
    print(f"case {case}:", flush=True)
    for ms, name, err in sorted(results):
        pct = 100 * nbytes / (ms * 1e-3) / (ceiling * 1e12)
        print(f"  {ms:9.4f} ms {pct:6.1f}% of copy  max|diff| {err:.3g}  {name}", flush=True)


def _programs(plan, sms: int, per_sm: int):
    token_programs = plan.grid // plan.splits
    return dataclasses.replace(plan, grid=min(token_programs, sms * per_sm) * plan.splits)


def _multi_case(target, case):
    """(values: a token-major bf16 bank's first N slots, float32 queries, bytes of (N + M) rows and the lse, the
    planner's plan) of an (N, M, tokens, D) case."""
    n, m, tokens, dim = case
    bank = torch.randn(tokens, n + 2, dim, device="cuda", dtype=torch.bfloat16)
    queries = 0.05 * torch.randn(m, dim, device="cuda")
    nbytes = (n + m) * tokens * dim * 2 + m * tokens * 4
    return bank[:, :n].movedim(1, 0), queries, nbytes, multi_plan(target, tokens, n, m, dim, 2)


def sweep_multi(target, ceiling: float) -> None:
    for case in MULTI_CASES:
        if time.monotonic() > DEADLINE:
            print("out of time", flush=True)
            return
        n, m, tokens, dim = case
        values, queries, nbytes, planned = _multi_case(target, case)
        ref = _multi(values, queries, target, planned)[0].float()
        old = multi_plan(target, tokens, n, m, dim, 2, dot=False)
        candidates = {"planner " + str(planned): planned, "cuda-core " + str(old): old}
        for bt, bd, warps in itertools.product((1, 2, 4), (32, 64, 128), (4, 8)):
            p = multi_plan(target, tokens, n, m, dim, 2, tile_t=bt, tile_d=bd)
            for stages, per_sm in ((2, 4), (1, 4), (3, 4), (2, 2), (2, 8)):
                c = _programs(dataclasses.replace(p, num_warps=warps, num_stages=stages), target.vector_cores, per_sm)
                candidates[f"bt{bt} bd{bd} w{warps} s{stages} {per_sm}/SM splits{c.splits}"] = c
        results = []
        for name, plan in candidates.items():
            if time.monotonic() > DEADLINE:
                break
            try:
                out = _multi(values, queries, target, plan)[0]
                err = (out.float() - ref).abs().max().item()
                results.append((_time(lambda: _multi(values, queries, target, plan)), name, err))
            except Exception as e:  # noqa: BLE001 - a configuration that fails to compile is reported, not fatal
                print(f"  {name}: {type(e).__name__}: {str(e)[:120]}", flush=True)
        _report(case, nbytes, ceiling, results)
        del values


def _one_kernel_plan(target, tokens, n, m, dim):
    """The planner's one-kernel tensor-core forward (the table's row with the two-pass forward off)."""
    row = next(r for r in plans.table("block_attn_res")["rows"] if r["kernel"] == "multi_dot"
               and r["vendor"] == "cuda" and r["arch"] == target.arch and not r["when"].get("interpreted"))
    with plans.candidate_rows("block_attn_res", [dict(row, params=dict(row["params"], two_pass_min_tokens=0))]):
        return multi_plan(target, tokens, n, m, dim, 2)


def sweep_two_pass(target, ceiling: float) -> None:
    """The two-pass forward: its logits kernel's configurations timed alone, then its output kernel's, then the
    planner's and the best pair's whole forward against the one-kernel forward."""
    dev = torch.device("cuda")
    for case in MULTI_CASES[:3] + [(8, 24, 2048, 7168), (9, 16, 32768, 4096)]:
        if time.monotonic() > DEADLINE:
            print("out of time", flush=True)
            return
        n, m, tokens, dim = case
        values, queries, nbytes, planned = _multi_case(target, case)
        one = _one_kernel_plan(target, tokens, n, m, dim)
        ref_out, ref_lse = _multi(values, queries, target, one)
        s1, s2, st0, st1, st2 = sources_walk(values)
        walk = dict(N=n, M=m, T=tokens, D=dim, S1=s1, S2=s2, ST0=st0, ST1=st1, ST2=st2, STRIDE_N=values.stride(0),
                    DIM=dim)
        logits = torch.empty((tokens, m, n), device=dev)
        lse = torch.empty((m, tokens), device=dev)
        out = torch.empty_like(ref_out)
        firsts = []
        for rows, tile, warps, stages in itertools.product((64, 128, 256), (64, 128), (4, 8), (2, 3)):
            c = dataclasses.replace(planned, block_t=rows, block_d=tile, num_warps=warps, num_stages=stages)
            firsts.append((f"logits rows{rows} bd{tile} w{warps} s{stages}", c))
        seconds = []
        for warps, per_thread in itertools.product((1, 2, 4), (4, 8)):
            tile = min(1 << (dim - 1).bit_length(), 32 * warps * per_thread)
            c = dataclasses.replace(planned, block_d2=tile, out_warps=warps)
            seconds.append((f"outputs bd{tile} w{warps} ({per_thread} x {n} a thread)", c))
        best = {}
        for part, configs, pass_bytes in (("logits", firsts, n * tokens * dim * 2),
                                          ("outputs", seconds, (n + m) * tokens * dim * 2)):
            results = []
            for name, plan in configs:
                if time.monotonic() > DEADLINE:
                    break
                try:
                    if part == "logits":
                        def run():
                            _multi_logits(values, queries, logits, EPS, plan, target, walk)
                    else:
                        def run():
                            _multi_outputs(values, logits, out, plan, walk)
                    run()
                    err = (out.float() - ref_out.float()).abs().max().item() if part == "outputs" else float("nan")
                    results.append((_time(run), name, err))
                except Exception as e:  # noqa: BLE001
                    print(f"  {name}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            if results:
                best[part] = dict(configs)[min(results)[1]]
                if part == "logits":  # the outputs sweep reads the weights of these logits
                    _multi_logits(values, queries, logits, EPS, planned, target, walk)
                    _multi_weights(logits, lse, walk)
            _report(f"{case} {part} (alone)", pass_bytes, ceiling, results)
        whole = {"planner " + str(planned): planned, "one kernel " + str(one): one}
        if len(best) == 2:
            whole["best pair"] = dataclasses.replace(best["logits"], block_d2=best["outputs"].block_d2,
                                                     out_warps=best["outputs"].out_warps)
        results = []
        for name, plan in whole.items():
            got_out, got_lse = _multi(values, queries, target, plan)
            err = max((got_out.float() - ref_out.float()).abs().max().item(), (got_lse - ref_lse).abs().max().item())
            results.append((_time(lambda: _multi(values, queries, target, plan)), name, err))
        _report(f"{case} whole forward", nbytes, ceiling, results)
        del values, logits, out


def sweep_merge(target, ceiling: float) -> None:
    dev = torch.device("cuda")
    for case in MERGE_CASES:
        if time.monotonic() > DEADLINE:
            print("out of time", flush=True)
            return
        tokens, dim = case
        out, partial, addend = (torch.randn(tokens, dim, device=dev, dtype=torch.bfloat16) for _ in range(3))
        lse = torch.randn(tokens, device=dev)
        query = 0.05 * torch.randn(dim, device=dev)
        gain = torch.rand(dim, device=dev) + 0.5
        nbytes = 5 * tokens * dim * 2 + tokens * 4

        def run(plan):
            with _forcing("merge_fwd", plan):
                return _merge_forward(out, lse, partial, query, addend, None, gain, EPS, EPS, target)

        planned = merge_plan(target, tokens, dim, 2)
        ref = run(planned)[0].float()
        candidates = {"planner " + str(planned): planned}
        tiled = dataclasses.replace(planned, whole_row=False, blocks_per_program=0, constant_dim=False)
        for bt, bd, warps in itertools.product((1, 2), (2048, 4096, 8192), (8, 16)):
            if bt * bd > 16384 or bt > max(1, tokens) or bd > 2 * dim:
                continue
            for per_sm in (2, 4):
                grid = max(1, min(-(-tokens // bt), target.vector_cores * per_sm))
                candidates[f"tiles bt{bt} bd{bd} w{warps} {per_sm}/SM"] = dataclasses.replace(
                    tiled, block_t=bt, block_d=bd, num_warps=warps, grid=grid)
        whole = dataclasses.replace(planned, block_t=1, block_d=1 << (dim - 1).bit_length(), whole_row=True,
                                    constant_dim=True)
        for warps in (4, 8, 16):
            for per_program in (1, 2):
                candidates[f"whole w{warps} {per_program} tok/program"] = dataclasses.replace(
                    whole, num_warps=warps, blocks_per_program=per_program, grid=-(-tokens // per_program))
            for per_sm in (1, 2, 4):
                candidates[f"whole w{warps} {per_sm}/SM"] = dataclasses.replace(
                    whole, num_warps=warps, blocks_per_program=0,
                    grid=max(1, min(tokens, target.vector_cores * per_sm)))
            candidates[f"whole w{warps} 1 tok/program, D not constant"] = dataclasses.replace(
                whole, num_warps=warps, blocks_per_program=1, grid=tokens, constant_dim=False)
        results = []
        for name, plan in candidates.items():
            if time.monotonic() > DEADLINE:
                break
            try:
                err = (run(plan)[0].float() - ref).abs().max().item()
                results.append((_time(lambda: run(plan)), name, err))
            except Exception as e:  # noqa: BLE001
                print(f"  {name}: {type(e).__name__}: {str(e)[:120]}", flush=True)
        _report(case, nbytes, ceiling, results)


def main() -> None:
    parts = sys.argv[1:] or ["multi", "merge"]
    target = cuda_target(torch.device("cuda"))
    ceiling = measure_ceiling(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}: copy {ceiling:.2f} TB/s, {target.vector_cores} SMs, arch {target.arch}",
          flush=True)
    # Launch directly, as the op does (outside a triton_op body wrap_triton costs ~1 ms of host time a launch).
    with set_wrap_triton_enabled(False), torch.no_grad():
        for part in parts:
            {"multi": sweep_multi, "two-pass": sweep_two_pass, "merge": sweep_merge}[part](target, ceiling)


if __name__ == "__main__":
    main()
