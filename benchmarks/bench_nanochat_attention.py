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

Models with the same weights train side by side, the only difference being the attention
call (``--variants``): ``distcompat`` is ``distcompat.attention.flash_attn.flash_attn_func``
(nanochat's drop-in) as ``auto`` decides (flex for the S layers' windows on a GPU, by
``FLEX_WINDOW_RULES``); ``noflex`` is the same call with flex ruled out for windows
(``_rules.FLEX_WINDOW_RULES = ()`` while that model traces and runs: SDPA with a cached mask,
auto's choice before the rule was measured); ``sdpa`` is ``F.scaled_dot_product_attention``
with ``is_causal=True`` for L layers and a bool window mask built once (a buffer) for S layers.
A variant that raises is reported and dropped. Steps are interleaved in blocks (in turn, the
order reversed every other block) so drift on the machine hits all; each step is timed with
a device synchronize, peak memory is reset before and read after each step. Printed: median
step time (after the warm-up steps, which include compilation), peak memory, final loss, and
each variant's ratio SDPA / variant (>= 1.00: no slower than direct SDPA); ``--profile`` adds
one profiled step per variant (the kernels that took the most device time). The whole run
with three compiles took 59-87 s on an H200 (``tools/gpu_checks.sh nanochat``); on CPU use
tiny sizes as above.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from distcompat.attention import _dispatch, _plans, _rules, explain_attention
from distcompat.attention.flash_attn import flash_attn_func

VARIANTS = {
    "distcompat": "distcompat",
    "noflex": "distcompat, no flex",
    "sdpa": "direct SDPA",
}


@contextlib.contextmanager
def flex_rules(rules: tuple[tuple[int, int, int], ...] | None) -> Iterator[None]:
    """Auto's flex rules set to ``rules`` (None: as shipped) and the decisions made under them."""
    if rules is None:
        yield
        return
    shipped = _rules.FLEX_WINDOW_RULES
    _rules.FLEX_WINDOW_RULES = rules
    _dispatch._decide.cache_clear()
    _plans.clear_plans()
    try:
        yield
    finally:
        _rules.FLEX_WINDOW_RULES = shipped
        _dispatch._decide.cache_clear()
        _plans.clear_plans()


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
    def __init__(self, width: int, head_dim: int, seq: int, window: int, variant: str) -> None:
        super().__init__()
        self.heads, self.head_dim, self.window = width // head_dim, head_dim, window
        # Read in forward, so dynamo guards on it and each variant gets its own graph (one class,
        # one forward: without the guard, a second distcompat variant reused the first's graph).
        self.variant = variant
        direct = variant == "sdpa"
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
        if self.variant != "sdpa":
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
    def __init__(self, width: int, head_dim: int, seq: int, window: int, variant: str) -> None:
        super().__init__()
        self.attn = Attention(width, head_dim, seq, window, variant)
        self.fc = nn.Linear(width, 4 * width, bias=False)
        self.out = nn.Linear(4 * width, width, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(F.rms_norm(x, (x.shape[-1],)), cos, sin)
        h = F.relu(self.fc(F.rms_norm(x, (x.shape[-1],)))).square()
        return x + self.out(h)  # type: ignore[no-any-return]


class GPT(nn.Module):
    def __init__(self, args: argparse.Namespace, variant: str, device: torch.device) -> None:
        super().__init__()
        self.embed = nn.Embedding(args.vocab, args.width)
        self.blocks = nn.ModuleList(
            Block(args.width, args.head_dim, args.seq, w, variant)
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

    def __init__(self, variant: str, args: argparse.Namespace) -> None:
        self.name, self.device = VARIANTS[variant], torch.device(args.device)
        self.rules: tuple[tuple[int, int, int], ...] | None = () if variant == "noflex" else None
        self.error: str | None = None
        torch.manual_seed(0)  # the same weights for every model
        self.model = GPT(args, variant, self.device).to(self.device)
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
        with flex_rules(self.rules), self.autocast:
            loss = self.forward(idx, targets)
        loss.backward()  # type: ignore[no-untyped-call]
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            self.peaks.append(torch.cuda.max_memory_allocated())
        self.loss = float(loss.detach())
        return time.perf_counter() - start


def profile_step(run: Run, idx: torch.Tensor, targets: torch.Tensor) -> None:
    """Print the kernels of one (warm) step of ``run``, the most device time first."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if run.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    times, peaks = list(run.times), list(run.peaks)
    with profile(activities=activities) as prof:
        run.step(idx, targets)
    run.times, run.peaks = times, peaks  # the profiled step is not one of the timed ones
    sort = "self_device_time_total" if run.device.type == "cuda" else "self_cpu_time_total"
    print(f"\n{run.name}: one step, profiled")
    print(prof.key_averages().table(sort_by=sort, row_limit=14, max_name_column_width=70))


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
    parser.add_argument(
        "--profile", action="store_true", help="then profile one step each: top kernels by time"
    )
    parser.add_argument(
        "--variants",
        default="distcompat,noflex,sdpa",
        help=f"comma-separated: {', '.join(VARIANTS)}",
    )
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
    names = [name.strip() for name in args.variants.split(",")]
    unknown = [name for name in names if name not in VARIANTS]
    if unknown or "sdpa" not in names:
        parser.error(f"--variants: unknown {unknown} or no sdpa (the baseline): {args.variants}")
    runs = [Run(name, args) for name in names]
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
    for run in runs:
        if run.name == VARIANTS["sdpa"]:
            continue
        for window in sorted(set(window_sizes(args.depth, args.seq))):
            with flex_rules(run.rules):
                decision = explain_attention(
                    probe, probe, probe, causal=True, window=(window, 0), layout="bthd"
                )
            print(f"{run.name}: window {window}: {decision.impl}: {decision.reason}")
    done = 0
    while done < args.steps:
        order = runs if (done // args.block) % 2 == 0 else runs[::-1]
        for run in order:
            for i in range(done, min(done + args.block, args.steps)):
                if run.error is not None:
                    break
                try:
                    seconds = run.step(*batches[i % len(batches)])
                except Exception as exc:  # a variant that cannot run is reported, not fatal
                    run.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                    print(f"{run.name} raised at step {i}: {run.error}", flush=True)
                    break
                if i >= args.warmup:
                    run.times.append(seconds)
        done += args.block
        print(f"steps done: {min(done, args.steps)}", flush=True)
    if args.profile:
        for run in runs:
            if run.error is None:
                profile_step(run, *batches[0])
    base = runs[names.index("sdpa")]
    base_median = statistics.median(base.times) if base.times else float("nan")
    print(
        "\n| attention | median step (ms) | direct SDPA / this | peak memory (MiB) "
        "| peak - SDPA's (MiB) | loss at last step |"
    )
    print("|---|---|---|---|---|---|")
    for run in runs:
        if not run.times:
            print(f"| {run.name} | {run.error or 'no timed steps'} | - | - | - | - |")
            continue
        median = statistics.median(run.times)
        peak, extra = "-", "-"
        if run.peaks and base.peaks:
            peak = f"{max(run.peaks) / 2**20:,.0f}"
            extra = f"{(max(run.peaks) - max(base.peaks)) / 2**20:+,.0f}"
        print(
            f"| {run.name} | {median * 1e3:.1f} | {base_median / median:.3f}x | {peak} | {extra} "
            f"| {run.loss:.4f} |"
        )


if __name__ == "__main__":
    main()
