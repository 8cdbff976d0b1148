"""fusedops: fused Triton kernels as first-class PyTorch ops, for CUDA GPUs and Ascend NPUs.

Each op is `torch.ops.fusedops.<name>` (a torch.library.triton_op) with a Python wrapper here and an
nn.Module in `fusedops.nn`. On CPU tensors the PyTorch reference runs, or the Triton kernels under the
interpreter when FUSEDOPS_INTERPRET=cuda|ascend and TRITON_INTERPRET=1 are set.
"""

from fusedops import distributed, nn, npu
from fusedops.attn_res import attn_res
from fusedops.block_attn_res import attn_res_merge, attn_res_multi
from fusedops.embedding import embedding
from fusedops.neighborhood_attention import context_parallel_neighborhood_attention, neighborhood_attention
from fusedops.plans import plan_override
from fusedops.registry import op_names

__version__ = "0.1.0"
__all__ = ["attn_res", "attn_res_merge", "attn_res_multi", "context_parallel_neighborhood_attention", "embedding",
           "nn", "op_names", "neighborhood_attention", "plan_override"]

npu.register()
distributed.register()
