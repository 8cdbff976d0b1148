"""nn.Module front ends of the fusedops ops."""

from fusedops.attn_res.module import AttnRes

__all__ = ["AttnRes"]
