"""attn_res: Kimi Attention Residuals, a softmax over depth sources per token."""

from .module import AttnRes
from .op import attn_res

__all__ = ["AttnRes", "attn_res"]
