"""fusedops.nn.AttnRes: the learnable pseudo-query and key norm gain of one AttnRes mixing site."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fusedops.validation import check_fp32_normal, check_positive_int

from .op import attn_res


class AttnRes(nn.Module):
    """Mixes N depth sources [N, *batch, dim] into [*batch, dim] with a softmax over depth
    (`fusedops.attn_res`). Parameters query and norm_weight [dim] are float32 unless dtype says
    otherwise; values may be float32, float16, bfloat16 or float64 whatever the parameters' dtype, and the
    output has values' dtype.

    The pseudo-query starts at zero, as the AttnRes paper requires, so a fresh module is a uniform
    average of its sources; the RMSNorm gain of the keys starts at one.
    """

    def __init__(self, dim: int, eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__()
        dim = check_positive_int("dim", dim)
        check_fp32_normal("eps", eps)  # as the op checks it: bad arguments fail here, not at the first call
        factory = {"device": device, "dtype": dtype}
        self.dim = dim
        self.eps = eps
        self.query = nn.Parameter(torch.empty(dim, **factory))
        self.norm_weight = nn.Parameter(torch.empty(dim, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """query = 0, norm_weight = 1 (what FSDP's meta-device initialisation and `to_empty` callers run)."""
        with torch.no_grad():
            self.query.zero_()
            self.norm_weight.fill_(1.0)

    def forward(self, values: Tensor) -> Tensor:
        return attn_res(values, self.query, self.norm_weight, self.eps)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, eps={self.eps}"
