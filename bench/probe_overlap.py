"""Overlap probe for the embedding fwd+bwd step (CUDA): what a second stream could hide.
python -m bench.probe_overlap

The step's pieces are the forward gather (bandwidth-bound), the run detection (keys, sort, offsets:
latency-bound, ~45 us at 16K tokens) and the backward kernel (V x D stores + the runs' gathers). The
run detection needs only the indices, so it could run beside the forward on a side stream; the
backward's zero tiles and run items write disjoint rows, so they could run as two kernels on two
streams. Each variant is timed as a CUDA graph of raw launches (no host time) and eagerly, and its
grad_weight is compared bitwise with the current pipeline's.

  current      fwd; keys, sort, offsets; bwd (one kernel)                  (what the op does)
  det||fwd     [side: keys, sort, offsets] beside fwd; bwd (one kernel)
  det||fwd+2k  [side: detection] beside fwd; [side: run items] beside [main: zero tiles]
  2k serial    fwd; detection; zero tiles; run items (two kernels, one stream: the control)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
import triton.testing

from bench.common import measure_ceiling
from fusedops.embedding import op as emb
from fusedops.embedding.kernels import _run_item, _zero_tile, embedding_bwd_kernel, embedding_fwd_kernel
from fusedops.embedding.plan import make_plan
from fusedops.targets import cuda_target


@triton.jit
def _run_items(g_ptr, keys_ptr, perm_ptr, offs_ptr, gw_ptr, V, D, N, G_S0, G_S1, PAD,
               BLOCK_D: tl.constexpr, EVICT: tl.constexpr):
    """The run items of embedding_bwd_kernel alone: one program per (sorted position, feature block)."""
    _run_item(g_ptr, keys_ptr, perm_ptr, offs_ptr, gw_ptr, tl.program_id(0), V, D, N, G_S0, G_S1, PAD,
              False, BLOCK_D, EVICT)


@triton.jit
def _zero_tiles(offs_ptr, gw_ptr, V, D, PAD, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, EVICT: tl.constexpr):
    """The zero tiles of embedding_bwd_kernel alone: one program per (row block, feature block), with
    the few registers stores need (the op's kernel is compiled for its run branch's 125)."""
    _zero_tile(offs_ptr, gw_ptr, tl.program_id(0), V, D, PAD, BLOCK_R, BLOCK_D, EVICT)


class Step:
    """Raw launches of one fwd+bwd step over fixed buffers (so a CUDA graph can replay it)."""

    def __init__(self, v, d, tokens, idx, weight, grad_out):
        self.v, self.d, self.tokens = v, d, tokens
        self.idx, self.weight, self.g = idx, weight, grad_out
        self.target = cuda_target(weight.device)
        self.fplan = make_plan(self.target, tokens, d, 2, backward=False)
        self.bplan = make_plan(self.target, v, d, 2, backward=True, tokens=tokens)
        self.out = torch.empty(tokens, d, device=weight.device, dtype=weight.dtype)
        self.gw = torch.empty(v, d, device=weight.device, dtype=weight.dtype)
        self.side = torch.cuda.Stream(priority=-1)
        self.runs = None

    def forward(self):
        embedding_fwd_kernel[(self.fplan.grid,)](self.idx, self.weight, self.out, self.tokens, self.v, self.d,
                                                 self.idx.stride(0), self.weight.stride(0), self.weight.stride(1),
                                                 BLOCK_T=self.fplan.block_rows, BLOCK_D=self.fplan.block_d,
                                                 num_warps=self.fplan.num_warps)

    def detect(self):
        self.runs = emb._sorted_runs(self.idx, self.v, self.target)

    def backward_one(self):
        keys, perm, offs = self.runs
        p = self.bplan
        embedding_bwd_kernel[(p.grid,)](self.g, keys, perm, offs, self.gw, self.v, self.d, self.tokens,
                                        self.g.stride(0), self.g.stride(1), -1, p.zeros_per_run(self.v, self.tokens),
                                        SCALE=False, BLOCK_R=p.block_rows, BLOCK_D=p.block_d, EVICT=p.evict,
                                        num_warps=p.num_warps, maxnreg=p.max_registers)

    def zeros(self):
        p = self.bplan
        _zero_tiles[(p.tiles(self.v, self.d),)](self.runs[2], self.gw, self.v, self.d, -1,
                                                BLOCK_R=p.block_rows, BLOCK_D=p.block_d, EVICT=p.evict,
                                                num_warps=p.num_warps)

    def run_items(self):
        keys, perm, offs = self.runs
        p = self.bplan
        _run_items[(self.tokens * -(-self.d // p.block_d),)](self.g, keys, perm, offs, self.gw, self.v, self.d,
                                                             self.tokens, self.g.stride(0), self.g.stride(1), -1,
                                                             BLOCK_D=p.block_d, EVICT=p.evict,
                                                             num_warps=p.num_warps, maxnreg=p.max_registers)

    def on_side(self, fn):
        main = torch.cuda.current_stream()
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            fn()
        return self.side

    def current(self):
        self.forward()
        self.detect()
        self.backward_one()

    def det_beside_fwd(self):
        side = self.on_side(self.detect)
        self.forward()
        torch.cuda.current_stream().wait_stream(side)
        self.backward_one()

    def det_beside_fwd_two_kernels(self):
        main = torch.cuda.current_stream()
        side = self.on_side(self.detect)
        self.forward()
        main.wait_stream(side)  # zero tiles need the offsets
        side.wait_stream(main)  # run items need grad_out (here: the forward's position in the stream)
        with torch.cuda.stream(side):
            self.run_items()
        self.zeros()
        main.wait_stream(side)

    def two_kernels_serial(self):
        self.forward()
        self.detect()
        self.zeros()
        self.run_items()


def graph_ms(fn):
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(graph.replay, return_mode="median")


def zipf_indices(v, tokens, a, dev):
    """Zipf(a) over the vocabulary, as bench.embedding.sweep_bwd draws it (rank r names row r)."""
    probs = torch.arange(1, v + 1, dtype=torch.float64).pow(-a)
    return torch.multinomial(probs / probs.sum(), tokens, replacement=True).to(dev)


def main() -> None:
    dev = torch.device("cuda")
    ceiling = measure_ceiling(dev)
    print(f"copy ceiling {ceiling:.2f} TB/s")
    variants = ("current", "det_beside_fwd", "det_beside_fwd_two_kernels", "two_kernels_serial")
    for v, d, tokens in ((151936, 4096, 16384), (131072, 4096, 16384), (50257, 1600, 8192), (32768, 768, 16384)):
        floor_ms = (v * d + 2 * tokens * d) * 2 / ceiling / 1e9
        weight = torch.randn(v, d, device=dev, dtype=torch.bfloat16)
        grad_out = torch.randn(tokens, d, device=dev, dtype=torch.bfloat16)
        for dist in ("uniform", "zipf1.1"):
            if dist == "uniform":
                idx = torch.randint(0, v, (tokens,), device=dev)
            else:
                idx = zipf_indices(v, tokens, 1.1, dev)
            step = Step(v, d, tokens, idx, weight, grad_out)
            step.current()
            torch.cuda.synchronize()
            expected = step.gw.clone()
            for name in variants:
                fn = getattr(step, name)
                step.gw.fill_(float("nan"))
                fn()
                torch.cuda.synchronize()
                same = torch.equal(step.gw, expected)
                g_ms = graph_ms(fn)
                e_ms = triton.testing.do_bench(fn, return_mode="median")
                print(f"V={v} D={d} T={tokens} {dist:8s} {name:28s} graph {g_ms:.4f} ms ({g_ms / floor_ms:.3f}x floor)"
                      f"  eager {e_ms:.4f}  bitwise {'equal' if same else 'DIFFERENT'}", flush=True)

if __name__ == "__main__":
    main()
