"""Exact attention math: the fallback that runs anywhere and the float64 reference of the tests.

Scores, softmax and the weighted sum are computed in float32 for 16-bit inputs (float64 stays
float64), then cast back to the input dtype, as SDPA's MATH backend does::

    out = math_attention(q, k, v, mask=visible_mask(tq, tk, -1, 0, q.device), scale=None)

The softmax is "safe": a row whose mask is all False gives an output of 0 and gradients of 0,
never NaN. GQA follows FA and SDPA: query head ``h`` reads key/value head ``h // (Hq // Hkv)``.
"""

from __future__ import annotations

import math

import torch

__all__ = ["math_attention", "safe_softmax"]


def safe_softmax(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim where a row of only ``-inf`` gives zeros instead of NaN.

    Example:
        >>> safe_softmax(torch.tensor([[0.0, 0.0], [-math.inf, -math.inf]])).tolist()
        [[0.5, 0.5], [0.0, 0.0]]
    """
    peak = scores.amax(dim=-1, keepdim=True)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    weights = torch.exp(scores - peak)
    total = weights.sum(dim=-1, keepdim=True)
    return weights / torch.where(total > 0, total, torch.ones_like(total))


def math_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    scale: float | None,
) -> torch.Tensor:
    """Attention of (B, H, T, D) tensors with a bool ``mask`` (True = attend, broadcastable).

    Example:
        >>> q = k = v = torch.ones(1, 2, 3, 4)
        >>> math_attention(q, k[:, :1], v[:, :1], mask=None, scale=None).shape   # MQA
        torch.Size([1, 2, 3, 4])
    """
    groups = q.shape[1] // k.shape[1]
    if groups != 1:  # (B, Hkv, Tk, D) -> (B, Hq, Tk, D), kv head h serves q heads h*g .. h*g+g-1
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    work = torch.promote_types(q.dtype, torch.float32)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q.to(work), k.to(work).transpose(-2, -1)) * scale  # (B, H, Tq, Tk)
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    return torch.matmul(safe_softmax(scores), v.to(work)).to(q.dtype)
