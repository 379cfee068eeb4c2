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

from distcompat.attention._contract import (
    AttentionInputError,
    from_hf_sliding_window,
    from_nanochat_window,
    to_fa4_window,
)
from distcompat.attention._dispatch import (
    ENV_VAR,
    AttentionConfigError,
    AttentionDecision,
    AttentionUnavailableError,
    Rejection,
    explain_attention,
)
from distcompat.attention._kvcache import attend_with_kvcache
from distcompat.attention._plans import attend

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
