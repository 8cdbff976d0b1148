"""How a context-parallel rank assembles its extended keys (issue 33; torch 2.11, Triton 3.6 when last run): the
slab copied into a strided range of a fresh extended tensor (context_parallel.extend's plain layout) against one
torch.cat of the halo pieces and the slab, and a contiguous copy of the same bytes as the ceiling.
python -m bench.experiments.cp_slab_copy; do_bench medians, bf16."""

import torch
import triton.testing


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")


def case(name, shape, dim, left, right):
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    halo = []
    for rows in (left, right):
        s = list(shape)
        s[dim] = rows
        halo.append(torch.randn(s, device="cuda", dtype=torch.bfloat16))
    ext_shape = list(shape)
    ext_shape[dim] += left + right
    ext = torch.empty(ext_shape, device="cuda", dtype=torch.bfloat16)
    flat = torch.empty_like(x)

    def strided():  # the slab into the middle of the extended tensor, then the halo rows
        ext.narrow(dim, left, shape[dim]).copy_(x)
        ext.narrow(dim, 0, left).copy_(halo[0])
        ext.narrow(dim, left + shape[dim], right).copy_(halo[1])

    def cat():
        return torch.cat([halo[0], x, halo[1]], dim)

    torch.testing.assert_close(cat(), (strided(), ext)[1], rtol=0, atol=0)
    mb = 2 * ext.numel() * ext.element_size() / 1e6  # read and written
    times = {"strided copy_": bench(strided), "torch.cat": bench(cat), "contiguous copy (ceiling)":
             bench(lambda: flat.copy_(x)) * ext.numel() / x.numel()}
    for label, ms in times.items():
        print(f"{name:28s} {label:26s} {1e3 * ms:8.1f} us {mb / ms / 1e3:6.2f} TB/s", flush=True)


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__)
    case("1-D 32K slab, 2x2047 halo", (1, 8, 32768, 128), 2, 2047, 2047)
    case("1-D 64K slab, 2047 halo", (1, 8, 65536, 128), 2, 0, 2047)
    case("2-D 64x256 slab, 2x40 halo", (1, 24, 64, 256, 128), 2, 40, 40)
