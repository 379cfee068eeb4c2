"""What this host and this torch build can do: devices, collective backends, versions.

Every hardware and feature probe in distcompat goes through :func:`probe_host`, which asks torch
once and caches the answer. Tests that pretend to have hardware we do not have replace the answer
with :func:`override_host` instead of patching torch in several places::

    with override_host(replace(probe_host(), cuda_device_count=1)):
        init_distributed(device="cuda")   # sees a one-GPU host

Nothing is probed at import time; the first call pays for it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["HostInfo", "override_host", "probe_host"]

# Collective backends we know how to ask about, in the order doctor prints them.
_BACKEND_PROBES: tuple[tuple[str, str], ...] = (
    ("gloo", "is_gloo_available"),
    ("nccl", "is_nccl_available"),
    ("xccl", "is_xccl_available"),
    ("mpi", "is_mpi_available"),
    ("ucc", "is_ucc_available"),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class HostInfo:
    """A snapshot of the devices and collective backends this process can use.

    Example:
        >>> info = probe_host()
        >>> "gloo" in info.backends
        True
    """

    torch_version: str
    distributed_available: bool
    backends: frozenset[str]
    cuda_device_count: int
    xpu_device_count: int
    mps_available: bool

    def device_count(self, device_type: str) -> int:
        """Return how many devices of ``device_type`` this host has (cpu counts as one).

        Example:
            >>> probe_host().device_count("cpu")
            1
        """
        counts = {
            "cpu": 1,
            "cuda": self.cuda_device_count,
            "xpu": self.xpu_device_count,
            "mps": int(self.mps_available),
        }
        return counts.get(device_type, 0)


_override: HostInfo | None = None


@functools.cache
def _probe() -> HostInfo:
    backends = frozenset(
        name
        for name, probe in _BACKEND_PROBES
        if dist.is_available() and getattr(dist, probe, lambda: False)()
    )
    xpu = getattr(torch, "xpu", None)
    xpu_count = int(xpu.device_count()) if xpu is not None and xpu.is_available() else 0
    return HostInfo(
        torch_version=torch.__version__,
        distributed_available=dist.is_available(),
        backends=backends,
        cuda_device_count=torch.cuda.device_count() if torch.cuda.is_available() else 0,
        xpu_device_count=xpu_count,
        mps_available=bool(torch.backends.mps.is_available()),
    )


def probe_host() -> HostInfo:
    """Return what this host has, probing torch on the first call only.

    Example:
        >>> probe_host().torch_version.startswith("2.")
        True
    """
    return _override if _override is not None else _probe()


@contextlib.contextmanager
def override_host(info: HostInfo) -> Iterator[HostInfo]:
    """Make :func:`probe_host` return ``info`` inside the block (for tests of hardware we lack).

    Example:
        >>> from dataclasses import replace
        >>> with override_host(replace(probe_host(), cuda_device_count=8)):
        ...     probe_host().cuda_device_count
        8
    """
    global _override
    previous, _override = _override, info
    try:
        yield info
    finally:
        _override = previous
