"""Registration of Block AttnRes's ops: fusedops::attn_res_multi (phase 1) and fusedops::attn_res_merge
(phase 2), with their backward ops fusedops::attn_res_multi_backward and fusedops::attn_res_merge_backward."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from fusedops.launch import launch
from fusedops.layout import collapse_dims, sources_walk, unit_last_stride, walkable_sources
from fusedops.numerics import accumulate_dtype, float_args
from fusedops.registry import fused_op
from fusedops.targets import Target, target_for
from fusedops.validation import (
    check_float,
    check_fp32_normal,
    check_min_dim,
    check_same_device,
    check_sources,
    check_tensor,
    checks_in_wrapper,
)

from . import reference
from .kernels import (
    attn_res_merge_bwd_kernel,
    attn_res_merge_fwd_kernel,
    attn_res_multi_bwd_grads_flat_kernel,
    attn_res_multi_bwd_grads_kernel,
    attn_res_multi_bwd_kernel,
    attn_res_multi_bwd_stats_kernel,
    attn_res_multi_fwd_dot_kernel,
    attn_res_multi_fwd_kernel,
    attn_res_multi_logits_kernel,
    attn_res_multi_out_kernel,
    attn_res_multi_softmax_kernel,
)
from .plan import DOT_MIN, MultiPlan, flat_grad_cols, flat_grad_step, forced_plan, merge_plan, multi_plan, pow2_at_least
from .sources import stack_sources

# ---- attn_res_multi ---------------------------------------------------------------------------------------


def check_multi_args(values: Tensor, queries: Tensor, eps: float) -> None:
    dim = check_sources(values)
    check_float("queries", queries)
    if queries.dim() != 2 or queries.shape[1] != dim or queries.shape[0] == 0:
        raise ValueError(f"queries must have shape [M, D] = [M >= 1, {dim}] to match values, got "
                         f"{tuple(queries.shape)}")
    check_same_device([("values", values), ("queries", queries)])
    check_fp32_normal("eps", eps)


def check_multi_backward_args(values: Tensor, queries: Tensor, grad_out: Optional[Tensor],
                              grad_lse: Optional[Tensor]) -> None:
    m = queries.shape[0]
    check_tensor("grad_out", grad_out, values.dtype, (m, *values.shape[1:]), optional=True)
    check_tensor("grad_lse", grad_lse, accumulate_dtype(values.dtype), (m, *values.shape[1:-1]), optional=True)
    check_same_device([("values", values), ("grad_out", grad_out), ("grad_lse", grad_lse)])


def _multi_forward(values: Tensor, queries: Tensor, eps: float, target: Target) -> tuple[Tensor, Tensor]:
    n, dim, m = values.shape[0], values.shape[-1], queries.shape[0]
    out = values.new_empty((m, *values.shape[1:]))
    lse = values.new_empty((m, *values.shape[1:-1]), dtype=accumulate_dtype(values.dtype))
    tokens = out[0].numel() // dim
    if tokens == 0:
        return out, lse
    values, queries = walkable_sources(values), unit_last_stride(queries)
    s1, s2, st0, st1, st2 = sources_walk(values)
    plan = forced_plan(multi_plan(target, tokens, n, m, dim, values.element_size()), "multi_fwd", sources=n, queries=m,
                       dim=dim)
    if plan.two_pass:
        _two_pass_forward(values, queries, out, lse, eps, plan, target, tokens, s1, s2, st0, st1, st2)
        return out, lse
    if plan.dot:
        launch(attn_res_multi_fwd_dot_kernel, (plan.grid,),
               dict(v_ptr=values, q_ptr=queries, out_ptr=out, lse_ptr=lse, N=n, M=m, T=tokens, D=dim, S1=s1,
                    S2=s2, ST0=st0, ST1=st1, ST2=st2, STRIDE_N=values.stride(0), QS=queries.stride(0),
                    OUT_STEP=tokens * dim, D_CHUNK=plan.d_chunk, **float_args(eps=eps)),
               dict(SPLITS=plan.splits, BLOCK_T=plan.block_t, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
                    BLOCK_D=plan.block_d, BLOCK_D2=plan.block_d2,
                    # the interpreter's bfloat16 tl.dot is wrong: there bfloat16 takes the tf32x3 path
                    BF16=values.dtype == torch.bfloat16 and not target.interpreted,
                    num_warps=plan.num_warps, num_stages=plan.num_stages))
        return out, lse
    launch(attn_res_multi_fwd_kernel, (plan.grid,),
           dict(v_ptr=values, q_ptr=queries, out_ptr=out, lse_ptr=lse, N=n, M=m, T=tokens, D=dim, S1=s1, S2=s2,
                ST0=st0, ST1=st1, ST2=st2, STRIDE_N=values.stride(0), QS=queries.stride(0), OUT_STEP=tokens * dim,
                D_CHUNK=plan.d_chunk, **float_args(eps=eps)),
           dict(SPLITS=plan.splits, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_D=plan.block_d,
                F64=values.dtype == torch.float64, num_warps=plan.num_warps))
    return out, lse


# The softmax between the two passes: a [rows, next_pow2(N)] tile of this many elements a program (its logits are
# 1/300 of the rows' bytes at N = 8, M = 24, D = 7168; not tuned).
SOFTMAX_ELEMENTS = 4096


def _two_pass_forward(values, queries, out, lse, eps, plan: MultiPlan, target: Target, tokens, s1, s2, st0, st1,
                      st2) -> None:
    """attn_res_multi's forward reading the rows twice (plan.two_pass): the logits [T, M, N] float32 on tensor
    cores, their softmax in place, then the outputs from the weights and the rows."""
    n, dim, m = values.shape[0], values.shape[-1], queries.shape[0]
    walk = dict(N=n, M=m, T=tokens, D=dim, S1=s1, S2=s2, ST0=st0, ST1=st1, ST2=st2, STRIDE_N=values.stride(0),
                DIM=dim if plan.constant_dim and isinstance(dim, int) else 0)
    logits = torch.empty((tokens, m, n), dtype=torch.float32, device=values.device)
    _multi_logits(values, queries, logits, eps, plan, target, walk)
    _multi_weights(logits, lse, walk)
    _multi_outputs(values, logits, out, plan, walk)


def _multi_logits(values, queries, logits, eps, plan: MultiPlan, target: Target, walk: dict) -> None:
    """The two-pass forward's first pass over the rows: logits [T, M, N] float32."""
    launch(attn_res_multi_logits_kernel, (-(-walk["T"] * walk["N"] // plan.block_t),),
           dict(v_ptr=values, q_ptr=queries, logits_ptr=logits, QS=queries.stride(0), **float_args(eps=eps),
                **{k: v for k, v in walk.items() if k != "DIM"}),
           dict(BLOCK_R=plan.block_t, BLOCK_M=plan.block_m, BLOCK_D=plan.block_d,
                # the interpreter's bfloat16 tl.dot is wrong: there bfloat16 takes the tf32x3 path
                BF16=values.dtype == torch.bfloat16 and not target.interpreted, DIM=walk["DIM"],
                num_warps=plan.num_warps, num_stages=plan.num_stages))


def _multi_weights(logits, lse, walk: dict) -> None:
    """The softmax over depth, over the logits in place (then alpha [T, M, N]), and lse."""
    rows = walk["T"] * walk["M"]
    block_n = pow2_at_least(walk["N"], 1)
    block_r = max(1, SOFTMAX_ELEMENTS // block_n)
    launch(attn_res_multi_softmax_kernel, (-(-rows // block_r),),
           dict(logits_ptr=logits, lse_ptr=lse, N=walk["N"], M=walk["M"], T=walk["T"]),
           dict(BLOCK_R=block_r, BLOCK_N=block_n))


def _multi_outputs(values, alpha, out, plan: MultiPlan, walk: dict) -> None:
    """The two-pass forward's second pass over the rows: out from alpha and the rows."""
    launch(attn_res_multi_out_kernel, (walk["T"] * -(-walk["D"] // plan.block_d2),),
           dict(v_ptr=values, alpha_ptr=alpha, out_ptr=out, OUT_STEP=walk["T"] * walk["D"],
                **{k: v for k, v in walk.items() if k != "DIM"}),
           dict(HEAD=plan.block_n, TAIL=plan.tail_rows, BLOCK_D=plan.block_d2, DIM=walk["DIM"],
                num_warps=plan.out_warps))


def _multi_backward(grad_out: Optional[Tensor], grad_lse: Optional[Tensor], values: Tensor, queries: Tensor,
                    eps: float, need_values: bool, need_queries: bool, target: Target) -> tuple[Tensor, Tensor]:
    n, dim, m = values.shape[0], values.shape[-1], queries.shape[0]
    values, queries = walkable_sources(values), unit_last_stride(queries)
    grad_values = (torch.empty_like(values, memory_format=torch.contiguous_format) if need_values
                   else values.new_empty(0))
    grad_queries = torch.empty_like(queries) if need_queries else queries.new_empty(0)
    tokens = values[0].numel() // dim
    if not (need_values or need_queries):
        return grad_values, grad_queries
    if tokens == 0 or (grad_out is None and grad_lse is None):
        grad_values.zero_()
        grad_queries.zero_()
        return grad_values, grad_queries
    acc = accumulate_dtype(values.dtype)
    plan = forced_plan(multi_plan(target, tokens, n, m, dim, values.element_size(), backward=True), "multi_bwd",
                       sources=n, queries=m, dim=dim)
    s1, s2, st0, st1, st2 = sources_walk(values)
    g = values if grad_out is None else grad_out.contiguous()
    glse = values if grad_lse is None else grad_lse.contiguous()
    walk = dict(N=n, M=m, T=tokens, D=dim, S1=s1, S2=s2, ST0=st0, ST1=st1, ST2=st2, STRIDE_N=values.stride(0),
                QS=queries.stride(0), OUT_STEP=tokens * dim)
    flags = dict(HAS_G=grad_out is not None, NEED_DV=need_values, NEED_DQ=need_queries)
    if plan.dot:
        _multi_backward_dot(g, glse, values, queries, grad_values, grad_queries, grad_lse is not None, eps, plan,
                            walk, flags, target.interpreted)
        return grad_values, grad_queries
    partial = values.new_zeros((plan.grid, m, dim) if need_queries else (1,), dtype=acc)
    launch(attn_res_multi_bwd_kernel, (plan.grid,),
           dict(g_ptr=g, glse_ptr=glse, v_ptr=values, q_ptr=queries, dv_ptr=grad_values if need_values else values,
                partial_ptr=partial, **walk, DV_STEP=tokens * dim, **float_args(eps=eps)),
           dict(flags, HAS_DLSE=grad_lse is not None, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_D=plan.block_d,
                F64=acc == torch.float64, num_warps=plan.num_warps))
    if need_queries:
        grad_queries.copy_(partial.sum(0))  # a fixed-order reduction: deterministic
    return grad_values, grad_queries


def _multi_backward_dot(g, glse, values, queries, grad_values, grad_queries, has_dlse: bool, eps: float,
                        plan: MultiPlan, walk: dict, flags: dict, interpreted: bool) -> None:
    """The tensor-core backward: attn_res_multi_bwd_stats_kernel writes each (token, query, source)'s alpha and
    coef and each (token, source)'s ck, then attn_res_multi_bwd_grads_flat_kernel (plan.grad_rows) or
    attn_res_multi_bwd_grads_kernel the gradients from them."""
    tokens, m, n, dim = walk["T"], walk["M"], walk["N"], walk["D"]
    alpha, coef = (values.new_empty((tokens, m, n), dtype=torch.float32) for _ in range(2))
    ck = values.new_empty((tokens, n), dtype=torch.float32)
    # the interpreter's bfloat16 tl.dot is wrong: there bfloat16 takes the tf32x3 path
    exact_bf16 = values.dtype == torch.bfloat16 and not interpreted
    precision = dict(BF16=exact_bf16)
    launch(attn_res_multi_bwd_stats_kernel, (-(-tokens // plan.block_t),),
           dict(v_ptr=values, q_ptr=queries, g_ptr=g, glse_ptr=glse, alpha_ptr=alpha, coef_ptr=coef, ck_ptr=ck,
                **walk, **float_args(eps=eps)),
           dict(HAS_G=flags["HAS_G"], HAS_DLSE=has_dlse, BLOCK_T=plan.block_t, BLOCK_M=plan.block_m,
                BLOCK_N=plan.block_n, BLOCK_D=plan.block_d, HALF=exact_bf16 or values.dtype == torch.float16,
                num_warps=plan.num_warps, **precision))
    step = flat_grad_step(plan.grad_rows, n) if plan.grad_rows else plan.grad_tokens or plan.block_t
    per_program = -(-(-(-tokens // plan.grid)) // step) * step
    programs = -(-tokens // per_program)
    partial = values.new_empty((programs, m, dim) if flags["NEED_DQ"] else (1,), dtype=torch.float32)
    stages = {"num_stages": plan.grad_stages} if plan.grad_stages else {}
    args = dict(v_ptr=values, q_ptr=queries, g_ptr=g, alpha_ptr=alpha, coef_ptr=coef, ck_ptr=ck,
                dv_ptr=grad_values if flags["NEED_DV"] else values, partial_ptr=partial, **walk, DV_STEP=tokens * dim,
                TOKENS_PER_PROGRAM=per_program)
    meta = dict(flags, BLOCK_M=plan.block_m, BLOCK_D=plan.block_d2, num_warps=plan.out_warps, **precision, **stages)
    if plan.grad_rows:
        launch(attn_res_multi_bwd_grads_flat_kernel, (-(-dim // plan.block_d2), programs), dict(args, STEP=step),
               dict(meta, BLOCK_R=pow2_at_least(max(plan.grad_rows, n), DOT_MIN),
                    BLOCK_K=flat_grad_cols(plan.grad_rows, n, m)))
    else:
        launch(attn_res_multi_bwd_grads_kernel, (-(-dim // plan.block_d2), programs), args,
               dict(meta, BLOCK_T=step, BLOCK_N=plan.block_n))
    if flags["NEED_DQ"]:
        grad_queries.copy_(partial.sum(0))  # a fixed-order reduction: deterministic


def _multi_run(values: Tensor, queries: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    target = target_for(values.device, values.dtype)
    if target is None:
        return reference.attn_res_multi(values, queries, eps)
    return _multi_forward(values, queries, eps, target)


def _multi_run_backward(grad_out, grad_lse, values, queries, eps, need_values, need_queries):
    target = target_for(values.device, values.dtype)
    if target is None:
        grads = reference.attn_res_multi_backward(grad_out, grad_lse, values, queries, eps, need_values,
                                                  need_queries)
        return tuple(g if g is not None else values.new_empty(0) for g in grads)
    return _multi_backward(grad_out, grad_lse, values, queries, eps, need_values, need_queries, target)


def _multi_backward_fake(grad_out, grad_lse, values, queries, eps, need_values, need_queries):
    check_multi_args(values, queries, eps)
    check_multi_backward_args(values, queries, grad_out, grad_lse)
    return (torch.empty_like(values, memory_format=torch.contiguous_format) if need_values else values.new_empty(0),
            torch.empty_like(queries) if need_queries else queries.new_empty(0))


@fused_op("attn_res_multi_backward", fake=_multi_backward_fake, run=_multi_run_backward)
def attn_res_multi_backward_op(
    grad_out: Optional[Tensor], grad_lse: Optional[Tensor], values: Tensor, queries: Tensor, eps: float,
    need_values: bool, need_queries: bool,
) -> tuple[Tensor, Tensor]:
    """Gradients of attn_res_multi w.r.t. (values, queries) from grad_out [M, *batch, D] (values' dtype) and
    grad_lse [M, *batch] (lse's dtype), either may be None (zero). A gradient not asked for comes back as an
    empty tensor. grad_values is contiguous [N, *batch, D]. Re-derives the softmax from values (neither out
    nor lse is needed); deterministic (per-program partial sums reduced in a fixed order, no atomics)."""
    check_multi_args(values, queries, eps)
    check_multi_backward_args(values, queries, grad_out, grad_lse)
    return _multi_run_backward(grad_out, grad_lse, values, queries, eps, need_values, need_queries)


def _multi_fake(values, queries, eps):
    check_multi_args(values, queries, eps)
    m = queries.shape[0]
    return (values.new_empty((m, *values.shape[1:])),
            values.new_empty((m, *values.shape[1:-1]), dtype=accumulate_dtype(values.dtype)))


def _multi_setup_context(ctx, inputs, output):
    values, queries, eps = inputs
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(values, queries)
    ctx.eps = eps


def _multi_backward_rule(ctx, grad_out, grad_lse):
    values, queries = ctx.saved_tensors
    need_values, need_queries = ctx.needs_input_grad[:2]
    grads = attn_res_multi_backward_op(grad_out, grad_lse, values, queries, ctx.eps, need_values, need_queries)
    return (grads[0] if need_values else None, grads[1] if need_queries else None, None)


@fused_op("attn_res_multi", fake=_multi_fake, run=_multi_run, setup_context=_multi_setup_context,
          backward=_multi_backward_rule)
def attn_res_multi_op(values: Tensor, queries: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Phase 1 of Block AttnRes: (out [M, *batch, D] in values' dtype, lse [M, *batch] float32, float64 for
    float64 values). See `fusedops.attn_res_multi`."""
    check_multi_args(values, queries, eps)
    return _multi_run(values, queries, eps)


def attn_res_multi(values, queries: Tensor, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """Phase 1 of Block AttnRes (Kimi, arXiv 2603.15031, Algorithm 1): M pseudo-queries attend over the same
    N depth sources, each source row read once for all M.

    Args:
        values: [N, *batch, D] float32/float16/bfloat16/float64, the completed block sums b_0..b_{N-1}; or a
            list/tuple of N tensors [*batch, D] of one dtype and device. Any layout of a tensor is read in
            place where its last dim has stride 1 and its batch dims merge into three strided dims, e.g. a
            token-major bank ``bank[:, :n].movedim(1, 0)`` of a ``[tokens, N_max, D]`` buffer. A list whose
            tensors are equally spaced views of one storage (``[bank[:, i] for i in range(n)]``) becomes a
            view of it (no copy, outside torch.compile); any other list is stacked (one copy).
        queries: [M, D] float32/float16/bfloat16/float64, the pseudo-queries already folded with their
            key-norm gains (q_l = w_l * g_l); their dtype need not be values'.
        eps: RMSNorm epsilon of the keys, a normal float32 number (as `fusedops.attn_res`).

    Returns:
        (out, lse): out [M, *batch, D] in values' dtype and lse [M, *batch] float32 (float64 for float64
        values), for each query l
        ``s_{l,i} = <queries[l], values[i]> / sqrt(mean(values[i] ** 2) + eps)``,
        ``out[l] = sum_i softmax_i(s_{l,.}) values[i]``, ``lse[l] = logsumexp_i s_{l,i}``:
        ``out[l] == fusedops.attn_res(values, queries[l], None, eps)`` (its lse likewise).

    Differentiable in values and queries (also through lse); the backward is the op
    ``fusedops::attn_res_multi_backward`` (deterministic). Raises ValueError naming the argument on bad input.
    """
    values = stack_sources("values", values)
    if checks_in_wrapper():
        check_multi_args(values, queries, eps)
    return attn_res_multi_op(values, queries, eps)


# ---- attn_res_merge ---------------------------------------------------------------------------------------


def check_merge_args(out: Tensor, lse: Tensor, partial: Tensor, query: Tensor, addend: Optional[Tensor],
                     addend2: Optional[Tensor], gain: Optional[Tensor], eps: float, norm_eps: float) -> None:
    check_float("out", out)
    check_min_dim("out", out, 1)
    dim = out.shape[-1]
    if dim == 0:
        raise ValueError("out must have a feature dim D >= 1, got D = 0")
    check_tensor("lse", lse, accumulate_dtype(out.dtype), out.shape[:-1])
    check_tensor("partial", partial, out.dtype, out.shape)
    check_tensor("addend", addend, out.dtype, out.shape, optional=True)
    check_tensor("addend2", addend2, out.dtype, out.shape, optional=True)
    if addend2 is not None and addend is None:
        raise ValueError("addend2 needs addend (pass a single addend as addend)")
    for name, t in (("query", query), ("gain", gain)):
        if t is None and name == "gain":
            continue
        check_float(name, t)
        if t.dim() != 1 or t.shape[0] != dim:
            raise ValueError(f"{name} must have shape [D] = [{dim}] to match out, got {tuple(t.shape)}")
    check_same_device([("out", out), ("lse", lse), ("partial", partial), ("query", query), ("addend", addend),
                       ("addend2", addend2), ("gain", gain)])
    check_fp32_normal("eps", eps)
    check_fp32_normal("norm_eps", norm_eps)


def check_merge_backward_args(grad_h: Tensor, grad_partial: Optional[Tensor], out: Tensor) -> None:
    check_tensor("grad_h", grad_h, out.dtype, out.shape)
    check_tensor("grad_partial", grad_partial, out.dtype, out.shape, optional=True)
    check_same_device([("out", out), ("grad_h", grad_h), ("grad_partial", grad_partial)])


def _rows(t: Optional[Tensor]) -> tuple[Optional[Tensor], int]:
    """(t, the element distance of its rows) when t's batch dims merge into one strided dim and its last dim
    has stride 1 (a bank slot is read in place), else (a contiguous copy, D)."""
    if t is None:
        return None, 0
    sizes, strides = collapse_dims(t.shape[:-1], t.stride()[:-1])
    if len(sizes) == 1 and unit_last_stride(t) is t:
        return t, strides[0]
    return t.contiguous(), t.shape[-1]


def _merge_forward(out, lse, partial, query, addend, addend2, gain, eps, norm_eps, target: Target,
                   partial_out: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(y, p'): p' a new tensor when there are addends, else empty; with partial_out, p' is written there
    (rows read in place, see _rows) and the second result is empty."""
    dim = out.shape[-1]
    num_add = (addend is not None) + (addend2 is not None)
    y = torch.empty(out.shape, dtype=out.dtype, device=out.device)
    store = num_add > 0 or partial_out is not None
    if partial_out is None and num_add:
        p_new = torch.empty(partial.shape, dtype=partial.dtype, device=partial.device)
    else:
        p_new = partial.new_empty(0)
    tokens = y.numel() // dim
    if tokens == 0:
        return y, p_new
    plan = forced_plan(merge_plan(target, tokens, dim, out.element_size()), "merge_fwd", sources=1, queries=1, dim=dim)
    (o, o_st), (p, p_st), (a1, a1_st), (a2, a2_st) = map(_rows, (out, partial, addend, addend2))
    pn, pn_st = (p_new, dim) if partial_out is None else _rows(partial_out)
    if pn is not partial_out and partial_out is not None:
        raise ValueError("partial_out's batch dims must merge into one strided dim with a unit last stride "
                         f"(a bank slot), got strides {partial_out.stride()}")
    query, gain, lse = unit_last_stride(query), unit_last_stride(gain), lse.contiguous()
    per_program = plan.block_t * plan.blocks_per_program
    # blocks_per_program > 0: the grid follows from it, so a forced value cannot leave tokens out
    launch(attn_res_merge_fwd_kernel, (-(-tokens // per_program) if per_program else plan.grid,),
           dict(o_ptr=o, lse_ptr=lse, p_ptr=p, a1_ptr=p if a1 is None else a1, a2_ptr=p if a2 is None else a2,
                q_ptr=query, gain_ptr=query if gain is None else gain, y_ptr=y, pn_ptr=pn if store else y,
                T=tokens, D=dim, O_ST=o_st, P_ST=p_st, A1_ST=a1_st, A2_ST=a2_st, PN_ST=pn_st,
                **float_args(eps=eps, norm_eps=norm_eps)),
           dict(NUM_ADD=num_add, STORE_P=store, HAS_GAIN=gain is not None, BLOCK_T=plan.block_t, BLOCK_D=plan.block_d,
                F64=out.dtype == torch.float64, WHOLE_ROW=plan.whole_row, BLOCKS=plan.blocks_per_program,
                DIM=dim if plan.constant_dim and isinstance(dim, int) else 0, num_warps=plan.num_warps))
    return y, p_new


def _merge_backward(grad_h, grad_partial, out, lse, partial, query, gain, eps, norm_eps, need_out, need_lse,
                    need_partial, need_query, need_gain, target: Target):
    dim = out.shape[-1]
    need_gain = need_gain and gain is not None
    acc = accumulate_dtype(out.dtype)
    d_out = torch.empty(out.shape, dtype=out.dtype, device=out.device) if need_out else out.new_empty(0)
    d_lse = torch.empty(lse.shape, dtype=lse.dtype, device=lse.device)
    d_partial = torch.empty(partial.shape, dtype=partial.dtype, device=partial.device) if need_partial \
        else partial.new_empty(0)
    d_query = torch.empty_like(query) if need_query else query.new_empty(0)
    d_gain = torch.empty_like(gain) if need_gain else query.new_empty(0)
    tokens = out.numel() // dim
    if tokens == 0:
        d_query.zero_()
        d_gain.zero_()
        return d_out, d_lse if need_lse else lse.new_empty(0), d_partial, d_query, d_gain
    plan = forced_plan(merge_plan(target, tokens, dim, out.element_size(), backward=True), "merge_bwd", sources=1,
                       queries=1, dim=dim)
    dq_part = out.new_zeros((plan.grid, dim) if need_query else (1,), dtype=acc)
    dg_part = out.new_zeros((plan.grid, dim) if need_gain else (1,), dtype=acc)
    (o, o_st), (p, p_st) = _rows(out), _rows(partial)
    grad_h = grad_h.contiguous()
    gp = grad_h if grad_partial is None else grad_partial.contiguous()
    query, gain, lse = unit_last_stride(query), unit_last_stride(gain), lse.contiguous()
    launch(attn_res_merge_bwd_kernel, (plan.grid,),
           dict(gy_ptr=grad_h, gp_ptr=gp, o_ptr=o, lse_ptr=lse, p_ptr=p, q_ptr=query,
                gain_ptr=query if gain is None else gain, do_ptr=d_out if need_out else grad_h, dlse_ptr=d_lse,
                dp_ptr=d_partial if need_partial else grad_h, dq_part_ptr=dq_part, dg_part_ptr=dg_part,
                T=tokens, D=dim, O_ST=o_st, P_ST=p_st, **float_args(eps=eps, norm_eps=norm_eps)),
           dict(HAS_GP=grad_partial is not None, HAS_GAIN=gain is not None, NEED_DO=need_out, NEED_DP=need_partial,
                NEED_DQ=need_query, NEED_DG=need_gain, BLOCK_T=plan.block_t, BLOCK_D=plan.block_d,
                F64=acc == torch.float64, num_warps=plan.num_warps))
    if need_query:
        d_query.copy_(dq_part.sum(0))
    if need_gain:
        d_gain.copy_(dg_part.sum(0))
    return d_out, d_lse if need_lse else lse.new_empty(0), d_partial, d_query, d_gain


def _merge_run(out, lse, partial, query, addend, addend2, gain, eps, norm_eps):
    target = target_for(out.device, out.dtype)
    if target is None:
        return reference.attn_res_merge(out, lse, partial, query, addend, addend2, gain, eps, norm_eps)
    return _merge_forward(out, lse, partial, query, addend, addend2, gain, eps, norm_eps, target)


def _merge_run_backward(grad_h, grad_partial, out, lse, partial, query, gain, eps, norm_eps, need_out, need_lse,
                        need_partial, need_query, need_gain):
    need_gain = need_gain and gain is not None
    target = target_for(out.device, out.dtype)
    if target is not None:
        return _merge_backward(grad_h, grad_partial, out, lse, partial, query, gain, eps, norm_eps, need_out,
                               need_lse, need_partial, need_query, need_gain, target)
    d_out, d_lse, d_p, d_q, d_g = reference.attn_res_merge_backward(grad_h, grad_partial, out, lse, partial, query,
                                                                    gain, eps, norm_eps)
    return (d_out.to(out.dtype) if need_out else out.new_empty(0),
            d_lse.to(lse.dtype) if need_lse else lse.new_empty(0),
            d_p.to(partial.dtype) if need_partial else partial.new_empty(0),
            d_q.to(query.dtype) if need_query else query.new_empty(0),
            d_g.to(gain.dtype) if need_gain else query.new_empty(0))


def _merge_backward_fake(grad_h, grad_partial, out, lse, partial, query, gain, eps, norm_eps, need_out, need_lse,
                         need_partial, need_query, need_gain):
    check_merge_args(out, lse, partial, query, None, None, gain, eps, norm_eps)
    check_merge_backward_args(grad_h, grad_partial, out)
    need_gain = need_gain and gain is not None
    c = torch.contiguous_format
    return (torch.empty_like(out, memory_format=c) if need_out else out.new_empty(0),
            torch.empty_like(lse, memory_format=c) if need_lse else lse.new_empty(0),
            torch.empty_like(partial, memory_format=c) if need_partial else partial.new_empty(0),
            torch.empty_like(query) if need_query else query.new_empty(0),
            torch.empty_like(gain) if need_gain else query.new_empty(0))


@fused_op("attn_res_merge_backward", fake=_merge_backward_fake, run=_merge_run_backward)
def attn_res_merge_backward_op(
    grad_h: Tensor, grad_partial: Optional[Tensor], out: Tensor, lse: Tensor, partial: Tensor, query: Tensor,
    gain: Optional[Tensor], eps: float, norm_eps: float, need_out: bool, need_lse: bool, need_partial: bool,
    need_query: bool, need_gain: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of attn_res_merge w.r.t. (out, lse, the merged partial P, query, gain), `partial` being P
    (the updated partial sum the forward merged; the addends' gradients are P's). grad_h: the gradient of h
    (or of rmsnorm(h) * gain), grad_partial that of the updated partial sum (None: zero). A gradient not asked
    for (gain's when gain is None) comes back as an empty tensor. Deterministic (no atomics)."""
    check_merge_args(out, lse, partial, query, None, None, gain, eps, norm_eps)
    check_merge_backward_args(grad_h, grad_partial, out)
    return _merge_run_backward(grad_h, grad_partial, out, lse, partial, query, gain, eps, norm_eps, need_out,
                               need_lse, need_partial, need_query, need_gain)


def _merge_fake(out, lse, partial, query, addend, addend2, gain, eps, norm_eps):
    check_merge_args(out, lse, partial, query, addend, addend2, gain, eps, norm_eps)
    has_add = addend is not None or addend2 is not None
    return torch.empty_like(out, memory_format=torch.contiguous_format), (
        torch.empty_like(partial, memory_format=torch.contiguous_format) if has_add else partial.new_empty(0))


def _merge_setup_context(ctx, inputs, output):
    out, lse, partial, query, addend, addend2, gain, eps, norm_eps = inputs
    has_add = addend is not None or addend2 is not None
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(out, lse, output[1] if has_add else partial, query, gain)
    ctx.eps, ctx.norm_eps, ctx.has_add = eps, norm_eps, has_add


def _merge_backward_rule(ctx, grad_h, grad_partial):
    out, lse, p, query, gain = ctx.saved_tensors
    need = ctx.needs_input_grad
    need_out, need_lse, need_query, need_gain = need[0], need[1], need[3], need[6]
    need_p = need[2] or need[4] or need[5]
    if grad_h is None:
        grad_h = torch.zeros_like(out)
    if not ctx.has_add:
        grad_partial = None  # the op's second output is empty without addends
    d_out, d_lse, d_p, d_q, d_g = attn_res_merge_backward_op(
        grad_h, grad_partial, out, lse, p, query, gain, ctx.eps, ctx.norm_eps, need_out, need_lse, need_p, need_query,
        need_gain and gain is not None)
    return (d_out if need_out else None, d_lse if need_lse else None, d_p if need[2] else None,
            d_q if need_query else None, d_p if need[4] else None, d_p if need[5] else None,
            d_g if need_gain and gain is not None else None, None, None)


@fused_op("attn_res_merge", fake=_merge_fake, run=_merge_run, setup_context=_merge_setup_context,
          backward=_merge_backward_rule)
def attn_res_merge_op(out: Tensor, lse: Tensor, partial: Tensor, query: Tensor, addend: Optional[Tensor],
                      addend2: Optional[Tensor], gain: Optional[Tensor], eps: float,
                      norm_eps: float) -> tuple[Tensor, Tensor]:
    """Phase 2 of Block AttnRes: (h, or rmsnorm(h) * gain, [*batch, D] in out's dtype; the updated partial
    sum partial + addend + addend2 [*batch, D], or an empty tensor without addends). See
    `fusedops.attn_res_merge`."""
    check_merge_args(out, lse, partial, query, addend, addend2, gain, eps, norm_eps)
    return _merge_run(out, lse, partial, query, addend, addend2, gain, eps, norm_eps)


def _byte_span(t: Tensor) -> tuple[int, int]:
    """[first, last + 1) bytes of t's storage that t's elements occupy."""
    last = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return t.storage_offset() * t.element_size(), (last + 1) * t.element_size()


def _may_overlap(a: Tensor, b: Tensor) -> bool:
    """Whether two tensors may share a byte: exact for [*batch, D] views of one dtype with one row stride and a
    unit last stride (bank slots interleave without overlapping), conservative (their byte spans meet) otherwise,
    any shapes and dtypes. Reads no data. Tensors without a storage (traced) are not compared: the eager call
    checks them."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    try:
        if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
            return False
    except RuntimeError:  # a traced (functional, fake) tensor has no storage to compare: nothing to check
        return False
    if a.dim() and b.dim() and a.element_size() == b.element_size():
        (sa, ra), (sb, rb) = [collapse_dims(t.shape[:-1], t.stride()[:-1]) for t in (a, b)]
        dim, delta = a.shape[-1], b.storage_offset() - a.storage_offset()
        if len(sa) == 1 and sa == sb and ra == rb and a.stride(-1) == b.stride(-1) == 1 and ra[0] >= dim:
            rows, stride = sa[0], ra[0]
            k = delta // stride if stride else 0
            return any(abs(j) < rows and abs(delta - j * stride) < dim for j in (k, k + 1))
    (a0, a1), (b0, b1) = _byte_span(a), _byte_span(b)
    return a0 < b1 and b0 < a1


def merge_reads(out, lse, partial, query, addend, addend2, gain) -> tuple:
    """(name, tensor) of every input of a merge: partial_out may overlap none of them (the kernel re-reads
    partial, the addends, out, lse, query and gain after it has written p')."""
    return (("out", out), ("lse", lse), ("partial", partial), ("query", query), ("addend", addend),
            ("addend2", addend2), ("gain", gain))


def check_partial_out(partial_out: Tensor, partial: Tensor, reads, check_overlap: bool) -> None:
    """partial_out: partial's dtype and shape on its device, and (real tensors) sharing no byte with any of
    `reads` (merge_reads)."""
    check_tensor("partial_out", partial_out, partial.dtype, partial.shape)
    check_same_device([("partial", partial), ("partial_out", partial_out)])
    if check_overlap:
        for name, t in reads:
            if t is not None and _may_overlap(partial_out, t):
                raise ValueError(f"partial_out must not overlap {name} (the merge re-reads it after writing "
                                 "partial_out); write the updated sum to another slot")


def _merge_into(out: Tensor, lse: Tensor, partial: Tensor, query: Tensor, addend: Optional[Tensor],
                addend2: Optional[Tensor], gain: Optional[Tensor], eps: float, norm_eps: float,
                partial_out: Tensor) -> Tensor:
    """attn_res_merge writing the updated partial sum (partial + addends, or partial itself) into partial_out
    (e.g. a slot of a token-major bank, `bank[:, slot]`, written in place) and returning h (or
    rmsnorm(h) * gain). For inference: no autograd formula. partial_out must not overlap the inputs."""
    check_merge_args(out, lse, partial, query, addend, addend2, gain, eps, norm_eps)
    check_partial_out(partial_out, partial, merge_reads(out, lse, partial, query, addend, addend2, gain), True)
    target = target_for(out.device, out.dtype)
    if target is None:
        y, p_new = reference.attn_res_merge(out, lse, partial, query, addend, addend2, gain, eps, norm_eps)
        partial_out.copy_(p_new if addend is not None or addend2 is not None else partial)
        return y
    return _merge_forward(out, lse, partial, query, addend, addend2, gain, eps, norm_eps, target,
                          partial_out=partial_out)[0]


def _merge_into_fake(out, lse, partial, query, addend, addend2, gain, eps, norm_eps, partial_out):
    check_merge_args(out, lse, partial, query, addend, addend2, gain, eps, norm_eps)
    check_partial_out(partial_out, partial, (), False)
    return torch.empty_like(out, memory_format=torch.contiguous_format)


attn_res_merge_into_op = fused_op("attn_res_merge_into", fake=_merge_into_fake,
                                  mutates_args=("partial_out",))(_merge_into)


def attn_res_merge(out: Tensor, lse: Tensor, partial: Tensor, query: Tensor,
                   addends: Optional[Tensor | Sequence[Tensor]] = None, gain: Optional[Tensor] = None,
                   eps: float = 1e-6, norm_eps: Optional[float] = None,
                   partial_out: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Phase 2 of Block AttnRes: merge one sublayer's phase-1 result with the block's running partial sum,
    fused with the residual add(s) into that sum and, optionally, the next sublayer's RMSNorm. One launch.

    Args:
        out: [*batch, D] float32/float16/bfloat16/float64, o_l = out[l] of `attn_res_multi` for this sublayer.
        lse: [*batch] float32 (float64 for float64 out), lse[l] of `attn_res_multi`.
        partial: [*batch, D] in out's dtype, the block's partial sum p before this sublayer. Rows are read in
            place where the batch dims merge into one strided dim (e.g. a bank slot ``bank[:, slot]``).
        query: [D] any float dtype, this sublayer's pseudo-query folded with its key-norm gain (q_l).
        addends: None, a tensor or a list/tuple of at most two tensors [*batch, D] in out's dtype (the previous
            sublayer's output(s), e.g. routed and shared experts) added into partial first:
            ``p' = partial + addends[0] + addends[1]``, summed in float32 (float64) and rounded once to the
            dtype; the merge uses the rounded p' (what a later read of it sees).
        gain: [D] any float dtype or None. With a gain the first result is ``rmsnorm(h) * gain`` (the next
            sublayer's pre-norm folded in, normalised in float32 before any rounding of h), else h.
        eps: the key RMSNorm epsilon of the logit, as in `attn_res_multi` (a normal float32 number).
        norm_eps: the output RMSNorm's epsilon; None means eps.
        partial_out: None, or a tensor of partial's shape and dtype (e.g. the next slot of a token-major bank,
            ``bank[:, slot]``, written in place: its batch dims must merge into one strided dim) that receives
            p' (partial itself when there are no addends); it must not overlap any other argument.
            Fused into the same launch when no input requires grad (inference, the op
            ``fusedops::attn_res_merge_into``); otherwise the differentiable op runs and p' is copied in.

    Returns:
        (h, p'): ``s = <query, p'> / sqrt(mean(p' ** 2) + eps)``,
        ``h = sigmoid(lse - s) * out + sigmoid(s - lse) * p'``, the single-query softmax over
        [b_0, ..., b_{N-1}, p'] (`fusedops.attn_res` of the stacked sources with this query), or its
        rmsnorm times gain; h in out's dtype. p' is partial_out when given, else a new tensor [*batch, D] when
        there are addends, else ``partial`` itself (no copy).

    Differentiable in out, lse, partial, query, the addends and gain; the backward is the op
    ``fusedops::attn_res_merge_backward`` (deterministic). Raises ValueError naming the argument on bad input.
    """
    if addends is None:
        addends = ()
    elif isinstance(addends, Tensor):
        addends = (addends,)
    elif not isinstance(addends, (list, tuple)) or len(addends) > 2:
        raise ValueError(f"addends must be None, a tensor or a list/tuple of at most two tensors, got {addends!r}")
    addend, addend2 = (tuple(addends) + (None, None))[:2]
    norm_eps = eps if norm_eps is None else norm_eps
    args = (out, lse, partial, query, addend, addend2, gain, eps, norm_eps)
    if checks_in_wrapper():
        check_merge_args(*args)
    if partial_out is not None:
        tensors = (out, lse, partial, query, addend, addend2, gain)
        if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)):
            # no dispatcher on the eager path: its host time is as long as a 2048-token merge on the GPU (a block
            # makes 24)
            return attn_res_merge_into_op(*args, partial_out), partial_out
        check_partial_out(partial_out, partial, merge_reads(*tensors), checks_in_wrapper())
        h, p_new = attn_res_merge(out, lse, partial, query, addends, gain, eps, norm_eps)
        partial_out.copy_(p_new)
        return h, partial_out
    h, p_new = attn_res_merge_op(*args)
    return h, (p_new if addend is not None else partial)


__all__ = ["attn_res_merge", "attn_res_multi"]
