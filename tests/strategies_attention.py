"""Hypothesis strategies and an independent float64 reference for the attention tests.

The reference builds its mask with a plain double loop straight from the contract's definition
(query ``i`` sits at key position ``i + Tk - Tq`` and sees ``j`` iff ``pos - left <= j <= pos +
right``), so it shares no code with the mask builder under test.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from hypothesis import strategies as st


@dataclass(frozen=True)
class Case:
    """One attention call: shapes, masking and dtype."""

    batch: int
    hkv: int
    groups: int
    tq: int
    tk: int
    d: int
    causal: bool
    window: tuple[int, int] | None
    dtype: torch.dtype

    @property
    def hq(self) -> int:
        return self.hkv * self.groups


def loop_mask(tq: int, tk: int, causal: bool, window: tuple[int, int] | None) -> torch.Tensor:
    """(tq, tk) bool mask, True = attend, written as literally as the contract reads."""
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0 if right == -1 else min(right, 0)
    mask = torch.zeros(tq, tk, dtype=torch.bool)
    for i in range(tq):
        pos = i + tk - tq
        for j in range(tk):
            ok = (left == -1 or j >= pos - left) and (right == -1 or j <= pos + right)
            mask[i, j] = ok
    return mask


def plain_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Matmul, mask, softmax, matmul entirely in the inputs' dtype; dead rows set to 0.

    In float64 this is the reference; in a 16-bit dtype it is the "plain implementation in the
    same low precision" of the parity criterion.
    """
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    alive = mask.any(dim=-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(~alive, 0.0), dim=-1).masked_fill(~alive, 0.0)
    return probs @ v


def _windows(draw: st.DrawFn, tk: int) -> tuple[int, int] | None:
    kind = draw(st.sampled_from(["none", "left", "both", "wide"]))
    if kind == "none":
        return None
    w = draw(st.integers(0, max(tk, 1)))
    if kind == "left":
        return (w, 0)
    if kind == "both":
        return (w, draw(st.integers(0, 4)))
    return (tk + 3, -1)  # a left bound that excludes nothing


@st.composite
def cases(draw: st.DrawFn, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> Case:
    """Small attention calls: causal, windows, GQA/MQA, Tq != Tk, decode (Tq = 1)."""
    tk = draw(st.integers(1, 24))
    tq = draw(st.sampled_from([1, tk, max(1, tk // 2), tk + 2]))
    return Case(
        batch=draw(st.integers(1, 2)),
        hkv=draw(st.integers(1, 2)),
        groups=draw(st.sampled_from([1, 2, 4])),
        tq=tq,
        tk=tk,
        d=draw(st.sampled_from([8, 16, 32])),
        causal=draw(st.booleans()),
        window=_windows(draw, tk),
        dtype=draw(st.sampled_from(dtypes)),
    )


def make_inputs(
    case: Case, seed: int, *, grad: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float64 randn q, k, v in (B, H, T, D) for ``case``, leaves with grad when asked."""
    gen = torch.Generator().manual_seed(seed)
    shapes = (
        (case.batch, case.hq, case.tq, case.d),
        (case.batch, case.hkv, case.tk, case.d),
        (case.batch, case.hkv, case.tk, case.d),
    )
    q, k, v = (torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes)
    return q.requires_grad_(grad), k.requires_grad_(grad), v.requires_grad_(grad)
