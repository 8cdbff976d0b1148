"""Where context-parallel NA's forward time goes (issue 33): torchrun --nproc-per-node 2 -m
bench.experiments.cp_profile. Times the rank's forward, the exchange alone and the op alone; then profiles the
forward on rank 0 (GPU kernels by total time; trace in $OUT)."""

import os
import torch
import torch.distributed as dist

import fusedops
from fusedops.bench.distributed import timed
from fusedops.neighborhood_attention import context_parallel as cp
from fusedops.neighborhood_attention.op import check_window_args


def main():
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    out_dir = os.environ.get("OUT", ".")
    for name, shape, ks in (("1D 131072 w2048 H8", (1, 8, 131072, 128), 2048),
                            ("2D 256x256 w80 H24", (1, 24, 256, 256, 128), (80, 80))):
        torch.manual_seed(0)
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16).tensor_split(world, 2)[rank].contiguous()
                   for _ in range(3))
        lengths = [q.shape[2]] * world
        fwd = lambda: cp.context_parallel_neighborhood_attention(q, k, v, ks, lengths=lengths)
        rows = {"forward": timed(fwd)}
        ranges = cp.rank_ranges(lengths, 0, *check_window_args(q.dim() - 3, ks, 1, 1, False, "shifted"), "shifted")
        rows["exchange (k, v) alone"] = timed(lambda: cp.extend((k, v), 2, rank, ranges, None))
        k_ext, v_ext = cp.extend((k, v), 2, rank, ranges, None)
        off = [ranges[rank][0] - ranges[rank][2]] + [0] * (q.dim() - 4)
        rows["op alone"] = timed(lambda: fusedops.neighborhood_attention(q, k_ext, v_ext, ks, query_offset=off))
        if rank == 0:
            print(f"\n{name}, rank 0 slab {ranges[0]}")
            for key, ms in rows.items():
                print(f"  {key:<28} {ms:8.3f} ms")
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                fwd()
            torch.cuda.synchronize()
        dist.barrier()
        if rank == 0:
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
            prof.export_chrome_trace(os.path.join(out_dir, f"cp_{name.split()[0]}.json"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
