"""block_attn_res: Block AttnRes (Kimi, arXiv 2603.15031) at inference and training scale: the multi-query
phase 1 (`attn_res_multi`) and the LSE merge of phase 2 fused with the residual add and the next RMSNorm
(`attn_res_merge`)."""

from .module import BlockAttnRes
from .op import attn_res_merge, attn_res_multi

__all__ = ["BlockAttnRes", "attn_res_merge", "attn_res_multi"]
