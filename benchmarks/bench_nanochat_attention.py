"""Train a nanochat-shaped model with attention through distcompat and through direct SDPA.

Usage::

    python benchmarks/bench_nanochat_attention.py --device cuda   # issue 29's sizes (GPU)
    .venv/bin/python benchmarks/bench_nanochat_attention.py --device cpu --depth 2 --width 64 \\
        --head-dim 16 --seq 256 --batch 2 --vocab 256 --steps 6 --warmup 2 --backend aot_eager

The model follows nanochat's GPT (``nanochat/gpt.py``, read, not copied): token embedding,
``depth`` blocks of RMSNorm -> attention with rotary embeddings and QK norm -> RMSNorm -> a
relu^2 MLP, untied head. Windows follow its ``window_pattern="SSSL"``: an S layer sees
``ceil(seq / 4 / 128) * 128`` keys back (``window_size=(512, 0)``, 513 keys, at seq 2048), an
L layer the whole sequence, and the last layer is always L. Defaults are issue 29's: depth 8,
width 512, head dim 128 (4 heads), seq 2048, batch 16, bf16 autocast, ``torch.compile``.

Two models with the same weights train side by side, the only difference being the attention
call: ``distcompat.attention.flash_attn.flash_attn_func`` (nanochat's drop-in) or
``F.scaled_dot_product_attention`` with ``is_causal=True`` for L layers and a bool window mask
built once (a buffer) for S layers. Steps are interleaved in blocks (A then B, then B then A)
so drift on the machine hits both; each step is timed with a device synchronize, peak memory is
reset before and read after each step. Printed: median step time (after the warm-up steps,
which include compilation), peak memory, final loss, and the ratio SDPA / distcompat (>= 1.00
means distcompat is at least as fast). Sized for about 5 minutes on an H100 with both compiles
(not yet run on one: ``tools/gpu_checks.sh nanochat``); on CPU use tiny sizes as above.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from distcompat.attention import explain_attention
from distcompat.attention.flash_attn import flash_attn_func


def window_sizes(depth: int, seq: int, pattern: str = "SSSL") -> list[int]:
    """nanochat's per-layer left window: S = ceil(seq/4/128)*128, L = seq; the last layer L."""
    short = math.ceil(seq / 4 / 128) * 128
    sizes = [short if pattern[i % len(pattern)] == "S" else seq for i in range(depth)]
    sizes[-1] = seq
    return sizes


def rotary(seq: int, head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables, (1, T, 1, D/2) each, in float32."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device) / head_dim))
    angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv_freq)
    return angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, width: int, head_dim: int, seq: int, window: int, direct: bool) -> None:
        super().__init__()
        self.heads, self.head_dim, self.window, self.direct = (
            width // head_dim,
            head_dim,
            window,
            direct,
        )
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width, bias=False)
        mask = None
        if direct and window < seq - 1:  # SDPA's only window: a bool mask, True = attend
            pos = torch.arange(seq)
            diff = pos[:, None] - pos[None, :]
            mask = (diff >= 0) & (diff <= window)
        self.register_buffer("mask", mask, persistent=False)
        self.mask: torch.Tensor | None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, self.head_dim).unbind(2)  # (B, T, H, D)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k = F.rms_norm(q, (self.head_dim,)), F.rms_norm(k, (self.head_dim,))
        if not self.direct:
            y = flash_attn_func(q, k, v, causal=True, window_size=(self.window, 0))
        else:
            q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # (B, H, T, D)
            if self.mask is None:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)
            y = y.transpose(1, 2)
        return self.proj(y.reshape(b, t, c))  # type: ignore[no-any-return]


class Block(nn.Module):
    def __init__(self, width: int, head_dim: int, seq: int, window: int, direct: bool) -> None:
        super().__init__()
        self.attn = Attention(width, head_dim, seq, window, direct)
        self.fc = nn.Linear(width, 4 * width, bias=False)
        self.out = nn.Linear(4 * width, width, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(F.rms_norm(x, (x.shape[-1],)), cos, sin)
        h = F.relu(self.fc(F.rms_norm(x, (x.shape[-1],)))).square()
        return x + self.out(h)  # type: ignore[no-any-return]


class GPT(nn.Module):
    def __init__(self, args: argparse.Namespace, direct: bool, device: torch.device) -> None:
        super().__init__()
        self.embed = nn.Embedding(args.vocab, args.width)
        self.blocks = nn.ModuleList(
            Block(args.width, args.head_dim, args.seq, w, direct)
            for w in window_sizes(args.depth, args.seq)
        )
        self.head = nn.Linear(args.width, args.vocab, bias=False)
        cos, sin = rotary(args.seq, args.head_dim, device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = F.rms_norm(self.embed(idx), (self.embed.embedding_dim,))
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        logits = self.head(F.rms_norm(x, (x.shape[-1],))).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


class Run:
    """One model, its optimizer and compiled step; collects step times and peak memory."""

    def __init__(self, name: str, args: argparse.Namespace, direct: bool) -> None:
        self.name, self.device = name, torch.device(args.device)
        torch.manual_seed(0)  # the same weights for both models
        self.model = GPT(args, direct, self.device).to(self.device)
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=3e-4, fused=self.device.type == "cuda"
        )
        self.autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=args.bf16)
        self.forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = self.model
        if args.backend != "none":
            self.forward = torch.compile(self.model, backend=args.backend, dynamic=False)
        self.times: list[float] = []
        self.peaks: list[int] = []
        self.loss = float("nan")

    def step(self, idx: torch.Tensor, targets: torch.Tensor) -> float:
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        with self.autocast:
            loss = self.forward(idx, targets)
        loss.backward()  # type: ignore[no-untyped-call]
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            self.peaks.append(torch.cuda.max_memory_allocated())
        self.loss = float(loss.detach())
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=40, help="steps per model, warm-up included")
    parser.add_argument("--warmup", type=int, default=3, help="first steps not timed (compile)")
    parser.add_argument("--block", type=int, default=5, help="steps per model per turn")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend, or none")
    parser.add_argument("--no-bf16", dest="bf16", action="store_false", help="no bf16 autocast")
    args = parser.parse_args()
    device = torch.device(args.device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"torch {torch.__version__}, {where}; depth {args.depth} width {args.width} "
        f"head dim {args.head_dim} seq {args.seq} batch {args.batch}, windows "
        f"{window_sizes(args.depth, args.seq)}, bf16 autocast {args.bf16}, "
        f"compile {args.backend}, {args.steps} steps each",
        flush=True,
    )
    runs = [Run("distcompat", args, direct=False), Run("direct SDPA", args, direct=True)]
    gen = torch.Generator().manual_seed(1)
    tokens = [
        torch.randint(args.vocab, (args.batch, args.seq + 1), generator=gen) for _ in range(4)
    ]
    batches = [
        (t[:, :-1].contiguous().to(device), t[:, 1:].contiguous().to(device)) for t in tokens
    ]
    # What distcompat runs for an S and an L layer of this model (the tensors' layout and dtype).
    probe = torch.empty(
        args.batch,
        args.seq,
        args.width // args.head_dim,
        args.head_dim,
        device=device,
        dtype=torch.bfloat16 if args.bf16 else torch.float32,
    )
    for window in sorted(set(window_sizes(args.depth, args.seq))):
        decision = explain_attention(
            probe, probe, probe, causal=True, window=(window, 0), layout="bthd"
        )
        print(f"window {window}: {decision.impl}: {decision.reason}")
    done = 0
    while done < args.steps:
        order = runs if (done // args.block) % 2 == 0 else runs[::-1]
        for run in order:
            for i in range(done, min(done + args.block, args.steps)):
                seconds = run.step(*batches[i % len(batches)])
                if i >= args.warmup:
                    run.times.append(seconds)
        done += args.block
    print("\n| attention | median step (ms) | peak memory (MiB) | loss at last step |")
    print("|---|---|---|---|")
    for run in runs:
        peak = f"{max(run.peaks) / 2**20:,.0f}" if run.peaks else "-"
        median = statistics.median(run.times) * 1e3 if run.times else float("nan")
        print(f"| {run.name} | {median:.1f} | {peak} | {run.loss:.4f} |")
    ours, direct = (statistics.median(r.times) if r.times else float("nan") for r in runs)
    print(f"\nstep time direct SDPA / distcompat: {direct / ours:.3f}x (>= 1.00: no slower)")
    if all(r.peaks for r in runs):
        print(
            f"peak memory distcompat - direct SDPA: "
            f"{(max(runs[0].peaks) - max(runs[1].peaks)) / 2**20:+,.0f} MiB"
        )


if __name__ == "__main__":
    main()
