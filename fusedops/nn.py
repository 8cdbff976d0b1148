"""nn.Module front ends of the fusedops ops."""

from fusedops.attn_res.module import AttnRes
from fusedops.embedding.module import Embedding

__all__ = ["AttnRes", "Embedding"]
