"""attn_res forward against fla-core's fused_attnres on the grid shapes where fla is ahead (issue 31; bench/NOTES.md,
attn_res runs 16 and 18): the op as the grid calls it (with a norm weight) as planned and forced to each of the
depth-tile forward's row-load options (prefetch, neither, evict-first), with the weight folded into the query
beforehand, beside fla, each a CUDA-graph replay, in two alternating rounds. With --ncu the same
calls run once each inside an NVTX range "profile", for `ncu --nvtx --nvtx-include profile/` to read both kernels'
counters. do_bench_cudagraph leaves L2 warm between replays (a step not far past the L2's size then reads part of
its rows from it); --cold times each captured call with do_bench, which flushes L2 before every replay as the grid
does, and sweeps the depth-tile forward's rows a group (2, 4, 8) x warps (4, 8) x row loads (prefetch, evict-first,
both, neither), printing fla's autotuned config beside (FWD_VARIANTS="g2 w4 p;g4 w4 p": only those). Last run with
torch 2.11 + Triton 3.6 + fla-core 0.6.0 on an H200.

    python -m bench.experiments.attn_res_fwd_vs_fla [--ncu | --cold]"""

import os
import sys

import torch
import triton
import triton.testing

import fusedops
from fusedops.bench.common import measure_ceiling

SHAPES = [(6, 8192, 1536), (8, 2048, 3072), (12, 2048, 3072), (12, 32768, 2048), (9, 32768, 3072), (8, 8192, 2304),
          (6, 2048, 2048), (8, 2048, 1536), (16, 512, 2048), (9, 64, 3072), (9, 1, 3072), (12, 4096, 3072)]


def main():
    from fla.ops.attnres import fused_attnres

    dev = torch.device("cuda")
    shapes = SHAPES
    if os.environ.get("FLA_SHAPES"):
        shapes = [tuple(int(x) for x in c.split(",")) for c in os.environ["FLA_SHAPES"].split(";")]
    ncu = "--ncu" in sys.argv
    ceiling = 0.0 if ncu else measure_ceiling(dev)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__,
          f"copy {ceiling:.2f} TB/s", flush=True)
    for n, tokens, dim in shapes:
        v = torch.randn(n, tokens, dim, device=dev, dtype=torch.bfloat16)
        q = torch.randn(dim, device=dev, dtype=torch.bfloat16)
        w = torch.rand(dim, device=dev, dtype=torch.bfloat16) + 0.5
        qw = (q.float() * w.float()).to(torch.bfloat16)
        sources = list(v.unbind(0))

        def forced(**fields):
            def call():
                with fusedops.plan_override("attn_res", "forward", **fields):
                    return fusedops.attn_res(v, q, w)
            return call

        if "--cold" in sys.argv:
            cold_sweep(n, tokens, dim, v, q, w, sources, forced, fused_attnres, ceiling)
            continue
        calls = {"fusedops (v, q, w) planned": lambda: fusedops.attn_res(v, q, w),
                 "fusedops prefetch": forced(prefetch=True, evict_first=False),
                 "fusedops neither": forced(prefetch=False, evict_first=False),
                 "fusedops evict-first": forced(prefetch=False, evict_first=True),
                 "fusedops (v, q*w)": lambda: fusedops.attn_res(v, qw),
                 "fla (q, list, w)": lambda: fused_attnres(q, sources, w, rms_eps=1e-6)}
        for call in calls.values():
            call()  # compiles, fla's autotuning
        torch.cuda.synchronize()
        case = f"N{n} T{tokens} D{dim}"
        if ncu:
            with torch.cuda.nvtx.range("profile"):
                for call in calls.values():
                    call()
            torch.cuda.synchronize()
            continue
        nbytes = (n + 1) * tokens * dim * 2
        times = {name: [] for name in calls}
        for _ in range(2):
            for name, call in calls.items():
                times[name].append(triton.testing.do_bench_cudagraph(call, return_mode="median") * 1e3)
        for name, us in times.items():
            print(f"{case} {name}: {' / '.join(f'{t:.1f}' for t in us)} us "
                  f"({100 * nbytes / (min(us) * 1e-6) / (ceiling * 1e12):.1f}% of copy)", flush=True)


def cold_sweep(n, tokens, dim, v, q, w, sources, forced, fused_attnres, ceiling):
    from fla.ops.attnres import fused as fla_fused

    from fusedops.bench.common import cuda_graph

    calls = {"planned": lambda: fusedops.attn_res(v, q, w),
             "fla": lambda: fused_attnres(q, sources, w, rms_eps=1e-6)}
    wanted = os.environ.get("FWD_VARIANTS")  # e.g. "g2 w4 p;g4 w4 p": only these (and the planned call, and fla)
    for rows in (2, 4, 8):
        for warps in (4, 8):
            for name, prefetch, evict in (("p", 1, 0), ("e", 0, 1), ("pe", 1, 1), ("-", 0, 0)):
                if wanted and f"g{rows} w{warps} {name}" not in wanted.split(";"):
                    continue
                calls[f"g{rows} w{warps} {name}"] = forced(variant="depth_tile", block_n=rows, num_warps=warps,
                                                           prefetch=bool(prefetch), evict_first=bool(evict))
    nbytes = (n + 1) * tokens * dim * 2
    times = {}
    for name, call in calls.items():
        try:
            times[name] = triton.testing.do_bench(cuda_graph(call), return_mode="median") * 1e3
        except Exception as e:  # noqa: BLE001 - a forced plan that does not compile is reported, not fatal
            print(f"N{n} T{tokens} D{dim} {name}: {type(e).__name__}", flush=True)
    tuned = getattr(fla_fused.attnres_fwd_kernel, "cache", {})
    best = min((t, k) for k, t in times.items() if k not in ("planned", "fla"))
    print(f"N{n} T{tokens} D{dim} cold us: planned {times['planned']:.1f} "
          f"({100 * nbytes / (times['planned'] * 1e-6) / (ceiling * 1e12):.1f}% of copy), fla {times['fla']:.1f} "
          f"({list(tuned.values())[-1] if tuned else '?'}), best {best[1]} {best[0]:.1f}; all: "
          + ", ".join(f"{k} {t:.1f}" for k, t in times.items() if k not in ("planned", "fla")), flush=True)


if __name__ == "__main__":
    main()
