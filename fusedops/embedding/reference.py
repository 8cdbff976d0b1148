"""The readable PyTorch definition of fusedops.embedding, used on plain CPU tensors and as the
specification the kernels are tested against.

Forward: out[*i] = weight[indices[*i]] (a row gather). The op checks the indices before it gets here;
an index outside [0, V) would read as a zero row (meta tensors, which hold no data, come here too).

Backward (the weight gradient, the only one):
    grad_weight[v] = s_v * sum over tokens t with indices[t] == v of grad_out[t]
with s_v = 1 / count_v under scale_grad_by_freq (count_v: how often v occurs in the batch) and 1
otherwise; the padding_idx row and rows that no token names are zero; tokens with an out-of-range
index contribute nothing. Sums run in float32 (float64 for float64 gradients) and are cast to the weight's
dtype once.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fusedops.numerics import accumulate_dtype


def in_range(flat: Tensor, num_weights: int) -> Tensor:
    return (flat >= 0) & (flat < num_weights)


def embedding(weight: Tensor, indices: Tensor, padding_idx: int) -> Tensor:
    """padding_idx is already normalised to [0, V) or -1; the forward does not use it."""
    num_weights, dim = weight.shape
    flat = indices.reshape(-1).long()
    ok = in_range(flat, num_weights)
    rows = weight.index_select(0, torch.where(ok, flat, 0)) if num_weights else weight.new_zeros(flat.shape[0], dim)
    # Shaped before the where, so out is a fresh tensor and not a view: in-place ops on it are legal.
    shape = (*indices.shape, dim)
    return torch.where(ok.reshape(*indices.shape, 1), rows.reshape(shape), rows.new_zeros(()))


def embedding_backward(
    grad_out: Tensor, indices: Tensor, num_weights: int, padding_idx: int, scale_grad_by_freq: bool
) -> Tensor:
    dim = grad_out.shape[-1]
    if num_weights == 0:
        return grad_out.new_zeros(0, dim)
    flat = indices.reshape(-1).long()
    acc = accumulate_dtype(grad_out.dtype)
    g = grad_out.reshape(flat.shape[0], dim).to(acc)  # explicit sizes: -1 is ambiguous at D = 0
    ok = in_range(flat, num_weights)
    # Out-of-range tokens become zero rows added to row 0 rather than being dropped by a boolean mask:
    # no data-dependent shape, so meta tensors (shapes only) take this path too.
    flat = torch.where(ok, flat, 0)
    if scale_grad_by_freq:
        counts = torch.zeros(num_weights, dtype=acc, device=flat.device).index_add_(0, flat, ok.to(acc))
        g = g / counts[flat].clamp_min(1)[:, None]
    g = torch.where(ok[:, None], g, 0.0)
    grad = torch.zeros(num_weights, dim, dtype=acc, device=grad_out.device).index_add_(0, flat, g)
    if padding_idx >= 0:
        grad[padding_idx] = 0
    return grad.to(grad_out.dtype)
