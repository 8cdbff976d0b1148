"""A small causal language model built from fusedops ops, trained under torch.compile(fullgraph=True).

    python -m fusedops.examples.lm                 # CPU by default (the GPU when there is one)
    python -m fusedops.examples.lm --steps 50 --out /tmp/lm
    torchrun --nproc-per-node 4 -m fusedops.examples.lm --tp 2   # FSDP2 x tensor parallel, 2 x 2 ranks

The model:
- `fusedops.nn.Embedding` for the tokens; the output head is tied to it.
- Block Attention Residuals (Kimi, "Attention Residuals", 2025) instead of the plain residual stream:
  the sublayers are grouped into blocks; the input of every sublayer (and of the final norm) is a
  softmax-over-depth mix, `fusedops.nn.AttnRes`, of its sources stacked as [N, B, T, D]: the token
  embedding, the sum of each completed block's sublayer outputs, and the running partial sum of the
  current block. Each mixing site has its own pseudo-query, initialised to zero (so a fresh model
  averages its sources uniformly).
- Causal sliding-window attention: `fusedops.neighborhood_attention(q, k, v, window, is_causal=True)`
  over [B, H, T, D] (query t sees keys t-window+1 .. t), with rotary position embeddings.
- A GELU MLP.

The data is generated: a fixed random "language" in which the next token is, with probability
`1 - noise`, a function of the two tokens before it, else uniform noise. The loss falls from
ln(vocab) towards the noise floor; the floor is printed.

Under torchrun (more than one rank: NCCL on GPUs, gloo on CPUs) it trains data-parallel with FSDP2
(`fully_shard`) over `world / tp` ranks and, with `--tp N`, tensor-parallel over N ranks: attention heads
and the MLP's hidden units split Megatron-style (ColwiseParallel / RowwiseParallel from
torch.distributed.tensor.parallel), each rank running the fusedops ops on its own heads. Each data-parallel
rank takes its slice of one global batch, so the losses are the single-process run's. Distributed runs
train eagerly and skip the export.

After training, the model is exported with torch.export, saved and loaded back
(torch.export.save/load), and the loaded program's logits are checked against the eager model's. With
`--aoti` it is also compiled ahead of time by AOTInductor into a deployable package (on a GPU the package
holds the fusedops Triton kernels), loaded back and checked the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fusedops
from fusedops.registry import opaque_triton_ops


@dataclass
class Config:
    vocab: int = 128
    dim: int = 64
    heads: int = 2
    layers: int = 4  # each layer is two sublayers: attention, MLP
    block_layers: int = 2  # layers per AttnRes block
    window: int = 8  # causal attention window (keys t-window+1 .. t)
    mlp_ratio: int = 4
    seq: int = 64
    batch: int = 16
    steps: int = 200
    lr: float = 3e-3
    period: int = 6  # the generated text repeats with this period (must be <= window)
    noise: float = 0.05  # probability that a token is random
    seed: int = 0


# ---- data ----------------------------------------------------------------------------------------------


class SyntheticText:
    """Token streams of a fixed random language with two kinds of structure:

    - the first `period` tokens of a sequence follow a sparse Markov chain (each token has `fanout`
      possible successors), learnable from the previous token alone;
    - after that the sequence repeats itself: x[t] = x[t - period], learnable only by attending
      `period - 1` positions back from the query (which the sliding window must cover);
    - every token is replaced by a uniform random one with probability `noise`.

    Deterministic for a seed."""

    def __init__(self, vocab: int, period: int, noise: float, seed: int = 0, fanout: int = 4) -> None:
        g = torch.Generator().manual_seed(seed)
        self.vocab, self.period, self.noise, self.fanout = vocab, period, noise, fanout
        self.successors = torch.randint(0, vocab, (vocab, fanout), generator=g)
        self.gen = torch.Generator().manual_seed(seed + 1)

    def batch(self, batch: int, seq: int) -> tuple[Tensor, Tensor]:
        """(inputs, targets), each [batch, seq] int64, targets shifted by one."""
        n, g = seq + 1, self.gen
        x = torch.empty(batch, n, dtype=torch.long)
        noisy = torch.rand(batch, n, generator=g) < self.noise
        rand = torch.randint(0, self.vocab, (batch, n), generator=g)
        pick = torch.randint(0, self.fanout, (batch, n), generator=g)
        for t in range(n):
            if t == 0:
                nxt = rand[:, 0]
            elif t < self.period:
                nxt = self.successors[x[:, t - 1], pick[:, t]]
            else:
                nxt = x[:, t - self.period]
            x[:, t] = torch.where(noisy[:, t], rand[:, t], nxt)
        return x[:, :-1], x[:, 1:]

    def loss_floor(self, seq: int) -> float:
        """Expected cross-entropy (nats) per target of the best predictor: a lower bound for the loss."""
        v, e = self.vocab, self.noise

        def entropy(choices: int) -> float:  # choices equally likely outcomes, then the noise
            p_in, p_out = (1 - e) / choices + e / v, e / v
            out = -choices * p_in * math.log(p_in)
            return out - (v - choices) * p_out * math.log(p_out) if e > 0 else out

        chain = min(self.period - 1, seq)
        return (chain * entropy(self.fanout) + (seq - chain) * entropy(1)) / seq


# ---- model ---------------------------------------------------------------------------------------------


def rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (x[..., :h], x[..., h:]) of x [B, H, T, D] by the position angles [T, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class SlidingWindowAttention(nn.Module):
    """Causal multi-head attention over the last `window` positions, as 1D neighborhood attention."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        if cfg.dim % cfg.heads:
            raise ValueError(f"dim {cfg.dim} must be divisible by heads {cfg.heads}")
        self.heads, self.head_dim, self.window = cfg.heads, cfg.dim // cfg.heads, cfg.window
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, t, _ = x.shape
        # [B, T, 3, H, Dh] -> three [B, H, T, Dh] views (heads-last memory, last dim contiguous)
        # The projection's rows are grouped by head (q, k, v of head 0, then of head 1, ...), so a row-wise
        # split of qkv over tensor-parallel ranks hands each rank whole heads; it then has fewer of them.
        qkv = self.qkv(x)
        heads = qkv.shape[-1] // (3 * self.head_dim)
        q, k, v = qkv.view(b, t, heads, 3, self.head_dim).permute(3, 0, 2, 1, 4).unbind(0)
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        out = fusedops.neighborhood_attention(q, k, v, self.window, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim, bias=False)
        self.down = nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(x)))


class Sublayer(nn.Module):
    """One residual branch: AttnRes over the sources, pre-norm, then attention or MLP."""

    def __init__(self, cfg: Config, kind: str) -> None:
        super().__init__()
        self.mix = fusedops.nn.AttnRes(cfg.dim)  # zero-initialised pseudo-query
        self.norm = nn.RMSNorm(cfg.dim)
        self.kind = kind
        self.body = SlidingWindowAttention(cfg) if kind == "attn" else MLP(cfg)

    def forward(self, sources: list[Tensor], cos: Tensor, sin: Tensor) -> Tensor:
        h = self.mix(torch.stack(sources))  # [N, B, T, D] -> [B, T, D]
        h = self.norm(h)
        return self.body(h, cos, sin) if self.kind == "attn" else self.body(h)


class AttnResLM(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        if cfg.layers % cfg.block_layers:
            raise ValueError(f"layers {cfg.layers} must be a multiple of block_layers {cfg.block_layers}")
        self.cfg = cfg
        self.embed = fusedops.nn.Embedding(cfg.vocab, cfg.dim)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.sublayers = nn.ModuleList(
            Sublayer(cfg, kind) for _ in range(cfg.layers) for kind in ("attn", "mlp")
        )
        self.block_sublayers = 2 * cfg.block_layers
        self.final_mix = fusedops.nn.AttnRes(cfg.dim)
        self.final_norm = nn.RMSNorm(cfg.dim)
        hd = cfg.dim // cfg.heads
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hd // 2, dtype=torch.float32) / (hd // 2)))
        angles = torch.outer(torch.arange(cfg.seq, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("down.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.layers))

    def forward(self, tokens: Tensor) -> Tensor:
        """tokens [B, T] -> logits [B, T, vocab]."""
        t = tokens.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        blocks = [self.embed(tokens)]  # the embedding, then each completed block's sum
        partial: Optional[Tensor] = None  # running sum of the current block's sublayer outputs
        for i, sub in enumerate(self.sublayers):
            out = sub(blocks if partial is None else blocks + [partial], cos, sin)
            partial = out if partial is None else partial + out
            if (i + 1) % self.block_sublayers == 0:
                blocks.append(partial)
                partial = None
        h = self.final_mix(torch.stack(blocks if partial is None else blocks + [partial]))
        return self.final_norm(h) @ self.embed.weight.t()  # head tied to the embedding

    @torch.no_grad()
    def forward_two_phase(self, tokens: Tensor) -> Tensor:
        """The same logits computed the way Block AttnRes serves (Kimi's Algorithm 1, issue 37): per block,
        phase 1 (`fusedops.attn_res_multi`) mixes the completed blocks once for all of the block's sublayers'
        pseudo-queries (folded with their key-norm gains); then each sublayer after the first merges the
        running partial sum in with `fusedops.attn_res_merge`, which also adds the previous sublayer's output
        into that sum and applies the sublayer's pre-norm (its gain and eps). Inference only (no grad)."""
        t = tokens.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        blocks = [self.embed(tokens)]
        subs = list(self.sublayers)
        for b0 in range(0, len(subs), self.block_sublayers):
            block = subs[b0:b0 + self.block_sublayers]
            queries = torch.stack([s.mix.query * s.mix.norm_weight for s in block])
            out, lse = fusedops.attn_res_multi(blocks, queries, block[0].mix.eps)
            partial, pending = None, None
            for l, sub in enumerate(block):
                norm_eps = sub.norm.eps if sub.norm.eps is not None else torch.finfo(out.dtype).eps
                if partial is None:  # the block's first sublayer has no partial sum yet: phase 1 alone
                    h = F.rms_norm(out[0], (out.shape[-1],), sub.norm.weight, norm_eps)
                else:
                    h, partial = fusedops.attn_res_merge(out[l], lse[l], partial, queries[l], pending, sub.norm.weight,
                                                         sub.mix.eps, norm_eps)
                f = sub.body(h, cos, sin) if sub.kind == "attn" else sub.body(h)
                partial, pending = (f, None) if partial is None else (partial, f)
            blocks.append(partial if pending is None else partial + pending)
        h = self.final_mix(torch.stack(blocks))
        return self.final_norm(h) @ self.embed.weight.t()


# ---- training, export ----------------------------------------------------------------------------------


def pick_device(name: Optional[str] = None) -> torch.device:
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def graph_context(device: torch.device):
    """The context for torch.compile and torch.export. On CPU the fusedops ops stay single opaque graph
    nodes (`fusedops.registry.opaque_triton_ops`), so the exported program keeps `fusedops.*` calls
    and the interpreter's Triton kernels, which cannot be traced, run as they are. On a GPU the
    compiler sees through the ops into their Triton kernels."""
    return opaque_triton_ops() if device.type == "cpu" else contextlib.nullcontext()


def compiled_loss(model: nn.Module, backend: str = "inductor"):
    """The loss function compiled with fullgraph=True: a graph break raises instead of splitting."""

    def loss_fn(x: Tensor, y: Tensor) -> Tensor:
        logits = model(x)
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    return torch.compile(loss_fn, fullgraph=True, backend=backend)


def train(
    model: AttnResLM,
    data: SyntheticText,
    steps: int,
    device: torch.device,
    compile: bool = True,
    backend: str = "inductor",
    log_every: int = 10,
    log=print,
    shard: Optional[tuple[int, int]] = None,
) -> list[float]:
    """shard: (data-parallel rank, data-parallel size) in a distributed run, else None."""
    cfg = model.cfg
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    loss_fn = compiled_loss(model, backend) if compile else (
        lambda x, y: F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
    )
    losses = []
    t0 = time.perf_counter()
    with graph_context(device):
        for step in range(steps):
            x, y = data.batch(cfg.batch, cfg.seq)
            if shard is not None:  # data parallel: this rank's slice of the global batch
                x, y = x.chunk(shard[1])[shard[0]], y.chunk(shard[1])[shard[0]]
            loss = loss_fn(x.to(device), y.to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if shard is None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            else:
                _clip_sharded(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(_mean_over_ranks(loss.detach(), shard) if shard is not None else loss.item())
            if log and (step % log_every == 0 or step == steps - 1):
                log(f"step {step:4d}  loss {losses[-1]:.4f}  ({time.perf_counter() - t0:.1f} s)")
    return losses


def _clip_sharded(params, max_norm: float) -> None:
    """clip_grad_norm_ for gradients that live on different meshes (FSDP's and FSDP x TP's), which
    torch's own cannot stack: each gradient's global norm, then one scale for all."""
    grads = [p.grad for p in params if p.grad is not None]
    norms = [g.norm() for g in grads]
    total = torch.stack([n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms]).norm().item()
    scale = min(1.0, max_norm / (total + 1e-6))
    for g in grads:
        g.mul_(scale)


def _mean_over_ranks(loss: Tensor, shard: tuple[int, int]) -> float:
    """The global batch's loss: the mean of the data-parallel ranks' (equal slices)."""
    import torch.distributed as dist

    total = loss.clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()  # tensor-parallel ranks hold equal copies


def parallelize(model: AttnResLM, tp: int, device: torch.device) -> tuple[int, int]:
    """Tensor parallel over `tp` ranks, then FSDP2 over the rest (a [dp, tp] mesh of the whole world).
    Returns (data-parallel rank, data-parallel size)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    world = dist.get_world_size()
    if world % tp or model.cfg.heads % tp or (model.cfg.mlp_ratio * model.cfg.dim) % tp:
        raise ValueError(f"--tp {tp} must divide the world size ({world}), the heads ({model.cfg.heads}) and "
                         f"the MLP width ({model.cfg.mlp_ratio * model.cfg.dim})")
    mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    if tp > 1:
        for sub in model.sublayers:
            plan = ({"qkv": ColwiseParallel(), "proj": RowwiseParallel()} if sub.kind == "attn"
                    else {"up": ColwiseParallel(), "down": RowwiseParallel()})
            parallelize_module(sub.body, mesh["tp"], plan)
    for sub in model.sublayers:
        fully_shard(sub, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return mesh["dp"].get_local_rank(), mesh["dp"].size()


def export_and_reload(model: nn.Module, example: Tensor, path: str):
    """torch.export the model, save it to `path`, load it back; returns the loaded ExportedProgram."""
    model.eval()
    with graph_context(example.device), torch.no_grad():
        ep = torch.export.export(model, (example,))
    torch.export.save(ep, path)
    return torch.export.load(path)


def build_aoti_package(model: nn.Module, example: Tensor, path: str) -> str:
    """torch.export the model and compile it ahead of time with AOTInductor into the package `path` (a .pt2);
    returns the package's path. On a GPU the package holds the fusedops Triton kernels, compiled for this
    device; on a CPU, C++ compiled from the ops' PyTorch reference path."""
    model.eval()
    with torch.no_grad():
        ep = torch.export.export(model, (example,))
        return torch._inductor.aoti_compile_and_package(ep, package_path=path)


def aoti_package(model: nn.Module, example: Tensor, path: str):
    """build_aoti_package, then load the package; returns the loaded callable."""
    return torch._inductor.aoti_load_package(build_aoti_package(model, example, path))


def save_loss_plot(losses: list[float], path: str, floor: Optional[float] = None, title: str = "") -> bool:
    """The loss curve as a PNG at path; False, saying so and why, when matplotlib does not import."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        print(f"loss curve not saved ({path}): matplotlib is not importable ({type(e).__name__}: {e}); "
              "`pip install matplotlib` (or fusedops[bench]) for the PNG")
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(losses, lw=1, label="training loss")
    if floor is not None:
        ax.axhline(floor, color="k", ls="--", lw=0.8, label=f"entropy floor {floor:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: Optional[list[str]] = None) -> int:
    d = Config()
    p = argparse.ArgumentParser(prog="python -m fusedops.examples.lm", description=__doc__.split("\n\n")[0])
    for name, val in asdict(d).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(val), default=val)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--no-compile", action="store_true", help="train eagerly (the default compiles, fullgraph)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (inductor, aot_eager, ...)")
    p.add_argument("--out", default="lm_example_out", help="directory for the loss curve and exported model")
    p.add_argument("--aoti", action="store_true", help="also package the model with AOTInductor and check it")
    p.add_argument("--tp", type=int, default=1, help="under torchrun: tensor-parallel ranks (the rest: FSDP2)")
    args = p.parse_args(argv)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return distributed_main(args, Config(**{k: getattr(args, k) for k in asdict(d)}))
    cfg = Config(**{k: getattr(args, k) for k in asdict(d)})
    if not 2 <= cfg.period <= cfg.window:
        p.error(f"--period {cfg.period} must be in [2, window={cfg.window}]: the copy must fall inside the window")
    device = pick_device(args.device)
    torch.manual_seed(cfg.seed)
    os.makedirs(args.out, exist_ok=True)

    data = SyntheticText(cfg.vocab, cfg.period, cfg.noise, cfg.seed)
    model = AttnResLM(cfg).to(device)
    nparams = sum(p.numel() for p in model.parameters())
    print(f"AttnResLM: {nparams / 1e6:.2f} M parameters, {cfg.layers} layers in blocks of {cfg.block_layers}, "
          f"window {cfg.window}, on {device}; loss starts near ln({cfg.vocab}) = {math.log(cfg.vocab):.3f}, "
          f"best possible {data.loss_floor(cfg.seq):.3f}")
    print(f"training under torch.compile(fullgraph=True, backend={args.backend!r})" if not args.no_compile
          else "training eagerly")
    losses = train(model, data, cfg.steps, device, compile=not args.no_compile, backend=args.backend)
    k = max(1, min(10, len(losses) // 5))
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    print(f"loss {first:.3f} -> {last:.3f} (mean of the first and last {k} steps)")

    png = os.path.join(args.out, "loss.png")
    if save_loss_plot(losses, png, data.loss_floor(cfg.seq), f"AttnResLM on {device}, {cfg.steps} steps"):
        print(f"wrote {png}")

    x, _ = data.batch(4, cfg.seq)
    x = x.to(device)
    pt2 = os.path.join(args.out, "lm.pt2")
    loaded = export_and_reload(model, x, pt2)
    with torch.no_grad():
        ref = model(x)
        got = loaded.module()(x)
    failures = []

    def check(what: str, logits: Tensor, failure: str) -> None:
        err = (logits - ref).abs().max().item()
        print(f"{what}: max |logits - eager| = {err:.2e}")
        if not err <= 1e-4 * max(1.0, ref.abs().max().item()):
            failures.append(failure)

    check(f"exported to {pt2} and reloaded", got, "the reloaded exported program does not match the eager model")
    check("Block AttnRes two-phase inference (attn_res_multi + attn_res_merge)", model.forward_two_phase(x),
          "the two-phase Block AttnRes inference path does not match the training-form model")
    if args.aoti:
        package = os.path.join(args.out, "lm_aoti.pt2")
        t0 = time.perf_counter()
        compiled = aoti_package(model, x, package)
        with torch.no_grad():
            logits = compiled(x)
        check(f"AOTInductor package {package} ({time.perf_counter() - t0:.0f} s to build and load)", logits,
              "the AOTInductor package does not match the eager model")
    if cfg.steps >= 20 and not last < first:  # fewer steps than the warm-up: too early to judge
        failures.append("the loss did not fall")
    for f in failures:
        print(f"FAILED: {f}", file=sys.stderr)
    return 1 if failures else 0


def distributed_main(args, cfg: Config) -> int:
    """One rank of a torchrun launch: FSDP2 (and tensor parallel with --tp) training, rank 0 logging."""
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and args.device != "cpu"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        torch.manual_seed(cfg.seed)  # every rank builds the same model and draws the same global batches
        model = AttnResLM(cfg).to(device)
        shard = parallelize(model, args.tp, device)
        rank0 = dist.get_rank() == 0
        if rank0:
            print(f"AttnResLM on {dist.get_world_size()} ranks ({device.type}): FSDP2 over {shard[1]}, tensor "
                  f"parallel over {args.tp}; training eagerly")
        data = SyntheticText(cfg.vocab, cfg.period, cfg.noise, cfg.seed)
        losses = train(model, data, cfg.steps, device, compile=False, log=print if rank0 else None, shard=shard)
        k = max(1, min(10, len(losses) // 5))
        first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
        if rank0:
            print(f"loss {first:.3f} -> {last:.3f} (mean of the first and last {k} steps)")
        drain_collectives(model)
        return 0 if cfg.steps < 20 or last < first else 1
    finally:
        dist.destroy_process_group()


def drain_collectives(model: nn.Module) -> None:
    """Wait for every collective still queued on the groups the model's DTensors use (FSDP2 leaves
    reductions in flight that nothing waits for on CPU). gloo's barrier completes after all earlier
    work of its group; a gloo work still running when Python finalises aborts the process."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    groups = {id(g): g for p in model.parameters() if isinstance(p, DTensor) for g in p.device_mesh.get_all_groups()}
    for group in [*groups.values(), None]:
        dist.barrier(group=group)


if __name__ == "__main__":
    sys.exit(main())
