"""Sweep the neighborhood-attention backward tiles on a GPU (not part of `python -m bench`): GPU time
(profiler) of one fwd+bwd step per FUSEDOPS_NA_BWD_TILES setting, the forward plan fixed, so a plan
change is backed by a measurement. Usage: python -m bench.tune_neighborhood_attention"""

from __future__ import annotations

import os

import torch

import fusedops
from bench.common import gpu_time_ms

CASES = [  # (B, H, spatial, D, kernel)
    (2, 12, (4096,), 64, (7,)),
    (2, 16, (8192,), 128, (33,)),
    (1, 8, (16384,), 64, (129,)),
    (1, 16, (64, 64), 64, (7, 7)),
]
VARIANTS = {
    1: ["", "1,1,64/1,1,64/4", "1,1,64/1,1,32/4", "1,1,32/1,1,64/4", "1,1,64/1,1,128/8", "1,1,128/1,1,64/8",
        "1,1,128/1,1,32/8", "1,1,32/1,1,128/8", "1,1,64/1,1,64/8"],
    2: ["", "1,8,8/1,8,8/4", "1,8,16/1,8,8/8", "1,16,8/1,8,16/8", "1,8,8/1,16,16/8", "1,4,8/1,8,16/4"],
}


def main() -> None:
    for b, h, spatial, d, kernel in CASES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, h, *spatial, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                   .requires_grad_() for _ in range(3))
        go = torch.randn_like(q)

        def step():
            return torch.autograd.grad(fusedops.neighborhood_attention(q, k, v, list(kernel)), (q, k, v), go)

        # TUNE_PLANNER_ONLY=1: the planner's tiles only (a kernel change, not a plan change, is measured)
        for tiles in [""] if os.environ.get("TUNE_PLANNER_ONLY") == "1" else VARIANTS[len(spatial)]:
            os.environ["FUSEDOPS_NA_BWD_TILES"] = tiles
            try:
                ms = gpu_time_ms(step)
                print(f"{'x'.join(map(str, spatial))} D{d} k{'x'.join(map(str, kernel))} bwd tiles "
                      f"{tiles or '(planner)':22s} fwd+bwd GPU {ms:.4f} ms", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"{spatial} k{kernel} {tiles}: {type(e).__name__}: {str(e)[:120]}", flush=True)
        os.environ.pop("FUSEDOPS_NA_BWD_TILES", None)


if __name__ == "__main__":
    main()
