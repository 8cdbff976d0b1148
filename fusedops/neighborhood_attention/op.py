"""Registration of fusedops::neighborhood_attention and fusedops::neighborhood_attention_backward."""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from fusedops.launch import launch
from fusedops.plans import forced_key, on_reload
from fusedops.layout import unit_last_stride
from fusedops.numerics import accumulate_dtype, float_args, tf32_allowed
from fusedops.registry import fused_op, memoize
from fusedops.targets import Target, size_hint, target_for
from fusedops.validation import (
    FP32,
    as_int,
    check_bool,
    check_float,
    check_fp32_normal,
    check_same_device,
    check_tensor,
    checks_in_wrapper,
)

from . import reference
from .kernels import LOG2E, na_bwd_dkdv_kernel, na_bwd_dq_kernel, na_bwd_fused_1d_kernel, na_fwd_kernel
from .plan import grid as plan_grid
from .plan import OP, make_plan

WINDOWS = ("shifted", "truncated")
MIN_HEAD_DIM, MAX_HEAD_DIM = 8, 256
# The largest scale: the kernels multiply fp32 dot products q.k by it. At most sqrt(fp32 max) (~1.8e19),
# every logit stays finite while |q.k| stays below that bound too.
MAX_SCALE = FP32.max ** 0.5

IntOrSeq = Union[int, Sequence[int]]
BoolOrSeq = Union[bool, Sequence[bool]]


def _as_list(value) -> list:
    """A per-axis argument as a list: a sequence's entries, or the one value (the op broadcasts it)."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _per_axis(name: str, value, ndim: int, kind: type) -> list:
    """An int/bool, or one per spatial axis (a 1-element sequence broadcasts). Ints may be any integer
    type (numpy's too, as torch takes them); bools must be bools."""
    values = _as_list(value)
    if len(values) == 1:
        values = values * ndim
    if len(values) != ndim:
        raise ValueError(f"{name} must have one entry per spatial axis ({ndim}), got {value!r}")
    if kind is bool:
        if not all(isinstance(x, bool) for x in values):
            raise ValueError(f"{name} must be a bool or one bool per spatial axis, got {value!r}")
        return values
    try:
        return [as_int(name, x) for x in values]
    except ValueError:
        raise ValueError(f"{name} must be an int or one int per spatial axis, got {value!r}") from None


def check_window_args(ndim: int, kernel_size, dilation, stride, is_causal, window: str
                      ) -> tuple[list[int], list[int], list[int], list[bool]]:
    """The per-axis window arguments normalised, and every check that needs no tensor (the modules run
    it at construction)."""
    if window not in WINDOWS:
        raise ValueError(f"window must be one of {WINDOWS}, got {window!r}")
    ks = _per_axis("kernel_size", kernel_size, ndim, int)
    dil = _per_axis("dilation", dilation, ndim, int)
    st = _per_axis("stride", stride, ndim, int)
    causal = _per_axis("is_causal", is_causal, ndim, bool)
    for a in range(ndim):
        if ks[a] < 2:
            raise ValueError(f"kernel_size must be >= 2 on every axis, got {ks}")
        if dil[a] < 1:
            raise ValueError(f"dilation must be >= 1 on every axis, got {dil}")
        if st[a] < 1:
            raise ValueError(f"stride must be >= 1 on every axis, got {st}")
        if st[a] > ks[a]:
            raise ValueError(f"stride must not exceed kernel_size, got stride {st} for kernel_size {ks}")
        if window == "truncated" and ks[a] % 2 == 0:
            raise ValueError(f"kernel_size must be odd with window='truncated', got {ks}")
        if window == "truncated" and st[a] != 1:
            raise ValueError(f"stride must be 1 with window='truncated', got {st}")
    return ks, dil, st, causal


def check_args(
    q: Tensor, k: Tensor, v: Tensor, kernel_size, dilation, stride, is_causal, scale: Optional[float], window: str,
    query_offset=None,
) -> tuple[list[int], list[int], list[int], list[bool], float, list[int]]:
    """Validate and normalise; returns per-axis (kernel_size, dilation, stride, is_causal), the scale and the
    per-axis query offset.
    query_offset (checked by check_query_offset) lets q's spatial box be a part of k's."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float(name, t)
    if q.dim() < 4 or q.dim() > 6:
        raise ValueError(f"q must be [B, H, *spatial, D] with 1 to 3 spatial axes (rank 4..6), got shape "
                         f"{tuple(q.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dim() != q.dim():
            raise ValueError(f"{name} must have q's rank {q.dim()}, got shape {tuple(t.shape)}")
        if t.dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
    check_same_device([("q", q), ("k", k), ("v", v)])
    ndim = q.dim() - 3
    batch, heads, head_dim = q.shape[0], q.shape[1], q.shape[-1]
    spatial = list(k.shape[2:-1])  # the key grid; q's box lies in it (query_offset)
    offset = check_query_offset(query_offset, q, k)
    for name, t in (("k", k), ("v", v)):
        if t.shape[0] != batch:
            raise ValueError(f"{name} must have q's batch size {batch}, got shape {tuple(t.shape)}")
    if list(v.shape[2:-1]) != spatial:
        raise ValueError(f"v must have k's spatial shape {tuple(spatial)}, got shape {tuple(v.shape)}")
    if k.shape[-1] != head_dim:
        raise ValueError(f"k must have q's head dim {head_dim}, got shape {tuple(k.shape)}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"v must have k's number of heads {k.shape[1]}, got shape {tuple(v.shape)}")
    kv_heads = k.shape[1]
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(f"k's number of heads ({kv_heads}) must divide q's ({heads})")
    for name, dim in (("q", head_dim), ("v", v.shape[-1])):
        if not MIN_HEAD_DIM <= dim <= MAX_HEAD_DIM:
            raise ValueError(f"{name}'s head dim must be in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], got {dim}")
    ks, dil, st, causal = check_window_args(ndim, kernel_size, dilation, stride, is_causal, window)
    for a in range(ndim):
        # A truncated window is cut at the borders anyway: a group shorter than the kernel only cuts more.
        if window == "shifted" and ks[a] * dil[a] > spatial[a]:
            raise ValueError(f"kernel_size * dilation must not exceed the axis length with window='shifted': axis "
                             f"{a} has length {spatial[a]}, kernel_size {ks[a]} x dilation {dil[a]}")
    if scale is None:
        return ks, dil, st, causal, head_dim ** -0.5, offset  # may be symbolic under torch.compile
    check_fp32_normal("scale", scale, MAX_SCALE)
    return ks, dil, st, causal, scale if isinstance(scale, torch.SymFloat) else float(scale), offset


def check_query_offset(query_offset, q: Tensor, k: Tensor) -> list[int]:
    """query_offset normalised to one int per spatial axis: None (q's spatial shape must be k's; all 0) or
    offsets >= 0 with q's box inside k's grid on every axis."""
    ndim = q.dim() - 3
    q_spatial, k_spatial = list(q.shape[2:-1]), list(k.shape[2:-1])
    if query_offset is None:
        if q_spatial != k_spatial:
            raise ValueError(f"k must have q's spatial shape {tuple(q_spatial)} (or pass query_offset), got shape "
                             f"{tuple(k.shape)}")
        return [0] * ndim
    offset = _per_axis("query_offset", query_offset, ndim, int)
    for a in range(ndim):
        if offset[a] < 0 or offset[a] + q_spatial[a] > k_spatial[a]:
            raise ValueError(f"query_offset must place q's spatial box {tuple(q_spatial)} inside k's "
                             f"{tuple(k_spatial)} (0 <= offset, offset + q's length <= k's length on every axis), "
                             f"got {list(offset)}")
    return offset


def _pad3(values: Sequence, fill) -> list:
    return [fill] * (3 - len(values)) + list(values)


def _strides(name: str, stride: Sequence[int]) -> dict:
    """The kernels' stride arguments s<name>b, s<name>h, s<name>0..2 of a [B, H, *spatial, D] tensor (batch,
    head, axis 0..2; missing leading axes as 0)."""
    values = [stride[0], stride[1]] + _pad3(list(stride[2:-1]), 0)
    return dict(zip((f"s{name}{axis}" for axis in ("b", "h", "0", "1", "2")), values))


def _named(prefix: str, values: Sequence) -> dict:
    """{prefix0: values[0], prefix1: values[1], ...}"""
    return {f"{prefix}{i}": v for i, v in enumerate(values)}


def reach(kernel: int, stride: int, causal: bool, window: str) -> int:
    """The largest |key - query| (within-group) of any window on one axis: kernel - 1 plus the
    leader's offset for shifted windows (the window slides inward at the borders), half the kernel
    for truncated ones."""
    if causal:
        return kernel - 1
    return kernel // 2 if window == "truncated" else kernel - 1 + stride // 2


class _Geometry:
    def __init__(self, q_shape, k_shape, v_shape, ks, dil, st, causal, offset, window="shifted"):
        self.ndim = len(q_shape) - 3
        self.spatial = _pad3(list(k_shape[2:-1]), 1)  # the key grid
        self.q_spatial = _pad3(list(q_shape[2:-1]), 1)  # q's box in it, at q_offset
        self.q_offset = _pad3(list(offset), 0)
        self.kernel = _pad3(ks, 1)
        self.dilation = _pad3(dil, 1)
        self.stride = _pad3(st, 1)
        self.causal = [int(c) for c in _pad3(causal, False)]
        self.batch, self.heads, self.kv_heads = q_shape[0], q_shape[1], k_shape[1]
        self.head_dim, self.head_dim_v = q_shape[-1], v_shape[-1]
        self.box = self.q_spatial != self.spatial  # q holds part of the key grid (query_offset)
        # The fused 1-D backward owns keys and queries alike: only where q covers the key grid.
        self.halo = (reach(self.kernel[2], self.stride[2], bool(self.causal[2]), window)
                     if self.ndim == 1 and not self.box else None)

    def axis_args(self) -> dict:
        """The kernels' per-axis arguments by name: key lengths L, query offsets QO and lengths QL, kernel K,
        dilation DL, stride ST, causal C."""
        return dict(**_named("L", self.spatial), **_named("QO", self.q_offset), **_named("QL", self.q_spatial),
                    **_named("K", self.kernel), **_named("DL", self.dilation), **_named("ST", self.stride),
                    **_named("C", self.causal))

    def blocks(self, box: Sequence[int], queries: bool) -> list[int]:
        """Tiles per dilation group on each axis, over q's box (queries) or the key grid. A group holds at most
        ceil(length / dilation) of any run of consecutive positions."""
        lengths = self.q_spatial if queries else self.spatial
        return [-(-(-(-length // d)) // b) for length, d, b in zip(lengths, self.dilation, box)]

    def tiles(self, box: Sequence[int], heads: int, queries: bool) -> int:
        n = self.batch * heads
        for nb, d in zip(self.blocks(box, queries), self.dilation):
            n *= nb * d
        return n

    def plan(self, target: Target, dtype: torch.dtype, backward: bool, tf32: bool):
        # Tile shapes from the (hinted) lengths; tiles and grids from the real ones (see size_hint).
        spatial = tuple(size_hint(length) for length in self.spatial)
        return make_plan(target, spatial, self.dilation, self.head_dim, self.head_dim_v, dtype, self.ndim,
                         backward=backward, kernel_volume=math.prod(self.kernel), halo=self.halo, tf32=tf32,
                         kernel=self.kernel, stride=self.stride)


def _meta(plan, window: str, geo: _Geometry) -> dict:
    return dict(
        TRUNCATED=window == "truncated", NDIM=geo.ndim, BOX=geo.box, ONE_COMPARE=plan.one_compare_mask,
        MASK_BITS=plan.mask_bits, INSIDE=plan.unmasked_inside,
        BM0=plan.bm[0], BM1=plan.bm[1], BM2=plan.bm[2], BN0=plan.bn[0], BN1=plan.bn[1], BN2=plan.bn[2],
        **_launch_meta(plan),
    )


def _launch_meta(plan) -> dict:
    return dict(
        BLOCK_D=plan.block_d, BLOCK_DV=plan.block_dv, DOT_FP32=plan.dot_fp32, PRECISION=plan.precision, F64=plan.f64,
        num_warps=plan.num_warps, **({} if plan.num_stages is None else {"num_stages": plan.num_stages}),
    )


# A launch: (grid, the scalar arguments by name, the constexpr/launch keywords). Specs are cached per
# shape/stride/argument combination and settings (what fusedops.plan_override forces, TF32): planning costs
# more host time than the launch.
Launch = tuple[int, tuple, dict]


@memoize
def _forward_spec(q_shape, q_stride, k_shape, k_stride, v_shape, v_stride, dtype, ks, dil, st, causal, scale,
                  window, offset, target: Target, forced: tuple, tf32: bool) -> Optional[Launch]:
    geo = _Geometry(q_shape, k_shape, v_shape, ks, dil, st, causal, offset)
    plan = geo.plan(target, dtype, backward=False, tf32=tf32)
    tiles = geo.tiles(plan.bm, geo.heads, queries=True)
    if tiles == 0:
        return None
    args = dict(**_strides("q", q_stride), **_strides("k", k_stride), **_strides("v", v_stride),
                H=geo.heads, G=geo.heads // geo.kv_heads, D=geo.head_dim, DV=geo.head_dim_v,
                **geo.axis_args(), **_named("NB", geo.blocks(plan.bm, queries=True)), num_tiles=tiles,
                **_scales(scale, backward=False))
    meta = dict(_meta(plan, window, geo), **_register_cap(plan.fwd_registers))
    return plan_grid(target, tiles), args, meta


def _tf32(dtype: torch.dtype) -> bool:
    """float32 dots may use TF32 (torch's matmul precision setting, read per call like torch's matmuls)."""
    return dtype == torch.float32 and tf32_allowed()


def _forward(q, k, v, ks, dil, st, causal, scale, window, offset, target: Target) -> tuple[Tensor, Tensor]:
    out = q.new_empty(*q.shape[:-1], v.shape[-1])
    lse = torch.empty(q.shape[:-1], dtype=accumulate_dtype(q.dtype), device=q.device)
    q, k, v = unit_last_stride(q), unit_last_stride(k), unit_last_stride(v)
    spec = _forward_spec(q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, tuple(ks),
                         tuple(dil), tuple(st), tuple(causal), scale, window, tuple(offset), target, forced_key(OP),
                         _tf32(q.dtype))
    if spec is not None:
        grid, args, meta = spec
        launch(na_fwd_kernel, (grid,), dict(q_ptr=q, k_ptr=k, v_ptr=v, o_ptr=out, lse_ptr=lse, **args), meta)
    return out, lse


@memoize
def _backward_spec(q_shape, q_stride, k_shape, k_stride, v_shape, v_stride, go_stride, dtype, ks, dil, st, causal,
                   scale, window, offset, has_dlse, target: Target, forced: tuple, tf32: bool) -> tuple[Launch, ...]:
    """The backward's launches: (fused,) for a narrow 1-D window, else (dQ + delta, dK/dV)."""
    geo = _Geometry(q_shape, k_shape, v_shape, ks, dil, st, causal, offset, window)
    plan = geo.plan(target, dtype, backward=True, tf32=tf32)
    if plan.fused:
        return (_fused_spec(geo, plan, q_stride, k_stride, v_stride, go_stride, scale, window, has_dlse, target),)
    meta = _meta(plan, window, geo)
    strides = dict(**_strides("q", q_stride), **_strides("k", k_stride), **_strides("v", v_stride),
                   **_strides("d", go_stride))
    q_tiles = geo.tiles(plan.bm, geo.heads, queries=True)
    dq = (plan_grid(target, q_tiles),
          dict(strides, H=geo.heads, G=geo.heads // geo.kv_heads, D=geo.head_dim, DV=geo.head_dim_v,
               **geo.axis_args(), **_named("NB", geo.blocks(plan.bm, queries=True)), num_tiles=q_tiles,
               **_scales(scale)),
          dict(meta, HAS_DLSE=has_dlse, **_register_cap(plan.dq_registers)))
    dk_plan = plan.dkdv or plan
    k_tiles = geo.tiles(dk_plan.bn, geo.kv_heads, queries=False)
    dkdv = (plan_grid(target, k_tiles),
            dict(strides, H=geo.heads, HKV=geo.kv_heads, G=geo.heads // geo.kv_heads, D=geo.head_dim,
                 DV=geo.head_dim_v, **geo.axis_args(), **_named("NN", geo.blocks(dk_plan.bn, queries=False)), num_tiles=k_tiles,
                 **_scales(scale)),
            dict(_meta(dk_plan, window, geo), DK_BY_KEYS=dk_plan.dk_by_keys, WALK_TESTS=dk_plan.walk_tests,
                 KEYS_MAJOR=dk_plan.keys_major,
                 **_register_cap(dk_plan.dkdv_registers)))
    return dq, dkdv


on_reload(_forward_spec.cache_clear)
on_reload(_backward_spec.cache_clear)


def _scales(scale, backward: bool = True) -> dict:
    """The kernels' softmax scale arguments: qk_scale = scale * log2(e) (the forward's only one) and scale, each
    as float_args' hi and lo."""
    if not backward:
        return float_args(qk_scale=scale * LOG2E)
    return float_args(qk_scale=scale * LOG2E, scale=scale)


def _register_cap(registers: int | None) -> dict:
    return {} if registers is None else {"maxnreg": registers}


def _fused_spec(geo, plan, q_stride, k_stride, v_stride, go_stride, scale, window, has_dlse, target) -> Launch:
    block = plan.bm[2]
    own = block - 2 * geo.halo
    if own < 1:
        raise ValueError(f"plan_override: a fused block of {block} rows leaves none to own with a window "
                         f"reach of {geo.halo}")
    box = (1, 1, own)
    tiles = geo.tiles(box, geo.kv_heads, queries=False)
    strides = {f"s{name}{axis}": st[i] for name, st in (("q", q_stride), ("k", k_stride), ("v", v_stride),
                                                        ("d", go_stride)) for i, axis in enumerate(("b", "h", ""))}
    args = dict(strides, H=geo.heads, HKV=geo.kv_heads, G=geo.heads // geo.kv_heads, D=geo.head_dim,
                DV=geo.head_dim_v, L=geo.spatial[2], K=geo.kernel[2], DL=geo.dilation[2], ST=geo.stride[2],
                CAUSAL=geo.causal[2], HALO=geo.halo, OWN=own, NB=geo.blocks(box, queries=False)[2], num_tiles=tiles,
                **_scales(scale))
    meta = dict(TRUNCATED=window == "truncated", BLOCK=block, HAS_DLSE=has_dlse, **_launch_meta(plan))
    return plan_grid(target, tiles), args, meta


def _backward(grad_out, grad_lse, q, k, v, out, lse, ks, dil, st, causal, scale, window, offset, target: Target):
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if q.numel() == 0:
        return dq, dk.zero_(), dv.zero_()
    q, k, v, grad_out = unit_last_stride(q), unit_last_stride(k), unit_last_stride(v), unit_last_stride(grad_out)
    out = out.contiguous()
    lse = lse.contiguous()
    has_dlse = grad_lse is not None
    dlse = grad_lse.contiguous() if has_dlse else lse
    launches = _backward_spec(
        q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), grad_out.stride(), q.dtype, tuple(ks),
        tuple(dil), tuple(st), tuple(causal), scale, window, tuple(offset), has_dlse, target, forced_key(OP),
        _tf32(q.dtype),
    )
    if len(launches) == 1:
        (grid, args, meta), = launches
        launch(na_bwd_fused_1d_kernel, (grid,), dict(q_ptr=q, k_ptr=k, v_ptr=v, do_ptr=grad_out, o_ptr=out, lse_ptr=lse,
                                                      dlse_ptr=dlse, dq_ptr=dq, dk_ptr=dk, dv_ptr=dv, **args), meta)
        return dq, dk, dv
    (grid, args, meta), (dkdv_grid, dkdv_args, dkdv_meta) = launches
    delta = torch.empty(lse.shape, dtype=lse.dtype, device=q.device)
    # dQ first: it also computes delta = rowsum(dO * O) - dLSE, which the dK/dV kernel reads.
    launch(na_bwd_dq_kernel, (grid,), dict(q_ptr=q, k_ptr=k, v_ptr=v, do_ptr=grad_out, o_ptr=out, lse_ptr=lse,
                                           dlse_ptr=dlse, delta_ptr=delta, dq_ptr=dq, **args), meta)
    launch(na_bwd_dkdv_kernel, (dkdv_grid,), dict(q_ptr=q, k_ptr=k, v_ptr=v, do_ptr=grad_out, lse_ptr=lse,
                                                  delta_ptr=delta, dk_ptr=dk, dv_ptr=dv, **dkdv_args), dkdv_meta)
    return dq, dk, dv


def _filled(q, ks, dil, st, causal, scale, offset) -> tuple:
    """The op's checked arguments as check_args normalises them: a 1-element list for every axis, the default
    scale (D ** -0.5) and offset (zeros) for None. The direct calls get them so from the wrappers, but a backward
    gets its forward's arguments as a torch.ops caller passed them."""
    ndim = q.dim() - 3
    ks, dil, st, causal = (list(x) * ndim if len(x) == 1 else x for x in (ks, dil, st, causal))
    offset = [0] * ndim if offset is None else list(offset) * ndim if len(offset) == 1 else offset
    return ks, dil, st, causal, q.shape[-1] ** -0.5 if scale is None else scale, offset


def _run(q, k, v, ks, dil, st, causal, scale, window, offset) -> tuple[Tensor, Tensor]:
    """The op on checked arguments (see _filled): kernels under the device's plan, or the reference."""
    ks, dil, st, causal, scale, offset = _filled(q, ks, dil, st, causal, scale, offset)
    target = target_for(q.device, q.dtype)
    if target is None:
        return reference.neighborhood_attention(q, k, v, ks, dil, st, causal, scale, window, offset)
    return _forward(q, k, v, ks, dil, st, causal, scale, window, offset, target)


def _run_backward(grad_out, grad_lse, q, k, v, out, lse, ks, dil, st, causal, scale, window, offset):
    ks, dil, st, causal, scale, offset = _filled(q, ks, dil, st, causal, scale, offset)
    target = target_for(q.device, q.dtype)
    if target is None:
        return reference.neighborhood_attention_backward(
            grad_out, grad_lse, q, k, v, out, lse, ks, dil, st, causal, scale, window, offset
        )
    return _backward(grad_out, grad_lse, q, k, v, out, lse, ks, dil, st, causal, scale, window, offset, target)


def _check_backward(grad_out, grad_lse, q, v, out, lse):
    """grad_out and out [B, H, *spatial, Dv] in q's dtype, lse and grad_lse [B, H, *spatial] float32 (float64
    for float64 q), all on q's device (check_args has checked q, k and v)."""
    expect = (*q.shape[:-1], v.shape[-1])
    check_tensor("grad_out", grad_out, q.dtype, expect)
    check_tensor("out", out, q.dtype, expect)
    check_tensor("lse", lse, accumulate_dtype(q.dtype), q.shape[:-1])
    check_tensor("grad_lse", grad_lse, accumulate_dtype(q.dtype), q.shape[:-1], optional=True)
    check_same_device([("q", q), ("grad_out", grad_out), ("out", out), ("lse", lse), ("grad_lse", grad_lse)])


def _backward_fake(grad_out, grad_lse, q, k, v, out, lse, kernel_size, dilation, stride, is_causal, scale, window,
                   query_offset=None):
    check_args(q, k, v, kernel_size, dilation, stride, is_causal, scale, window, query_offset)
    _check_backward(grad_out, grad_lse, q, v, out, lse)
    return (
        torch.empty(q.shape, dtype=q.dtype, device=q.device),
        torch.empty(k.shape, dtype=k.dtype, device=k.device),
        torch.empty(v.shape, dtype=v.dtype, device=v.device),
    )


@fused_op("neighborhood_attention_backward", fake=_backward_fake, run=_run_backward)
def neighborhood_attention_backward_op(
    grad_out: Tensor, grad_lse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    kernel_size: Sequence[int], dilation: Sequence[int], stride: Sequence[int], is_causal: Sequence[bool],
    scale: Optional[float], window: str, query_offset: Optional[Sequence[int]] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of neighborhood attention given grad_out (and optionally grad_lse).
    Deterministic: dK/dV are summed per key tile over query tiles and GQA heads in a fixed order."""
    *window_args, offset = check_args(q, k, v, kernel_size, dilation, stride, is_causal, scale, window, query_offset)
    ks, dil, st, causal, scale = window_args
    _check_backward(grad_out, grad_lse, q, v, out, lse)
    return _run_backward(grad_out, grad_lse, q, k, v, out, lse, ks, dil, st, causal, scale, window, offset)


def _fake(q, k, v, kernel_size, dilation, stride, is_causal, scale, window, query_offset=None):
    check_args(q, k, v, kernel_size, dilation, stride, is_causal, scale, window, query_offset)
    return q.new_empty(*q.shape[:-1], v.shape[-1]), q.new_empty(q.shape[:-1], dtype=accumulate_dtype(q.dtype))


def _setup_context(ctx, inputs, output):
    q, k, v, *args = inputs  # kernel_size, dilation, stride, is_causal, scale, window[, query_offset]
    out, lse = output
    ctx.set_materialize_grads(False)  # an unused lse gets no zero-filled gradient
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = tuple(args)


def _backward_rule(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    elif grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    # The forward's arguments as it got them: a symbolic default scale computed here would be specialised by
    # the dispatcher (a float argument), recompiling a dynamic-shape graph for every head dim.
    dq, dk, dv = neighborhood_attention_backward_op(grad_out, grad_lse, q, k, v, out, lse, *ctx.args)
    need_q, need_k, need_v = ctx.needs_input_grad[:3]
    return (dq if need_q else None, dk if need_k else None, dv if need_v else None, None, None, None, None, None,
            None, None)


@fused_op("neighborhood_attention", fake=_fake, run=_run, setup_context=_setup_context, backward=_backward_rule)
def neighborhood_attention_op(
    q: Tensor, k: Tensor, v: Tensor, kernel_size: Sequence[int], dilation: Sequence[int], stride: Sequence[int],
    is_causal: Sequence[bool], scale: Optional[float], window: str, query_offset: Optional[Sequence[int]] = None,
) -> tuple[Tensor, Tensor]:
    """Neighborhood attention; returns (out, lse). See `fusedops.neighborhood_attention`."""
    *window_args, offset = check_args(q, k, v, kernel_size, dilation, stride, is_causal, scale, window, query_offset)
    ks, dil, st, causal, scale = window_args
    return _run(q, k, v, ks, dil, st, causal, scale, window, offset)


def neighborhood_attention(
    q: Tensor, k: Tensor, v: Tensor, kernel_size: IntOrSeq, dilation: IntOrSeq = 1, stride: IntOrSeq = 1,
    is_causal: BoolOrSeq = False, scale: Optional[float] = None, window: str = "shifted", return_lse: bool = False,
    query_offset: Optional[IntOrSeq] = None,
):
    """Sparse neighborhood attention over 1, 2 or 3 spatial axes (flash-style, fwd + bwd).

    Args:
        q: [B, H, *spatial, D]; k: [B, H_kv, *spatial, D]; v: [B, H_kv, *spatial, Dv], float32/float16/
            bfloat16/float64 (k and v in q's dtype), 1 to 3 spatial axes, H_kv dividing H (GQA/MQA), 8 <= D,
            Dv <= 256. Any layout: a tensor whose last dim has stride 1 is read in place (a permuted heads-last
            view, an expanded head), others are copied first. float32 products are
            exact unless torch's matmul precision allows TF32 (torch.set_float32_matmul_precision("high")),
            which CUDA kernels then use, as torch's matmuls do; softmax and accumulators are float32.
            float64 runs in float64 throughout (dots, softmax, accumulators, lse): for gradcheck.
        kernel_size, dilation, stride, is_causal: an int/bool or one per spatial axis. The neighbourhood
            of a query is the product of its per-axis windows. On an axis of length L: dilation d splits
            it into d interleaved groups (attention stays within i mod d); stride s makes each group of
            s consecutive queries share one window, the one of their leader; is_causal keeps keys at or
            before the query. kernel_size >= 2, 1 <= stride <= kernel_size, and with window="shifted"
            kernel_size * dilation <= L.
        scale: softmax scale in [~1.2e-38, ~1.8e19] (a normal float32 number at most sqrt(float32 max),
            MAX_SCALE: the kernels compute in float32); default D ** -0.5.
        window: "shifted" (NATTEN: every query sees exactly kernel_size keys per axis, the window
            slides inward at the borders) or "truncated" (Liger: centred window cut at the borders;
            odd kernel_size, stride 1; any kernel_size * dilation, as in Liger: where it exceeds L,
            queries see the keys of their dilation group that the window reaches).
        return_lse: a bool; also return the log-sum-exp [B, H, *spatial] (differentiable), float32 (float64
            for float64 q).
        query_offset: None, or an int or one per spatial axis: q holds only the queries of a box of k's
            spatial grid, at positions query_offset + [0, q's length) on every axis (q's spatial shape may then
            be smaller than k's). Every query sees the window it has on k's whole grid: the result is the
            rows of that box of the op on queries covering the grid, computed for the box only (context
            parallelism, chunked inference).

    Returns:
        out [B, H, *q's spatial, Dv] in q's dtype, or (out, lse) with return_lse.

    Non-finite values: a query's out, lse and gradients depend only on its window, so an inf or NaN reaches
    only the queries whose window holds it (and the keys those queries see, in the backward), and there
    gives what IEEE arithmetic gives in the reference: lse is torch.logsumexp's (-inf where every logit is
    -inf, +inf with a +inf logit, NaN with a NaN), out softmax's (NaN then). No input is refused for its
    values.

    DTensor inputs run under the DTensor sharding rules (batch or heads sharded); sharded on a spatial
    axis, they run context-parallel (`context_parallel_neighborhood_attention`: halo exchange).
    Raises ValueError naming the argument on bad input (under torch.compile, from the op's fake kernel:
    dynamo reports it with its message).
    """
    check_bool("return_lse", return_lse)
    if checks_in_wrapper():
        ks, dil, st, causal, checked_scale, offset = check_args(q, k, v, kernel_size, dilation, stride, is_causal,
                                                                scale, window, query_offset)
    else:  # compiling: the op's fake kernel checks them (see checks_in_wrapper)
        ks, dil, st, causal = map(_as_list, (kernel_size, dilation, stride, is_causal))
        checked_scale = scale
        offset = None if query_offset is None else _as_list(query_offset)
    if type(q) is not Tensor:
        from . import context_parallel

        if context_parallel.spatially_sharded(q):  # a DTensor sharded on a spatial axis
            if query_offset is not None:
                raise ValueError("query_offset is not taken with spatially sharded DTensor inputs (context "
                                 "parallelism places each rank's queries itself)")
            return context_parallel.dtensor_neighborhood_attention(q, k, v, ks, dil, st, causal, scale, window,
                                                                   return_lse)
    out, lse = neighborhood_attention_op(q, k, v, ks, dil, st, causal, checked_scale, window,
                                         None if query_offset is None else offset)
    return (out, lse) if return_lse else out
