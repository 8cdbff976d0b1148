"""embedding benchmark: fusedops vs F.embedding (eager and torch.compile) and Liger 0.8.5's
LigerEmbeddingFunction when importable. Cases (V, D, tokens) from issue #4, uniform random indices.

Bytes counted (the issue's floor): fwd 2*tokens*D (gather read + write), bwd V*D + tokens*D (grad_weight
written once + grad_out read), fwd+bwd V*D + 2*tokens*D; all times the element size.

Providers: "fusedops" is the default call (the kernel checks the indices with a device assert, no host
sync); "fusedops-host-check" passes check_bounds="host" (one aminmax + host sync per forward, the
debugging mode); "(GPU time)" rows give the device time of the same fwd+bwd step from the profiler (no
host overhead). The acceptance grid of shapes and index distributions is fusedops/bench/embedding_grid.py."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from fusedops.bench.common import Context, alternated_rows, fwd_bwd_fns, measure, optional_import

OP = "embedding"
CASES = [(32768, 768, 16384), (50257, 1600, 8192), (131072, 4096, 16384), (151936, 4096, 16384)]
CPU_CASES = [(4096, 256, 2048), (32768, 128, 1024)]
QUICK = {"cpu": [(1024, 64, 256)], "gpu": [(151936, 4096, 16384)]}
# Providers whose device time per fwd+bwd is also reported ("<name> (GPU time)", from the profiler):
# the small cases are host-bound in eager mode.
GPU_TIMED = ("fusedops", "torch", "torch.compile", "liger")
# Providers whose fwd+bwd steps are also timed in alternation (fusedops.bench.common.alternated_rows): the eager
# steps are host-bound or nearly so, and the host's speed drifts during a run.
ALTERNATED = ("fusedops", "torch", "liger")


def nbytes(v: int, d: int, tokens: int, esize: int) -> dict:
    return {
        "fwd": 2 * tokens * d * esize,
        "bwd": (v * d + tokens * d) * esize,
        "fwd+bwd": (v * d + 2 * tokens * d) * esize,
    }


def providers():
    import fusedops

    yield "fusedops", lambda w, i: fusedops.embedding(i, w)
    yield "fusedops-host-check", lambda w, i: fusedops.embedding(i, w, check_bounds="host")
    yield "torch", lambda w, i: F.embedding(i, w)
    compiled = torch.compile(lambda w, i: F.embedding(i, w), dynamic=False)
    yield "torch.compile", compiled

    def liger(w, i):
        mod = optional_import("liger_kernel.ops.experimental.embedding")
        return mod.LigerEmbeddingFunction.apply(w, i)

    yield "liger", liger


def run(ctx: Context) -> list[dict]:
    cases = ctx.cases_of(sys.modules[__name__])
    esize = torch.tensor([], dtype=ctx.dtype).element_size()
    rows = []
    for case in cases:
        v, d, tokens = case
        gen = torch.Generator(device="cpu").manual_seed(0)
        indices = torch.randint(0, v, (tokens,), generator=gen).to(ctx.device)
        weight = torch.randn(v, d, generator=gen).to(ctx.device, ctx.dtype).requires_grad_()
        counted = nbytes(v, d, tokens, esize)
        steps = {}
        for name, fn in providers():
            try:
                fns = fwd_bwd_fns(lambda fn=fn: fn(weight, indices), [weight])
            except Exception as e:  # noqa: BLE001
                rows += ctx.failed(OP, case, name, ("fwd", "bwd", "fwd+bwd"), e)
                continue
            for mode, f in fns.items():
                rows.append(measure(ctx, OP, case, name, mode, f, nbytes=counted[mode]))
            if ctx.device.type == "cuda" and name in GPU_TIMED:
                rows.append(measure(ctx, OP, case, name, "fwd+bwd", fns["fwd+bwd"], nbytes=counted["fwd+bwd"],
                                    gpu_time=True))
            if ctx.device.type == "cuda" and name in ALTERNATED and "error" not in rows[-1]:
                steps[name] = fns["fwd+bwd"]
            del fns
        if steps:
            rows += alternated_rows(ctx, OP, case, "fwd+bwd", steps, nbytes=counted["fwd+bwd"])
        del weight, indices, steps
        ctx.empty_cache()
    return rows


def sweep(cases=((151936, 4096, 16384), (32768, 768, 16384))) -> None:
    """Forward plan study on a GPU (not part of the table): kernel-only times of the forward under
    several CUDA tile sizes (the backward's: sweep_bwd).
    python -c "from fusedops.bench.embedding import sweep; sweep()" """
    import triton.testing

    from fusedops import plans
    from fusedops.bench.common import measure_ceiling
    from fusedops.embedding import plan as emb_plan
    from fusedops.embedding.kernels import embedding_fwd_kernel
    from fusedops.targets import target_for

    print(f"sweep copy ceiling {measure_ceiling(torch.device('cuda')):.3f} TB/s")
    for v, d, tokens in cases:
        gen = torch.Generator().manual_seed(0)
        weight = torch.randn(v, d, generator=gen).to("cuda", torch.bfloat16)
        idx = torch.randint(0, v, (tokens,), generator=gen).cuda()
        target = target_for(weight.device)
        out = torch.empty(tokens, d, device="cuda", dtype=torch.bfloat16)
        for tile_bytes, max_d in [(8192, 512), (16384, 1024), (32768, 2048)]:
            row = {"kernel": "fwd", "vendor": "cuda", "arch": target.arch or "*", "when": {"interpreted": False},
                   "params": {"tile_bytes": tile_bytes, "max_block_d": max_d, "min_rows": 1, "run_chunk": 256},
                   "run": "sweep"}
            with plans.candidate_rows("embedding", [row]):
                pf = emb_plan.make_plan(target, tokens, d, 2, backward=False)
            ms = triton.testing.do_bench(lambda: embedding_fwd_kernel[(pf.grid,)](
                idx, weight, out, tokens, v, d, 1, weight.stride(0), 1,
                BLOCK_T=pf.block_rows, BLOCK_D=pf.block_d, num_warps=pf.num_warps), return_mode="median")
            print(f"sweep {v},{d},{tokens} tile={tile_bytes} fwd[{pf.block_rows}x{pf.block_d} w{pf.num_warps}] "
                  f"{ms:.4f} ms {2 * tokens * d * 2 / ms / 1e9:.3f} TB/s", flush=True)


# Backward-kernel tile variants: (rows, features, warps, register cap); one program per work item.
BWD_VARIANTS = [(4, 1024, 4, 128), (4, 1024, 4, None), (4, 2048, 8, None), (8, 1024, 4, None), (4, 512, 2, None)]
# Whole-row feature blocks (block 0: next_pow2(D), the padding masked), for narrow rows: one run item per
# token instead of one per 256-wide block.
WHOLE_ROW_VARIANTS = [(4, 256, 2, None), (4, 0, 2, None), (4, 0, 4, None), (2, 0, 4, None), (4, 0, 8, None),
                      (8, 0, 4, None)]


def sweep_bwd(cases=((151936, 4096, 16384), (131072, 4096, 16384), (50257, 1600, 8192), (32768, 768, 16384)),
              variants=BWD_VARIANTS, evict: str = "", chunks=(64, 256, 1024)) -> None:
    """Backward-kernel tile variants (tile shape, warps, register cap), kernel-only, uniform and
    Zipf(1.1) indices, each result checked bitwise against the first; every variant twice, with the
    run items first (ZEROS_PER_RUN = 0, the v5 order) and interleaved with the zero tiles (the plan's);
    evict: the L2 eviction policy of the once-touched loads and stores (the kernel's EVICT); chunks: the
    longest run one program sums (longer runs are split and merged by embedding_bwd_merge_kernel).
    python -c "from fusedops.bench.embedding import sweep_bwd; sweep_bwd()" """
    import triton.testing

    from fusedops.bench.common import measure_ceiling
    from fusedops.embedding import op as emb_op
    from fusedops.embedding import plan as emb_plan
    from fusedops.embedding.kernels import embedding_bwd_kernel, embedding_bwd_merge_kernel
    from fusedops.targets import cuda_target

    target = cuda_target(torch.device("cuda"))
    ceiling = measure_ceiling(torch.device("cuda"))
    print(f"sweep_bwd copy ceiling {ceiling:.3f} TB/s")
    for v, d, tokens in cases:
        gen = torch.Generator().manual_seed(0)
        g = torch.randn(tokens, d, generator=gen).to("cuda", torch.bfloat16)
        probs = torch.arange(1, v + 1, dtype=torch.float64).pow(-1.1)
        indices = {
            "uniform": torch.randint(0, v, (tokens,), generator=gen).cuda(),
            "zipf1.1": torch.multinomial(probs / probs.sum(), tokens, replacement=True, generator=gen).cuda(),
        }
        nbytes = (v * d + tokens * d) * 2
        zeros = torch.empty(v, d, device="cuda", dtype=torch.bfloat16)
        ms = triton.testing.do_bench(zeros.zero_, return_mode="median")
        print(f"sweep_bwd {v},{d} memset of grad_weight (write-only reference): {ms:.4f} ms "
              f"{v * d * 2 / ms / 1e9:.3f} TB/s", flush=True)
        del zeros
        for dist, idx in indices.items():
            keys, perm, offsets = emb_op._sorted_runs(idx, v, target)
            ms = triton.testing.do_bench(lambda: emb_op._sorted_runs(idx, v, target), return_mode="median")
            print(f"sweep_bwd {v},{d},{tokens} {dist} sort + offsets {ms:.4f} ms", flush=True)
            first = None
            runs = []
            for rows, block_d, warps, maxnreg in variants:
                # the plan's padding rule (D = 768: 256 wide), or the whole row
                block_d = emb_plan._block_d(d, 8, block_d) if block_d else emb_plan.next_pow2(d)
                plan = emb_plan.Plan(rows, block_d, 0, warps)
                grid = plan.tiles(v, d) + tokens * -(-d // block_d)
                for mix, chunk in [(0, emb_plan.RUN_CHUNK)] + [(plan.zeros_per_run(v, tokens), c) for c in chunks]:
                    gw = torch.empty(v, d, device="cuda", dtype=torch.bfloat16)
                    part = torch.empty(2 * -(-tokens // chunk), d, device="cuda", dtype=torch.float32)
                    opts = dict(SCALE=False, BLOCK_R=rows, BLOCK_D=block_d, EVICT=evict, CHUNK=chunk, num_warps=warps,
                                **({"maxnreg": maxnreg} if maxnreg else {}))

                    def run(gw=gw, grid=grid, opts=opts, mix=mix, part=part, chunk=chunk, block_d=block_d, warps=warps):
                        embedding_bwd_kernel[(grid,)](g, keys, perm, offsets, gw, part, v, d, tokens, d, 1, -1, mix,
                                                      **opts)
                        embedding_bwd_merge_kernel[(-(-tokens // chunk) * -(-d // block_d),)](
                            part, keys, offsets, gw, v, d, tokens, -1, SCALE=False, BLOCK_D=block_d, CHUNK=chunk,
                            num_warps=warps)

                    runs.append((f"{rows}x{block_d} w{warps} maxnreg={maxnreg} zeros/run={mix} chunk={chunk}", gw,
                                 run))
            for name, gw, run in runs:
                run()
                same = first is None or torch.equal(first, gw)
                first = gw if first is None else first
                ms = triton.testing.do_bench(run, return_mode="median")
                print(f"sweep_bwd {v},{d},{tokens} {dist} {name}: {ms:.4f} ms "
                      f"{100 * nbytes / ms / 1e9 / ceiling:.0f}%{'' if same else ' DIFFERENT RESULT'}", flush=True)
