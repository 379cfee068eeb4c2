"""What each attention implementation can take, as data: one predicate per implementation.

A predicate looks at a :class:`CallSignature` (built from the tensors: device, capability of that
device, dtype, heads, lengths, head dims, window, grad) and returns ``None`` when the
implementation can run the call, else the reason it cannot::

    sig = CallSignature(device_type="cpu", ..., dtype=torch.bfloat16, ...)
    infeasible("fa3", sig, host)   # "tensors are on cpu; FA3 runs on CUDA only (host has ...)"

Device checks come before import probes, so tensors on CPU never make distcompat import a CUDA
kernel package. ``auto_skip`` holds the softer rule "can run, but does not win here", which an
explicit override ignores.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from distcompat.attention._contract import UNBOUNDED, Window
from distcompat.attention._kernels import probe_kernel
from distcompat.launch._host import HostInfo

__all__ = [
    "AUTO_ORDER",
    "FLEX_WINDOW_RULES",
    "IMPLEMENTATIONS",
    "CallSignature",
    "auto_skip",
    "infeasible",
]

#: Every implementation name, in the order ``auto`` tries them.
AUTO_ORDER: tuple[str, ...] = ("fa3", "fa4", "fa2", "flex", "sdpa", "math")
IMPLEMENTATIONS = frozenset(AUTO_ORDER)

_HALF = (torch.float16, torch.bfloat16)
_FA_LABEL = {"fa2": "FA2", "fa3": "FA3", "fa4": "FA4"}


@dataclass(frozen=True, slots=True, kw_only=True)
class CallSignature:
    """Everything about one attention call that decides its implementation (hashable)."""

    device_type: str
    device_index: int | None
    capability: tuple[int, int] | None
    rocm: bool
    dtype: torch.dtype
    hq: int
    hkv: int
    tq: int
    tk: int
    d_qk: int
    d_v: int
    window: Window  # canonical: causal folded in as right == 0
    requires_grad: bool
    kvcache: bool = False

    @property
    def device_label(self) -> str:
        """``cuda:1 sm90``, ``cpu``: the device as the explanation prints it."""
        name = self.device_type
        if self.device_index is not None:
            name = f"{name}:{self.device_index}"
        if self.capability is not None:
            name += f" sm{self.capability[0]}{self.capability[1]}"
        return name


def _device_rule(label: str, sig: CallSignature, host: HostInfo | None) -> str | None:
    if sig.device_type == "cuda":
        return None
    note = ""
    if host is not None and host.cuda_device_count:
        count = host.cuda_device_count
        note = f" (this host has {count} CUDA device(s); these tensors are not on one)"
    return f"tensors are on {sig.device_type}; {label} runs on CUDA only{note}"


def _half_rule(label: str, sig: CallSignature) -> str | None:
    if sig.dtype in _HALF:
        return None
    return (
        f"{label} takes float16/bfloat16 only and {sig.dtype} is never downcast silently; "
        "pass 16-bit tensors to use it"
    )


def _head_rule(label: str, sig: CallSignature, max_dim: int) -> str | None:
    if sig.d_qk != sig.d_v:
        return f"{label} adapter needs equal q/k and v head dims (got {sig.d_qk} and {sig.d_v})"
    if sig.d_qk > max_dim or sig.d_qk % 8:
        return f"{label} needs head dim <= {max_dim} and a multiple of 8 (got {sig.d_qk})"
    return None


def _window_rule(label: str, sig: CallSignature) -> str | None:
    # FA drops a right bound >= Tk, which only changes the result when Tq > Tk.
    right = sig.window[1]
    if sig.tq > sig.tk and right != UNBOUNDED and right >= sig.tk:
        return f"{label} ignores window right={right} >= Tk={sig.tk}, which matters when Tq > Tk"
    return None


def _import_rule(name: str, sig: CallSignature) -> str | None:
    probe = probe_kernel(name)
    if not probe.available:
        return f"not installed: {probe.reason}"
    if sig.kvcache and "flash_attn_with_kvcache" not in probe.functions:
        return f"{_FA_LABEL[name]} build has no flash_attn_with_kvcache"
    return None


def _arch_fa2(sig: CallSignature) -> str | None:
    assert sig.capability is not None  # checked by _device_rule
    if sig.rocm or sig.capability >= (8, 0):
        return None
    return f"FA2 needs sm80 or newer (Ampere+), device is sm{sig.capability[0]}{sig.capability[1]}"


def _arch_fa3(sig: CallSignature) -> str | None:
    assert sig.capability is not None
    if sig.rocm:
        return "FA3 is an NVIDIA Hopper kernel; this is a ROCm build"
    if sig.capability[0] == 9:
        return None
    major, minor = sig.capability
    return f"FA3 requires compute capability 9.x (Hopper), device is sm{major}{minor}"


def _arch_fa4(sig: CallSignature) -> str | None:
    assert sig.capability is not None
    major = sig.capability[0]
    if sig.rocm:
        return "FA4 is an NVIDIA kernel; this is a ROCm build"
    if sig.kvcache:
        return "FA4 has no flash_attn_with_kvcache"
    if major == 8 and sig.requires_grad:
        return "FA4 has no backward on sm8x (forward only); these tensors require grad"
    if major not in (8, 9, 10):
        minor = sig.capability[1]
        return f"FA4 is enabled for sm90 and sm100 (sm8x forward), device is sm{major}{minor}"
    if major == 10 and sig.d_qk not in (*range(8, 129, 8), 256):
        return f"FA4 on sm100 takes head dim 8..128 or 256 (got {sig.d_qk})"
    return None


_ARCH_RULES: dict[str, Callable[[CallSignature], str | None]] = {
    "fa2": _arch_fa2,
    "fa3": _arch_fa3,
    "fa4": _arch_fa4,
}


def _fa_infeasible(name: str, sig: CallSignature, host: HostInfo | None) -> str | None:
    label = _FA_LABEL[name]
    return (
        _device_rule(label, sig, host)
        or _ARCH_RULES[name](sig)
        or _half_rule(label, sig)
        or _head_rule(label, sig, 256)
        or _window_rule(label, sig)
        or _import_rule(name, sig)
    )


#: When auto takes flex (block-sparse) over SDPA with a mask for a sliding window on CUDA/XPU.
#: Each row is (least head dim, least keys Tk, N): a call whose head dim and Tk reach the row's
#: takes flex for a window that sees at most 1/N of its keys; the first row that fits decides,
#: and a call that fits none keeps SDPA. Measured on an H200 (torch 2.11, bf16, SDPA there is
#: cuDNN's kernel with the mask; forward + backward, SDPA time / flex time, benchmarks/README.md):
#: head dim 128, Tk 4096: 3.1x / 2.6x / 2.2x for windows of 1/8, 1/4, 1/2 of the keys; Tk 2048:
#: 1.67x / 1.35x / 1.38x; Tk 1024: 1.32x at 1/8, 1.09x at 1/4 and 1/2 (forward alone 0.97x and
#: 0.91x: not taken). Head dim 64 (B4 H8): Tk 2048 1.05x at 1/8 (forward 1.75x), 0.82x at 1/4;
#: Tk 1024 0.49-0.67x. An H100 gave 2.2x for 256 of 4096 keys at head dim 64. nanochat's S layers
#: (513 of 2048 keys, head dim 128) take flex: its model trained 1.27x faster per step.
FLEX_WINDOW_RULES: tuple[tuple[int, int, int], ...] = (
    (65, 2048, 2),
    (65, 1024, 8),
    (1, 2048, 8),
)

#: On CUDA, query lengths from 2 to this were not run through compiled flex: Tq 64 raised
#: inductor's NoValidChoicesError (torch 2.11, GQA 8:2, D 64, bf16); Tq 1, 256, 1024, 4096 ran.
_FLEX_MIN_TQ = 128


def _flex_infeasible(sig: CallSignature) -> str | None:
    if sig.device_type not in ("cuda", "xpu", "cpu", "mps"):
        return f"flex_attention does not run on {sig.device_type}"
    if sig.kvcache:
        return "the KV-cache path uses a per-row mask, which flex would rebuild every step"
    if sig.device_type in ("cpu", "mps") and sig.requires_grad:
        return f"FlexAttention has no backward on {sig.device_type}; these tensors require grad"
    if sig.device_type == "cuda" and 1 < sig.tq < _FLEX_MIN_TQ:
        return (
            f"{sig.tq} query rows: compiled flex found no kernel for 64 rows on torch 2.11 "
            f"(H100 and H200, measured); it ran with 1 and with {_FLEX_MIN_TQ * 2} or more"
        )
    probe = probe_kernel("flex")
    return None if probe.available else f"not installed: {probe.reason}"


def infeasible(name: str, sig: CallSignature, host: HostInfo | None) -> str | None:
    """Why implementation ``name`` cannot run the call ``sig``, or None when it can.

    ``host`` only adds a note to device rejections (None while torch.compile traces the call).
    """
    if name in _FA_LABEL:
        return _fa_infeasible(name, sig, host)
    if name == "flex":
        return _flex_infeasible(sig)
    return None  # sdpa and math take every call (SDPA falls back to its MATH kernel itself)


def auto_skip(name: str, sig: CallSignature) -> str | None:
    """Why ``auto`` passes over a feasible implementation here (an override still uses it)."""
    if name == "flex":
        if sig.window[0] == UNBOUNDED:
            return "no sliding window: flex only wins by skipping key blocks outside a window"
        if sig.device_type not in ("cuda", "xpu"):
            return (
                f"on {sig.device_type} flex beats SDPA only compiled (40-90 s first call); "
                "name it in DISTCOMPAT_ATTENTION to use it"
            )
        keys = sig.window[0] + 1
        share = next(
            (n for dim, least, n in FLEX_WINDOW_RULES if sig.d_qk >= dim and sig.tk >= least), None
        )
        if share is None or keys * share > sig.tk:
            won = "for no window" if share is None else f"only for windows up to 1/{share} of them"
            return (
                f"a {keys}-key window of {sig.tk} keys at head dim {sig.d_qk}: flex beat SDPA "
                f"with a mask {won} (FLEX_WINDOW_RULES, measured on an H200)"
            )
    cpu_decode = sig.device_type == "cpu" and sig.tq == 1 and not sig.requires_grad
    if name == "sdpa" and cpu_decode and sig.dtype in _HALF:
        return (
            "one 16-bit query row on cpu, no grad: exact math (float32) is 2-3x faster than "
            "SDPA's CPU flash kernel here (measured, benchmarks/README.md)"
        )
    return None
