"""Each call's plan, looked up by the call's key in plain Python: the traced region gets the kernel.

A call's key is what its tensors and arguments say (shapes, dtypes, devices, grad, causal,
window, scale, layout). With ``DISTCOMPAT_ATTENTION`` and the kernel-override token it finds the
call's :class:`~distcompat.attention._adapters.Plan` in a plain dict, so a warm eager call costs
one lookup before the kernel::

    out = attend(q, k, v, causal=True, layout="bthd")

On a miss, the one checking function (``signature_from``) validates the key and the decision
is made; a key that failed raises again on every call, never cached. Inside ``torch.compile``
the same lookup runs eagerly while the call is traced (``torch.compiler.assume_constant_result``)
and the plan enters the graph as constants, so the graph holds only the kernel call: no guard
on the environment, no trace of the decision. The dims that decide (heads, lengths, head dims)
are specialized there; the batch is not. A change of ``DISTCOMPAT_ATTENTION`` or of the kernel
overrides reaches compiled code after ``torch.compiler.reset()``, as any traced constant does.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Hashable
from typing import Any

import torch
import torch.nn.functional as F

from distcompat.attention._adapters import Plan, plan_call, run_plan
from distcompat.attention._contract import Layout, Window, bhtd_shape
from distcompat.attention._dispatch import decide, override_token, signature_from
from distcompat.attention._kernels import state_token

__all__ = ["attend", "call_key", "clear_plans", "plan_of"]

# Feature test: torch.compiler.is_compiling is missing from older torch builds.
_is_compiling: Callable[[], bool] = getattr(torch.compiler, "is_compiling", lambda: False)

Key = tuple[Hashable, ...]
Call = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

#: Plans kept at most; when full, the cache starts over. A plan may hold a (Tq, Tk) bool mask
#: (4 MiB at 2048 x 2048) that outlives ``visible_mask``'s own cache of 32: keep this modest.
MAX_PLANS = 64

_plans: dict[tuple[Key, bytes | str, int], tuple[Plan, Call]] = {}


def call_key(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    window: Window | None,
    scale: float | None,
    layout: Layout,
    kvcache: bool,
) -> Key:
    """Everything about a call that its plan depends on, read off the tensors (no checks).

    Example:
        >>> q = torch.zeros(1, 2, 4, 8)
        >>> call_key(q, q, q, True, None, None, "bhtd", False)[0]
        torch.Size([1, 2, 4, 8])
    """
    return (
        q.shape,
        k.shape,
        v.shape,
        q.dtype,
        k.dtype,
        v.dtype,
        q.device,
        k.device,
        v.device,
        (q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled(),
        causal,
        window,
        scale,
        layout,
        kvcache,
    )


def _eager_call(plan: Plan) -> Call:
    # What run_plan does for this plan, with its branches taken once, here: a plain SDPA plan
    # becomes SDPA with bound arguments (and the layout's transposes), anything else run_plan.
    if plan.impl != "sdpa" or plan.start or plan.repeat != 1 or plan.dead is not None:
        return functools.partial(run_plan, plan)
    # Only the arguments that differ from SDPA's defaults: each keyword costs a parse per call.
    bound: dict[str, Any] = {
        "attn_mask": plan.mask,
        "is_causal": plan.causal,
        "scale": plan.scale,
        "enable_gqa": plan.gqa,  # older torch has no such argument: passed only when True
    }
    kwargs = {
        name: value for name, value in bound.items() if value is not None and value is not False
    }
    kernel: Call = functools.partial(F.scaled_dot_product_attention, **kwargs)
    if not plan.bthd:
        return kernel

    def bthd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return kernel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

    return bthd


def _make(key: Key) -> tuple[Plan, Call]:
    (q_s, k_s, v_s, q_t, k_t, v_t, q_d, k_d, v_d, grad, causal, window, scale, layout, kv) = key
    shapes = (bhtd_shape(q_s, layout), bhtd_shape(k_s, layout), bhtd_shape(v_s, layout))  # type: ignore[arg-type]
    sig = signature_from(
        shapes,
        (q_t, k_t, v_t),  # type: ignore[arg-type]
        (q_d, k_d, v_d),  # type: ignore[arg-type]
        requires_grad=bool(grad),
        causal=bool(causal),
        window=window,  # type: ignore[arg-type]
        kvcache=bool(kv),
    )
    plan = plan_call(decide(sig).impl, sig, scale, bthd=layout == "bthd")  # type: ignore[arg-type]
    return plan, _eager_call(plan)


def _entry(key: Key) -> tuple[Plan, Call]:
    stamp = (key, override_token(), state_token())
    try:
        entry = _plans.get(stamp)
    except TypeError:  # an unhashable argument (a list for a window): decide, do not keep
        return _make(key)
    if entry is None:
        entry = _make(key)
        if len(_plans) >= MAX_PLANS:
            _plans.clear()
        _plans[stamp] = entry
    return entry


def clear_plans() -> None:
    """Forget every plan (they are rebuilt on the next calls); for tests and benchmarks.

    Example:
        >>> clear_plans()
    """
    _plans.clear()


def _plan_eagerly(key: Key) -> Plan:
    # Runs eagerly while torch.compile traces the call; the plan enters the graph as constants.
    return _entry(key)[0]


_plan_when_traced: Callable[[Key], Plan] = torch.compiler.assume_constant_result(  # type: ignore[no-untyped-call]
    _plan_eagerly
)


def _traced_key(key: Key) -> Key:
    # While traced, a dynamic batch stays symbolic (the plan does not depend on it) and the
    # other dims are specialized to the ints the plan was made for.
    q_s, k_s, v_s = key[:3]
    same_batch = q_s[0] == k_s[0] == v_s[0]  # type: ignore[index]
    shapes = tuple(
        (-1 if same_batch else operator.index(s[0]), *(operator.index(d) for d in s[1:]))  # type: ignore[index]
        for s in (q_s, k_s, v_s)
    )
    return (*shapes, *key[3:])


def plan_of(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    window: Window | None,
    scale: float | None,
    layout: Layout,
    kvcache: bool = False,
) -> Plan:
    """Return the call's plan: a dict lookup when warm, a constant when traced.

    Example:
        >>> q = torch.zeros(1, 2, 4, 8)
        >>> plan_of(q, q, q, causal=True, window=None, scale=None, layout="bhtd").impl
        'sdpa'
    """
    key = call_key(q, k, v, causal, window, scale, layout, kvcache)
    if _is_compiling():
        return _plan_when_traced(_traced_key(key))
    return _entry(key)[0]


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
    key = call_key(q, k, v, causal, window, scale, layout, False)
    if _is_compiling():
        return run_plan(_plan_when_traced(_traced_key(key)), q, k, v)
    try:  # the warm path: one lookup (what _entry does first, without its call)
        call = _plans[(key, override_token(), state_token())][1]
    except (KeyError, TypeError):
        call = _entry(key)[1]
    return call(q, k, v)
