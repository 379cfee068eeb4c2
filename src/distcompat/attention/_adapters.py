"""How each implementation is called so that it keeps the contract of ``_contract``.

Every runner takes (B, H, T, D) tensors and a :class:`~distcompat.attention._rules.CallSignature`
and returns (B, H, Tq, D_v) in the input dtype. The SDPA runner picks the cheapest exact way to
express the window (``is_causal``, no mask, a key slice for decode, else a cached bool mask)::

    sdpa_strategy(sig)          # "is_causal" when causal and Tq == Tk
    run_sdpa(q, k, v, sig, scale=None)
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from distcompat.attention._contract import UNBOUNDED, has_dead_rows, to_fa4_window, visible_mask
from distcompat.attention._kernels import (
    flex_takes_gqa,
    probe_kernel,
    sdpa_cpu_rough_backward,
    sdpa_supports_gqa,
    sdpa_zeroes_dead_rows,
)
from distcompat.attention._reference import math_attention
from distcompat.attention._rules import CallSignature

__all__ = [
    "RUNNERS",
    "run_flash",
    "run_flex",
    "run_math",
    "run_sdpa",
    "sdpa_notes",
    "sdpa_strategy",
    "sdpa_with_dead_rows",
]

Runner = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, CallSignature, float | None], Any]

#: Notes added to an explanation where this torch needs a fallback (found by feature tests).
SDPA_GQA_FALLBACK = (
    "K/V heads repeated with repeat_interleave (this torch's SDPA has no enable_gqa)"
)
SDPA_DEAD_ROW_FALLBACK = (
    "fully masked rows see every key, then are zeroed (this torch's SDPA gives NaN for them)"
)
SDPA_ROUGH_BACKWARD_FALLBACK = (
    "run as exact math, as SDPA's MATH backend computes it (this torch's default SDPA CPU kernel "
    "rounds 16-bit gradients)"
)
FLEX_GQA_FALLBACK = (
    "K/V heads repeated with repeat_interleave (this flex_attention has no enable_gqa)"
)

#: What each SDPA strategy means, for explanations.
SDPA_STRATEGIES: dict[str, str] = {
    "is_causal": "SDPA is_causal=True (causal, Tq == Tk: no mask needed)",
    "full": "SDPA without a mask (nothing is masked)",
    "decode_slice": "SDPA over the last left+1 keys, no mask (one query row)",
    "mask": "SDPA with a cached bottom-right bool mask",
}


def sdpa_strategy(sig: CallSignature) -> str:
    """Name the cheapest exact SDPA call for this window (``is_causal`` only when Tq == Tk)."""
    left, right = sig.window
    if (left, right) == (UNBOUNDED, UNBOUNDED):
        return "full"
    if (left, right) == (UNBOUNDED, 0) and sig.tq == sig.tk:
        return "is_causal"
    if sig.tq == 1 and right == UNBOUNDED:  # canonical: one row sees keys tk-1-left .. tk-1
        return "decode_slice"
    return "mask"


def _rough_backward(sig: CallSignature) -> bool:
    cpu_grad = sig.device_type == "cpu" and sig.requires_grad and not sig.kvcache
    return cpu_grad and sig.dtype in sdpa_cpu_rough_backward()


def sdpa_notes(sig: CallSignature) -> list[str]:
    """Name the fallbacks this torch's SDPA needs for ``sig`` (none on a torch that needs none)."""
    if _rough_backward(sig):
        return [SDPA_ROUGH_BACKWARD_FALLBACK]  # exact math needs none of the others
    notes = []
    if sig.hq != sig.hkv and not sdpa_supports_gqa():
        notes.append(SDPA_GQA_FALLBACK)
    left, right = sig.window
    dead = sig.kvcache or (
        sdpa_strategy(sig) == "mask" and has_dead_rows(sig.tq, sig.tk, left, right)
    )
    if dead and not sdpa_zeroes_dead_rows():
        notes.append(SDPA_DEAD_ROW_FALLBACK)
    return notes


def _expand_kv(
    k: torch.Tensor, v: torch.Tensor, sig: CallSignature
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    if sig.hq == sig.hkv:
        return k, v, {}
    if sdpa_supports_gqa():
        return k, v, {"enable_gqa": True}
    groups = sig.hq // sig.hkv  # same grouping as enable_gqa: kv head h serves q heads h*g ..
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), {}


def zero_dead_rows(out: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Set to 0 every output row whose mask row is all False (no kernel's NaN survives)."""
    return out.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0)


def sdpa_with_dead_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None,
    gqa: dict[str, Any],
) -> torch.Tensor:
    """SDPA under a bool mask that may have all-False rows; those rows come out 0, grads too.

    Where SDPA gives NaN for such rows (``sdpa_zeroes_dead_rows`` is False), zeroing the output
    is not enough: the NaN reaches q/k/v through the backward. Such rows then see every key
    (finite, and their zeroed output sends no gradient back).
    """
    dead = ~mask.any(dim=-1, keepdim=True)  # (B or 1, 1, Tq, 1)
    run_mask = mask if sdpa_zeroes_dead_rows() else mask | dead
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=run_mask, scale=scale, **gqa)
    return out.masked_fill(dead, 0.0)


def run_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sig: CallSignature, scale: float | None
) -> torch.Tensor:
    """Run PyTorch SDPA and let it pick its kernel (CPU flash; CUDA flash/efficient/cuDNN)."""
    if _rough_backward(sig):  # an sdpa_kernel(MATH) scope would not trace on such a torch
        return run_math(q, k, v, sig, scale)
    return _run_sdpa(q, k, v, sig, scale)


def _run_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sig: CallSignature, scale: float | None
) -> torch.Tensor:
    k, v, gqa = _expand_kv(k, v, sig)
    strategy = sdpa_strategy(sig)
    if strategy == "is_causal":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, **gqa)
    if strategy == "full":
        return F.scaled_dot_product_attention(q, k, v, scale=scale, **gqa)
    left, right = sig.window
    if strategy == "decode_slice":
        start = sig.tk - 1 - left
        return F.scaled_dot_product_attention(
            q, k[:, :, start:], v[:, :, start:], scale=scale, **gqa
        )
    mask = visible_mask(sig.tq, sig.tk, left, right, q.device)
    if has_dead_rows(sig.tq, sig.tk, left, right):
        return sdpa_with_dead_rows(q, k, v, mask, scale, gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, **gqa)


def run_math(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sig: CallSignature, scale: float | None
) -> torch.Tensor:
    """Run the exact math of ``_reference`` with the contract's mask."""
    left, right = sig.window
    mask = None
    if (left, right) != (UNBOUNDED, UNBOUNDED):
        mask = visible_mask(sig.tq, sig.tk, left, right, q.device)
    return math_attention(q, k, v, mask=mask, scale=scale)


@functools.lru_cache(maxsize=64)
def _flex_block_mask(tq: int, tk: int, left: int, right: int, device: torch.device) -> Any:
    create_block_mask = probe_kernel("flex").functions["create_block_mask"]
    offset = tk - tq

    def mask_mod(b: Any, h: Any, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        pos = i + offset  # bottom-right aligned position of query row i
        seen = j >= 0
        if left != UNBOUNDED:
            seen = seen & (j >= pos - left)
        if right != UNBOUNDED:
            seen = seen & (j <= pos + right)
        return seen

    return create_block_mask(mask_mod, None, None, tq, tk, device=device)


@functools.cache
def _flex_callable(device_type: str) -> Callable[..., Any]:
    flex = probe_kernel("flex").functions["flex_attention"]
    if device_type in ("cuda", "xpu"):
        # Static shapes: on a second query length torch 2.11 recompiled flex with a symbolic one,
        # and inductor found no kernel for it (NoValidChoicesError; an H100, Tq 256 then 64).
        return torch.compile(flex, dynamic=False)
    return flex  # CPU/MPS: forward only, eager (compiling costs 40-90 s on first call)


def run_flex(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sig: CallSignature, scale: float | None
) -> torch.Tensor:
    """flex_attention with a block mask: compiled on CUDA/XPU, eager forward on CPU/MPS."""
    left, right = sig.window
    block_mask = None
    if (left, right) != (UNBOUNDED, UNBOUNDED):
        block_mask = _flex_block_mask(sig.tq, sig.tk, left, right, q.device)
    flex = _flex_callable(q.device.type)
    kwargs: dict[str, Any] = {"block_mask": block_mask, "scale": scale}
    if sig.hq != sig.hkv:
        if flex_takes_gqa():
            kwargs["enable_gqa"] = True
        else:
            k, v = (t.repeat_interleave(sig.hq // sig.hkv, dim=1) for t in (k, v))
    with warnings.catch_warnings():
        # Eager flex on CPU warns that it is unfused; the decision's reason already says so.
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        out: torch.Tensor = flex(q, k, v, **kwargs)
    if block_mask is not None and has_dead_rows(sig.tq, sig.tk, left, right):
        out = zero_dead_rows(out, visible_mask(sig.tq, sig.tk, left, right, q.device))
    return out


def fa_window(name: str, sig: CallSignature) -> tuple[bool, tuple[int | None, int | None]]:
    """``(causal, window_size)`` for FA ``name``: the plainest spelling of the canonical window."""
    left, right = sig.window
    # One query row (decode) sees no key after its own position either way: say causal, FA's
    # fast path, rather than the canonical "right unbounded".
    causal = right == 0 or (sig.tq == 1 and right == UNBOUNDED)
    right = 0 if causal else right
    window: tuple[int, int] = (
        (UNBOUNDED, UNBOUNDED) if causal and left == UNBOUNDED else (left, right)
    )
    return causal, (to_fa4_window(window) if name == "fa4" else window)


def _device_scope(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    # FA4 reads the arch of the *current* CUDA device; make it the tensors' device.
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def run_flash(
    name: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sig: CallSignature,
    scale: float | None,
) -> torch.Tensor:
    """FlashAttention 2/3/4: (B, H, T, D) in, FA's (B, T, H, D) for the call, (B, H, T, D) out."""
    fn = probe_kernel(name).functions["flash_attn_func"]
    disable = getattr(torch.compiler, "disable", None)
    if name == "fa4" and disable is not None:  # FA4's CuTe DSL calls must not be traced
        fn = disable(fn)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, T, H, D) views
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    causal, window = fa_window(name, sig)
    with _device_scope(q.device):
        out = fn(q, k, v, softmax_scale=scale, causal=causal, window_size=window)
    if isinstance(out, tuple):  # FA4 always, FA3 in some builds: (out, lse)
        out = out[0]
    return out.transpose(1, 2)  # type: ignore[no-any-return]


RUNNERS: dict[str, Runner] = {
    "sdpa": run_sdpa,
    "math": run_math,
    "flex": run_flex,
    "fa2": functools.partial(run_flash, "fa2"),
    "fa3": functools.partial(run_flash, "fa3"),
    "fa4": functools.partial(run_flash, "fa4"),
}
