"""The readable PyTorch definition of AttnRes (Kimi Attention Residuals), used on plain CPU tensors
and as the specification the kernels are tested against.

For each token, N depth sources v_i (the embedding output and earlier block outputs) are mixed by a
softmax over depth whose logits compare a learned pseudo-query with the RMS-normalised sources:

    rstd_i  = 1 / sqrt(mean(v_i ** 2) + eps)
    logit_i = rstd_i * dot(query * norm_weight, v_i)
    out     = sum_i softmax_i(logit) * v_i

Everything is computed in float32 (float64 for float64 values) and the result is cast back to the values'
dtype.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from fusedops.numerics import accumulate_dtype


def _folded_query(query: Tensor, norm_weight: Optional[Tensor], dtype: torch.dtype) -> Tensor:
    u = query.to(dtype)
    return u if norm_weight is None else u * norm_weight.to(dtype)


def _logits(v: Tensor, u: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    rstd = torch.rsqrt(v.square().mean(-1, keepdim=True) + eps)
    return (v * u).sum(-1, keepdim=True) * rstd, rstd


def attn_res(values: Tensor, query: Tensor, norm_weight: Optional[Tensor], eps: float) -> tuple[Tensor, Tensor]:
    """(out [*batch, D] in values' dtype, lse [*batch] fp32 (float64 for float64 values): logsumexp over depth
    of the logits)."""
    v = values.to(accumulate_dtype(values.dtype))
    logits, _ = _logits(v, _folded_query(query, norm_weight, v.dtype), eps)
    alpha = torch.softmax(logits, dim=0)
    return (alpha * v).sum(0).to(values.dtype), torch.logsumexp(logits, dim=0).squeeze(-1)


def attn_res_backward(
    grad_out: Tensor,
    values: Tensor,
    query: Tensor,
    norm_weight: Optional[Tensor],
    eps: float,
    need_values: bool,
    need_query: bool,
    need_norm_weight: bool,
    grad_lse: Optional[Tensor] = None,
) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """Gradients in closed form (no autograd), written the way the kernels compute them.

    With g = grad_out, s_i the logits and g_lse the gradient of lse (zero when None):
      dL/ds_i = alpha_i * (dot(g, v_i) - sum_j alpha_j dot(g, v_j) + g_lse)
      dL/dv_i = alpha_i g + dL/ds_i * rstd_i * (u - s_i * rstd_i * v_i / D)
      dL/du   = sum over tokens and i of dL/ds_i * rstd_i * v_i,  u = query * norm_weight
    """
    v = values.to(accumulate_dtype(values.dtype))
    g = grad_out.to(v.dtype)
    u = _folded_query(query, norm_weight, v.dtype)
    logits, rstd = _logits(v, u, eps)
    alpha = torch.softmax(logits, dim=0)
    g_dot_v = (g * v).sum(-1, keepdim=True)
    d_logits = alpha * (g_dot_v - (alpha * g_dot_v).sum(0, keepdim=True))
    if grad_lse is not None:
        d_logits = d_logits + alpha * grad_lse.to(v.dtype).unsqueeze(-1)
    grad_values = grad_query = grad_weight = None
    if need_values:
        D = v.shape[-1]
        grad_values = (alpha * g + d_logits * rstd * (u - logits * rstd * v / D)).to(values.dtype)
    if need_query or need_norm_weight:
        grad_u = (d_logits * rstd * v).reshape(-1, v.shape[-1]).sum(0)
        if need_query:
            scale = grad_u if norm_weight is None else grad_u * norm_weight.to(v.dtype)
            grad_query = scale.to(query.dtype)
        if need_norm_weight and norm_weight is not None:
            grad_weight = (grad_u * query.to(v.dtype)).to(norm_weight.dtype)
    return grad_values, grad_query, grad_weight
