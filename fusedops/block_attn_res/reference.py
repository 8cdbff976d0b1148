"""The readable PyTorch definition of Block AttnRes's two phases (Kimi, arXiv 2603.15031, Algorithm 1), used
on plain CPU tensors and as the specification the kernels are tested against.

Phase 1 (`attn_res_multi`): M pseudo-queries q_l (already folded with their key-norm gains) attend over the N
completed block sums b_i of every token at once, with the scoring of `fusedops.attn_res`:

    rstd_i  = 1 / sqrt(mean(b_i ** 2) + eps)
    s_{l,i} = rstd_i * <q_l, b_i>
    out_l   = sum_i softmax_i(s_{l,.}) b_i,    lse_l = logsumexp_i s_{l,i}

Phase 2 (`attn_res_merge`): the running partial sum p of the block (after adding the addends into it) joins
as one more source: s = rstd(p) <q_l, p>, h = sigmoid(lse_l - s) out_l + sigmoid(s - lse_l) p, which is the
single-query softmax over [b_0, ..., b_{N-1}, p]; optionally h is RMS-normalised and scaled by a gain.

Everything is computed in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from fusedops.numerics import accumulate_dtype


def _rstd(x: Tensor, eps: float) -> Tensor:
    return torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def _multi_logits(v: Tensor, u: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(logits [M, N, *batch, 1], rstd [N, *batch, 1]) of v [N, *batch, D] against u [M, D]."""
    rstd = _rstd(v, eps)
    dots = torch.einsum("n...d,md->mn...", v, u).unsqueeze(-1)
    return dots * rstd, rstd


def attn_res_multi(values: Tensor, queries: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(out [M, *batch, D] in values' dtype, lse [M, *batch] float32 (float64 for float64 values))."""
    acc = accumulate_dtype(values.dtype)
    v, u = values.to(acc), queries.to(acc)
    logits, _ = _multi_logits(v, u, eps)
    alpha = torch.softmax(logits, dim=1)
    out = (alpha * v.unsqueeze(0)).sum(1)
    return out.to(values.dtype), torch.logsumexp(logits, dim=1).squeeze(-1)


def attn_res_multi_backward(
    grad_out: Optional[Tensor], grad_lse: Optional[Tensor], values: Tensor, queries: Tensor, eps: float,
    need_values: bool, need_queries: bool,
) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """Closed form, written as the kernels compute it. For each query l (g_l = grad_out[l]):
      ds_{l,i} = alpha_{l,i} (<g_l, v_i> - sum_j alpha_{l,j} <g_l, v_j> + grad_lse_l)
      dv_i     = sum_l alpha_{l,i} g_l + ds_{l,i} rstd_i (q_l - s_{l,i} rstd_i v_i / D)
      dq_l     = sum over tokens and i of ds_{l,i} rstd_i v_i
    """
    acc = accumulate_dtype(values.dtype)
    v, u = values.to(acc), queries.to(acc)
    m, dim = u.shape
    logits, rstd = _multi_logits(v, u, eps)  # [M, N, *b, 1]
    alpha = torch.softmax(logits, dim=1)
    g = torch.zeros((m, *v.shape[1:]), dtype=acc) if grad_out is None else grad_out.to(acc)
    gv = (g.unsqueeze(1) * v.unsqueeze(0)).sum(-1, keepdim=True)  # [M, N, *b, 1]
    ds = alpha * (gv - (alpha * gv).sum(1, keepdim=True))
    if grad_lse is not None:
        ds = ds + alpha * grad_lse.to(acc).unsqueeze(1).unsqueeze(-1)
    coef = ds * rstd.unsqueeze(0)
    grad_values = grad_queries = None
    if need_values:
        u_b = u.reshape(m, 1, *([1] * (v.dim() - 2)), dim)
        dv = alpha * g.unsqueeze(1) + coef * (u_b - logits * rstd.unsqueeze(0) * v.unsqueeze(0) / dim)
        grad_values = dv.sum(0).to(values.dtype)
    if need_queries:
        grad_queries = (coef * v.unsqueeze(0)).reshape(m, -1, dim).sum(1).to(queries.dtype)
    return grad_values, grad_queries


def merged_partial(partial: Tensor, addend: Optional[Tensor], addend2: Optional[Tensor]) -> Tensor:
    """partial + addend + addend2, summed in the accumulation dtype and rounded once to partial's dtype."""
    acc = accumulate_dtype(partial.dtype)
    p = partial.to(acc)
    for a in (addend, addend2):
        if a is not None:
            p = p + a.to(acc)
    return p.to(partial.dtype)


def _merge_weights(lse: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    """(w_out, w_partial) = softmax over the two logits (lse, s), taken as torch.softmax takes it."""
    w = torch.softmax(torch.stack([lse, s]), dim=0)
    return w[0], w[1]


def attn_res_merge(
    out: Tensor, lse: Tensor, partial: Tensor, query: Tensor, addend: Optional[Tensor], addend2: Optional[Tensor],
    gain: Optional[Tensor], eps: float, norm_eps: float,
) -> tuple[Tensor, Tensor]:
    """(h or rmsnorm(h) * gain [*batch, D] in out's dtype, the updated partial [*batch, D] in partial's dtype,
    or an empty tensor when there is no addend)."""
    acc = accumulate_dtype(out.dtype)
    has_add = addend is not None or addend2 is not None
    p_new = merged_partial(partial, addend, addend2) if has_add else partial
    p = p_new.to(acc)
    s = (p * query.to(acc)).sum(-1) * _rstd(p, eps).squeeze(-1)
    w_o, w_p = _merge_weights(lse.to(acc), s)
    h = w_o.unsqueeze(-1) * out.to(acc) + w_p.unsqueeze(-1) * p
    if gain is not None:
        h = h * _rstd(h, norm_eps) * gain.to(acc)
    return h.to(out.dtype), (p_new if has_add else partial.new_empty(0))


def attn_res_merge_backward(
    grad_h: Tensor, grad_partial: Optional[Tensor], out: Tensor, lse: Tensor, partial: Tensor, query: Tensor,
    gain: Optional[Tensor], eps: float, norm_eps: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Optional[Tensor]]:
    """Closed form of the merge's gradients, `partial` being the merged (updated) partial sum P:
      dh     = grad_h, or with a gain r gain grad_h - h r^3 <gain grad_h, h> / D  (r = rstd(h))
      ds     = w_o w_p <dh, P - out>,  d_lse = -ds,  d_out = w_o dh
      dP     = w_p dh + ds rstd(P) (q - s rstd(P) P / D) + grad_partial
      dq     = sum over tokens of ds rstd(P) P,  dgain = sum over tokens of grad_h h r
    Returns (d_out, d_lse, dP, dq, dgain or None), each in the accumulation dtype."""
    acc = accumulate_dtype(out.dtype)
    o, p, q, g = out.to(acc), partial.to(acc), query.to(acc), grad_h.to(acc)
    dim = p.shape[-1]
    rp = _rstd(p, eps)
    s = (p * q).sum(-1, keepdim=True) * rp
    w_o, w_p = _merge_weights(lse.to(acc).unsqueeze(-1), s)
    h = w_o * o + w_p * p
    dgain = None
    if gain is not None:
        r = _rstd(h, norm_eps)
        gg = g * gain.to(acc)
        dgain = (g * h * r).reshape(-1, dim).sum(0)
        g = r * gg - h * r.pow(3) * (gg * h).sum(-1, keepdim=True) / dim
    ds = w_o * w_p * (g * (p - o)).sum(-1, keepdim=True)
    dp = w_p * g + ds * rp * (q - s * rp * p / dim)
    if grad_partial is not None:
        dp = dp + grad_partial.to(acc)
    dq = (ds * rp * p).reshape(-1, dim).sum(0)
    return w_o * g, -ds.squeeze(-1), dp, dq, dgain
