"""attn_res's online forward on wide rows whose D is not a power of two (issue 31: 61-62% of copy on the H200
at N=24, 2048 tokens, D=6144 and N=9, 32768 tokens, D=3072, where fla-core's forward reaches 76-82%): warps and
tokens a step forced with fusedops.plan_override, each timed as a CUDA-graph replay beside fla's, % of the copy
bandwidth measured in the same run. Last run with torch 2.11 + Triton 3.6 on an H200 and an H100.

    python -m bench.experiments.attn_res_wide_rows"""

import torch
import triton
import triton.testing

import fusedops
from fusedops.bench.common import cuda_graph, measure_ceiling, optional_import

SHAPES = [(24, 2048, 6144), (9, 32768, 3072), (9, 8192, 3584), (16, 512, 5120), (12, 32768, 4096), (8, 8192, 7168),
          (9, 4096, 7168)]


def main():
    dev = torch.device("cuda")
    ceiling = measure_ceiling(dev)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__,
          f"copy {ceiling:.2f} TB/s", flush=True)
    try:
        fla = optional_import("fla.ops.attnres").fused_attnres
    except Exception:  # noqa: BLE001
        fla = None
    for n, tokens, d in SHAPES:
        values = torch.randn(n, tokens, d, device=dev, dtype=torch.bfloat16)
        query = 0.1 * torch.randn(d, device=dev)
        weight = torch.ones(d, device=dev)
        nbytes = (n + 1) * tokens * d * 2
        rows = []
        with torch.no_grad():
            configs = [("planner", {})] + [(f"online w{w} bt{bt}", dict(variant="online", num_warps=w, block_t=bt))
                                           for w in (4, 8, 16) for bt in (1, 2)]
            ref = fusedops.attn_res(values, query, weight)
            for name, forced in configs:
                try:
                    with fusedops.plan_override("attn_res", "forward", **forced):
                        out = fusedops.attn_res(values, query, weight)
                        err = (out.float() - ref.float()).abs().max().item()
                        replay = cuda_graph(lambda: fusedops.attn_res(values, query, weight))
                    rows.append((triton.testing.do_bench(replay, warmup=10, rep=50), name, err))
                except Exception as e:  # noqa: BLE001
                    print(f"  {name}: {type(e).__name__}: {str(e)[:100]}", flush=True)
            if fla is not None:
                srcs = list(values.unbind(0))
                replay = cuda_graph(lambda: fla(query, srcs, weight, rms_eps=1e-6))
                rows.append((triton.testing.do_bench(replay, warmup=10, rep=50), "fla fused_attnres", 0.0))
        print(f"N={n} tokens={tokens} D={d}", flush=True)
        for ms, name, err in sorted(rows):
            print(f"  {ms:8.4f} ms {100 * nbytes / (ms * 1e-3) / (ceiling * 1e12):5.1f}% of copy  max|diff| {err:.3g}"
                  f"  {name}", flush=True)
        del values


if __name__ == "__main__":
    main()
