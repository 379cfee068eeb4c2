"""Attention against a KV cache, equivalent to FlashAttention's ``flash_attn_with_kvcache``.

Tensors are in FA's (B, T, H, D) layout. New keys/values are written into the cache in place at
each row's own position ``cache_seqlens[b]``; query row ``i`` of batch row ``b`` then sits at key
position ``i + cache_seqlens[b] + T_new - Tq`` (bottom-right, per row), so ragged batches are
exact::

    out = attend_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=lens, causal=True)
    lens += k.shape[1]     # the caller advances the lengths, as with FA

Off FA, the cache is read through one (B, 1, Tq, T_max) bool mask built with tensor ops: no
``.item()``, no host sync, and the same compiled graph for every step of a decode loop.
"""

from __future__ import annotations

import torch

from distcompat.attention._adapters import (
    FLASH,
    Plan,
    call_sdpa,
    repeat_kv,
    sdpa_with_dead_rows,
)
from distcompat.attention._contract import UNBOUNDED, AttentionInputError, Window
from distcompat.attention._kernels import probe_kernel
from distcompat.attention._plans import plan_of
from distcompat.attention._reference import math_attention

__all__ = ["attend_with_kvcache", "cache_mask"]


def _lengths(
    cache_seqlens: torch.Tensor | int | None,
    batch: int,
    t_max: int,
    appending: bool,
    device: torch.device,
) -> torch.Tensor:
    if cache_seqlens is None:
        if appending:
            raise AttentionInputError("cache_seqlens is required when new k/v are appended")
        return torch.full((batch,), t_max, dtype=torch.long, device=device)
    if isinstance(cache_seqlens, int):
        return torch.full((batch,), cache_seqlens, dtype=torch.long, device=device)
    if cache_seqlens.shape != (batch,):
        raise AttentionInputError(
            f"cache_seqlens has shape {tuple(cache_seqlens.shape)}, expected ({batch},)"
        )
    return cache_seqlens.to(device=device, dtype=torch.long)


def cache_mask(lengths: torch.Tensor, tq: int, t_max: int, window: Window) -> torch.Tensor:
    """Build the (B, 1, Tq, T_max) bool mask: row ``b`` sees its first ``lengths[b]`` keys.

    Example:
        >>> cache_mask(torch.tensor([2, 3]), 1, 4, (-1, 0))[:, 0, 0].int().tolist()
        [[1, 1, 0, 0], [1, 1, 1, 0]]
    """
    cols = torch.arange(t_max, device=lengths.device).view(1, 1, t_max)
    ends = lengths.view(-1, 1, 1)
    rows = torch.arange(tq, device=lengths.device).view(1, tq, 1) + ends - tq  # (B, Tq, 1)
    mask = cols < ends
    left, right = window
    if left != UNBOUNDED:
        mask = mask & (cols >= rows - left)
    if right != UNBOUNDED:
        mask = mask & (cols <= rows + right)
    return mask.unsqueeze(1)


def _flash_kvcache(
    plan: Plan,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    seqlens: torch.Tensor,
) -> torch.Tensor:
    fn = probe_kernel(plan.impl).functions["flash_attn_with_kvcache"]
    out = fn(
        q,
        k_cache,
        v_cache,
        k=k,
        v=v,
        cache_seqlens=seqlens.to(torch.int32),
        softmax_scale=plan.scale,
        causal=plan.causal,
        window_size=plan.fa_window,
    )
    return out[0] if isinstance(out, tuple) else out  # type: ignore[no-any-return]


def attend_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    *,
    cache_seqlens: torch.Tensor | int | None = None,
    causal: bool = False,
    window: Window | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Append ``k``/``v`` to the cache in place, then attend ``q`` to each row's filled prefix.

    Shapes: ``q`` (B, Tq, Hq, D), caches (B, T_max, Hkv, D), ``k``/``v`` (B, T_new, Hkv, D),
    ``cache_seqlens`` (B,) ints (lengths before this call) or one int; omitted means full caches.
    Writing past ``T_max`` is an indexing error, as it is undefined in FA.

    Example:
        >>> kc, vc = torch.zeros(2, 8, 1, 4), torch.zeros(2, 8, 1, 4)
        >>> lens = torch.tensor([3, 5])
        >>> out = attend_with_kvcache(
        ...     torch.randn(2, 1, 2, 4), kc, vc, torch.ones(2, 1, 1, 4), torch.ones(2, 1, 1, 4),
        ...     cache_seqlens=lens, causal=True)
        >>> out.shape, kc[0, 3, 0].tolist(), kc[0, 4, 0].tolist()
        (torch.Size([2, 1, 2, 4]), [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0])
    """
    if (k is None) != (v is None):
        raise AttentionInputError("pass both k and v to append to the cache, or neither")
    if k is not None and (k.dtype != k_cache.dtype or v is None or v.dtype != v_cache.dtype):
        raise AttentionInputError("new k/v must have the dtype of the caches (no silent casts)")
    batch, tq = q.shape[0], q.shape[1]
    t_max = k_cache.shape[1]
    seqlens = _lengths(cache_seqlens, batch, t_max, k is not None, k_cache.device)
    t_new = 0
    # Decided (and an impossible override raised) before any write.
    plan = plan_of(
        q, k_cache, v_cache, causal=causal, window=window, scale=scale, layout="bthd", kvcache=True
    )
    if plan.impl in FLASH:
        return _flash_kvcache(plan, q, k_cache, v_cache, k, v, seqlens)
    qb, kcb, vcb = (t.transpose(1, 2) for t in (q, k_cache, v_cache))  # (B, H, T, D) views
    if k is not None and v is not None:
        t_new = k.shape[1]
        pos = seqlens.view(-1, 1) + torch.arange(t_new, device=seqlens.device)  # (B, T_new)
        rows = torch.arange(batch, device=seqlens.device).view(-1, 1).expand_as(pos)
        k_cache[rows, pos] = k
        v_cache[rows, pos] = v
    mask = cache_mask(seqlens + t_new, tq, t_max, plan.window)
    if plan.impl == "math":
        out = math_attention(qb, kcb, vcb, mask=mask, scale=scale)
    else:
        kx, vx = repeat_kv(plan, kcb, vcb)
        if plan.nan_rows:  # this kernel gives NaN for a row that sees no key
            out = sdpa_with_dead_rows(qb, kx, vx, mask, scale, plan.gqa)
        else:
            out = call_sdpa(qb, kx, vx, mask, False, scale, plan.gqa)
    return out.transpose(1, 2)
