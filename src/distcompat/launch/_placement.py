"""Where a rank runs and which collective backend talks for it, each choice with its reason.

The rule that fixes seed 000 (a CPU run on a host with a GPU picked a CUDA kernel): the RUN device
decides the backend, never ``torch.cuda.is_available()`` alone::

    device = resolve_device("cpu", local_rank=0, env=env, host=probe_host())
    backend = choose_backend(device.device, None, host=probe_host())   # gloo, with the reason

Both functions are pure: the host comes in as a :class:`HostInfo`, so tests can
describe hosts we do not have.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch

from distcompat.launch._env import LaunchEnv
from distcompat.launch._host import HostInfo

__all__ = [
    "DEFAULT_BACKENDS",
    "DEFAULT_TIMEOUT",
    "BackendChoice",
    "BackendUnavailableError",
    "DeviceBindingError",
    "DeviceChoice",
    "TimeoutChoice",
    "backend_map",
    "choose_backend",
    "choose_timeout",
    "resolve_device",
]

#: Backend for each run-device type when the caller does not name one.
DEFAULT_BACKENDS: dict[str, str] = {"cpu": "gloo", "cuda": "nccl", "xpu": "xccl", "mps": "gloo"}
#: Device types each backend can move tensors of.
_BACKEND_DEVICES: dict[str, frozenset[str]] = {
    "gloo": frozenset({"cpu", "cuda"}),
    "nccl": frozenset({"cuda"}),
    "xccl": frozenset({"xpu"}),
    "mpi": frozenset({"cpu", "cuda"}),
    "ucc": frozenset({"cpu", "cuda"}),
}
_ACCELERATORS: tuple[str, ...] = ("cuda", "xpu", "mps")

#: Process-group timeout when the caller gives none (see :func:`choose_timeout`).
DEFAULT_TIMEOUT = timedelta(minutes=10)


class DeviceBindingError(RuntimeError):
    """The requested run device does not exist on this host, or LOCAL_RANK has no device to bind."""


class BackendUnavailableError(RuntimeError):
    """The requested collective backend is not built into this torch or cannot drive the device."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceChoice:
    """The run device of this rank and why it was chosen."""

    device: torch.device
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class BackendChoice:
    """The collective backend string for ``init_process_group`` and why it was chosen."""

    backend: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class TimeoutChoice:
    """The process-group timeout and why it was chosen."""

    timeout: timedelta
    reason: str


def _visible(env: LaunchEnv) -> str:
    shown = "unset" if env.cuda_visible_devices is None else repr(env.cuda_visible_devices)
    return f"CUDA_VISIBLE_DEVICES={shown}"


def resolve_device(
    requested: str | torch.device, *, local_rank: int, env: LaunchEnv, host: HostInfo
) -> DeviceChoice:
    """Turn ``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"xpu"`` or ``"mps"`` into a device.

    An accelerator type without an index is bound to ``LOCAL_RANK`` (never ``RANK``: seed 002, D3).

    Example:
        >>> from distcompat.launch._host import probe_host
        >>> env = LaunchEnv.from_environ({})
        >>> resolve_device("cpu", local_rank=0, env=env, host=probe_host()).device
        device(type='cpu')
    """
    try:
        device = torch.device(requested) if requested != "auto" else None
    except RuntimeError as exc:
        raise ValueError(
            f"device={requested!r} is not a device; use 'auto', 'cpu', 'cuda', 'cuda:N', "
            "'xpu' or 'mps'"
        ) from exc
    if device is None:
        return _auto_device(local_rank=local_rank, env=env, host=host)
    if device.type == "cpu":
        present = [f"{t} ({host.device_count(t)})" for t in _ACCELERATORS if host.device_count(t)]
        note = f"; {', '.join(present)} present but unused" if present else ""
        return DeviceChoice(device=torch.device("cpu"), reason=f"cpu: requested{note}")
    count = host.device_count(device.type)
    if device.type not in DEFAULT_BACKENDS:
        raise ValueError(f"device={requested!r}: distcompat does not run on {device.type!r}")
    if count == 0:
        raise DeviceBindingError(
            f"device={requested!r} requested but this host has no {device.type} device "
            f"({_visible(env)}); use device='cpu' or 'auto'"
        )
    if device.type == "mps":
        return DeviceChoice(device=torch.device("mps"), reason="mps: requested")
    index: int | None = device.index  # torch's stubs say int; it is None for a bare "cuda"
    if index is not None:
        if index >= count:
            raise DeviceBindingError(
                f"device={requested!r} but this host shows {count} {device.type} device(s) "
                f"({_visible(env)})"
            )
        return DeviceChoice(
            device=device,
            reason=f"{device}: requested with an explicit index (LOCAL_RANK={local_rank} not used)",
        )
    return _bind_local_rank(
        device.type, local_rank=local_rank, count=count, env=env, why="requested"
    )


def _bind_local_rank(
    device_type: str, *, local_rank: int, count: int, env: LaunchEnv, why: str
) -> DeviceChoice:
    if local_rank >= count:
        raise DeviceBindingError(
            f"LOCAL_RANK={local_rank} has no {device_type} device to bind: this host shows "
            f"{count} {device_type} device(s) ({_visible(env)}). Launch at most {count} "
            f"process(es) per node, or make more devices visible"
        )
    device = torch.device(device_type, local_rank)
    return DeviceChoice(device=device, reason=f"{device}: {why}, bound by LOCAL_RANK={local_rank}")


def _auto_device(*, local_rank: int, env: LaunchEnv, host: HostInfo) -> DeviceChoice:
    for device_type in _ACCELERATORS:
        count = host.device_count(device_type)
        if count == 0:
            continue
        why = f"auto found {count} {device_type} device(s)"
        if device_type == "mps":
            return DeviceChoice(device=torch.device("mps"), reason=f"mps: {why}")
        return _bind_local_rank(device_type, local_rank=local_rank, count=count, env=env, why=why)
    return DeviceChoice(device=torch.device("cpu"), reason="cpu: auto found no accelerator")


def backend_map(requested: str) -> dict[str, str]:
    """Return the device types and backends of a per-device map (``"cpu:gloo,cuda:nccl"``).

    A part that is not ``device:backend`` raises ValueError naming it.

    Example:
        >>> backend_map("cpu:gloo, cuda:nccl")
        {'cpu': 'gloo', 'cuda': 'nccl'}
    """
    pairs: dict[str, str] = {}
    for part in requested.split(","):
        device_type, sep, name = part.strip().partition(":")
        if not sep or not device_type or not name:
            raise ValueError(
                f"backend={requested!r}: {part.strip()!r} is not 'device:backend' "
                "(expected a form like 'cpu:gloo,cuda:nccl')"
            )
        pairs[device_type.strip()] = name.strip()
    return pairs


def choose_backend(device: torch.device, requested: str | None, *, host: HostInfo) -> BackendChoice:
    """Pick the collective backend for ``device``, or check the one the caller asked for.

    ``requested`` may be a backend name (``"gloo"``) or a per-device map (``"cpu:gloo,cuda:nccl"``).

    Example:
        >>> from distcompat.launch._host import probe_host
        >>> choose_backend(torch.device("cpu"), None, host=probe_host()).backend
        'gloo'
    """
    if requested is None:
        return _default_backend(device, host=host)
    normalized = requested.strip().lower()
    pairs = backend_map(normalized) if ":" in normalized else {device.type: normalized}
    for device_type, name in pairs.items():
        if name not in _BACKEND_DEVICES:
            raise ValueError(
                f"backend={requested!r}: unknown backend {name!r}; "
                f"known: {', '.join(sorted(_BACKEND_DEVICES))}"
            )
        if name not in host.backends:
            raise BackendUnavailableError(
                f"backend={requested!r}: {name} is not built into torch {host.torch_version} "
                f"(available: {', '.join(sorted(host.backends)) or 'none'})"
            )
        if device_type not in _BACKEND_DEVICES[name]:
            raise BackendUnavailableError(
                f"backend={requested!r}: {name} cannot move {device_type} tensors "
                f"(it handles {', '.join(sorted(_BACKEND_DEVICES[name]))})"
            )
    if device.type not in pairs:
        raise BackendUnavailableError(
            f"backend={requested!r} names no backend for the run device {device.type!r}"
        )
    if ":" in normalized:
        normalized = ",".join(f"{device_type}:{name}" for device_type, name in pairs.items())
    return BackendChoice(backend=normalized, reason=f"{normalized}: requested")


def _default_backend(device: torch.device, *, host: HostInfo) -> BackendChoice:
    name = DEFAULT_BACKENDS[device.type]
    if name in host.backends:
        note = " (gloo moves MPS tensors through host memory)" if device.type == "mps" else ""
        return BackendChoice(
            backend=name, reason=f"{name}: the default for run device {device.type}{note}"
        )
    if device.type == "cuda" and "gloo" in host.backends:
        return BackendChoice(
            backend="gloo",
            reason=(
                f"gloo: fallback 'cuda-without-nccl': nccl is not built into torch "
                f"{host.torch_version}; gloo handles CUDA tensors, more slowly"
            ),
        )
    raise BackendUnavailableError(
        f"run device {device.type} needs the {name} backend, which torch {host.torch_version} "
        f"does not have (available: {', '.join(sorted(host.backends)) or 'none'})"
    )


def choose_timeout(requested: float | timedelta | None) -> TimeoutChoice:
    """Pick the process-group timeout: the caller's, or :data:`DEFAULT_TIMEOUT` (10 minutes).

    torch's default for gloo is 30 minutes, and a hung (not dead) peer is noticed only when it
    expires; a dead peer is noticed in about 0.1 s whatever the timeout (reliability.md, 2.2).

    Example:
        >>> choose_timeout(30).timeout
        datetime.timedelta(seconds=30)
    """
    if requested is None:
        return TimeoutChoice(
            timeout=DEFAULT_TIMEOUT,
            reason=(
                "10 min: distcompat's default (torch's gloo default is 30 min; a hung peer is "
                "only noticed when the timeout expires); pass timeout= to change it"
            ),
        )
    timeout = requested if isinstance(requested, timedelta) else timedelta(seconds=requested)
    if timeout <= timedelta(0):
        raise ValueError(f"timeout={requested!r} must be positive")
    return TimeoutChoice(timeout=timeout, reason=f"{timeout}: requested")
