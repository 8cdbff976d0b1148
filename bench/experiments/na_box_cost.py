"""What a query box costs neighborhood attention's kernels (issue 33: a context-parallel rank's op on its slab
against the extended keys runs slower per query than the single-GPU op): python -m bench.experiments.na_box_cost.
Per case, forward and forward+backward (do_bench medians, bf16): the whole axis, the slab's queries against the
extended keys (query_offset), the slab alone and the extended range alone as their own problems (no box)."""

import torch
import triton.testing

import fusedops


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=50, return_mode="median")


def case(name, heads, spatial, ks, slab, ext):
    """spatial: the whole grid; slab = (start, end) and ext = (lo, hi) on axis 0."""
    torch.manual_seed(0)
    shape = (1, heads, *spatial, 128)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    rest = [0] * (len(spatial) - 1)

    def views(a, b, c, d):
        qs, ks_, vs = (t.detach()[:, :, a:b].contiguous().requires_grad_() for t in (q, k, v))
        ke, ve = (t.detach()[:, :, c:d].contiguous().requires_grad_() for t in (k, v))
        return qs, ks_, vs, ke, ve

    qs, k_slab, v_slab, k_ext, v_ext = views(*slab, *ext)
    q_ext = q.detach()[:, :, ext[0]:ext[1]].contiguous().requires_grad_()
    rows = {
        "whole axis": (q, k, v, None),
        "slab vs extended keys (box)": (qs, k_ext, v_ext, [slab[0] - ext[0]] + rest),
        "slab alone": (qs, k_slab, v_slab, None),
        "extended range alone": (q_ext, k_ext, v_ext, None),
    }
    print(f"\n{name}: slab {slab}, extended {ext}")
    for label, (a, b, c, off) in rows.items():
        fwd = lambda: fusedops.neighborhood_attention(a, b, c, ks, query_offset=off)
        try:
            g = torch.randn_like(fwd())
        except ValueError as e:  # a slab shorter than the window is no problem of its own
            print(f"  {label:<30} n/a: {e}")
            continue
        t_f = bench(fwd)
        t_fb = bench(lambda: torch.autograd.grad(fwd(), (a, b, c), g))
        queries = a[0, 0, ..., 0].numel()
        print(f"  {label:<30} queries {queries:>7}  fwd {t_f:8.3f} ms ({t_f / queries * 1e6:7.2f} ns/query)  "
              f"fwd+bwd {t_fb:8.3f} ms ({t_fb / queries * 1e6:7.2f} ns/query)")


def main():
    print(torch.cuda.get_device_name())
    case("1D 131072, window 2048, H8", 8, (131072,), 2048, (32768, 65536), (31744, 66559))
    case("2D 256x256, window 80x80, H24", 24, (256, 256), (80, 80), (64, 128), (24, 167))


if __name__ == "__main__":
    main()
