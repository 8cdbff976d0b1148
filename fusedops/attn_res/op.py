"""Registration of fusedops::attn_res and fusedops::attn_res_backward."""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch
from torch import Tensor

from fusedops.launch import launch
from fusedops.plans import forced
from fusedops.numerics import accumulate_dtype, float_args
from fusedops.layout import sources_walk, unit_last_stride, walkable_sources
from fusedops.registry import fused_op
from fusedops.targets import Target, target_for
from fusedops.validation import (
    check_bool,
    check_float,
    check_fp32_normal,
    check_same_device,
    check_sources,
    check_tensor,
    checks_in_wrapper,
)

from . import reference
from .kernels import (
    attn_res_bwd_depth_tile_kernel,
    attn_res_bwd_kernel,
    attn_res_bwd_onepass_kernel,
    attn_res_fwd_depth_tile_kernel,
    attn_res_fwd_kernel,
    attn_res_fwd_merge_kernel,
    attn_res_param_grad_kernel,
    waiting_slots_elements,
)
from .plan import (OP, SPLIT_MERGE_BLOCK_D, Plan, depth_tile_plan, make_plan, reduce_plan, stash_rows,
                   two_phase_plan)


def check_args(values: Tensor, query: Tensor, norm_weight: Optional[Tensor], eps: float) -> None:
    dim = check_sources(values)
    check_float("query", query)
    if norm_weight is not None:
        check_float("norm_weight", norm_weight)
    if query.dim() != 1 or query.shape[0] != dim:
        raise ValueError(f"query must have shape [D] = [{dim}] to match values, got {tuple(query.shape)}")
    if norm_weight is not None and (norm_weight.dim() != 1 or norm_weight.shape[0] != dim):
        raise ValueError(
            f"norm_weight must have shape [D] = [{dim}] to match values, got {tuple(norm_weight.shape)}"
        )
    check_same_device([("values", values), ("query", query), ("norm_weight", norm_weight)])
    check_fp32_normal("eps", eps)


def _forced_plan(kernel: str, choose, sources: int, dim: int) -> Plan:
    """choose(variant) under what fusedops.plan_override forces on attn_res's `kernel` ("forward",
    "backward"): the variant it names, then its Plan fields on top, taken as given except where they would
    leave sources or features out (ValueError: the kernels mask what their tiles do not cover, so it would be
    a wrong answer, not an error)."""
    fields = forced(OP, kernel)
    if not fields:
        return choose(None)
    variant = fields.pop("variant", None)
    fields.pop("stash", None)  # read by _backward
    plan = choose(variant)
    if plan is None and {"block_n", "block_d", "grid", "num_warps"} <= set(fields):
        # a depth tile the planner declines, as a sweep names it
        plan = Plan(block_t=1, block_d=fields["block_d"], one_tile=True, grid=fields["grid"],
                    num_warps=fields["num_warps"], block_n=fields["block_n"])
    if plan is None:
        raise ValueError(f"plan_override: attn_res {kernel} variant {variant!r} does not fit this shape on chip")
    plan = replace(plan, **fields) if fields else plan
    gaps = _gaps(plan, kernel, sources, dim) if isinstance(sources, int) and isinstance(dim, int) else []
    if gaps:
        raise ValueError(f"plan_override: attn_res {kernel} plan {plan} leaves out {' and '.join(gaps)}")
    return plan


def _gaps(plan: Plan, kernel: str, sources: int, dim: int) -> list[str]:
    """What a plan's tiles leave out: a whole-row tile (depth tile, one tile, one pass) narrower than D; the
    backward's depth tile, which holds all N rows at once, shorter than N (the forward's steps through groups)."""
    gaps = []
    if (plan.block_n or plan.one_tile) and plan.block_d < dim:
        gaps.append(f"features past block_d = {plan.block_d} of D = {dim}")
    if kernel == "backward" and plan.block_n and plan.block_n < sources:
        gaps.append(f"sources past block_n = {plan.block_n} of N = {sources}")
    return gaps


def forward_plan(target: Target, tokens: int, sources: int, dim: int, elem_size: int) -> Plan:
    """The depth-tile plan when all N source rows of a token fit on chip, else the online-softmax one (or
    what fusedops.plan_override("attn_res", "forward", ...) forces)."""

    def choose(variant):
        # Not for a symbolic N (torch.compile with dynamic shapes): see backward_plan.
        if variant in (None, "depth_tile") and isinstance(sources, int):
            depth = depth_tile_plan(target, tokens, sources, dim, elem_size, backward=False)
            if depth is not None or variant == "depth_tile":
                return depth
        if variant not in (None, "online", "rows", "depth_tile"):
            raise ValueError("plan_override: attn_res forward variant must be 'online' (alias 'rows') or 'depth_tile', "
                             f"got {variant!r}")
        return make_plan(target, tokens, dim, elem_size, backward=False)

    return _forced_plan("forward", choose, sources, dim)


def _forward(
    values: Tensor, query: Tensor, norm_weight: Optional[Tensor], eps: float, target: Target
) -> tuple[Tensor, Tensor]:
    n, dim = values.shape[0], values.shape[-1]
    out = values.new_empty(values.shape[1:])
    lse = values.new_empty(values.shape[1:-1], dtype=accumulate_dtype(values.dtype))
    tokens = out.numel() // dim
    if tokens == 0:
        return out, lse
    values, query, norm_weight = walkable_sources(values), unit_last_stride(query), unit_last_stride(norm_weight)
    s1, s2, st0, st1, st2 = sources_walk(values)
    plan = forward_plan(target, tokens, n, dim, values.element_size())
    weight = query if norm_weight is None else norm_weight
    walk = dict(N=n, T=tokens, D=dim, S1=s1, S2=s2, ST0=st0, ST1=st1, ST2=st2, STRIDE_N=values.stride(0),
                **float_args(eps=eps))
    f64 = values.dtype == torch.float64
    if plan.block_n:
        # tokens_per_program > 0: the grid follows from it, so a forced value cannot leave tokens out
        grid = -(-tokens // plan.tokens_per_program) if plan.tokens_per_program else plan.grid
        splits, part = max(plan.split, 1), lse  # part: not read unless split
        if splits > 1:  # program (token, s) writes fp32 partials [splits, T, D + 2] that the merge folds
            grid, part = tokens * splits, values.new_empty((splits * tokens * (dim + 2),), dtype=lse.dtype)
        launch(attn_res_fwd_depth_tile_kernel, (grid,),
               dict(v_ptr=values, q_ptr=query, w_ptr=weight, out_ptr=out, lse_ptr=lse, part_ptr=part, splits=splits,
                    **walk),
               dict(HAS_WEIGHT=norm_weight is not None, BLOCK_N=plan.block_n, BLOCK_D=plan.block_d, F64=f64,
                    TOKENS=plan.tokens_per_program, DIM=dim if plan.constant_dim and isinstance(dim, int) else 0,
                    SPLIT=splits > 1, PREFETCH=plan.prefetch, EVICT_FIRST=plan.evict_first, num_warps=plan.num_warps))
        if splits > 1:
            block = min(SPLIT_MERGE_BLOCK_D, plan.block_d)
            launch(attn_res_fwd_merge_kernel, (tokens, -(-dim // block)),
                   dict(part_ptr=part, out_ptr=out, lse_ptr=lse, T=tokens, D=dim, splits=splits),
                   dict(BLOCK_D=block, F64=f64, num_warps=4))
        return out, lse
    logits = out if plan.one_tile else values.new_empty((n, tokens), dtype=lse.dtype)
    launch(
        attn_res_fwd_kernel, (plan.grid,),
        dict(v_ptr=values, q_ptr=query, w_ptr=weight, out_ptr=out, lse_ptr=lse, logits_ptr=logits, **walk),
        dict(HAS_WEIGHT=norm_weight is not None, ONE_TILE=plan.one_tile, UNROLL=plan.unroll,
             BLOCK_T=plan.block_t, BLOCK_D=plan.block_d, F64=f64, num_warps=plan.num_warps,
             num_stages=plan.num_stages),
    )
    return out, lse


def backward_plan(target: Target, tokens: int, sources: int, dim: int, elem_size: int, one_pass: bool) -> Plan:
    """The depth-tile plan when all N source rows of a token fit on chip (it needs neither out nor lse);
    else the one-pass plan when the forward's out and lse are at hand and a whole row fits on chip (on
    Ascend, for fp32 values only); otherwise the two-phase plan. fusedops.plan_override("attn_res",
    "backward", variant="two_phase" | "one_pass" | "depth_tile" | "rows", ...) forces one ("rows": the
    planner's choice without the depth tile; a forced one-pass plan runs only where out and lse are at
    hand and a whole row fits, else the two-phase kernel runs it)."""

    def choose(variant):
        if variant not in (None, "rows", "two_phase", "one_pass", "depth_tile"):
            raise ValueError("plan_override: attn_res backward variant must be 'rows', 'two_phase', 'one_pass' or "
                             f"'depth_tile', got {variant!r}")
        # Not for a symbolic N (torch.compile with dynamic shapes): its tile height would need a guard on N,
        # and a graph is meant to serve every size without recompiling.
        if variant in (None, "depth_tile"):
            depth = depth_tile_plan(target, tokens, sources, dim, elem_size) if isinstance(sources, int) else None
            if depth is not None or variant == "depth_tile":
                return depth
        if variant == "one_pass":
            return make_plan(target, tokens, dim, elem_size, backward=True, one_pass=True)
        # triton-ascend's adapter cannot lower the one-pass kernel's deferred 16-bit rows (a select between
        # pointer tensors, fusedops_tests/compile_ascend.py): on Ascend 16-bit values take the two-phase kernel.
        if variant in (None, "rows") and one_pass and not (target.vendor == "ascend" and elem_size < 4):
            plan = make_plan(target, tokens, dim, elem_size, backward=True, one_pass=True)
            if plan.one_tile:
                return plan
        return two_phase_plan(target, tokens, sources, dim, elem_size)

    return _forced_plan("backward", choose, sources, dim)


def _reduce_plan(target: Target, dim: int, programs: int, stash: int, acc_bytes: int) -> tuple[int, int, int, int]:
    """reduce_plan, with what fusedops.plan_override("attn_res", "reduce", ...) forces on top."""
    block_d, block_p, grid, rewrite_p = reduce_plan(target, dim, programs, stash, acc_bytes)
    fields = forced(OP, "reduce")
    if fields:
        block_d, block_p = fields.get("block_d", block_d), fields.get("block_p", block_p)
        grid, rewrite_p = fields.get("grid", grid), fields.get("rewrite_p", rewrite_p)
    return block_d, block_p, grid, rewrite_p


def _backward(
    grad_out: Tensor, values: Tensor, query: Tensor, norm_weight: Optional[Tensor], eps: float,
    need_values: bool, need_query: bool, need_norm_weight: bool, target: Target,
    out: Optional[Tensor] = None, lse: Optional[Tensor] = None, grad_lse: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    n, dim = values.shape[0], values.shape[-1]
    tokens = grad_out.numel() // dim
    need_du = need_query or need_norm_weight
    values, query, norm_weight = walkable_sources(values), unit_last_stride(query), unit_last_stride(norm_weight)
    grad_values = (torch.empty_like(values, memory_format=torch.contiguous_format) if need_values
                   else values.new_empty(0))
    grad_query = torch.empty_like(query) if need_query else query.new_empty(0)
    grad_weight = torch.empty_like(norm_weight) if need_norm_weight else query.new_empty(0)
    if not (need_values or need_du):
        return grad_values, grad_query, grad_weight
    saved = out is not None and lse is not None
    plan = backward_plan(target, tokens, n, dim, values.element_size(), saved)
    one_pass = plan.one_pass and plan.one_tile and saved
    # One fp32 row of query/weight-gradient partial sums per program; not even allocated when only
    # grad_values is wanted (frozen mixing parameters). The depth-tile and one-pass kernels write every
    # row once, and stash it in grad_values where they can (stash_rows; `partial` then keeps the scalars
    # of the rows the stash overwrites); the two-phase kernel adds to its row per token block, so it
    # starts from zeros.
    writes_once = (one_pass or bool(plan.block_n)) and tokens > 0
    # A split two-phase plan: `slices` programs a token block, each with its own row of partial sums.
    slice_rows = -(-n // plan.split) if plan.split > 1 and not (one_pass or plan.block_n) else 0
    slices = -(-n // slice_rows) if slice_rows else 1
    programs = plan.grid * slices if tokens else 1
    stash = stash_rows(target, n, dim, values.element_size()) if writes_once and need_values and need_du else 0
    if stash and forced(OP, "backward").get("stash", stash) == 0:
        stash = 0  # plan_override("attn_res", "backward", stash=0): the partial sums get their own buffer
    rows = (programs + 1, stash, 3) if stash else (programs, dim) if need_du else (1,)  # + 1: see _keep_row_scalars
    acc = accumulate_dtype(values.dtype)
    partial = (values.new_empty if writes_once else values.new_zeros)(rows, dtype=acc)
    block_d, block_p, reduce_grid, rewrite_p = _reduce_plan(target, dim, programs, stash, acc.itemsize)
    if tokens:
        grad_out = grad_out.contiguous()
        s1, s2, st0, st1, st2 = sources_walk(values)
        weight = query if norm_weight is None else norm_weight
        dv = grad_values if need_values else grad_out
        glse = grad_out if grad_lse is None else grad_lse.contiguous()
        flags = dict(HAS_WEIGHT=norm_weight is not None, HAS_DLSE=grad_lse is not None, NEED_DV=need_values,
                     NEED_DU=need_du, BLOCK_D=plan.block_d, F64=acc == torch.float64, num_warps=plan.num_warps,
                     num_stages=plan.num_stages)
        constant_dim = dict(DIM=dim if plan.constant_dim and isinstance(dim, int) else 0)
        # Always passed: torch.compile's wrap_triton takes no defaults for constexpr parameters.
        stash_flags = dict(STASH=stash, STASH_BLOCK=block_d if stash else 2)
        rows_in = dict(g_ptr=grad_out, glse_ptr=glse, v_ptr=values, q_ptr=query, w_ptr=weight, dv_ptr=dv,
                       partial_ptr=partial)
        walk = dict(N=n, T=tokens, D=dim, S1=s1, S2=s2, ST0=st0, ST1=st1, ST2=st2, STRIDE_N=values.stride(0),
                    DV_STEP=tokens * dim, **float_args(eps=eps))
        if plan.block_n:
            launch(attn_res_bwd_depth_tile_kernel, (plan.grid,), dict(rows_in, **walk),
                   dict(flags, BLOCK_N=plan.block_n, **stash_flags))
        elif one_pass:
            defer = out.element_size() == 2
            waiting = values.new_empty(waiting_slots_elements(plan.grid, plan.block_t) if defer else 0, dtype=acc)
            launch(
                attn_res_bwd_onepass_kernel, (plan.grid,),
                dict(rows_in, out_ptr=out.contiguous(), lse_ptr=lse.contiguous(), wait_ptr=waiting, **walk),
                dict(flags, DEFER=defer, UNROLL=plan.unroll, BLOCK_T=plan.block_t, **stash_flags,
                     **constant_dim, PREFETCH=plan.prefetch, FUSED_SUMS=plan.fused_sums),
            )
        else:
            stats = values.new_empty((3, n, tokens), dtype=acc)
            args = dict(rows_in, stats_ptr=stats, **walk, STAT_PLANE=n * tokens, SLICE=slice_rows)
            flags = dict(flags, ONE_TILE=plan.one_tile and not slice_rows, UNROLL=plan.unroll, BLOCK_T=plan.block_t)
            for phase in (1, 2) if slice_rows else (0,):
                launch(attn_res_bwd_kernel, (plan.grid, slices) if slice_rows else (plan.grid,), args,
                       dict(flags, PHASE=phase))
    if need_du:
        # With a stash the reduction also rewrites the stashed rows (from grad_out and values).
        rows_from = (grad_out, values, grad_values) if stash else (partial, partial, partial)
        first_token_step = 1 if plan.block_n else plan.block_t
        if stash:
            s1, s2, st0, st1, st2 = sources_walk(values)
            walk = dict(T0_STEP=first_token_step, S1=s1, S2=s2, ST0=st0, ST1=st1, ST2=st2, STRIDE_N=values.stride(0),
                        DV_STEP=tokens * dim)
        else:
            walk = dict(T0_STEP=1, S1=1, S2=1, ST0=0, ST1=0, ST2=0, STRIDE_N=0, DV_STEP=0)
        launch(
            attn_res_param_grad_kernel, (reduce_grid,),
            dict(partial_ptr=partial, q_ptr=query, w_ptr=query if norm_weight is None else norm_weight,
                 dq_ptr=grad_query if need_query else partial, dw_ptr=grad_weight if need_norm_weight else partial,
                 g_ptr=rows_from[0], v_ptr=rows_from[1], dv_ptr=rows_from[2], P=programs, D=dim, **walk),
            dict(HAS_WEIGHT=norm_weight is not None, NEED_DQ=need_query, NEED_DW=need_norm_weight, STASH=stash,
                 BLOCK_P=block_p, BLOCK_D=block_d, REWRITE_P=rewrite_p, F64=acc == torch.float64),
        )
    return grad_values, grad_query, grad_weight


def _run(values: Tensor, query: Tensor, norm_weight: Optional[Tensor], eps: float) -> tuple[Tensor, Tensor]:
    """(out, lse) on checked arguments: kernels under the device's plan, or the reference."""
    target = target_for(values.device, values.dtype)
    if target is None:
        return reference.attn_res(values, query, norm_weight, eps)
    return _forward(values, query, norm_weight, eps, target)


def _run_backward(grad_out, values, query, norm_weight, eps, need_values, need_query, need_norm_weight,
                  out=None, lse=None, grad_lse=None):
    target = target_for(values.device, values.dtype)
    if target is None:
        grads = reference.attn_res_backward(
            grad_out, values, query, norm_weight, eps, need_values, need_query, need_norm_weight, grad_lse
        )
        return tuple(g if g is not None else values.new_empty(0) for g in grads)
    return _backward(
        grad_out, values, query, norm_weight, eps, need_values, need_query, need_norm_weight, target, out, lse, grad_lse
    )


def _run_out(values: Tensor, query: Tensor, norm_weight: Optional[Tensor], eps: float) -> Tensor:
    return _run(values, query, norm_weight, eps)[0]


def check_backward_args(values: Tensor, grad_out: Tensor, out: Optional[Tensor], lse: Optional[Tensor],
                        grad_lse: Optional[Tensor]) -> None:
    """grad_out and out [*batch, D] in values' dtype, lse and grad_lse [*batch] float32 (float64 for float64
    values), all on values' device (check_args has checked values)."""
    if (out is None) != (lse is None):
        raise ValueError("out and lse come together (both from attn_res_with_lse) or not at all")
    check_tensor("grad_out", grad_out, values.dtype, values.shape[1:])
    check_tensor("out", out, values.dtype, values.shape[1:], optional=True)
    check_tensor("lse", lse, accumulate_dtype(values.dtype), values.shape[1:-1], optional=True)
    check_tensor("grad_lse", grad_lse, accumulate_dtype(values.dtype), values.shape[1:-1], optional=True)
    check_same_device([("values", values), ("grad_out", grad_out), ("out", out), ("lse", lse), ("grad_lse", grad_lse)])


def _backward_fake(grad_out, values, query, norm_weight, eps, need_values, need_query, need_norm_weight, out=None,
                   lse=None, grad_lse=None):
    check_args(values, query, norm_weight, eps)
    check_backward_args(values, grad_out, out, lse, grad_lse)
    need_norm_weight = need_norm_weight and norm_weight is not None
    return (
        torch.empty_like(values, memory_format=torch.contiguous_format) if need_values else values.new_empty(0),
        torch.empty_like(query) if need_query else query.new_empty(0),
        torch.empty_like(norm_weight) if need_norm_weight else query.new_empty(0),
    )


@fused_op("attn_res_backward", fake=_backward_fake, run=_run_backward)
def attn_res_backward_op(
    grad_out: Tensor,
    values: Tensor,
    query: Tensor,
    norm_weight: Optional[Tensor],
    eps: float,
    need_values: bool,
    need_query: bool,
    need_norm_weight: bool,
    out: Optional[Tensor] = None,
    lse: Optional[Tensor] = None,
    grad_lse: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of attn_res w.r.t. (values, query, norm_weight). A gradient that is not asked for
    (or norm_weight's when it is None) comes back as an empty tensor and is never computed.
    out and lse (the forward's, from attn_res_with_lse) let the kernels make one pass over values,
    using sum_j alpha_j <g, v_j> = <g, out>; grad_lse is the gradient of lse, if any.
    Deterministic: per-program partial sums reduced in a fixed order, no atomics."""
    check_args(values, query, norm_weight, eps)
    check_backward_args(values, grad_out, out, lse, grad_lse)
    need_norm_weight = need_norm_weight and norm_weight is not None
    return _run_backward(grad_out, values, query, norm_weight, eps, need_values, need_query, need_norm_weight,
                         out, lse, grad_lse)


def _fake(values, query, norm_weight, eps):
    check_args(values, query, norm_weight, eps)
    return values.new_empty(values.shape[1:])


def _fake_with_lse(values, query, norm_weight, eps):
    lse = values.new_empty(values.shape[1:-1], dtype=accumulate_dtype(values.dtype))
    return _fake(values, query, norm_weight, eps), lse


def _setup_context(ctx, inputs, output):
    values, query, norm_weight, eps = inputs
    ctx.save_for_backward(values, query, norm_weight)
    ctx.eps = eps


def _setup_context_with_lse(ctx, inputs, output):
    values, query, norm_weight, eps = inputs
    out, lse = output
    ctx.set_materialize_grads(False)  # an unused lse gets no zero-filled gradient
    ctx.save_for_backward(values, query, norm_weight, out, lse)
    ctx.eps = eps


def _gradients(ctx, grad_out, values, query, norm_weight, out=None, lse=None, grad_lse=None):
    """The backward op's result as autograd wants it: None for the inputs that need no gradient."""
    need_values, need_query, need_weight = ctx.needs_input_grad[:3]
    need_weight = need_weight and norm_weight is not None
    grads = attn_res_backward_op(grad_out, values, query, norm_weight, ctx.eps, need_values, need_query, need_weight,
                                 out, lse, grad_lse)
    return tuple(g if need else None for g, need in zip(grads, (need_values, need_query, need_weight))) + (None,)


def _backward_rule(ctx, grad_out):
    return _gradients(ctx, grad_out, *ctx.saved_tensors)


def _backward_rule_with_lse(ctx, grad_out, grad_lse):
    values, query, norm_weight, out, lse = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    return _gradients(ctx, grad_out, values, query, norm_weight, out, lse, grad_lse)


@fused_op("attn_res", fake=_fake, run=_run_out, setup_context=_setup_context, backward=_backward_rule)
def attn_res_op(values: Tensor, query: Tensor, norm_weight: Optional[Tensor], eps: float) -> Tensor:
    """AttnRes depth mixing, out only. See `fusedops.attn_res` for shapes, dtypes and semantics.
    Without the forward's lse its backward re-derives the softmax in a first pass over values;
    `fusedops::attn_res_with_lse` (what `fusedops.attn_res` calls) saves lse and reads values once."""
    check_args(values, query, norm_weight, eps)
    return _run_out(values, query, norm_weight, eps)


@fused_op("attn_res_with_lse", fake=_fake_with_lse, run=_run, setup_context=_setup_context_with_lse,
          backward=_backward_rule_with_lse)
def attn_res_with_lse_op(
    values: Tensor, query: Tensor, norm_weight: Optional[Tensor], eps: float
) -> tuple[Tensor, Tensor]:
    """(out, lse): out as `fusedops::attn_res`, lse [*batch] fp32 the logsumexp over depth of the
    logits (differentiable). Its backward makes one pass over values (out and lse are saved)."""
    check_args(values, query, norm_weight, eps)
    return _run(values, query, norm_weight, eps)


def attn_res(
    values: Tensor, query: Tensor, norm_weight: Optional[Tensor] = None, eps: float = 1e-6, return_lse: bool = False
):
    """Attention Residuals (Kimi AttnRes): a softmax over depth mixes N sources per token.

    Args:
        values: [N, *batch, D] float32/float16/bfloat16/float64. The N depth sources (embedding output and
            block outputs); any number of batch dims, zero included. Any layout: a slice of a
            preallocated bank (``bank[:n]``), permuted or expanded batch dims are read in place
            where the last dim has stride 1 and the batch dims merge into three strided dims; other
            layouts are copied, once in the forward and once in the backward. Or a list/tuple of N tensors
            [*batch, D]: equally spaced views of one storage (``[bank[:, i] for i in range(n)]``) become a view
            of it (no copy, outside torch.compile), other lists are stacked (one copy); see
            `fusedops.attn_res_multi`.
        query: [D] float32/float16/bfloat16/float64, the learned pseudo-query; its dtype need not be values'
            (e.g. fp32 with bf16 values).
        norm_weight: [D] float32/float16/bfloat16/float64 RMSNorm gain applied to the keys; None means ones.
        eps: RMSNorm epsilon in [~1.2e-38, ~3.4e38]: a normal float32 number (the kernels compute in
            float32, where a smaller eps is subnormal or 0, and a zero row's rstd = eps ** -0.5, or its
            square in the backward, overflows).
        return_lse: a bool; also return lse [*batch] float32 (float64 for float64 values), the logsumexp
            over depth of the logits (differentiable).

    Returns:
        out, or (out, lse) with return_lse. out is [*batch, D] in values' dtype:
        ``out = sum_i softmax_i(<query, rmsnorm(values[i]) * norm_weight>) * values[i]``
        with ``rmsnorm(v) = v / sqrt(mean(v * v) + eps)``; the softmax runs over the N axis and the
        values enter the sum un-normalised. All reductions accumulate in fp32; float64 values run in
        float64 throughout (for gradcheck; eps keeps the float32 range).

    Non-finite values give the reference's IEEE results, none is refused: lse is torch.logsumexp's over
    depth (-inf where every logit is -inf, +inf with a +inf logit, e.g. from an inf in norm_weight, NaN
    with a NaN), out and the gradients softmax's (NaN where lse is not finite).

    Runs the op ``fusedops::attn_res_with_lse``, which saves out and lse (O(tokens) fp32) for a backward
    that reads values once: sum_j alpha_j <g, v_j> = <g, out>. Differentiable in values, query and
    norm_weight; the backward is the op ``fusedops::attn_res_backward`` (deterministic; values are
    read in place where their layout allows, see above). As with any op that saves its output,
    modifying out in place before backward is an error.
    Raises ValueError naming the argument on bad input (under torch.compile, from the op's fake kernel:
    dynamo reports it with its message).
    """
    check_bool("return_lse", return_lse)
    if isinstance(values, (list, tuple)):  # N sources not stacked (issue 37): a view of their bank, or a stack
        from fusedops.block_attn_res.sources import stack_sources

        values = stack_sources("values", values)
    if checks_in_wrapper():
        check_args(values, query, norm_weight, eps)
    out, lse = attn_res_with_lse_op(values, query, norm_weight, eps)
    return (out, lse) if return_lse else out
