"""The neighborhood-attention acceptance grid (issue #32): fusedops against FlexAttention (torch.compile'd
flex_attention with the same neighbourhood as its block mask, built once per shape) on 1-D windows 3..4096
(causal sliding windows of 1024 and 4096 at 8K-32K tokens, dilation 1-8), 2-D 3x3..80x80 windows at
14x14..256x256 (dilation, causal axes), 3-D video shapes, head dims 32..256 and GQA; bf16.

python -m fusedops.bench.na_grid [--part I/K] [--out FILE.json]

Per shape: device time (profiler) of the forward and of a fwd+bwd step for both, and the eager wall clock of
the fwd+bwd step (triton.testing.do_bench: fusedops eager, Flex compiled), with fusedops' output checked
against Flex's. Prints one row per shape, then the worst / median ratio per comparison and the misses of the
issue's targets: never slower than Flex (forward, forward+backward), at least 2x Flex in forward+backward on
windows up to 33 (1-D) and 13x13 (2-D).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

import torch

from fusedops.bench.neighborhood_attention import neighborhood_mask_mod

# (B, H, H_kv, spatial, D, kernel, dilation, causal)
GRID = [
    (4, 16, 16, (8192,), 64, (3,), (1,), (False,)),
    (4, 16, 16, (8192,), 64, (7,), (4,), (False,)),
    (2, 16, 4, (8192,), 128, (13,), (2,), (False,)),
    (2, 16, 16, (16384,), 128, (33,), (1,), (False,)),
    (2, 8, 8, (16384,), 64, (33,), (8,), (False,)),
    (1, 8, 8, (16384,), 128, (129,), (1,), (False,)),
    (1, 8, 8, (32768,), 64, (513,), (2,), (False,)),
    (1, 32, 8, (8192,), 128, (1024,), (1,), (True,)),
    (1, 8, 8, (32768,), 128, (1024,), (1,), (True,)),
    (1, 8, 2, (32768,), 128, (4096,), (1,), (True,)),
    (1, 8, 8, (16384,), 96, (2048,), (1,), (False,)),
    (1, 4, 4, (32768,), 64, (4096,), (1,), (False,)),
    (1, 4, 4, (4096,), 256, (65,), (1,), (False,)),
    (8, 4, 4, (14, 14), 32, (3, 3), (1, 1), (False, False)),
    (8, 4, 4, (28, 28), 32, (7, 7), (1, 1), (False, False)),
    (4, 4, 4, (56, 56), 64, (7, 7), (2, 2), (False, False)),
    (4, 8, 8, (56, 56), 32, (9, 9), (1, 1), (False, False)),
    (2, 8, 8, (64, 64), 64, (13, 13), (1, 1), (False, False)),
    (2, 4, 4, (112, 112), 32, (7, 7), (4, 4), (False, False)),
    (1, 16, 16, (128, 128), 128, (13, 13), (1, 1), (False, False)),
    (1, 8, 2, (128, 128), 64, (31, 31), (1, 1), (False, False)),
    (1, 8, 8, (192, 192), 96, (21, 21), (3, 3), (False, False)),
    (1, 8, 8, (256, 256), 128, (31, 31), (1, 1), (False, False)),
    (1, 24, 24, (256, 256), 128, (80, 80), (1, 1), (False, False)),
    (2, 8, 8, (64, 64), 64, (11, 11), (1, 1), (False, True)),
    (2, 8, 8, (8, 16, 16), 64, (3, 3, 3), (1, 1, 1), (False, False, False)),
    (1, 16, 16, (16, 32, 32), 64, (7, 7, 7), (1, 1, 1), (False, False, False)),
    (1, 8, 8, (16, 32, 32), 128, (5, 5, 5), (1, 2, 2), (False, False, False)),
    (2, 8, 8, (8, 64, 64), 64, (3, 7, 7), (1, 1, 1), (True, False, False)),
    (1, 8, 4, (30, 48, 80), 128, (9, 9, 9), (1, 1, 1), (False, False, False)),
]


def label(case) -> str:
    b, h, hkv, spatial, d, kernel, dil, causal = case
    dims = "x".join(map(str, spatial))
    win = "x".join(map(str, kernel))
    extra = "".join([f" dil{'x'.join(map(str, dil))}" if any(x > 1 for x in dil) else "",
                     " causal" + "".join("1" if c else "0" for c in causal) if any(causal) else "",
                     f" kv{hkv}" if hkv != h else ""])
    return f"B{b} H{h} {dims} D{d} w{win}{extra}"


def small_window(case) -> bool:
    """Windows where the issue asks for 2x Flex in fwd+bwd: up to 33 (1-D) and 13x13 (2-D)."""
    kernel = case[5]
    return (len(kernel) == 1 and kernel[0] <= 33) or (len(kernel) == 2 and max(kernel) <= 13)


def flex_call(case, device):
    """Flex's compiled call on [B, H, *spatial, D] q, k, v with the case's neighbourhood as its block mask (built
    once) and GQA where H_kv < H."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    b, h, hkv, spatial, d, kernel, dil, causal = case
    tokens = math.prod(spatial)
    torch._dynamo.reset()
    # (an uncompiled mask builder materializes the tokens x tokens mask: fine up to 32K tokens, and no compile)
    mask = create_block_mask(neighborhood_mask_mod(spatial, kernel, dil, causal), None, None, tokens, tokens,
                             device=device, _compile=tokens > 32768)
    compiled = torch.compile(flex_attention)
    return lambda q, k, v: compiled(q.flatten(2, -2), k.flatten(2, -2), v.flatten(2, -2), block_mask=mask,
                                    enable_gqa=hkv != h).unflatten(2, spatial)


def measure(case) -> dict:
    import triton

    import fusedops
    from fusedops.bench.common import gpu_kernel_times_us

    b, h, hkv, spatial, d, kernel, dil, causal = case
    gen = torch.Generator(device="cuda").manual_seed(0)

    def make(heads):
        return torch.randn(b, heads, *spatial, d, device="cuda", dtype=torch.bfloat16, generator=gen)

    q, k, v = make(h), make(hkv), make(hkv)
    go = torch.randn_like(q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    providers = {
        "fusedops": lambda q, k, v: fusedops.neighborhood_attention(q, k, v, list(kernel), dilation=list(dil),
                                                                   is_causal=list(causal)),
        "flex": flex_call(case, q.device),
    }
    row: dict = {"case": label(case), "flops_fwd": 4.0 * b * h * math.prod(spatial) * math.prod(kernel) * d}
    outs = {}
    for name, fn in providers.items():
        def fwd(fn=fn):
            with torch.no_grad():
                return fn(q, k, v)

        def step(fn=fn):
            return torch.autograd.grad(fn(*leaves), leaves, go)

        outs[name] = fwd().float()
        step()
        row[f"{name}_fwd_us"] = sum(gpu_kernel_times_us(fwd, reps=5).values())
        row[f"{name}_step_us"] = sum(gpu_kernel_times_us(step, reps=3).values())
        row[f"{name}_step_wall_us"] = triton.testing.do_bench(step, warmup=5, rep=50) * 1e3
    row["diff"] = float((outs["fusedops"] - outs["flex"]).abs().max() / outs["flex"].abs().max())
    return row


RATIOS = [("fwd vs flex (GPU)", "fwd_us", 1.0, None), ("fwd+bwd vs flex (GPU)", "step_us", 1.0, None),
          ("fwd+bwd vs flex (wall)", "step_wall_us", 1.0, None),
          ("fwd+bwd vs flex, windows <= 33 / 13x13 (GPU)", "step_us", 2.0, small_window)]


def summarize(rows) -> list[str]:
    lines = ["", "neighborhood_attention grid summary (speed-up over Flex, higher is better)",
             f"{'comparison':48s} {'worst':>6s} {'median':>7s} {'target':>7s} {'misses':>7s}"]
    for title, key, target, select in RATIOS:
        picked = [r for r in rows if select is None or select(r["_case"])]
        ratios = [r[f"flex_{key}"] / r[f"fusedops_{key}"] for r in picked]
        if ratios:
            misses = sum(x < target for x in ratios)
            lines.append(f"{title:48s} {min(ratios):6.2f} {statistics.median(ratios):7.2f} {target:7.2f} "
                         f"{misses:3d}/{len(ratios)}")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", default="1/1", help="I/K: the I-th of K interleaved parts of the grid")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    i, k = map(int, args.part.split("/"))
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    print(f"{'case':48s} {'fwd us fo/flex':>22s} {'fwd+bwd us fo/flex':>24s} {'wall us fo/flex':>22s}  fo TF/s  diff",
          flush=True)
    rows = []
    for case in GRID[i - 1::k]:
        try:
            row = measure(case)
        except Exception as e:  # noqa: BLE001
            print(f"{label(case):48s} {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        rows.append(dict(row, _case=case))
        print(f"{row['case']:48s} {row['fusedops_fwd_us']:10.1f} {row['flex_fwd_us']:10.1f}  "
              f"{row['fusedops_step_us']:11.1f} {row['flex_step_us']:11.1f}  {row['fusedops_step_wall_us']:10.1f} "
              f"{row['flex_step_wall_us']:10.1f}  {3.5 * row['flops_fwd'] / row['fusedops_step_us'] / 1e6:6.0f}  "
              f"{row['diff']:.1e}", flush=True)
    print("\n".join(summarize(rows)))
    if args.out:
        with open(args.out, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "_case"} for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
