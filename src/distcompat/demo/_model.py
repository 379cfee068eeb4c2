"""A tiny nanochat-shaped GPT: rotary embeddings, QK norm, ReLU² MLP, attention via ``attend``.

The two lines the demo writes::

    model = GPT(GPTConfig(n_layer=4, n_embd=128), seed=0)
    loss = model(inputs, targets)          # inputs, targets: int64 (B, T)

Shapes follow nanochat: activations are (B, T, C) and attention runs on (B, T, H, D) tensors
through :func:`distcompat.attend` with ``layout="bthd"`` (FlashAttention's layout), so the kernel
is picked from the tensors' own device and never from ``torch.cuda.is_available()``. Norms have no
weights and linears no biases: every parameter is a matrix, which keeps the sharded optimizer
simple. Initialisation uses a private generator, so it does not depend on the global RNG.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from distcompat.attention import attend

__all__ = ["GPT", "GPTConfig"]


@dataclass(frozen=True, slots=True, kw_only=True)
class GPTConfig:
    """Model sizes. ``n_embd`` must divide by ``n_head`` into an even head dimension (rotary).

    Example:
        >>> GPTConfig(n_layer=2, n_head=2, n_embd=32).head_dim
        16
    """

    vocab_size: int = 256
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    softcap: float = 15.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name}={getattr(self, name)} must be at least 1")
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            raise ValueError(
                f"GPTConfig: n_embd={self.n_embd} / n_head={self.n_head} must be an even integer "
                "(rotary embeddings rotate pairs of channels)"
            )

    @property
    def head_dim(self) -> int:
        """Channels per attention head."""
        return self.n_embd // self.n_head


def _norm(x: torch.Tensor) -> torch.Tensor:
    """RMS norm over the last dim, without weights (as nanochat), in x's dtype.

    Under CUDA autocast ``rsqrt`` runs in float32; without the cast a bf16 q would come out
    float32 while v stays bf16, and attention refuses mixed dtypes.
    """
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(x)


def _rotary_tables(seq_len: int, head_dim: int, base: float = 10000.0) -> torch.Tensor:
    """Return cos and sin stacked: (2, 1, T, 1, D/2), broadcastable over (B, T, H, D/2)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)  # (T, D/2)
    return torch.stack((angles.cos(), angles.sin()))[:, None, :, None, :]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of the head dim of x (B, T, H, D) by the position's angles."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.type_as(x), sin.type_as(x)  # float32 tables would promote a bf16 x
    return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)


class _Attention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.head_dim = config.n_head, config.head_dim
        self.c_q = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.c_k = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.c_v = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q = self.c_q(x).view(b, t, self.n_head, self.head_dim)  # (B, T, H, D)
        k = self.c_k(x).view(b, t, self.n_head, self.head_dim)
        v = self.c_v(x).view(b, t, self.n_head, self.head_dim)
        q, k = _norm(_rotate(q, cos, sin)), _norm(_rotate(k, cos, sin))  # QK norm
        y = attend(q, k, v, causal=True, layout="bthd")  # (B, T, H, D)
        return self.c_proj(y.reshape(b, t, c))  # type: ignore[no-any-return]


class _MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.relu(self.c_fc(x)).square())  # type: ignore[no-any-return]


class _Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.attn = _Attention(config)
        self.mlp = _MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(_norm(x), cos, sin)
        return x + self.mlp(_norm(x))  # type: ignore[no-any-return]


class GPT(nn.Module):
    """The demo's language model; ``forward(idx, targets)`` returns the mean cross-entropy.

    Example:
        >>> model = GPT(GPTConfig(seq_len=8, n_layer=1, n_head=2, n_embd=16), seed=0)
        >>> idx = torch.zeros(2, 8, dtype=torch.int64)
        >>> model(idx).shape, round(model(idx, idx).item(), 1)
        (torch.Size([2, 8, 256]), 5.5)
    """

    def __init__(self, config: GPTConfig, *, seed: int) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.n_layer))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Not in state_dict: recomputed from the config, so checkpoints hold weights only.
        self.register_buffer("rotary", _rotary_tables(config.seq_len, config.head_dim), False)
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Initialise every weight from ``seed`` (nanochat's scheme; output projections zero).

        Example:
            >>> config = GPTConfig(seq_len=4, n_layer=1, n_head=2, n_embd=8)
            >>> a, b = GPT(config, seed=3), GPT(config, seed=3)
            >>> all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
            True
        """
        gen = torch.Generator().manual_seed(seed)
        self.wte.weight.normal_(0.0, 1.0, generator=gen)
        self.lm_head.weight.normal_(0.0, 0.001, generator=gen)
        bound = math.sqrt(3.0) / math.sqrt(self.config.n_embd)  # uniform with std 1/sqrt(fan_in)
        for block in self.blocks:
            assert isinstance(block, _Block)
            for linear in (block.attn.c_q, block.attn.c_k, block.attn.c_v, block.mlp.c_fc):
                linear.weight.uniform_(-bound, bound, generator=gen)
            block.attn.c_proj.weight.zero_()
            block.mlp.c_proj.weight.zero_()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Return logits (B, T, V) without ``targets``, else the mean cross-entropy (a scalar)."""
        t = idx.shape[1]
        if t > self.config.seq_len:
            raise ValueError(f"sequence of {t} tokens exceeds seq_len={self.config.seq_len}")
        rotary: torch.Tensor = self.rotary  # type: ignore[assignment]
        cos, sin = rotary[0, :, :t], rotary[1, :, :t]  # (1, T, 1, D/2) each
        x = _norm(self.wte(idx))  # (B, T, C)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(_norm(x)).float()  # (B, T, V)
        cap = self.config.softcap
        logits = cap * torch.tanh(logits / cap)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
