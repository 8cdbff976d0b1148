"""The readable PyTorch definition of neighborhood attention, used on plain CPU tensors.

Layout [B, H, *spatial, D] with 1, 2 or 3 spatial axes. Per axis of length L, a query i with kernel k,
dilation d and stride s attends inside its dilation group g = i mod d, on within-group coordinates
i' = i // d over a group of length L_g = L // d + (g < L % d):

  window="shifted" (NATTEN):   leader c = min((i' // s) * s + s // 2, L_g - 1); keys
                               clamp(c - k // 2, 0, L_g - k) + [0, k)
                     causal:   leader c = min((i' // s) * s + s - 1, L_g - 1); keys max(c - k + 1, 0) .. i'
  window="truncated" (Liger):  keys i' + j - k // 2, j in [0, k), inside [0, L_g)
                     causal:   keys max(i' - k + 1, 0) .. i'

Every axis's window is an interval [lo, hi] of within-group coordinates; the neighborhood of a query
is the product of its per-axis windows. This module never builds an S x S mask: it makes an
[S, kernel] table of neighbour indices and walks the queries in chunks, so memory is O(S x kernel).
All arithmetic is float32 (float64 for float64 inputs); results are cast back to the input dtype (LSE
stays float32, float64 for float64 inputs).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

from fusedops.numerics import accumulate_dtype

# Upper bound on the elements of one chunk's gathered keys (fp32): keeps the reference frugal.
CHUNK_ELEMENTS = 1 << 24


def axis_window(i: Tensor, lg: Tensor, k: int, s: int, causal: bool, window: str) -> tuple[Tensor, Tensor]:
    """Inclusive within-group window [lo, hi] of within-group query coordinates `i` (groups of length `lg`)."""
    if window == "truncated":
        lo = (i - (k - 1 if causal else k // 2)).clamp(min=0)
        hi = i if causal else torch.minimum(i + k // 2, lg - 1)
        return lo, hi
    c = axis_leader(i, lg, s, causal)
    if causal:
        return (c - k + 1).clamp(min=0), i
    lo = torch.minimum((c - k // 2).clamp(min=0), lg - k)
    return lo, lo + k - 1


def axis_leader(i: Tensor, lg: Tensor, s: int, causal: bool) -> Tensor:
    """The within-group position a shifted window is placed around (causal: ends at): the leader of i's stride group."""
    return torch.minimum((i // s) * s + (s - 1 if causal else s // 2), lg - 1)


def axis_neighbors(length: int, k: int, d: int, s: int, causal: bool, window: str) -> tuple[Tensor, Tensor]:
    """(index [L, k], valid [L, k]): the original-coordinate key positions each query of one axis sees.
    Slots past a query's window are marked invalid (and point at a valid position)."""
    i = torch.arange(length)
    g = i % d
    ip = i // d
    lg = length // d + (g < length % d).long()
    lo, hi = axis_window(ip, lg, k, s, causal, window)
    jp = lo[:, None] + torch.arange(k)[None, :]
    valid = jp <= hi[:, None]
    jp = torch.minimum(jp, hi[:, None])
    return jp * d + g[:, None], valid


def neighbor_table(
    spatial: Sequence[int], kernel_size: Sequence[int], dilation: Sequence[int], stride: Sequence[int],
    is_causal: Sequence[bool], window: str,
) -> tuple[Tensor, Tensor]:
    """(index [S, K], valid [S, K]) over flattened (row-major) spatial positions, K = prod(kernel_size)."""
    index = torch.zeros(1, 1, dtype=torch.long)
    valid = torch.ones(1, 1, dtype=torch.bool)
    for length, k, d, s, c in zip(spatial, kernel_size, dilation, stride, is_causal):
        idx, ok = axis_neighbors(length, k, d, s, c, window)
        # row-major: position = outer * length + inner
        index = (index[:, None, :, None] * length + idx[None, :, None, :]).reshape(index.shape[0] * length, -1)
        valid = (valid[:, None, :, None] & ok[None, :, None, :]).reshape(valid.shape[0] * length, -1)
    return index, valid


def _flat(t: Tensor) -> Tensor:
    """[B, H, *spatial, D] -> [B, H, S, D] in the compute dtype (float32; float64 for float64)."""
    return t.reshape(t.shape[0], t.shape[1], math.prod(t.shape[2:-1]), t.shape[-1]).to(accumulate_dtype(t.dtype))


def _chunk(b: int, h: int, k: int, d: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(1, b * h * k * d))


def query_rows(k_spatial: Sequence[int], q_spatial: Sequence[int], offset: Sequence[int]) -> Tensor:
    """Flat (row-major) positions in k's grid of the queries of q's box at `offset`."""
    rows = torch.zeros(1, dtype=torch.long)
    for length, n, o in zip(k_spatial, q_spatial, offset):
        rows = (rows[:, None] * length + torch.arange(o, o + n)[None, :]).reshape(-1)
    return rows


def _gqa_views(q, k, v, kernel_size, dilation, stride, is_causal, window, offset):
    """The neighbour table of q's queries (k's grid, q's box at `offset`) on q's device, q as
    [B, H_kv, G, S_q, D] (G query heads share a k/v head), k and v as [B, H_kv, S_k, D]."""
    index, valid = neighbor_table(k.shape[2:-1], kernel_size, dilation, stride, is_causal, window)
    if offset is not None and list(q.shape[2:-1]) != list(k.shape[2:-1]):
        rows = query_rows(k.shape[2:-1], q.shape[2:-1], offset)
        index, valid = index[rows], valid[rows]
    index, valid = index.to(q.device), valid.to(q.device)
    kv_heads = k.shape[1]
    qf = _flat(q).reshape(q.shape[0], kv_heads, q.shape[1] // kv_heads, index.shape[0], q.shape[-1])
    return index, valid, qf, _flat(k), _flat(v)


def neighborhood_attention(
    q: Tensor, k: Tensor, v: Tensor, kernel_size: Sequence[int], dilation: Sequence[int],
    stride: Sequence[int], is_causal: Sequence[bool], scale: float, window: str, offset: Sequence[int] | None = None,
) -> tuple[Tensor, Tensor]:
    """(out [B, H, *q's spatial, Dv] in q's dtype, lse [B, H, *q's spatial] float32, float64 for float64 q); q's
    box sits at `offset` in k's spatial grid (None: q's grid is k's)."""
    index, valid, qf, kf, vf = _gqa_views(q, k, v, kernel_size, dilation, stride, is_causal, window, offset)
    batch, kv_heads, groups, tokens = qf.shape[:4]
    kernel = index.shape[1]
    out = q.new_empty(batch, kv_heads, groups, tokens, v.shape[-1])
    lse = torch.empty(batch, kv_heads, groups, tokens, dtype=qf.dtype, device=q.device)
    step = _chunk(batch, kv_heads, kernel, max(q.shape[-1], v.shape[-1]) * 2)
    for r0 in range(0, tokens, step):
        r1 = min(tokens, r0 + step)
        idx = index[r0:r1]
        kg = kf[:, :, idx]  # [B, Hkv, C, K, D]
        vg = vf[:, :, idx]
        logits = torch.einsum("bhgcd,bhckd->bhgck", qf[:, :, :, r0:r1], kg) * scale
        logits = logits.masked_fill(~valid[r0:r1], float("-inf"))
        row_lse = torch.logsumexp(logits, dim=-1)
        p = torch.exp(logits - row_lse[..., None])
        out[:, :, :, r0:r1] = torch.einsum("bhgck,bhckd->bhgcd", p, vg).to(out.dtype)
        lse[:, :, :, r0:r1] = row_lse
    return out.reshape(*q.shape[:-1], v.shape[-1]), lse.reshape(q.shape[:-1])


def neighborhood_attention_backward(
    grad_out: Tensor, grad_lse: Tensor | None, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    kernel_size: Sequence[int], dilation: Sequence[int], stride: Sequence[int], is_causal: Sequence[bool],
    scale: float, window: str, offset: Sequence[int] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients in closed form, the way the kernels compute them:
      p = exp(scale q.k - lse),  delta = rowsum(dO * O) - dLSE
      dV_j = sum_i p_ij dO_i,  dS_ij = p_ij (dO_i.v_j - delta_i),
      dQ_i = scale sum_j dS_ij k_j,  dK_j = scale sum_i dS_ij q_i
    """
    index, valid, qf, kf, vf = _gqa_views(q, k, v, kernel_size, dilation, stride, is_causal, window, offset)
    batch, kv_heads, groups, tokens = qf.shape[:4]
    heads, kernel = q.shape[1], index.shape[1]
    # explicit sizes, no -1: a batch of 0 leaves nothing to infer a dim from
    go = _flat(grad_out).reshape(batch, kv_heads, groups, tokens, v.shape[-1])
    of = _flat(out).reshape(batch, kv_heads, groups, tokens, v.shape[-1])
    lf = lse.reshape(batch, kv_heads, groups, tokens).to(qf.dtype)
    delta = (go * of).sum(-1)
    if grad_lse is not None:
        delta = delta - grad_lse.reshape(batch, kv_heads, groups, tokens).to(qf.dtype)
    # contiguous like the fake kernel's outputs (empty_like would keep a permuted input's strides)
    dq = torch.empty(qf.shape, dtype=qf.dtype, device=q.device)
    dk = torch.zeros(kf.shape, dtype=qf.dtype, device=q.device)
    dv = torch.zeros(vf.shape, dtype=qf.dtype, device=q.device)
    step = _chunk(batch, heads, kernel, max(q.shape[-1], v.shape[-1]) * 2)
    for r0 in range(0, tokens, step):
        r1 = min(tokens, r0 + step)
        idx = index[r0:r1]
        kg = kf[:, :, idx]
        vg = vf[:, :, idx]
        logits = torch.einsum("bhgcd,bhckd->bhgck", qf[:, :, :, r0:r1], kg) * scale
        p = torch.exp(logits - lf[:, :, :, r0:r1, None]).masked_fill(~valid[r0:r1], 0.0)
        dp = torch.einsum("bhgcd,bhckd->bhgck", go[:, :, :, r0:r1], vg)
        ds = p * (dp - delta[:, :, :, r0:r1, None])
        dq[:, :, :, r0:r1] = torch.einsum("bhgck,bhckd->bhgcd", ds, kg) * scale
        flat_idx = idx.reshape(-1)
        dv.index_add_(2, flat_idx, torch.einsum("bhgck,bhgcd->bhckd", p, go[:, :, :, r0:r1]).flatten(2, 3))
        dk.index_add_(2, flat_idx, (torch.einsum("bhgck,bhgcd->bhckd", ds, qf[:, :, :, r0:r1]) * scale).flatten(2, 3))
    return (
        dq.reshape(q.shape).to(q.dtype),
        dk.reshape(k.shape).to(k.dtype),
        dv.reshape(v.shape).to(v.dtype),
    )


def kernel_volume(kernel_size: Sequence[int]) -> int:
    return math.prod(kernel_size)
