"""Probe: run detection for the embedding backward without torch.sort (CUDA). python -m bench.probe_sort

Every index is packed with its token position into one int64 ((clamped index + 1) << 32 | position), so
all values are distinct and any sort of them is the stable sort of the indices. Variants: one program
sorts everything (tl.sort), or chunks are sorted by tl.sort and placed by rank (each element's final
position = the number of smaller elements, counted by binary search in every sorted chunk)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
import triton.testing

from bench.common import gpu_kernel_times_us

PAD = 0x7FFFFFFFFFFFFFFF


@triton.jit
def _packed(idx_ptr, t, T, V):
    m = t < T
    k = tl.load(idx_ptr + t, mask=m, other=0).to(tl.int64)
    k = tl.minimum(tl.maximum(k, -1), V) + 1
    return tl.where(m, (k << 32) | t.to(tl.int64), 0x7FFFFFFFFFFFFFFF)


@triton.jit
def sort_one(idx_ptr, keys_ptr, perm_ptr, T, V, BLOCK: tl.constexpr):
    t = tl.arange(0, BLOCK)
    s = tl.sort(_packed(idx_ptr, t, T, V))
    m = t < T
    tl.store(keys_ptr + t, ((s >> 32) - 1).to(tl.int32), mask=m)
    tl.store(perm_ptr + t, s & 0xFFFFFFFF, mask=m)


@triton.jit
def sort_chunks(idx_ptr, tmp_ptr, T, V, C: tl.constexpr):
    t = tl.program_id(0) * C + tl.arange(0, C)
    tl.store(tmp_ptr + t, tl.sort(_packed(idx_ptr, t, T, V)))


@triton.jit
def place_by_rank(tmp_ptr, keys_ptr, perm_ptr, T, P, C: tl.constexpr, LOG_C: tl.constexpr):
    x = tl.load(tmp_ptr + tl.program_id(0) * C + tl.arange(0, C))
    rank = tl.zeros([C], tl.int32)
    for j in range(P):
        base = tmp_ptr + j * C
        pos = tl.zeros([C], tl.int32)
        for b in tl.static_range(LOG_C):
            step = C >> (b + 1)
            pos = tl.where(tl.load(base + pos + step - 1) < x, pos + step, pos)
        pos = tl.where(tl.load(base + pos) < x, pos + 1, pos)
        rank += pos
    real = x != 0x7FFFFFFFFFFFFFFF
    tl.store(keys_ptr + rank, ((x >> 32) - 1).to(tl.int32), mask=real)
    tl.store(perm_ptr + rank, x & 0xFFFFFFFF, mask=real)


def _us(fn):
    """Device microseconds per call (profiler), so that host launch time does not count."""
    return sum(gpu_kernel_times_us(fn, 20).values())


def main() -> None:
    dev = "cuda"
    for tokens, v in ((4096, 32768), (8192, 50257), (16384, 151936), (32768, 151936)):
        idx = torch.randint(0, v, (tokens,), device=dev)
        ref_keys, ref_perm = torch.sort(idx.to(torch.int32), stable=True)
        keys = torch.empty(tokens, device=dev, dtype=torch.int32)
        perm = torch.empty(tokens, device=dev, dtype=torch.int64)
        t_ref = _us(lambda: torch.sort(idx.to(torch.int32), stable=True)) / 1e3
        print(f"T={tokens}: torch.sort int32 stable {t_ref * 1e3:.1f} us", flush=True)
        for name, us in gpu_kernel_times_us(lambda: torch.sort(idx.to(torch.int32), stable=True), 20).items():
            print(f"    {us:6.1f} us {name[:90]}")
        block = triton.next_power_of_2(tokens)
        for warps in (8, 16, 32):
            if block > 16384 and warps < 16:
                continue
            try:
                fn = lambda: sort_one[(1,)](idx, keys, perm, tokens, v, BLOCK=block, num_warps=warps)
                keys.fill_(-7)
                fn()
                ok = torch.equal(keys, ref_keys) and torch.equal(perm, ref_perm)
                print(f"  one program w{warps}: {_us(fn):.1f} us"
                      f" {'ok' if ok else 'WRONG'}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"  one program w{warps}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
        for chunk in (512, 1024, 2048, 4096):
            for warps in (4, 8):
                p = -(-tokens // chunk)
                tmp = torch.empty(p * chunk, device=dev, dtype=torch.int64)

                def fn():
                    sort_chunks[(p,)](idx, tmp, tokens, v, C=chunk, num_warps=warps)
                    place_by_rank[(p,)](tmp, keys, perm, tokens, p, C=chunk, LOG_C=chunk.bit_length() - 1,
                                        num_warps=warps)
                try:
                    keys.fill_(-7)
                    fn()
                    ok = torch.equal(keys, ref_keys) and torch.equal(perm, ref_perm)
                    t_sort = _us(lambda: sort_chunks[(p,)](idx, tmp, tokens, v, C=chunk, num_warps=warps)) / 1e3
                    print(f"  chunks of {chunk} w{warps}: {_us(fn):.1f}"
                          f" us (chunk sort {t_sort * 1e3:.1f}) {'ok' if ok else 'WRONG'}", flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"  chunks of {chunk} w{warps}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)


if __name__ == "__main__":
    main()
