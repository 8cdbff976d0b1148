"""Neighborhood attention at the large windows of issue #32 (B=1, D=128, bf16): device us of the forward
kernel and of the two backward kernels per launch setting, with and without the unmasked inside boxes
(Plan.unmasked_inside), each setting's results checked against the first one's.

Settings: "bm/bn[/warps[/stages]]" (bench/NOTES.md notation) or "plan", with "+i" for unmasked_inside and, for the
dK/dV kernel, "+u" / "+w" for its walk without / with the per-chunk test (walk_tests), "+c" for dK as [D, keys]
(dk_by_keys False) and "+k" for scores as [keys, queries] (keys_major); backward settings are "dq setting|dkdv setting".
Usage: python -m bench.experiments.na_large_windows [--cases 0,2] [--what fwd,bwd,flex] [--fwd "..."] [--bwd "..."]
"""

from __future__ import annotations

import argparse
import contextlib
import math

import torch

import fusedops
from fusedops.bench.common import gpu_kernel_times_us
from fusedops.bench.na_grid import flex_call
from fusedops.neighborhood_attention.plan import OP, tiles_from_string

# (label, heads, spatial, kernel, stride, causal[, head dim (128)])
CASES = [
    ("1D 32K w2048", 1, (32768,), (2048,), (1,), (False,)),
    ("1D 32K w2048 s256", 1, (32768,), (2048,), (256,), (False,)),
    ("1D 8K causal w1024 H32", 32, (8192,), (1024,), (1,), (True,)),
    ("2D 256^2 w80^2 H24", 24, (256, 256), (80, 80), (1, 1), (False, False)),
    ("2D 256^2 w80^2 s16 H24", 24, (256, 256), (80, 80), (16, 16), (False, False)),
    ("3D 30x48x80 w18x24x24 H24", 24, (30, 48, 80), (18, 24, 24), (1, 1, 1), (False,) * 3),
    ("3D 30x48x80 w18x24x24 s16x8x8 H24", 24, (30, 48, 80), (18, 24, 24), (16, 8, 8), (False,) * 3),
    ("1D 16K w129 H16", 16, (16384,), (129,), (1,), (False,)),
    ("1D 16K w513 H16", 16, (16384,), (513,), (1,), (False,)),
    ("1D 32K w2048 D64 H4", 4, (32768,), (2048,), (1,), (False,), 64),
    ("1D 16K w257 D64 H8", 8, (16384,), (257,), (1,), (False,), 64),
    ("2D 128^2 w31^2 H16", 16, (128, 128), (31, 31), (1, 1), (False, False)),
    ("2D 256^2 w80^2 D64 H24", 24, (256, 256), (80, 80), (1, 1), (False, False), 64),
    ("1D 32K w4096 D64 H4", 4, (32768,), (4096,), (1,), (False,), 64),
    ("1D 16K w1024 D32 H8", 8, (16384,), (1024,), (1,), (False,), 32),
    ("1D 32K w513 D64 H8", 8, (32768,), (513,), (1,), (False,), 64),
]
FWD = {
    1: ["", "+i", "1,1,128/1,1,64/8+i", "1,1,128/1,1,128/8+i", "1,1,64/1,1,64/4+i", "1,1,128/1,1,32/8+i",
        "1,1,128/1,1,64/4+i", "1,1,64/1,1,128/4+i"],
    2: ["", "+i", "1,8,16/1,8,8/8+i", "1,16,8/1,8,16/8+i", "1,8,16/1,8,16/8+i", "1,8,8/1,8,16/4+i",
        "1,16,16/1,8,8/8+i"],
    3: ["", "+i", "2,8,8/2,4,8/8+i", "4,4,8/2,4,8/8+i", "2,4,16/2,4,8/8+i", "4,4,8/4,4,8/8+i"],
}
BWD = {
    1: ["|", "+i|+i", "1,1,128/1,1,32/4+i|1,1,32/1,1,128/4+i", "1,1,128/1,1,64/8+i|1,1,64/1,1,128/8+i",
        "1,1,64/1,1,64/4+i|1,1,64/1,1,64/4+i", "1,1,128/1,1,32/8+i|1,1,32/1,1,128/8+i",
        "1,1,64/1,1,32/4+i|1,1,32/1,1,64/4+i", "1,1,128/1,1,64/8/2+i|1,1,64/1,1,128/8/2+i",
        "1,1,128/1,1,128/8+i|1,1,128/1,1,128/8+i", "1,1,64/1,1,128/4+i|1,1,128/1,1,64/8+i"],
    2: ["|", "+i|+i", "1,8,8/1,8,8/4+i|1,8,8/1,8,8/4+i", "1,8,16/1,8,8/8+i|1,8,8/1,8,16/8+i",
        "1,8,8/1,16,2/4+i|1,16,4/1,8,8/4+i", "1,8,8/1,8,16/4+i|1,4,8/1,8,16/4+i", "1,8,16/1,4,8/4+i|1,4,8/1,8,16/4+i",
        "1,8,8/1,4,8/4+i|1,4,8/1,8,8/4+i"],
    3: ["|", "+i|+i"],
}


FWD_SETTINGS: list = []
BWD_SETTINGS: list = []


def _override(kernel: str, setting: str) -> dict:
    tiles, *flags = setting.split("+")
    tiles = "" if tiles == "plan" else tiles
    params = tiles_from_string(tiles) if tiles else {}
    if "i" in flags:
        params["unmasked_inside"] = True
    if "u" in flags:
        params["walk_tests"] = False
    if "w" in flags:
        params["walk_tests"] = True
    if "c" in flags:
        params["dk_by_keys"] = False
    if "k" in flags:
        params["keys_major"] = True
    if kernel == "bwd":
        params["fused_block"] = 0
    return params


@contextlib.contextmanager
def forced(fwd: str = "", dq: str = "", dkdv: str = ""):
    with contextlib.ExitStack() as stack:
        for kernel, setting in (("fwd", fwd), ("bwd", dq), ("dkdv", dkdv)):
            params = _override(kernel, setting)
            if params:
                stack.enter_context(fusedops.plan_override(OP, kernel, **params))
        yield


def _rel(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6))


def flex_step(spatial, kernel, causal, q, k, v, go):
    """Flex's compiled forward and fwd+bwd step with the same neighbourhood (stride 1, dilation 1) as its mask."""
    call = flex_call((1, q.shape[1], k.shape[1], spatial, q.shape[-1], kernel, (1,) * len(spatial), causal), q.device)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def fwd():
        with torch.no_grad():
            return call(q, k, v)

    def step():
        return torch.autograd.grad(call(*leaves), leaves, go)

    return fwd, step


def run_case(case, what) -> list[str]:
    label, h, spatial, kernel, stride, causal, d = (*case, 128)[:7]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, h, *spatial, d, device="cuda", dtype=torch.bfloat16, generator=gen)
               for _ in range(3))
    go = torch.randn_like(q)
    flops = 4.0 * h * math.prod(spatial) * math.prod(kernel) * d
    args = dict(kernel_size=list(kernel), stride=list(stride), is_causal=list(causal))
    rows = []
    if "flex" in what and all(x == 1 for x in stride):
        fwd, step = flex_step(spatial, kernel, causal, q, k, v, go)
        fwd(), step()
        f_us, s_us = sum(gpu_kernel_times_us(fwd, reps=5).values()), sum(gpu_kernel_times_us(step, reps=3).values())
        rows.append(f"{label:34s} flex fwd {f_us:10.1f} us {flops / f_us / 1e6:6.0f} TF/s   fwd+bwd {s_us:10.1f} us "
                    f"{3.5 * flops / s_us / 1e6:6.0f} TF/s")
        print(rows[-1], flush=True)
    if "fwd" in what:
        ref = None
        for setting in FWD_SETTINGS or FWD[len(spatial)]:
            try:
                with forced(fwd=setting), torch.no_grad():
                    def fn():
                        return fusedops.neighborhood_attention(q, k, v, **args)
                    out = fn()
                    ref = out if ref is None else ref
                    us = sum(gpu_kernel_times_us(fn, reps=5).values())
                rows.append(f"{label:34s} fwd  {setting or '(plan)':42s} {us:10.1f} us {flops / us / 1e6:6.0f} TF/s "
                            f"diff {_rel(out, ref):.1e}")
            except Exception as e:  # noqa: BLE001
                rows.append(f"{label:34s} fwd  {setting:42s} {type(e).__name__}: {str(e)[:100]}")
            print(rows[-1], flush=True)
    if "bwd" in what:
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        ref = None
        for setting in BWD_SETTINGS or BWD[len(spatial)]:
            dq_set, _, dkdv_set = setting.partition("|")
            try:
                with forced(dq=dq_set, dkdv=dkdv_set):
                    def step():
                        return torch.autograd.grad(fusedops.neighborhood_attention(qg, kg, vg, **args), (qg, kg, vg),
                                                   go)
                    grads = step()
                    ref = grads if ref is None else ref
                    times = gpu_kernel_times_us(step, reps=3)
                dq_us = sum(t for n, t in times.items() if "dq_kernel" in n)
                dkdv_us = sum(t for n, t in times.items() if "dkdv_kernel" in n)
                fwd_us = sum(t for n, t in times.items() if "fwd_kernel" in n)
                total = sum(times.values())
                diff = max(_rel(a, b) for a, b in zip(grads, ref))
                rows.append(f"{label:34s} bwd  {setting or '(plan)':42s} fwd {fwd_us:9.1f} dq {dq_us:9.1f} dkdv "
                            f"{dkdv_us:9.1f} total {total:9.1f} us fwd+bwd {3.5 * flops / total / 1e6:5.0f} TF/s "
                            f"diff {diff:.1e}")
            except Exception as e:  # noqa: BLE001
                rows.append(f"{label:34s} bwd  {setting:42s} {type(e).__name__}: {str(e)[:100]}")
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=",".join(map(str, range(len(CASES)))))
    parser.add_argument("--what", default="fwd,bwd", help="fwd, bwd and/or flex")
    parser.add_argument("--fwd", default="", help="space-separated forward settings instead of FWD's")
    parser.add_argument("--bwd", default="", help="space-separated backward settings instead of BWD's")
    args = parser.parse_args()
    FWD_SETTINGS[:] = args.fwd.split()
    BWD_SETTINGS[:] = args.bwd.split()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    rows = []
    for i in map(int, args.cases.split(",")):
        rows += run_case(CASES[i], args.what.split(","))
    print("\n".join(["", "summary:"] + rows))


if __name__ == "__main__":
    main()
