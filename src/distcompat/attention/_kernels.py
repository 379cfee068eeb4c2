"""Which attention kernels this process can import, and what each CUDA device is; probed once.

Optional packages (``flash-attn`` for FA2, the Hopper build ``flash_attn_interface`` for FA3,
``flash-attn-4`` for FA4) are imported lazily, on the first call whose tensors could use them,
never at import time and never downloaded. A failed import is kept as the reason text::

    probe = probe_kernel("fa3")
    probe.available, probe.reason   # (False, "import flash_attn_interface failed: ...")

Behaviour that differs between torch releases is found by feature tests here too, each cached
and run eagerly even when first asked inside a torch.compile trace: whether SDPA takes
``enable_gqa`` and gives zeros for fully masked rows, whether flex_attention takes ``enable_gqa``,
and whether its CPU backward keeps 16-bit gradients exact to float32 rounding. Probe results
sit in plain dicts, which torch.compile reads without tracing a cache wrapper.

Tests describe hardware and packages we do not have with :func:`override_kernels`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

__all__ = [
    "KernelProbe",
    "constant_when_traced",
    "device_capability",
    "flex_takes_gqa",
    "forget_probes",
    "is_rocm",
    "override_kernels",
    "probe_kernel",
    "sdpa_cpu_rough_backward",
    "sdpa_supports_gqa",
    "sdpa_zeroes_dead_rows",
    "state_token",
]

#: Import path and the functions each optional kernel must have to count as installed.
_KERNEL_MODULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "fa2": ("flash_attn.flash_attn_interface", ("flash_attn_func", "flash_attn_with_kvcache")),
    "fa3": ("flash_attn_interface", ("flash_attn_func",)),
    "fa4": ("flash_attn.cute", ("flash_attn_func",)),
    "flex": ("torch.nn.attention.flex_attention", ("flex_attention", "create_block_mask")),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelProbe:
    """Whether one optional kernel imported, its functions, and the reason either way."""

    name: str
    functions: Mapping[str, Callable[..., Any]] = field(default_factory=dict, hash=False)
    reason: str

    @property
    def available(self) -> bool:
        """True when the import worked and every required function was found."""
        return bool(self.functions)


def _import_probe(name: str) -> KernelProbe:
    module_name, required = _KERNEL_MODULES[name]
    try:
        module: ModuleType = importlib.import_module(module_name)
    except Exception as exc:  # any import failure is a reason, kept verbatim
        return KernelProbe(
            name=name, reason=f"import {module_name} failed: {type(exc).__name__}: {exc}"
        )
    missing = [fn for fn in required if not callable(getattr(module, fn, None))]
    if missing:
        return KernelProbe(name=name, reason=f"{module_name} lacks {', '.join(missing)}")
    functions = {fn: getattr(module, fn) for fn in required}
    optional = getattr(module, "flash_attn_with_kvcache", None)
    if callable(optional):
        functions.setdefault("flash_attn_with_kvcache", optional)
    return KernelProbe(name=name, functions=functions, reason=f"{module_name} imported")


_probe_overrides: dict[str, KernelProbe] = {}
_capability_overrides: dict[int, tuple[int, int]] = {}
_rocm_override: list[bool] = []
_state = [0]


_probes: dict[str, KernelProbe] = {}


def forget_probes() -> None:
    """Forget every import probe, so the next ask imports again (for tests).

    Example:
        >>> forget_probes()
    """
    _probes.clear()


def probe_kernel(name: str) -> KernelProbe:
    """Return whether kernel ``name`` (fa2, fa3, fa4, flex) imports here; imports on first ask.

    Example:
        >>> probe = probe_kernel("flex")  # older torch has no flex_attention: the reason says so
        >>> probe.available or probe.reason.startswith("import torch.nn.attention.flex_attention")
        True
    """
    if name in _probe_overrides:
        return _probe_overrides[name]
    probe = _probes.get(name)
    if probe is None:
        probe = _probes[name] = _import_probe(name)
    return probe


@functools.cache
def _cached_capability(index: int) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(index)
    return (int(major), int(minor))


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """Compute capability of *this* CUDA device (not the current one); None for other types.

    Example:
        >>> device_capability(torch.device("cpu")) is None
        True
    """
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else 0
    if index in _capability_overrides:
        return _capability_overrides[index]
    return _cached_capability(index)


def is_rocm() -> bool:
    """Whether this torch is a ROCm build (its CUDA devices are AMD GPUs).

    Example:
        >>> isinstance(is_rocm(), bool)
        True
    """
    if _rocm_override:
        return _rocm_override[-1]
    return getattr(torch.version, "hip", None) is not None


_R = TypeVar("_R")


def constant_when_traced(fn: Callable[[], _R]) -> Callable[[], _R]:
    """Mark ``fn`` so that torch.compile calls it eagerly while tracing and keeps its result.

    For feature tests (one that raises or compiles cannot be traced into a graph); the result
    is not guarded, so ``fn`` must not change its answer within the process.
    """
    marked: Callable[[], _R] = torch.compiler.assume_constant_result(fn)  # type: ignore[no-untyped-call]
    return marked


@functools.cache
def _sdpa_supports_gqa() -> bool:
    q = torch.zeros(1, 2, 1, 8)
    kv = torch.zeros(1, 1, 1, 8)
    try:
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except TypeError:  # "unexpected keyword argument 'enable_gqa'"
        return False
    return True


@constant_when_traced
def sdpa_supports_gqa() -> bool:
    """Whether ``scaled_dot_product_attention`` takes ``enable_gqa`` (a feature test, cached).

    Without it, callers repeat K/V heads with ``repeat_interleave`` (same grouping).

    Example:
        >>> isinstance(sdpa_supports_gqa(), bool)
        True
    """
    return _sdpa_supports_gqa()


@functools.cache
def _sdpa_zeroes_dead_rows() -> bool:
    q = torch.ones(1, 1, 2, 8, requires_grad=True)
    mask = torch.tensor([[False, False], [True, True]])  # row 0 sees no key
    out = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    (grad,) = torch.autograd.grad(out.sum(), q)
    return bool((out[:, :, 0] == 0).all()) and bool(torch.isfinite(grad).all())


@constant_when_traced
def sdpa_zeroes_dead_rows() -> bool:
    """Whether CPU SDPA gives 0, and finite gradients, for a row whose bool mask is all False.

    A feature test on CPU (cached). Where it gives NaN instead, the NaN also reaches the
    gradients through SDPA's backward, so callers let such rows see every key and zero their
    output afterwards.

    Example:
        >>> isinstance(sdpa_zeroes_dead_rows(), bool)
        True
    """
    return _sdpa_zeroes_dead_rows()


@functools.cache
def _sdpa_cpu_rough_backward() -> tuple[torch.dtype, ...]:
    rough = []
    for dtype in (torch.float16, torch.bfloat16):
        gen = torch.Generator().manual_seed(0)
        q, k, v, dout = (torch.randn(1, 2, 4, 16, generator=gen).to(dtype) for _ in range(4))
        q.requires_grad_()
        out = F.scaled_dot_product_attention(q, k[:, :, :1], v[:, :, :1])
        (dq,) = torch.autograd.grad(out, q, dout)
        # One key: the softmax is constant, so dq is exactly 0. A backward that accumulates in
        # float32 leaves ~1e-7 here; one that rounds its intermediates to 16 bits leaves ~1e-3.
        if float(dq.abs().max()) > 1e-5:
            rough.append(dtype)
    return tuple(rough)


@constant_when_traced
def sdpa_cpu_rough_backward() -> tuple[torch.dtype, ...]:
    """Name the 16-bit dtypes whose SDPA CPU backward (default kernel) rounds intermediates.

    A feature test with an exactly known answer (cached). For these dtypes, callers with
    gradients on CPU get exact math instead, which is what SDPA's MATH kernel computes.

    Example:
        >>> set(sdpa_cpu_rough_backward()) <= {torch.float16, torch.bfloat16}
        True
    """
    return _sdpa_cpu_rough_backward()


@functools.cache
def _takes_gqa(flex_attention: Callable[..., Any]) -> bool:
    return "enable_gqa" in inspect.signature(flex_attention).parameters


@constant_when_traced
def flex_takes_gqa() -> bool:
    """Whether the installed ``flex_attention`` takes ``enable_gqa`` (False when flex is absent).

    Example:
        >>> isinstance(flex_takes_gqa(), bool)
        True
    """
    flex_attention = probe_kernel("flex").functions.get("flex_attention")
    return flex_attention is not None and _takes_gqa(flex_attention)


def state_token() -> int:
    """Return a number that changes with every override, for decision caches to key on."""
    return _state[0]


@contextlib.contextmanager
def override_kernels(
    *,
    probes: Mapping[str, KernelProbe] | None = None,
    capabilities: Mapping[int, tuple[int, int]] | None = None,
    rocm: bool | None = None,
) -> Iterator[None]:
    """Pretend to have these kernels, CUDA capabilities (by device index) and ROCm flag.

    Example:
        >>> with override_kernels(capabilities={0: (9, 0)}):
        ...     device_capability(torch.device("cuda", 0))
        (9, 0)
    """
    saved = (dict(_probe_overrides), dict(_capability_overrides), list(_rocm_override))
    _probe_overrides.update(probes or {})
    _capability_overrides.update(capabilities or {})
    if rocm is not None:
        _rocm_override.append(rocm)
    _state[0] += 1
    try:
        yield
    finally:
        _probe_overrides.clear()
        _probe_overrides.update(saved[0])
        _capability_overrides.clear()
        _capability_overrides.update(saved[1])
        _rocm_override[:] = saved[2]
        _state[0] += 1
