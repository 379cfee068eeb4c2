"""A drop-in for nanochat's ``flash_attn`` namespace, dispatched per call from the tensors.

nanochat imports FA3 when the *host* has a GPU and then sends CPU tensors to it. Replace its
import with this module and the same two calls run on every device::

    from distcompat.attention import flash_attn
    y = flash_attn.flash_attn_func(q, k, v, causal=True, window_size=(1024, 0))

Layout is FlashAttention's (B, T, H, D); ``window_size`` is FA's inclusive ``(left, right)``.
Unlike nanochat's SDPA fallback, ``causal=False`` is honoured and ``cache_seqlens`` may differ per
row (no ``.item()``).
"""

from __future__ import annotations

import torch

from distcompat.attention import attend
from distcompat.attention._contract import from_nanochat_window
from distcompat.attention._kvcache import attend_with_kvcache

__all__ = ["flash_attn_func", "flash_attn_with_kvcache"]


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
) -> torch.Tensor:
    """Attention of (B, T, H, D) tensors, shaped like FA3's ``flash_attn_func``.

    Example:
        >>> q = torch.randn(2, 5, 4, 8)
        >>> flash_attn_func(q, q[:, :, :2], q[:, :, :2], causal=True).shape
        torch.Size([2, 5, 4, 8])
    """
    # The window is checked where every call's arguments are, once per signature.
    return attend(q, k, v, causal=causal, window=window_size, layout="bthd")


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    cache_seqlens: torch.Tensor | int | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
) -> torch.Tensor:
    """Append ``k``/``v`` to the caches in place at ``cache_seqlens`` and attend, like FA3.

    Example:
        >>> kc = vc = torch.zeros(1, 4, 1, 8)
        >>> q = torch.randn(1, 1, 2, 8)
        >>> new = torch.randn(1, 1, 1, 8)
        >>> out = flash_attn_with_kvcache(q, kc, vc, new, new, torch.tensor([0]), causal=True)
        >>> torch.allclose(out, new.expand(1, 1, 2, 8))   # the only visible key is the new one
        True
    """
    return attend_with_kvcache(
        q,
        k_cache,
        v_cache,
        k,
        v,
        cache_seqlens=cache_seqlens,
        causal=causal,
        window=from_nanochat_window(window_size),
    )
