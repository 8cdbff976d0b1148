"""Where context-parallel NA's time goes (issue 33): torchrun --nproc-per-node N -m bench.experiments.cp_profile.
Profiles the forward and the forward+backward of each case on rank 1 (a middle slab): the GPU kernels by total
time, how much of the NCCL kernels' time ran while an attention kernel did, and the first step's kernels in time
order; chrome traces in $OUT. CP_CASES="1D" (or "2D") picks the cases; CP_OVERLAP=0 profiles without the interior's
attention under the exchange."""

import os

import torch
import torch.distributed as dist

from fusedops.neighborhood_attention import context_parallel as cp


def busy(events, pick) -> list[tuple[float, float]]:
    """Merged [start, end) intervals (us) of the kernels whose name `pick` accepts."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel" and pick(e["name"]))
    merged: list = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def overlap(xs, ys) -> float:
    total = 0.0
    for a, b in xs:
        for c, d in ys:
            total += max(0.0, min(b, d) - max(a, c))
    return total


def main():
    import json

    cp.OVERLAP = os.environ.get("CP_OVERLAP", "1") != "0"
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    out_dir = os.environ.get("OUT", ".")
    cases = (("1D 131072 w2048 H8", (1, 8, 131072, 128), 2048),
             ("2D 256x256 w80 H24", (1, 24, 256, 256, 128), (80, 80)))
    for name, shape, ks in [c for c in cases if c[0].startswith(tuple(os.environ.get("CP_CASES", "1D 2D").split()))]:
        torch.manual_seed(0)
        q, k, v, g = (torch.randn(shape, device="cuda", dtype=torch.bfloat16).tensor_split(world, 2)[rank]
                      .contiguous().requires_grad_() for _ in range(4))
        lengths = [q.shape[2]] * world
        for mode in ("fwd", "fwd+bwd"):
            def step():
                out = cp.context_parallel_neighborhood_attention(q, k, v, ks, lengths=lengths)
                if mode == "fwd+bwd":
                    torch.autograd.grad(out, (q, k, v), g)
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            dist.barrier()
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
            dist.barrier()
            if rank == min(1, world - 1):  # a middle slab: the most halo
                path = os.path.join(out_dir, f"cp_{name.split()[0]}_{mode.replace('+', '_')}.json")
                prof.export_chrome_trace(path)
                events = json.load(open(path))["traceEvents"]
                nccl = busy(events, lambda n: "nccl" in n.lower())
                attn = busy(events, lambda n: n.startswith("na_"))
                t_nccl, t_attn = sum(b - a for a, b in nccl), sum(b - a for a, b in attn)
                gpu = busy(events, lambda n: True)
                print(f"\n{name} {mode} (rank {rank}, 3 steps, overlap {cp.OVERLAP}): NCCL kernels "
                      f"{t_nccl / 3:.0f} us a step, attention {t_attn / 3:.0f} us, NCCL under attention "
                      f"{overlap(nccl, attn) / 3:.0f} us; GPU busy {sum(b - a for a, b in gpu) / 3:.0f} us a step over "
                      f"{(gpu[-1][1] - gpu[0][0]) / 3:.0f}")
                kernels = sorted((e["ts"], e["dur"], e["name"][:40]) for e in events if e.get("cat") == "kernel")
                t0 = kernels[0][0]
                for ts, dur, kname in kernels[:len(kernels) // 3]:  # the first step's kernels in time order
                    print(f"  {ts - t0:9.1f} {dur:8.1f}  {kname}")
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10, max_name_column_width=60))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
