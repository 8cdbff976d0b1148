"""attn_res_multi's tensor-core backward (issue 37): its statistics kernel's tokens a step, feature tile and warps,
then its gradients kernel's feature tile, warps and token ranges, each forced with plan_override around the table's
row, the whole backward (bf16 values and grad_out, fp32 queries; gradients of both) timed as a CUDA-graph replay;
% of the copy bandwidth measured in the same run, counting (2N + M) U (values and grad_out read, grad_values
written; U = tokens x D x 2 bytes). The CUDA-core kernel it replaces (dot=False) is timed once per case beside it,
with the largest relative difference between the two (MB_OLD=0: not; MB_STATS=0: the statistics kernel as planned;
MB_GRADS=steps: the gradients kernel's tokens a step x warps x pipelining stages instead of its tiles, flat: the flat
gradients kernel's rows a step x tiles x warps, none: as planned). Last run with torch 2.11 + Triton 3.6 on an H200 and an H100.

    python -m bench.experiments.multi_backward_tiles"""

import os

import torch
import triton
import triton.testing

import fusedops
from fusedops.bench.common import measure_ceiling
from fusedops.block_attn_res.op import _multi_backward
from fusedops.block_attn_res.plan import multi_plan
from fusedops.targets import cuda_target

CASES = [(8, 24, 8192, 7168), (9, 6, 8192, 4096), (4, 16, 32768, 4096), (9, 16, 8192, 7168), (8, 24, 2048, 7168)]
STATS = [dict(block_t=bt, block_d=bd, num_warps=w) for bt in (4, 8, 16) for bd in (32, 64) for w in (4, 8)]
GRADS = [dict(block_d2=bd, out_warps=w) for bd in (32, 64) for w in (4, 8)]


def _kernel_times(case, run) -> None:
    """Device time of each kernel of one planned backward (torch.profiler, the median of 5 calls)."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            run()
        torch.cuda.synchronize()
    for event in prof.key_averages():
        if event.device_type.name == "CUDA" and event.count:
            print(f"{case} kernel {event.key[:60]}: {event.device_time_total / event.count / 1e3:.3f} ms x "
                  f"{event.count // 5}", flush=True)


def setup(cases_variable: str, cases: list) -> tuple:
    """(device, its target, the copy bandwidth measured now in TB/s, the cases: `cases` or the environment variable's
    "N,M,tokens,D;..."), with the device and versions printed."""
    dev = torch.device("cuda")
    ceiling = measure_ceiling(dev)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__,
          f"copy {ceiling:.2f} TB/s", flush=True)
    if os.environ.get(cases_variable):
        cases = [tuple(int(x) for x in c.split(",")) for c in os.environ[cases_variable].split(";")]
    return dev, cuda_target(dev), ceiling, cases


def main():
    dev, target, ceiling, cases = setup("MB_CASES", CASES)
    summary = []
    for n, m, tokens, dim in cases:
        values = torch.randn(n, tokens, dim, device=dev, dtype=torch.bfloat16)
        queries = 0.05 * torch.randn(m, dim, device=dev)
        grad_out = torch.randn(m, tokens, dim, device=dev, dtype=torch.bfloat16)
        nbytes = (2 * n + m) * tokens * dim * 2
        case = f"N{n} M{m} T{tokens} D{dim}"

        def run(**forced):
            with fusedops.plan_override("block_attn_res", "multi_bwd", **forced):
                return _multi_backward(grad_out, None, values, queries, 1e-6, True, True, target)

        def timed(label, **forced):
            try:
                got = run(**forced)
                ms = triton.testing.do_bench_cudagraph(lambda: run(**forced), return_mode="median")
            except Exception as e:  # noqa: BLE001 - a config that does not compile is reported, not fatal
                print(f"{case} {label}: {type(e).__name__} {str(e)[:120]}", flush=True)
                return float("inf"), None
            print(f"{case} {label}: {ms:.3f} ms {100 * nbytes / ms / 1e9 / ceiling:.1f}%", flush=True)
            return ms, got

        planned_ms, planned = timed("planned", **{})
        _kernel_times(case, run)
        plan = multi_plan(target, tokens, n, m, dim, 2, backward=True)
        old_ms, old = (timed("CUDA-core kernel (dot=False)", dot=False, grid=target.vector_cores)
                       if tokens <= 8192 and os.environ.get("MB_OLD", "1") == "1" else (float("nan"), None))
        if old is not None:
            diff = max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(planned, old))
            print(f"{case} relative difference tensor-core vs CUDA-core: {diff:.2e}", flush=True)
        stats = STATS if os.environ.get("MB_STATS", "1") == "1" else [dict(block_t=plan.block_t)]
        best_stats = min(((timed(f"stats {c}", **c)[0], str(c), c) for c in stats), key=lambda b: b[0])
        groups = sorted({max(1, target.vector_cores * k // -(-dim // 64)) for k in (1, 2, 4, 8)})
        grads = [dict(g, grid=p) for g in GRADS for p in groups]
        if os.environ.get("MB_GRADS") == "none":
            grads = [{}]
        if os.environ.get("MB_GRADS") == "flat":  # attn_res_multi_bwd_grads_flat_kernel: rows a step x tile x warps
            grads = [dict(grad_rows=r, block_d2=bd, out_warps=w) for r in (16, 32) for bd in (64, 128) for w in (4, 8)]
            grads += [dict(grad_rows=16, block_d2=64, out_warps=4, grid=p) for p in groups]
        if os.environ.get("MB_GRADS") == "steps":  # the gradients kernel's tokens a step, warps and stages
            grads = [dict(grad_tokens=bt, out_warps=w, grad_stages=st) for bt in (2, 4, 8) for w in (4, 8)
                     for st in (2, 3)]
        best_grads = min(((timed(f"grads {c} + {best_stats[1]}", **c, **best_stats[2])[0], str(c), c) for c in grads),
                         key=lambda b: b[0])
        pct = lambda ms, nbytes=nbytes: 100 * nbytes / ms / 1e9 / ceiling  # noqa: E731
        summary.append((case, plan, planned_ms, old_ms, best_stats, best_grads, pct))
        del values, grad_out, planned, old
        torch.cuda.empty_cache()
    print("\ncase | planned ms (% copy) | CUDA-core kernel ms | best stats config ms | best grads config ms")
    for case, plan, planned_ms, old_ms, (s_ms, s_cfg, _), (g_ms, g_cfg, _), pct in summary:
        print(f"{case} | {planned_ms:.3f} ({pct(planned_ms):.1f}%) bt{plan.block_t} bd{plan.block_d} w{plan.num_warps} "
              f"bd2 {plan.block_d2} w{plan.out_warps} grid {plan.grid} | {old_ms:.3f} | {s_ms:.3f} {s_cfg} | "
              f"{g_ms:.3f} ({pct(g_ms):.1f}%) {g_cfg}")


if __name__ == "__main__":
    main()
