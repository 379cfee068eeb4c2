"""Attention that picks its kernel per call from the tensors, with one numerics contract.

The two lines a model writes::

    from distcompat.attention import attend
    y = attend(q, k, v, causal=True, window=(255, 0), layout="bthd")

The implementation (FlashAttention 4/3/2, flex_attention, PyTorch SDPA or exact math) is chosen
from the tensors' own device, that device's compute capability, dtype, head dims and masking, and
from what is installed; never from ``torch.cuda.is_available()``. :func:`explain_attention` says
what was chosen and why every other implementation was not. ``DISTCOMPAT_ATTENTION`` overrides
the choice (see :mod:`distcompat.attention._dispatch`).
"""

from __future__ import annotations

import torch

from distcompat.attention._contract import (
    AttentionInputError,
    Layout,
    Window,
    from_hf_sliding_window,
    from_nanochat_window,
    to_bhtd,
    to_fa4_window,
)
from distcompat.attention._dispatch import (
    ENV_VAR,
    AttentionConfigError,
    AttentionDecision,
    AttentionUnavailableError,
    Rejection,
    decide,
    signature_of,
)
from distcompat.attention._kvcache import attend_with_kvcache
from distcompat.attention._plans import dispatch

__all__ = [
    "ENV_VAR",
    "AttentionConfigError",
    "AttentionDecision",
    "AttentionInputError",
    "AttentionUnavailableError",
    "Rejection",
    "attend",
    "attend_with_kvcache",
    "explain_attention",
    "from_hf_sliding_window",
    "from_nanochat_window",
    "to_fa4_window",
]


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    window: Window | None = None,
    scale: float | None = None,
    layout: Layout = "bhtd",
) -> torch.Tensor:
    """Scaled dot-product attention, returned in the input layout and dtype.

    Args:
        q: queries, (B, Hq, Tq, D) for ``layout="bhtd"`` or (B, Tq, Hq, D) for ``"bthd"``.
        k: keys, with Hkv heads (Hq a multiple of Hkv: GQA/MQA) and Tk positions.
        v: values, shaped like ``k`` except possibly the head dim.
        causal: mask future keys, aligned bottom-right when Tq != Tk (as in FlashAttention).
        window: ``(left, right)`` keys visible around each query, inclusive, ``-1`` unbounded.
        scale: softmax scale; ``None`` means ``1 / sqrt(D)``.
        layout: ``"bhtd"`` (SDPA's) or ``"bthd"`` (FlashAttention's).

    The choice is looked up by the call's shapes, dtypes, devices, grad and arguments (a dict
    lookup once warm); inside ``torch.compile`` it is a constant and the graph holds only the
    chosen kernel's call.

    Example:
        >>> q = k = v = torch.randn(1, 2, 4, 8)
        >>> ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        >>> torch.allclose(attend(q, k, v, causal=True), ref)
        True
    """
    return dispatch(q, k, v, causal=causal, window=window, scale=scale, layout=layout)


def explain_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    window: Window | None = None,
    scale: float | None = None,
    layout: Layout = "bhtd",
) -> AttentionDecision:
    """Return what :func:`attend` would run for these arguments and why it rejected the others.

    Takes the same arguments as :func:`attend` and runs no kernel.

    Example:
        >>> q = torch.randn(1, 2, 4, 8)
        >>> decision = explain_attention(q, q, q, causal=True)
        >>> decision.impl, decision.reason
        ('sdpa', 'SDPA is_causal=True (causal, Tq == Tk: no mask needed)')
        >>> ", ".join(r.impl for r in decision.rejected)
        'fa3, fa4, fa2, flex, math'
    """
    del scale  # does not influence the choice
    qb, kb, vb = to_bhtd(q, layout), to_bhtd(k, layout), to_bhtd(v, layout)
    return decide(signature_of(qb, kb, vb, causal=causal, window=window))
