"""The embedding forward's tile shape on this GPU (issue #30: on the H200 the D=768 forward at 65536 tokens ran at
0.80x torch on the H100's plan row). For each case, the op's forward under fusedops.plan_override("embedding",
"fwd", block_rows=, block_d=, num_warps=) for every candidate tile, replayed from a CUDA graph (do_bench
medians, no host time), beside the planned tile and torch's F.embedding; bf16, uniform indices; the copy
bandwidth measured in the same run as the ceiling. Prints one line per case (planned, best, torch, each as
GB/s of gather traffic and % of copy), then the candidates' times relative to each case's best.
Last run: torch 2.11, Triton 3.6 (bench/NOTES.md, embedding, the forward's tiles).

python -m bench.experiments.embedding_fwd_tiles"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

CASES = [  # (V, D, tokens)
    (32000, 768, 8192), (151936, 768, 65536), (32000, 768, 131072),
    (50257, 1600, 8192), (50257, 1600, 65536),
    (128256, 2304, 16384), (256000, 2304, 131072),
    (151936, 4096, 16384), (151936, 4096, 65536), (256000, 8192, 16384),
]


def candidates(dim: int) -> list[tuple[int, int, int]]:
    """(rows, features, warps): feature blocks from 256 to the whole row (padding masked), tiles of 2K-32K
    elements, 2-16 warps at 8-64 elements a thread."""
    whole = 1 << (dim - 1).bit_length()
    out = []
    for block_d in (256, 512, 1024, 2048, 4096, 8192):
        if block_d > whole:
            continue
        for rows in (1, 2, 4, 8, 16, 32, 64):
            elements = rows * block_d
            if not 2048 <= elements <= 32768:
                continue
            for warps in (2, 4, 8, 16):
                if 8 <= elements // (32 * warps) <= 64:
                    out.append((rows, block_d, warps))
    return out


def replay_ms(fn) -> float:
    import triton.testing

    from fusedops.bench.embedding_grid import captured

    return triton.testing.do_bench(captured(fn), warmup=5, rep=25, return_mode="median")


def main() -> None:
    import fusedops
    from fusedops.bench.common import measure_ceiling
    from fusedops.embedding.plan import make_plan
    from fusedops.targets import target_for

    copy = measure_ceiling(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; copy {copy:.2f} TB/s", flush=True)
    cases = CASES if not os.environ.get("EMB_FWD_CASES") else [
        tuple(int(x) for x in c.split(",")) for c in os.environ["EMB_FWD_CASES"].split(";")]
    table = []
    for v, d, tokens in cases:
        gen = torch.Generator().manual_seed(v + d + tokens)
        weight = torch.randn(v, d, generator=gen).to("cuda", torch.bfloat16)
        idx = torch.randint(0, v, (tokens,), generator=gen).cuda()
        gbytes = 2 * tokens * d * 2 / 1e9  # rows read and written

        def fwd():
            return fusedops.embedding(idx, weight)

        want = F.embedding(idx, weight)
        planned = make_plan(target_for(weight.device), tokens, d, 2, backward=False)
        times = {}
        for rows, block_d, warps in candidates(d):
            with fusedops.plan_override("embedding", "fwd", block_rows=rows, block_d=block_d, num_warps=warps,
                                        grid=-(-tokens // rows) * -(-d // block_d)):
                if not torch.equal(fwd(), want):
                    raise AssertionError(f"{v},{d},{tokens} tile {rows}x{block_d} w{warps}: wrong rows")
                times[rows, block_d, warps] = replay_ms(fwd)
        plan_ms = replay_ms(fwd)
        torch_ms = replay_ms(lambda: F.embedding(idx, weight))
        best = min(times, key=times.get)
        pct = lambda ms: gbytes / ms / copy * 100  # noqa: E731 - % of copy
        print(f"{v},{d},{tokens}: planned {planned.block_rows}x{planned.block_d} w{planned.num_warps} "
              f"{plan_ms * 1e3:.1f} us ({pct(plan_ms):.1f}%), best {best[0]}x{best[1]} w{best[2]} "
              f"{times[best] * 1e3:.1f} us ({pct(times[best]):.1f}%), torch {torch_ms * 1e3:.1f} us "
              f"({pct(torch_ms):.1f}%)", flush=True)
        table.append(((v, d, tokens), times, plan_ms, torch_ms))
        del weight, idx, want
        torch.cuda.empty_cache()
    print("\ncandidates, time / the case's best (1.00 = best), cases in order; torch / best last")
    keys = sorted({k for _, times, _, _ in table for k in times})
    for k in keys:
        cells = [f"{times[k] / min(times.values()):5.2f}" if k in times else "    -" for _, times, _, _ in table]
        print(f"{k[0]:>3}x{k[1]:<5} w{k[2]:<3} " + " ".join(cells))
    print(f"{'planned':<15} " + " ".join(f"{p / min(t.values()):5.2f}" for _, t, p, _ in table))
    print(f"{'torch':<15} " + " ".join(f"{tt / min(t.values()):5.2f}" for _, t, _, tt in table))


if __name__ == "__main__":
    main()
