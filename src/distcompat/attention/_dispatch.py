"""Choosing the attention implementation for one call, with a reason for every rejected one.

The choice depends only on a hashable :class:`~distcompat.attention._rules.CallSignature` read off
the tensors, the ``DISTCOMPAT_ATTENTION`` override, the host and the kernel probes, so it is
cached; a warm call costs a dict lookup::

    sig = signature_of(q, k, v, causal=True, window=None)
    print(decide(sig).why())   # sdpa on cpu float32 (auto): SDPA is_causal=True ...

``DISTCOMPAT_ATTENTION`` is ``auto`` (default), one name (``sdpa``) or a priority list
(``fa3,sdpa``). Named implementations are tried in order and the first that can run the call is
used; when none can, :class:`AttentionUnavailableError` is raised before any kernel runs.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from distcompat.attention._adapters import (
    FLEX_GQA_FALLBACK,
    SDPA_STRATEGIES,
    sdpa_notes,
    sdpa_strategy,
)
from distcompat.attention._contract import (
    AttentionInputError,
    Layout,
    Window,
    canonical_window,
    to_bhtd,
)
from distcompat.attention._kernels import (
    device_capability,
    flex_takes_gqa,
    is_rocm,
    probe_kernel,
    state_token,
)
from distcompat.attention._rules import (
    AUTO_ORDER,
    IMPLEMENTATIONS,
    CallSignature,
    auto_skip,
    infeasible,
)
from distcompat.launch._host import HostInfo, probe_host

__all__ = [
    "ENV_VAR",
    "AttentionConfigError",
    "AttentionDecision",
    "AttentionUnavailableError",
    "Rejection",
    "decide",
    "explain_attention",
    "override_token",
    "parse_override",
    "read_override",
    "signature_from",
    "signature_of",
]

#: The environment variable that overrides the automatic choice.
ENV_VAR = "DISTCOMPAT_ATTENTION"


class AttentionConfigError(ValueError):
    """``DISTCOMPAT_ATTENTION`` names something that is not an attention implementation."""


class AttentionUnavailableError(RuntimeError):
    """No implementation named by ``DISTCOMPAT_ATTENTION`` can run on these tensors."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Rejection:
    """One implementation that was not used for a call, and why."""

    impl: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionDecision:
    """The implementation chosen for a call, why, and why each other one was not."""

    impl: str
    reason: str
    rejected: tuple[Rejection, ...]
    source: str
    device: str
    dtype: str

    def why(self) -> str:
        """Return the decision as lines a user can print."""
        lines = [f"{self.impl} on {self.device} {self.dtype} ({self.source}): {self.reason}"]
        lines += [f"  not {r.impl}: {r.reason}" for r in self.rejected]
        return "\n".join(lines)


#: On POSIX ``os.environ`` keeps the process environment in ``_data`` (bytes); a warm call reads
#: it there in about 0.05 us, where ``os.environ.get`` costs 0.7 (it encodes the key and decodes
#: the value on every call). Writes through ``os.environ`` (``monkeypatch.setenv`` too) update it.
#: Windows keeps str keys, upper-cased: it reads through ``os.environ.get``.
_ENV_KEY = ENV_VAR.encode()
_POSIX = os.name != "nt"


def override_token() -> bytes | str:
    """Return ``DISTCOMPAT_ATTENTION`` as the environment holds it; the one place it is read.

    Cheap enough for every call: the plan cache keys on it, so a change applies to the next call.

    Example:
        >>> os.environ[ENV_VAR] = "sdpa"
        >>> read_override()
        'sdpa'
        >>> del os.environ[ENV_VAR]
    """
    if _POSIX:
        try:
            return os.environ._data.get(_ENV_KEY, b"")  # type: ignore[attr-defined,no-any-return]
        except AttributeError:  # an os.environ replaced by a plain mapping
            pass
    return os.environ.get(ENV_VAR, "")


def read_override() -> str:
    """Return ``DISTCOMPAT_ATTENTION`` (empty when unset), read through :func:`override_token`.

    Example:
        >>> isinstance(read_override(), str)
        True
    """
    token = override_token()
    return token if isinstance(token, str) else os.fsdecode(token)


@functools.lru_cache(maxsize=64)
def parse_override(value: str) -> tuple[str, ...] | None:
    """Names in ``DISTCOMPAT_ATTENTION`` order, or None for automatic choice.

    Example:
        >>> parse_override("fa3, sdpa")
        ('fa3', 'sdpa')
        >>> parse_override("auto") is None
        True
    """
    text = value.strip().lower()
    if text in ("", "auto"):
        return None
    names = tuple(name.strip() for name in text.split(","))
    unknown = [name for name in names if name not in IMPLEMENTATIONS]
    if unknown:
        raise AttentionConfigError(
            f"{ENV_VAR}={value!r}: unknown implementation {unknown[0]!r}; expected 'auto' or a "
            f"comma-separated list of {', '.join(AUTO_ORDER)}"
        )
    return names


Shape = tuple[int, ...]


def signature_from(
    shapes: tuple[Shape, Shape, Shape],
    dtypes: tuple[torch.dtype, torch.dtype, torch.dtype],
    devices: tuple[torch.device, torch.device, torch.device],
    *,
    requires_grad: bool,
    causal: bool,
    window: Window | None,
    kvcache: bool = False,
) -> CallSignature:
    """Validate q/k/v given as (B, H, T, D) shapes, dtypes and devices; read off the signature.

    Every check of a call's tensors lives here, so a call that passes once passes again with
    the same shapes, dtypes and devices: the decision caches key on exactly these.

    Example:
        >>> cpu = torch.device("cpu")
        >>> sig = signature_from(((1, 4, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16)),
        ...     (torch.float32,) * 3, (cpu,) * 3, requires_grad=False, causal=True, window=None)
        >>> sig.hq, sig.hkv, sig.window
        (4, 2, (-1, 0))
    """
    (q_shape, k_shape, v_shape), (q_dtype, k_dtype, v_dtype) = shapes, dtypes
    if len(q_shape) != 4 or len(k_shape) != 4 or len(v_shape) != 4:
        raise AttentionInputError(
            f"q, k, v must be 4-D (got {len(q_shape)}-D, {len(k_shape)}-D, {len(v_shape)}-D)"
        )
    device = devices[0]
    if not (device == devices[1] == devices[2]):
        raise AttentionInputError(f"q, k, v are on {devices[0]}, {devices[1]}, {devices[2]}")
    if not (q_dtype == k_dtype == v_dtype):
        raise AttentionInputError(
            f"q, k, v have dtypes {q_dtype}, {k_dtype}, {v_dtype}; cast them to one "
            "(distcompat never casts silently)"
        )
    (b, hq, tq, d_qk), (bk, hkv, tk, dk), (bv, hv, tv, d_v) = q_shape, k_shape, v_shape
    if not (b == bk == bv) or hkv != hv or tk != tv or dk != d_qk:
        raise AttentionInputError(
            f"shapes do not fit: q {tuple(q_shape)}, k {tuple(k_shape)}, v {tuple(v_shape)} "
            "(as B, H, T, D: same B, k/v same H and T, q/k same D)"
        )
    if hkv == 0 or hq % hkv:
        raise AttentionInputError(f"{hq} query heads are not a multiple of {hkv} key/value heads")
    if tq == 0 or tk == 0:
        raise AttentionInputError(f"empty sequence: Tq={tq}, Tk={tk}")
    return CallSignature(
        device_type=device.type,
        device_index=device.index,
        capability=device_capability(device),
        rocm=device.type == "cuda" and is_rocm(),
        dtype=q_dtype,
        hq=hq,
        hkv=hkv,
        tq=tq,
        tk=tk,
        d_qk=d_qk,
        d_v=d_v,
        window=canonical_window(causal=causal, window=window, tq=tq, tk=tk),
        requires_grad=requires_grad,
        kvcache=kvcache,
    )


def signature_of(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    window: Window | None,
    kvcache: bool = False,
) -> CallSignature:
    """Validate (B, H, T, D) q/k/v and read off what decides the implementation.

    Example:
        >>> q = torch.randn(1, 2, 4, 8)
        >>> signature_of(q, q, q, causal=False, window=(1, 1)).window
        (1, 1)
    """
    return signature_from(
        (q.shape, k.shape, v.shape),
        (q.dtype, k.dtype, v.dtype),
        (q.device, k.device, v.device),
        requires_grad=torch.is_grad_enabled()
        and (q.requires_grad or k.requires_grad or v.requires_grad),
        causal=causal,
        window=window,
        kvcache=kvcache,
    )


def _chosen_reason(name: str, sig: CallSignature) -> str:
    if name == "sdpa":
        if sig.kvcache:
            reason = "SDPA with a per-row bool mask over the cache (no host sync)"
        else:
            reason = SDPA_STRATEGIES[sdpa_strategy(sig)]
        return "; ".join([reason, *sdpa_notes(sig)])
    if name == "math":
        return "exact math (float32 softmax for 16-bit inputs, zeros for fully masked rows)"
    if name == "flex":
        compiled = sig.device_type in ("cuda", "xpu")
        reason = "flex_attention, block-sparse window" + ("" if compiled else ", eager forward")
        gqa = sig.hq != sig.hkv and not flex_takes_gqa()
        return f"{reason}; {FLEX_GQA_FALLBACK}" if gqa else reason
    return f"FlashAttention kernel ({probe_kernel(name).reason})"


@functools.lru_cache(maxsize=1024)
def _decide(
    sig: CallSignature, override: str, host: HostInfo | None, token: int
) -> AttentionDecision:
    del token  # part of the cache key only: kernel overrides invalidate cached decisions
    names = parse_override(override)
    strict = names is not None
    order = names if names is not None else AUTO_ORDER
    rejected: list[Rejection] = []
    chosen = None
    for name in order:
        reason = infeasible(name, sig, host)
        if reason is None and not strict:
            reason = auto_skip(name, sig)
        if reason is None:
            chosen = name
            break
        rejected.append(Rejection(impl=name, reason=reason))
    source = f"{ENV_VAR}={override}" if strict else "auto"
    if chosen is None:
        reasons = "; ".join(f"{r.impl}: {r.reason}" for r in rejected)
        raise AttentionUnavailableError(
            f"{source} cannot run attention on {sig.device_label} {sig.dtype}: {reasons}. "
            f"Unset {ENV_VAR} or add a fallback such as ',sdpa'"
        )
    tried = {r.impl for r in rejected} | {chosen}
    for name in AUTO_ORDER:
        if name not in tried:
            note = f"not named in {source}" if strict else f"lower priority than {chosen}"
            rejected.append(Rejection(impl=name, reason=note))
    return AttentionDecision(
        impl=chosen,
        reason=_chosen_reason(chosen, sig),
        rejected=tuple(rejected),
        source=source,
        device=sig.device_label,
        dtype=str(sig.dtype).removeprefix("torch."),
    )


def decide(sig: CallSignature) -> AttentionDecision:
    """Return the (cached) decision for ``sig`` under the current override, host and probes.

    Made eagerly, also for a call inside torch.compile (see ``_plans``): never traced.

    Example:
        >>> q = torch.randn(1, 2, 4, 8)
        >>> decide(signature_of(q, q, q, causal=True, window=None)).impl
        'sdpa'
    """
    return _decide(sig, read_override(), probe_host(), state_token())


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
