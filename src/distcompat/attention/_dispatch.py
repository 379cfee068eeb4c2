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
from collections.abc import Callable
from dataclasses import dataclass

import torch

from distcompat.attention._adapters import (
    FLEX_GQA_FALLBACK,
    SDPA_STRATEGIES,
    sdpa_notes,
    sdpa_strategy,
)
from distcompat.attention._contract import AttentionInputError, Window, canonical_window
from distcompat.attention._kernels import (
    compile_traces_environ,
    constant_when_traced,
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
    "parse_override",
    "read_override",
    "signature_of",
]

#: The environment variable that overrides the automatic choice.
ENV_VAR = "DISTCOMPAT_ATTENTION"

# Feature test: torch.compiler.is_compiling is missing from older torch builds.
_is_compiling: Callable[[], bool] = getattr(torch.compiler, "is_compiling", lambda: False)


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


def read_override() -> str:
    """Return ``DISTCOMPAT_ATTENTION`` (empty when unset); the one place it is read."""
    return os.environ.get(ENV_VAR, "")


@constant_when_traced
def _override_read_at_trace() -> str:
    # For a torch.compile that cannot trace os.environ: read eagerly, kept in the graph.
    return read_override()


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


def signature_of(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    window: Window | None,
    tk: int | None = None,
    kvcache: bool = False,
) -> CallSignature:
    """Validate (B, H, T, D) q/k/v and read off what decides the implementation."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise AttentionInputError(
            f"q, k, v must be 4-D (got {q.dim()}-D, {k.dim()}-D, {v.dim()}-D)"
        )
    if not (q.device == k.device == v.device):
        raise AttentionInputError(f"q, k, v are on {q.device}, {k.device}, {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise AttentionInputError(
            f"q, k, v have dtypes {q.dtype}, {k.dtype}, {v.dtype}; cast them to one "
            "(distcompat never casts silently)"
        )
    (b, hq, tq, d_qk), (bk, hkv, tkk, dk), (bv, hv, tv, d_v) = q.shape, k.shape, v.shape
    if not (b == bk == bv) or hkv != hv or tkk != tv or dk != d_qk:
        raise AttentionInputError(
            f"shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
            "(as B, H, T, D: same B, k/v same H and T, q/k same D)"
        )
    if hkv == 0 or hq % hkv:
        raise AttentionInputError(f"{hq} query heads are not a multiple of {hkv} key/value heads")
    tk = tkk if tk is None else tk
    if tq == 0 or tk == 0:
        raise AttentionInputError(f"empty sequence: Tq={tq}, Tk={tk}")
    return CallSignature(
        device_type=q.device.type,
        device_index=q.device.index,
        capability=device_capability(q.device),
        rocm=q.device.type == "cuda" and is_rocm(),
        dtype=q.dtype,
        hq=hq,
        hkv=hkv,
        tq=tq,
        tk=tk,
        d_qk=d_qk,
        d_v=d_v,
        window=canonical_window(causal=causal, window=window, tq=tq, tk=tk),
        requires_grad=torch.is_grad_enabled()
        and (q.requires_grad or k.requires_grad or v.requires_grad),
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

    While torch.compile traces a call, the host is not probed (its CUDA query cannot be traced
    and only adds a note to explanations), so the decision traces into the graph as constants.
    ``DISTCOMPAT_ATTENTION`` is read inside the trace where torch.compile can trace (and guard
    on) ``os.environ``, so changing it recompiles; where it cannot (torch 2.4), it is read once
    when the call is traced and changing it later takes ``torch.compiler.reset()``.
    """
    if not _is_compiling():
        return _decide(sig, read_override(), probe_host(), state_token())
    override = read_override() if compile_traces_environ() else _override_read_at_trace()
    return _decide(sig, override, None, state_token())
