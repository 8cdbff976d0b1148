"""Headroom probe for the embedding backward (CUDA): how fast can V x D be written, and what do the
sort's pieces cost. python -m bench.probe_embedding

Prints do_bench medians (ms) and rates as a % of the device-to-device copy measured in the same run:
torch's memset of grad_weight's bytes, a Triton store-only kernel over the same bytes at several tile
shapes, the backward kernel as planned, and the pieces of the run detection (sort, searchsorted)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
import triton.testing

from bench.common import measure_ceiling
from fusedops.embedding import op as emb
from fusedops.targets import cuda_target


@triton.jit
def _store_zeros(out_ptr, V, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    d_blocks = tl.cdiv(D, BLOCK_D)
    tiles = tl.cdiv(V, BLOCK_R) * d_blocks
    for tile in range(pid, tiles, tl.num_programs(0)):
        rb = tile // d_blocks
        cols = (tile - rb * d_blocks).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)[None, :]
        rows = rb.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
        tl.store(out_ptr + rows * D + cols, tl.zeros([BLOCK_R, BLOCK_D], out_ptr.dtype.element_ty),
                 mask=(rows < V) & (cols < D))


def _ms(fn):
    return triton.testing.do_bench(fn, return_mode="median")


def main() -> None:
    dev = torch.device("cuda")
    ceiling = measure_ceiling(dev)
    print(f"copy ceiling {ceiling:.2f} TB/s")
    v, d, tokens = 151936, 4096, 16384
    gw = torch.empty(v, d, device=dev, dtype=torch.bfloat16)
    nbytes = gw.numel() * 2

    def show(label, ms, nb=nbytes):
        print(f"{label}: {ms:.4f} ms {nb / ms / 1e9:.2f} TB/s {100 * nb / ms / 1e9 / ceiling:.1f}% of copy", flush=True)

    show("memset (zero_)", _ms(lambda: gw.zero_()))
    for rows, bd, warps, per_sm in ((4, 1024, 4, 0), (8, 1024, 4, 0), (8, 1024, 8, 0), (16, 1024, 8, 0),
                                    (4, 1024, 4, 8), (8, 1024, 8, 4), (16, 1024, 8, 2), (32, 1024, 16, 1)):
        tiles = -(-v // rows) * -(-d // bd)
        grid = tiles if not per_sm else 132 * per_sm
        show(f"triton zeros {rows}x{bd} w{warps} grid {grid}",
             _ms(lambda: _store_zeros[(grid,)](gw, v, d, BLOCK_R=rows, BLOCK_D=bd, num_warps=warps)))
    target = cuda_target(dev)
    g = torch.randn(tokens, d, device=dev, dtype=torch.bfloat16)
    for name, idx in (("uniform", torch.randint(0, v, (tokens,), device=dev)),):
        show(f"backward op {name}", _ms(lambda: emb._backward(g, idx, v, -1, False, target)), nbytes + g.numel() * 2)
        flat = idx.reshape(-1)
        show("sort int32 stable + perm", _ms(lambda: torch.sort(flat.to(torch.int32), stable=True)), 1)
        show("sort int64 stable + perm", _ms(lambda: torch.sort(flat, stable=True)), 1)
        packed = (flat.to(torch.int64) << 14) | torch.arange(tokens, device=dev)
        show("sort packed int64 keys only", _ms(lambda: torch.sort(packed)), 1)
        p32 = packed.to(torch.int32)
        show("sort packed int32 keys only (wraps; timing only)", _ms(lambda: torch.sort(p32)), 1)
        keys, perm, offsets = emb._sorted_runs(flat, v, target)
        show("_sorted_runs (keys, sort, offsets)", _ms(lambda: emb._sorted_runs(flat, v, target)), 1)
        bounds = torch.arange(v + 1, dtype=torch.int32, device=dev)
        show("searchsorted alone", _ms(lambda: torch.searchsorted(keys, bounds)), 1)


if __name__ == "__main__":
    main()
