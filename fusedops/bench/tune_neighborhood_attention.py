"""Sweep neighborhood-attention tiles on a GPU (not part of `python -m fusedops.bench`): GPU time (profiler) of
one fwd+bwd step per backward tile setting, the forward plan fixed (TUNE_KERNELS="7 7x7" picks
cases by kernel); TUNE_FORWARD=1: the forward kernel alone per forward tile setting on the
benchmark's cases; TUNE_STAGES=1: the planner's tiles at each pipelining depth; TUNE_REGISTERS=1: the
planner's tiles under register caps, per kernel; TUNE_FUSED=1: the fused 1-D backward's blocks against the
two-kernel backward on narrow windows; TUNE_BOXES=1: box settings of the forward/dQ and of the dK/dV kernel on 2-D cases
(TUNE_VARIANTS or BOX_VARIANTS), device us per kernel of one fwd+bwd step; TUNE_CAPS=1: per-kernel register caps,
constexprs and tiles together (TUNE_VARIANTS or CAP_VARIANTS). A plan change is backed by a measurement.
Tile settings are in the notation of bench/NOTES.md ("bm/bn[/warps[/stages]]", "fused/BLOCK[/warps[/stages]]"),
forced with fusedops.plan_override (`_set_tiles`; "TILES" forces the forward and, unless "BWD_TILES" is set,
the backward, as the FUSEDOPS_NA_*TILES variables of the runs in NOTES did). For table rows, use
`python -m fusedops.bench tune neighborhood_attention`.
Usage: python -m fusedops.bench.tune_neighborhood_attention"""

from __future__ import annotations

import contextlib
import math
import os

import torch

import fusedops
from fusedops.neighborhood_attention.plan import OP, tiles_from_string

_TILES: dict = {}
_STACK = contextlib.ExitStack()


def _set_tiles(name: str, value: str) -> None:
    """Force the tiles `value` ("" clears) for "TILES" (forward, and backward unless BWD_TILES is set),
    "BWD_TILES" (dQ, or the fused 1-D backward) or "DKDV_TILES" (the dK/dV kernel), via plan_override."""
    global _STACK
    if value:
        _TILES[name] = value
    else:
        _TILES.pop(name, None)
    _STACK.close()
    _STACK = contextlib.ExitStack()
    forward, backward, dkdv = (_TILES.get(k, "") for k in ("TILES", "BWD_TILES", "DKDV_TILES"))
    if forward and not forward.startswith("fused"):
        _STACK.enter_context(fusedops.plan_override(OP, "fwd", **tiles_from_string(forward)))
    if backward or forward:
        _STACK.enter_context(fusedops.plan_override(OP, "bwd", **tiles_from_string(backward or forward)))
    if dkdv:
        _STACK.enter_context(fusedops.plan_override(OP, "dkdv", **tiles_from_string(dkdv)))
from fusedops.bench.common import gpu_kernel_times_us, gpu_time_ms
from fusedops.bench.neighborhood_attention import CASES  # (B, H, spatial, D, kernel)

VARIANTS = {
    1: ["", "1,1,64/1,1,64/4", "1,1,64/1,1,32/4", "1,1,32/1,1,64/4", "1,1,64/1,1,128/8", "1,1,128/1,1,64/8",
        "1,1,128/1,1,32/8", "1,1,32/1,1,128/8", "1,1,64/1,1,64/8", "1,1,128/1,1,32/4", "1,1,64/1,1,16/4",
        "1,1,32/1,1,32/4", "1,1,128/1,1,16/4", "1,1,32/1,1,16/2", "1,1,64/1,1,32/2"],
    2: ["", "1,8,8/1,8,8/4", "1,8,16/1,8,8/8", "1,16,8/1,8,16/8", "1,8,8/1,16,16/8", "1,4,8/1,8,16/4",
        "1,4,8/1,4,8/4", "1,4,16/1,4,16/4", "1,8,8/1,4,16/4", "1,4,16/1,8,8/4", "1,8,16/1,8,8/4",
        "1,8,8/1,8,16/4", "1,16,8/1,8,8/4", "1,8,8/1,16,8/4", "1,8,8/1,8,8/2", "1,16,16/1,8,8/8"],
    3: ["", "4,4,4/4,4,4/4", "2,4,8/2,4,8/4", "4,4,8/2,4,8/4", "2,4,8/4,4,4/4", "2,2,8/2,4,8/4", "2,4,4/2,4,4/4",
        "2,4,8/2,4,4/4"],
}


FORWARD_VARIANTS = {
    1: ["", "1,1,64/1,1,64/4", "1,1,64/1,1,32/4", "1,1,64/1,1,16/4", "1,1,32/1,1,32/4", "1,1,128/1,1,32/8",
        "1,1,128/1,1,64/8", "1,1,128/1,1,16/8", "1,1,128/1,1,128/8", "1,1,128/1,1,32/4", "1,1,256/1,1,32/8"],
    2: ["", "1,8,8/1,8,16/4", "1,8,8/1,8,8/4", "1,8,16/1,8,16/8", "1,8,16/1,8,8/4", "1,16,8/1,8,16/8",
        "1,16,16/1,8,16/8", "1,4,16/1,4,16/4", "1,8,16/1,16,8/8", "1,16,8/1,16,8/8", "1,4,8/1,8,16/4"],
    3: ["", "4,4,8/4,4,8/8", "4,4,4/4,4,8/4", "2,4,8/2,4,8/4", "2,8,8/2,8,8/8", "4,4,8/2,4,8/4",
        "2,4,16/2,4,16/8"],
}


def _inputs(b, h, spatial, d, grad=True):
    """q, k, v: bf16 [B, H, *spatial, D] on the GPU, the same values for every variant of a case."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    return tuple(torch.randn(b, h, *spatial, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                 .requires_grad_(grad) for _ in range(3))


def _name(spatial, d, kernel) -> str:
    return f"{'x'.join(map(str, spatial))} D{d} k{'x'.join(map(str, kernel))}"


def _step(b, h, spatial, d, kernel):
    """One fwd+bwd step of a case (its own inputs and output gradient)."""
    q, k, v = _inputs(b, h, spatial, d)
    go = torch.randn_like(q)
    return lambda: torch.autograd.grad(fusedops.neighborhood_attention(q, k, v, list(kernel)), (q, k, v), go)


def _per_kernel(step) -> str:
    """Device us of the step in all and per kernel."""
    times = gpu_kernel_times_us(step)
    parts = "  ".join(f"{name.split('_kernel')[0]} {us:7.1f}" for name, us in sorted(times.items()) if us > 1)
    return f"total {sum(times.values()):8.1f} us  {parts}"


def forward_sweep() -> None:
    for b, h, spatial, d, kernel in CASES:
        q, k, v = _inputs(b, h, spatial, d, grad=False)
        expected = None
        for tiles in FORWARD_VARIANTS[len(spatial)]:
            _set_tiles("TILES", tiles)
            try:
                out = fusedops.neighborhood_attention(q, k, v, list(kernel))
                expected = out if expected is None else expected
                same = torch.allclose(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
                us = sum(gpu_kernel_times_us(lambda: fusedops.neighborhood_attention(q, k, v, list(kernel))).values())
                print(f"{_name(spatial, d, kernel)} fwd tiles {tiles or '(planner)':22s} GPU {us:7.1f} us"
                      f"{'' if same else ' DIFFERENT RESULT'}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"{spatial} k{kernel} {tiles}: {type(e).__name__}: {str(e)[:120]}", flush=True)
        _set_tiles("TILES", "")


def stages_sweep() -> None:
    """The planner's tiles with each software-pipelining depth: the forward alone, then fwd+bwd with
    the backward's depth varied (GPU us)."""
    from fusedops.neighborhood_attention.op import reach
    from fusedops.neighborhood_attention.plan import make_plan
    from fusedops.targets import target_for

    target = target_for(torch.device("cuda"))
    for b, h, spatial, d, kernel in CASES:
        q, k, v = _inputs(b, h, spatial, d)
        go = torch.randn_like(q)
        pad = [1] * (3 - len(spatial))
        name = _name(spatial, d, kernel)

        def fwd():
            with torch.no_grad():
                return fusedops.neighborhood_attention(q, k, v, list(kernel))

        def step():
            return torch.autograd.grad(fusedops.neighborhood_attention(q, k, v, list(kernel)), (q, k, v), go)

        for backward, fn, stages in ((False, fwd, (None, 1, 2, 3, 4)), (True, step, (None, 1, 2, 3))):
            halo = reach(kernel[0], 1, False, "shifted") if len(spatial) == 1 else None
            plan = make_plan(target, pad + list(spatial), [1, 1, 1], d, d, torch.bfloat16, len(spatial),
                             backward=backward, kernel_volume=math.prod(kernel), halo=halo)
            box = f"fused/{plan.bm[2]}/{plan.num_warps}" if plan.fused else \
                f"{','.join(map(str, plan.bm))}/{','.join(map(str, plan.bn))}/{plan.num_warps}"
            for stage in stages:
                tiles = box if stage is None else f"{box}/{stage}"
                _set_tiles("BWD_TILES" if backward else "TILES", tiles)
                try:
                    us = sum(gpu_kernel_times_us(fn).values())
                    print(f"{name} {'fwd+bwd (bwd' if backward else 'fwd (fwd'} tiles {tiles:20s}) GPU {us:8.1f} us",
                          flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"{name} {tiles}: {type(e).__name__}: {str(e)[:160]}", flush=True)
            _set_tiles("BWD_TILES" if backward else "TILES", "")


FUSED_CASES = [(2, 12, (4096,), 64, (k,)) for k in (3, 7, 11, 15, 17, 31)] + [
    (2, 16, (8192,), 128, (k,)) for k in (7, 15, 33)]
FUSED_VARIANTS = ["", "1,1,32/1,1,16/2", "1,1,64/1,1,32/4", "fused/32/4", "fused/64/4", "fused/64/8",
                  "fused/128/8", "fused/128/4"]
# TUNE_FUSED_VARIANTS (space-separated) replaces the list; "+maxnreg=N" caps the fused kernel's registers.


def _max_rel_diff(grads, expected) -> float:
    """The largest max-abs difference of the gradients, relative to each expected gradient's max-abs."""
    return max(float((a.float() - e.float()).abs().max() / e.float().abs().max().clamp(min=1e-6))
               for a, e in zip(grads, expected))


def _cap_registers(caps: dict, flags: dict | None = None) -> None:
    """Launch the kernels in caps with that per-thread register cap (0: uncapped, whatever the plan
    says), and the kernels in flags with those constexprs set; the others as planned."""
    from fusedops.neighborhood_attention import op

    plain = getattr(op, "_plain_launch", op.launch)
    op._plain_launch = plain

    def capped(kernel, grid, args, meta):
        if kernel in caps:
            meta = {k: v for k, v in meta.items() if k != "maxnreg"}
            if caps[kernel]:
                meta["maxnreg"] = caps[kernel]
        meta = dict(meta, **(flags or {}).get(kernel, {}))
        plain(kernel, grid, args, meta)

    op.launch = capped


def registers_sweep() -> None:
    """The planner's tiles with the three tile kernels' registers capped alike (planner: the plan's
    caps), device us per kernel of one fwd+bwd step, gradients checked against the planner's."""
    from fusedops.neighborhood_attention.kernels import na_bwd_dkdv_kernel, na_bwd_dq_kernel, na_fwd_kernel

    tile_kernels = (na_fwd_kernel, na_bwd_dq_kernel, na_bwd_dkdv_kernel)
    for b, h, spatial, d, kernel in selected_cases():
        step = _step(b, h, spatial, d, kernel)

        expected = None
        for cap in ("planner", 0, 224, 192, 168, 128):
            _cap_registers({} if cap == "planner" else dict.fromkeys(tile_kernels, cap))
            grads = step()
            expected = grads if expected is None else expected
            err = _max_rel_diff(grads, expected)
            print(f"{_name(spatial, d, kernel)} registers {cap or 'uncapped'!s:8s} {_per_kernel(step)}"
                  f"  max rel diff {err:.1e}", flush=True)
        _cap_registers({})


# "caps;tiles|dkdv": per-kernel register caps "kernel=cap,..." (fwd, dq, dkdv; 0 = uncapped) or constexprs
# "kernel.NAME=int", then optional TILES | DKDV_TILES values (the caps apply to them too).
# 128 registers fit four 4-warp programs per SM where the tiles' shared memory allows it.
CAP_VARIANTS = ["planner", "fwd=128", "dq=128", "fwd=128,dq=128", "fwd=144,dq=144"]
CAP_CASES = [(2, 16, (8192,), 128, (33,)), (1, 8, (16384,), 64, (129,)), (1, 16, (16, 32, 32), 64, (7, 7, 7)),
             (1, 24, (128, 128), 128, (13, 13)), (1, 16, (64, 64), 128, (7, 7))] + [
    (1, 16, (64, 64), 64, (k, k)) for k in (3, 5, 7, 9, 11)]


def caps_sweep() -> None:
    """Device us per kernel of one fwd+bwd step for each cap/constexpr/tile setting (TUNE_VARIANTS,
    space-separated, or CAP_VARIANTS), gradients checked against the first setting's."""
    from fusedops.neighborhood_attention.kernels import na_bwd_dkdv_kernel, na_bwd_dq_kernel, na_fwd_kernel

    kernels = {"fwd": na_fwd_kernel, "dq": na_bwd_dq_kernel, "dkdv": na_bwd_dkdv_kernel}
    for b, h, spatial, d, kernel in selected_cases(CAP_CASES):
        step = _step(b, h, spatial, d, kernel)

        expected = None
        for variant in os.environ.get("TUNE_VARIANTS", "").split() or CAP_VARIANTS:
            settings, _, boxes = ("" if variant == "planner" else variant).partition(";")
            caps, flags = {}, {}
            for token in filter(None, settings.split(",")):
                name, value = token.split("=")
                name, _, constexpr = name.partition(".")
                if constexpr:
                    flags.setdefault(kernels[name], {})[constexpr] = int(value)
                else:
                    caps[kernels[name]] = int(value)
            _cap_registers(caps, flags)
            expected = _boxes_row(_name(spatial, d, kernel), f"{variant:24s}", boxes, step, expected)
        _clear_boxes()
        _cap_registers({})


def fused_sweep() -> None:
    """fwd+bwd GPU time per backward variant (the two-kernel tiles of the previous plan, fused blocks),
    with the gradients checked against the first variant's."""
    from fusedops.neighborhood_attention.kernels import na_bwd_fused_1d_kernel

    for b, h, spatial, d, kernel in selected_cases(FUSED_CASES):
        step = _step(b, h, spatial, d, kernel)

        expected = None
        for variant in os.environ.get("TUNE_FUSED_VARIANTS", "").split() or FUSED_VARIANTS:
            tiles, _, cap = variant.partition("+maxnreg=")
            tiles = "" if tiles == "planner" else tiles
            _cap_registers({na_bwd_fused_1d_kernel: int(cap) if cap else 0})
            _set_tiles("BWD_TILES", tiles)
            try:
                grads = step()
                expected = grads if expected is None else expected
                err = _max_rel_diff(grads, expected)
                ms = gpu_time_ms(step)
                print(f"{_name(spatial, d, kernel)} bwd {variant or '(planner)':24s} fwd+bwd GPU {ms:.4f} ms "
                      f"max rel diff {err:.1e}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"{_name(spatial, d, kernel)} {variant}: {type(e).__name__}: {str(e)[:120]}", flush=True)
        _set_tiles("BWD_TILES", "")
        _cap_registers({})


# Key boxes tall in the outer axis put a 2-D walk's steps in the innermost loop, the one Triton pipelines.
# "tiles|dkdv": TILES (forward and dQ) | DKDV_TILES (the dK/dV kernel alone), see _set_tiles.
BOX_VARIANTS = ["", "1,8,8/1,16,2/4", "1,8,8/1,16,4/4", "1,8,4/1,16,2/2", "1,8,8/1,16,2/4/2", "1,8,8/1,32,2/4",
                "|1,16,4/1,8,8/4", "|1,16,2/1,8,8/4", "|1,16,8/1,8,8/4", "|1,16,4/1,8,8/4/2", "|1,16,4/1,8,16/8",
                "1,8,8/1,16,2/4|1,16,4/1,8,8/4"]
BOX_CASES = [(1, 16, (64, 64), 64, (k, k)) for k in (3, 5, 7, 9, 11)] + [
    (1, 16, (64, 64), 128, (7, 7)), (1, 24, (128, 128), 128, (13, 13))]


def boxes_sweep() -> None:
    """Device us per kernel of one fwd+bwd step for each tiles|dkdv setting (TUNE_VARIANTS, space-separated,
    or BOX_VARIANTS), gradients checked against the planner's."""
    for b, h, spatial, d, kernel in selected_cases(BOX_CASES):
        step = _step(b, h, spatial, d, kernel)

        expected = None
        for variant in os.environ.get("TUNE_VARIANTS", "").split() or BOX_VARIANTS:
            boxes = "" if variant == "planner" else variant
            expected = _boxes_row(_name(spatial, d, kernel), f"{variant or '(planner)':32s}", boxes, step, expected)
        _clear_boxes()


def _boxes_row(case: str, label: str, boxes: str, step, expected):
    """Run the step under the "tiles|dkdv" boxes (TILES | DKDV_TILES, see _set_tiles) and print its device
    us per kernel and its gradients' largest difference from `expected` (the first row's, returned)."""
    tiles, _, dkdv = boxes.partition("|")
    _set_tiles("TILES", tiles)
    _set_tiles("DKDV_TILES", dkdv)
    try:
        grads = step()
        expected = grads if expected is None else expected
        print(f"{case} {label} {_per_kernel(step)}  max rel diff {_max_rel_diff(grads, expected):.1e}", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"{case} {label.strip()}: {type(e).__name__}: {str(e)[:160]}", flush=True)
    return expected


def _clear_boxes() -> None:
    _set_tiles("TILES", "")
    _set_tiles("DKDV_TILES", "")


def selected_cases(cases=CASES) -> list:
    """The cases whose kernel string (e.g. "7", "7x7") is listed in TUNE_KERNELS (all without it)."""
    wanted = os.environ.get("TUNE_KERNELS", "").split()
    return [c for c in cases if not wanted or "x".join(map(str, c[4])) in wanted]


def main() -> None:
    if os.environ.get("TUNE_FORWARD") == "1":
        forward_sweep()
        return
    if os.environ.get("TUNE_FUSED") == "1":
        fused_sweep()
        return
    if os.environ.get("TUNE_STAGES") == "1":
        stages_sweep()
        return
    if os.environ.get("TUNE_REGISTERS") == "1":
        registers_sweep()
        return
    if os.environ.get("TUNE_BOXES") == "1":
        boxes_sweep()
        return
    if os.environ.get("TUNE_CAPS") == "1":
        caps_sweep()
        return
    for b, h, spatial, d, kernel in selected_cases():
        step = _step(b, h, spatial, d, kernel)

        # TUNE_PLANNER_ONLY=1: the planner's tiles only (a kernel change, not a plan change, is measured)
        for tiles in [""] if os.environ.get("TUNE_PLANNER_ONLY") == "1" else VARIANTS[len(spatial)]:
            _set_tiles("BWD_TILES", tiles)
            try:
                ms = gpu_time_ms(step)
                print(f"{_name(spatial, d, kernel)} bwd tiles {tiles or '(planner)':22s} fwd+bwd GPU {ms:.4f} ms",
                      flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"{spatial} k{kernel} {tiles}: {type(e).__name__}: {str(e)[:120]}", flush=True)
        _set_tiles("BWD_TILES", "")


if __name__ == "__main__":
    main()
