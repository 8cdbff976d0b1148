"""The sort-free scan backward of small batches (issue #30) against the sort path, each forced with
fusedops.plan_override("embedding", "bwd", scan_tokens=...), and torch's F.embedding, bf16, uniform and
Zipf(1.1) indices. Per case and path: the backward op alone and the eager fwd+bwd step, as
triton.testing.do_bench medians of eager calls (wall clock: host time included where a step is
host-bound) and of a CUDA-graph replay (no host cost: close to device time), plus the step's host time;
the two paths' grad_weight must be bitwise equal. One line per case as it is measured, then a table of
ratios (> 1: the scan path is faster). Runs in about 2-4 minutes on an H100. EMB_SCAN_CASES and EMB_SCAN_DISTS
(see main) pick other cases, e.g. padded batches.

python -m bench.experiments.embedding_scan_backward"""

from __future__ import annotations

import os
import statistics
import sys

import torch
import torch.nn.functional as F

CASES = [  # (V, D, tokens): every value of each axis, the scan threshold's neighbourhood most
    (32000, 768, 512), (32000, 4096, 2048), (32000, 2304, 8192),
    (50257, 768, 2048), (50257, 2304, 4096), (50257, 4096, 512),
    (151936, 4096, 4096), (151936, 768, 8192), (151936, 2304, 2048),
    (256000, 2304, 512), (256000, 768, 4096), (256000, 4096, 8192),
]
DISTRIBUTIONS = ("uniform", "zipf1.1")  # also "padNN": uniform, the last NN% of the tokens index 0 (padding
# without padding_idx: one long run, which the scan path sums in one program)
PATHS = {"scan": dict(scan_tokens=2**31 - 1), "sort": dict(scan_tokens=0)}
MEASURES = ("bwd", "bwd graph", "step", "step graph")


def bench_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=30, return_mode="median")


def timings(bwd, step) -> dict:
    """do_bench medians (ms) of the backward alone and of the step, eager and replayed from a CUDA graph,
    and the step's host time."""
    from fusedops.bench.embedding_grid import captured
    from fusedops.bench.host import host_ms

    return {"bwd": bench_ms(bwd), "bwd graph": bench_ms(captured(bwd)), "step": bench_ms(step),
            "step graph": bench_ms(captured(step)), "step host": host_ms(step)}


def time_fusedops(path: str, weight, idx, grad_out) -> tuple[dict, torch.Tensor]:
    """Timings of fusedops on `path` ("scan" or "sort", forced for forward and backward alike; the
    backward of a step made inside the block is forced too), and the step's grad_weight."""
    import fusedops
    from fusedops.embedding.op import embedding_backward_op

    num_weights = weight.shape[0]
    with fusedops.plan_override("embedding", "bwd", **PATHS[path]):
        def bwd():
            return embedding_backward_op(grad_out, idx, num_weights, None, False)

        def step():
            return torch.autograd.grad(fusedops.embedding(idx, weight), [weight], grad_out)

        return timings(bwd, step), step()[0]


def time_torch(weight, idx, grad_out) -> dict:
    num_weights = weight.shape[0]

    def bwd():
        return torch.ops.aten.embedding_backward(grad_out, idx, num_weights, -1, False, False)

    def step():
        return torch.autograd.grad(F.embedding(idx, weight), [weight], grad_out)

    return timings(bwd, step)


def run_case(v: int, d: int, tokens: int, dist: str) -> dict:
    from fusedops.bench.embedding_grid import indices

    gen = torch.Generator().manual_seed(v * 7 + d * 3 + tokens)
    torch.manual_seed(v + d + tokens)
    weight = torch.randn(v, d, device="cuda", dtype=torch.bfloat16).requires_grad_()
    grad_out = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16)
    idx = padded(v, tokens, int(dist[3:]), gen) if dist.startswith("pad") else indices(v, tokens, dist, gen)
    idx = idx.cuda()
    scan, scan_grad = time_fusedops("scan", weight, idx, grad_out)
    sort, sort_grad = time_fusedops("sort", weight, idx, grad_out)
    return dict(case=(v, d, tokens, dist), scan=scan, sort=sort, torch=time_torch(weight, idx, grad_out),
                bitwise=torch.equal(scan_grad, sort_grad))


def padded(v: int, tokens: int, percent: int, gen: torch.Generator) -> torch.Tensor:
    idx = torch.randint(0, v, (tokens,), generator=gen)
    idx[tokens - tokens * percent // 100:] = 0
    return idx


def print_case(r: dict) -> None:
    v, d, tokens, dist = r["case"]
    cols = " | ".join(f"{key} " + " ".join(f"{r[p][key] * 1e3:7.1f}" for p in ("scan", "sort", "torch"))
                      for key in ("bwd", "bwd graph", "step", "step graph", "step host"))
    print(f"{v:>6} {d:>4} {tokens:>5} {dist:>8} | {cols} | {'bitwise' if r['bitwise'] else 'BITS DIFFER'}",
          flush=True)


def print_ratios(rows: list[dict]) -> None:
    """sort/scan per measure, torch/scan for the steps, and their medians per token count."""
    heads = [f"sort/scan {k}" for k in MEASURES] + ["torch/scan step", "torch/scan step graph"]
    print(f"\n{'V':>6} {'D':>4} {'tokens':>6} {'dist':>8} " + " ".join(f"{h:>{len(h)}}" for h in heads) + "  bits")

    def ratios(r):
        return [r["sort"][k] / r["scan"][k] for k in MEASURES] + [r["torch"][k] / r["scan"][k] for k in MEASURES[2:]]

    for r in rows:
        v, d, tokens, dist = r["case"]
        print(f"{v:>6} {d:>4} {tokens:>6} {dist:>8} "
              + " ".join(f"{x:>{len(h)}.2f}" for h, x in zip(heads, ratios(r))) + f"  {'=' if r['bitwise'] else 'DIFF'}")
    for tokens in sorted({r["case"][2] for r in rows}):
        some = [ratios(r) for r in rows if r["case"][2] == tokens]
        medians = [statistics.median(col) for col in zip(*some)]
        print(f"{'median':>6} {'':>4} {tokens:>6} {'':>8} " + " ".join(f"{x:>{len(h)}.2f}" for h, x in zip(heads, medians)))
    differ = [r["case"] for r in rows if not r["bitwise"]]
    print(f"\n{len(rows) - len(differ)}/{len(rows)} cases bitwise equal between the paths"
          + (f"; DIFFER: {differ}" if differ else ""))


def main() -> None:
    """EMB_SCAN_CASES="V,D,tokens;..." and EMB_SCAN_DISTS="uniform,pad50,..." replace CASES and DISTRIBUTIONS."""
    cases = ([tuple(int(x) for x in c.split(",")) for c in os.environ["EMB_SCAN_CASES"].split(";")]
             if os.environ.get("EMB_SCAN_CASES") else CASES)
    dists = os.environ["EMB_SCAN_DISTS"].split(",") if os.environ.get("EMB_SCAN_DISTS") else DISTRIBUTIONS
    print("us, do_bench medians; per measure: scan, sort, torch (the step's host time last)")
    rows = []
    for v, d, tokens in cases:
        for dist in dists:
            rows.append(run_case(v, d, tokens, dist))
            print_case(rows[-1])
        torch.cuda.empty_cache()
    print_ratios(rows)
    if any(not r["bitwise"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("embedding_scan_backward needs a CUDA GPU")
    main()
