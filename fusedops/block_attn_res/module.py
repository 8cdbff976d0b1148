"""fusedops.nn.BlockAttnRes: the pseudo-queries and key-norm gains of one Block AttnRes block's M sublayers."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from fusedops.validation import as_int, check_fp32_normal, check_positive_int

from .op import attn_res_merge, attn_res_multi


class BlockAttnRes(nn.Module):
    """The M mixing sites of one block (Kimi's Block AttnRes, arXiv 2603.15031): parameters query and
    norm_weight [sublayers, dim] (float32 unless dtype says otherwise), as M `fusedops.nn.AttnRes` modules
    would hold them. Per block:

        out, lse = block(values)                 # phase 1: values [N, *batch, dim] (or a list of N)
        for l in range(sublayers):               # phase 2, in order
            h, partial = block.merge(l, out, lse, partial, addends=previous_outputs, gain=next_norm_gain)

    gives every sublayer the single-query softmax over [b_0..b_{N-1}, partial] that M separate AttnRes calls
    over the stacked sources give. The queries are folded with their gains (query * norm_weight) once per
    forward call, and merge takes them from that call (call forward first).

    The pseudo-queries start at zero (a uniform average, as the paper requires), the gains at one.
    """

    def __init__(self, dim: int, sublayers: int, eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__()
        dim = check_positive_int("dim", dim)
        sublayers = check_positive_int("sublayers", sublayers)
        check_fp32_normal("eps", eps)
        factory = {"device": device, "dtype": dtype}
        self.dim, self.sublayers, self.eps = dim, sublayers, eps
        self.query = nn.Parameter(torch.empty(sublayers, dim, **factory))
        self.norm_weight = nn.Parameter(torch.empty(sublayers, dim, **factory))
        self._folded: Optional[Tensor] = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.query.zero_()
            self.norm_weight.fill_(1.0)

    def folded_queries(self) -> Tensor:
        """[sublayers, dim]: query * norm_weight (differentiable in both)."""
        return self.query * self.norm_weight

    def forward(self, values) -> tuple[Tensor, Tensor]:
        """Phase 1: (out [M, *batch, dim], lse [M, *batch]) of `fusedops.attn_res_multi`."""
        self._folded = self.folded_queries()
        return attn_res_multi(values, self._folded, self.eps)

    def merge(self, sublayer: int, out: Tensor, lse: Tensor, partial: Tensor,
              addends: Optional[Tensor | Sequence[Tensor]] = None, gain: Optional[Tensor] = None,
              norm_eps: Optional[float] = None, partial_out: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        """Phase 2 for sublayer l: `fusedops.attn_res_merge(out[l], lse[l], partial, q_l, ...)` with this
        block's folded query q_l of the last forward call."""
        l = as_int("sublayer", sublayer)
        if not 0 <= l < self.sublayers:
            raise ValueError(f"sublayer must be in [0, {self.sublayers}), got {l}")
        if self._folded is None:
            raise RuntimeError("BlockAttnRes.merge needs the folded queries of a forward call: call the module first")
        return attn_res_merge(out[l], lse[l], partial, self._folded[l], addends, gain, self.eps, norm_eps,
                              partial_out)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, sublayers={self.sublayers}, eps={self.eps}"
