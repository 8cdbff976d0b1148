"""fusedops benchmarks: `python -m fusedops.bench` (see fusedops/bench/__main__.py) and one module per op.

Shipped in the package, so the main job runs from an installed wheel. Each op benchmark
`fusedops/bench/<op>.py` has `CASES` (accelerator sizes), `CPU_CASES`, `QUICK` and
`run(ctx: fusedops.bench.common.Context) -> list[dict]`.
"""

OPS = ("attn_res", "neighborhood_attention", "embedding")
