"""Which attention kernels this process can import, and what each CUDA device is; probed once.

Optional packages (``flash-attn`` for FA2, the Hopper build ``flash_attn_interface`` for FA3,
``flash-attn-4`` for FA4) are imported lazily, on the first call whose tensors could use them,
never at import time and never downloaded. A failed import is kept as the reason text::

    probe = probe_kernel("fa3")
    probe.available, probe.reason   # (False, "import flash_attn_interface failed: ...")

Tests describe hardware and packages we do not have with :func:`override_kernels`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "KernelProbe",
    "device_capability",
    "is_rocm",
    "override_kernels",
    "probe_kernel",
    "sdpa_supports_gqa",
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


@functools.cache
def _cached_probe(name: str) -> KernelProbe:
    return _import_probe(name)


def probe_kernel(name: str) -> KernelProbe:
    """Return whether kernel ``name`` (fa2, fa3, fa4, flex) imports here; imports on first ask.

    Example:
        >>> probe_kernel("flex").available
        True
    """
    if name in _probe_overrides:
        return _probe_overrides[name]
    return _cached_probe(name)


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


@functools.cache
def sdpa_supports_gqa() -> bool:
    """Whether ``scaled_dot_product_attention`` takes ``enable_gqa`` (a feature test, cached).

    Example:
        >>> isinstance(sdpa_supports_gqa(), bool)
        True
    """
    q = torch.zeros(1, 2, 1, 8)
    kv = torch.zeros(1, 1, 1, 8)
    try:
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except TypeError:
        return False
    return True


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
