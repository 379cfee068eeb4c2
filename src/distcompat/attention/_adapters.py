"""How each implementation is called so that it keeps the contract of ``_contract``.

A decision becomes a :class:`Plan`: the kernel to call and every constant argument of the call
(flags, the cached bool mask, the first key a decode row can see, the rows to zero), worked out
once, eagerly, from the call's :class:`~distcompat.attention._rules.CallSignature`.
:func:`run_plan` is then nothing but the kernel call, so under ``torch.compile`` it traces to
the kernel's own ops::

    plan = plan_call("sdpa", sig, scale=None, bthd=False)   # is_causal=True, no mask
    out = run_plan(plan, q, k, v)   # F.scaled_dot_product_attention(q, k, v, is_causal=True)

A plan holds only Python constants and tensors, so ``torch.compile`` can take one as a constant.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from distcompat.attention._contract import (
    UNBOUNDED,
    Window,
    has_dead_rows,
    to_fa4_window,
    visible_mask,
)
from distcompat.attention._flex import block_mask_named, block_masks, flex_callable
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
    "FLASH",
    "Plan",
    "call_sdpa",
    "fa_window",
    "plan_call",
    "repeat_kv",
    "run_plan",
    "sdpa_notes",
    "sdpa_strategy",
    "sdpa_with_dead_rows",
]

# Feature test: torch.compiler.is_compiling is missing from older torch builds.
_is_compiling: Callable[[], bool] = getattr(torch.compiler, "is_compiling", lambda: False)

#: The FlashAttention implementations; they take (B, T, H, D) tensors natively.
FLASH = ("fa2", "fa3", "fa4")

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


class Plan(NamedTuple):
    """One decided call: the kernel and its constant arguments (Python constants and tensors).

    ``mask`` is the bool mask the kernel takes (True = attend), ``dead`` the ``(Tq, 1)`` rows
    to zero after it (only where the kernel would not), ``start`` the first key a decode row
    can see (0: all), ``repeat`` how often K/V heads are repeated for a kernel without GQA.
    """

    impl: str
    bthd: bool
    window: Window
    causal: bool = False
    fa_window: tuple[int | None, int | None] = (UNBOUNDED, UNBOUNDED)
    scale: float | None = None
    gqa: bool = False
    repeat: int = 1
    start: int = 0
    mask: torch.Tensor | None = None
    dead: torch.Tensor | None = None
    nan_rows: bool = False  # KV cache: the kernel gives NaN for a row that sees no key
    blocks: str = ""  # flex: the name its window's BlockMask has in _flex.block_masks


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


def _kernel_zeroes_dead_rows(sig: CallSignature) -> bool:
    # Measured on CPU only (the feature test runs there); elsewhere rows are zeroed explicitly.
    return sig.device_type == "cpu" and sdpa_zeroes_dead_rows()


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


def _device(sig: CallSignature) -> torch.device:
    if sig.device_index is None:
        return torch.device(sig.device_type)
    return torch.device(sig.device_type, sig.device_index)


def _dead_rows(sig: CallSignature) -> torch.Tensor:
    mask = visible_mask(sig.tq, sig.tk, *sig.window, _device(sig))
    return ~mask.any(dim=-1, keepdim=True)  # (Tq, 1)


def _sdpa_plan(sig: CallSignature, scale: float | None, bthd: bool) -> Plan:
    gqa = sig.hq != sig.hkv and sdpa_supports_gqa()
    repeat = sig.hq // sig.hkv if sig.hq != sig.hkv and not gqa else 1
    plan = Plan(impl="sdpa", bthd=bthd, window=sig.window, scale=scale, gqa=gqa, repeat=repeat)
    if sig.kvcache:  # the mask is built per call from the lengths
        return plan._replace(nan_rows=not _kernel_zeroes_dead_rows(sig))
    strategy = sdpa_strategy(sig)
    left, right = sig.window
    if strategy == "is_causal":
        return plan._replace(causal=True)
    if strategy == "full":
        return plan
    if strategy == "decode_slice":
        return plan._replace(start=sig.tk - 1 - left)
    mask = visible_mask(sig.tq, sig.tk, left, right, _device(sig))
    if not has_dead_rows(sig.tq, sig.tk, left, right) or _kernel_zeroes_dead_rows(sig):
        return plan._replace(mask=mask)
    # NaN in such rows would reach q/k/v through the backward: let them see every key (finite),
    # then zero their output (which sends no gradient back).
    dead = _dead_rows(sig)
    return plan._replace(mask=mask | dead, dead=dead)


def _flex_plan(sig: CallSignature, scale: float | None, bthd: bool) -> Plan:
    left, right = sig.window
    gqa = sig.hq != sig.hkv and flex_takes_gqa()
    repeat = sig.hq // sig.hkv if sig.hq != sig.hkv and not gqa else 1
    windowed = (left, right) != (UNBOUNDED, UNBOUNDED)
    dead = _dead_rows(sig) if windowed and has_dead_rows(sig.tq, sig.tk, left, right) else None
    blocks = block_mask_named(sig, _device(sig)) if windowed else ""
    return Plan(
        impl="flex",
        bthd=bthd,
        window=sig.window,
        scale=scale,
        gqa=gqa,
        repeat=repeat,
        dead=dead,
        blocks=blocks,
    )


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


def plan_call(impl: str, sig: CallSignature, scale: float | None, *, bthd: bool) -> Plan:
    """Work out, once and eagerly, how implementation ``impl`` runs the call ``sig``.

    Example:
        >>> from distcompat.attention._dispatch import signature_of
        >>> q = torch.randn(1, 2, 4, 8)
        >>> sig = signature_of(q, q, q, causal=True, window=None)
        >>> plan = plan_call("sdpa", sig, None, bthd=False)
        >>> plan.causal, plan.mask is None
        (True, True)
    """
    if impl == "sdpa" and not _rough_backward(sig):
        return _sdpa_plan(sig, scale, bthd)
    if impl in ("sdpa", "math"):  # sdpa here: this torch's CPU backward rounds 16-bit grads
        left, right = sig.window
        bounded = (left, right) != (UNBOUNDED, UNBOUNDED) and not sig.kvcache
        mask = visible_mask(sig.tq, sig.tk, left, right, _device(sig)) if bounded else None
        return Plan(impl="math", bthd=bthd, window=sig.window, scale=scale, mask=mask)
    if impl == "flex":
        return _flex_plan(sig, scale, bthd)
    causal, window = fa_window(impl, sig)
    return Plan(
        impl=impl, bthd=bthd, window=sig.window, causal=causal, fa_window=window, scale=scale
    )


def sdpa_with_dead_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None,
    gqa: bool,
) -> torch.Tensor:
    """SDPA under a bool mask whose all-False rows must give 0, on a kernel that gives NaN.

    Zeroing the output is not enough: the NaN reaches q/k/v through the backward. Such rows
    see every key instead (finite), and their zeroed output sends no gradient back.
    """
    dead = ~mask.any(dim=-1, keepdim=True)  # (B or 1, 1, Tq, 1)
    out = call_sdpa(q, k, v, mask | dead, False, scale, gqa)
    return out.masked_fill(dead, 0.0)


def call_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float | None,
    gqa: bool,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` with ``enable_gqa=True`` passed only when ``gqa``.

    Example:
        >>> q = torch.randn(1, 2, 4, 8)
        >>> call_sdpa(q, q[:, :1], q[:, :1], None, True, None, True).shape
        torch.Size([1, 2, 4, 8])
    """
    if gqa:  # enable_gqa only where needed: older torch has no such argument
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
        )
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)


def repeat_kv(plan: Plan, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Repeat K/V heads for a kernel without GQA (same grouping as ``enable_gqa``).

    Example:
        >>> plan = Plan(impl="sdpa", bthd=False, window=(-1, -1), repeat=2)
        >>> repeat_kv(plan, torch.zeros(1, 1, 3, 8), torch.zeros(1, 1, 3, 8))[0].shape
        torch.Size([1, 2, 3, 8])
    """
    if plan.repeat == 1:
        return k, v
    return k.repeat_interleave(plan.repeat, dim=1), v.repeat_interleave(plan.repeat, dim=1)


def _run_sdpa(plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    if plan.start:  # decode: the one query row sees only the last keys
        k, v = k[:, :, plan.start :], v[:, :, plan.start :]
    k, v = repeat_kv(plan, k, v)
    out = call_sdpa(q, k, v, plan.mask, plan.causal, plan.scale, plan.gqa)
    return out if plan.dead is None else out.masked_fill(plan.dead, 0.0)


def _run_flex(plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    k, v = repeat_kv(plan, k, v)
    block_mask = getattr(block_masks, plan.blocks) if plan.blocks else None
    kwargs: dict[str, Any] = {"block_mask": block_mask, "scale": plan.scale}
    if plan.gqa:
        kwargs["enable_gqa"] = True
    if _is_compiling():  # the caller's torch.compile traces flex itself
        out: torch.Tensor = probe_kernel("flex").functions["flex_attention"](q, k, v, **kwargs)
    else:
        with warnings.catch_warnings():
            # Eager flex on CPU warns that it is unfused; the decision's reason already says so.
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            out = flex_callable(q.device.type)(q, k, v, **kwargs)
    return out if plan.dead is None else out.masked_fill(plan.dead, 0.0)


def _device_scope(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    # FA4 reads the arch of the *current* CUDA device; make it the tensors' device.
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _run_flash(plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    fn = probe_kernel(plan.impl).functions["flash_attn_func"]
    disable = getattr(torch.compiler, "disable", None)
    if plan.impl == "fa4" and disable is not None:  # FA4's CuTe DSL calls must not be traced
        fn = disable(fn)
    if not plan.bthd:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, T, H, D) views
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    with _device_scope(q.device):
        out = fn(q, k, v, softmax_scale=plan.scale, causal=plan.causal, window_size=plan.fa_window)
    if isinstance(out, tuple):  # FA4 always, FA3 in some builds: (out, lse)
        out = out[0]
    return out if plan.bthd else out.transpose(1, 2)  # type: ignore[no-any-return]


def run_plan(plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Run a planned call on tensors in the plan's layout: only the kernel call and its views.

    Example:
        >>> from distcompat.attention._dispatch import signature_of
        >>> q = torch.randn(1, 2, 4, 8)
        >>> sig = signature_of(q, q, q, causal=True, window=None)
        >>> plan = plan_call("math", sig, None, bthd=False)
        >>> run_plan(plan, q, q, q).shape
        torch.Size([1, 2, 4, 8])
    """
    if plan.impl in FLASH:
        return _run_flash(plan, q, k, v)
    if plan.bthd:
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D) views
    if plan.impl == "sdpa":
        out = _run_sdpa(plan, q, k, v)
    elif plan.impl == "flex":
        out = _run_flex(plan, q, k, v)
    else:
        out = math_attention(q, k, v, mask=plan.mask, scale=plan.scale)
    return out.transpose(1, 2) if plan.bthd else out
