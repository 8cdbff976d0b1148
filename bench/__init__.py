"""fusedops benchmarks: `python -m bench` (see bench/__main__.py) and one module per op.

Each op benchmark `bench/<op>.py` exposes `run(ctx: bench.common.Context) -> list[dict]`.
"""

OPS = ("attn_res", "neighborhood_attention", "embedding")
