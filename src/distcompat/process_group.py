"""Process-group lifecycle: init once from the launcher env, adopt a group that exists, tear down.

The two lines a training script writes::

    info = distcompat.init_distributed(device="cpu")   # gloo, even on a host with a GPU
    print(info.reason)                                  # why this device, backend and timeout

Rules this module keeps:

* The backend follows the RUN device (cpu -> gloo, cuda -> nccl, xpu -> xccl, mps -> gloo).
* An accelerator is bound by ``LOCAL_RANK``; a LOCAL_RANK with no device is a clear error.
* Idempotent: a second call returns the same :class:`DistInfo` (and warns if its arguments differ);
  a group someone else created (Ray Train, user code) is adopted, never recreated or destroyed.
* No launcher env means one process and no group: every helper here is then the identity.
* Each init keys its rendezvous under a fresh store prefix, so init -> destroy -> init works even
  when a launcher's store outlives the group (torchrun's agent store: plain torch fails there).
* Nothing happens at import time.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from distcompat._host import probe_host
from distcompat._placement import (
    BackendChoice,
    DeviceChoice,
    TimeoutChoice,
    choose_backend,
    choose_timeout,
    resolve_device,
)
from distcompat.collectives._peers import publish as publish_identity
from distcompat.env import LaunchEnv

__all__ = [
    "DistInfo",
    "DistInitError",
    "barrier",
    "destroy_distributed",
    "distributed_session",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_main_process",
]


class DistInitError(RuntimeError):
    """The process group cannot be created from what the launcher environment says."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DistInfo:
    """What :func:`init_distributed` set up, and why.

    ``has_group`` is False for a plain single process (no launcher env): no group exists and the
    helpers in this module are the identity. ``timeout`` is None only for an adopted group whose
    timeout nobody told us (torch has no public getter for it).

    Example:
        >>> info = init_distributed(device="cpu")
        >>> info.rank, info.world_size, info.backend
        (0, 1, None)
        >>> destroy_distributed()
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    device: torch.device
    backend: str | None
    timeout: timedelta | None
    launcher: str
    has_group: bool
    adopted: bool
    device_reason: str
    backend_reason: str
    timeout_reason: str

    @property
    def is_main_process(self) -> bool:
        """True on global rank 0."""
        return self.rank == 0

    @property
    def reason(self) -> str:
        """One line per choice (device, backend, timeout) saying what was chosen and why."""
        return "\n".join(
            (
                f"device: {self.device_reason}",
                f"backend: {self.backend_reason}",
                f"timeout: {self.timeout_reason}",
            )
        )


@dataclass(frozen=True, slots=True)
class _Request:
    device: str
    backend: str | None
    timeout: timedelta | None
    watchdog: float | None = None

    def __str__(self) -> str:
        text = f"device={self.device!r}, backend={self.backend!r}, timeout={self.timeout}"
        return text + (f", watchdog={self.watchdog}" if self.watchdog is not None else "")


@dataclass(slots=True)
class _Lifecycle:
    info: DistInfo
    request: _Request
    watchdog: Any = None  # the distcompat.diagnostics.Watchdog init started, if any


# The one piece of module state: what init_distributed set up. Read by the helpers below.
_current: _Lifecycle | None = None
# The rendezvous store of the group _create_group made and its generation (for diagnostics).
_rendezvous: tuple[dist.Store, int] | None = None


def _normalize(
    device: str | torch.device,
    backend: str | None,
    timeout: float | timedelta | None,
    watchdog: float | None = None,
) -> _Request:
    seconds = timedelta(seconds=timeout) if isinstance(timeout, (int, float)) else timeout
    return _Request(str(device), backend, seconds, watchdog)


def _side_store() -> tuple[dist.Store, str] | None:
    """Return the store of the group init_distributed created, and a key prefix unique to it.

    distcompat.diagnostics exchanges hang reports through it while the group itself is stuck.
    None for an adopted group (its store is not ours to know) or when no group exists.
    """
    if _rendezvous is None or not _group_active():
        return None
    store, generation = _rendezvous
    return store, f"distcompat/diagnostics/generation{generation}"


def init_distributed(
    device: str | torch.device = "auto",
    backend: str | None = None,
    timeout: float | timedelta | None = None,
    *,
    env: LaunchEnv | None = None,
    watchdog: float | None = None,
) -> DistInfo:
    """Create (or adopt) the default process group for this launch and bind the run device.

    Args:
        device: ``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"xpu"`` or ``"mps"``.
            A type without an index is bound to ``LOCAL_RANK``.
        backend: ``None`` to follow the run device, a name (``"gloo"``), or a per-device map
            (``"cpu:gloo,cuda:nccl"``).
        timeout: seconds or a timedelta; ``None`` means 10 minutes (torch's gloo default is 30).
        env: the launcher environment; ``None`` reads it with :meth:`LaunchEnv.from_environ`.
        watchdog: seconds; start a :func:`distcompat.watchdog` with this timeout for the life of
            the group (a hang then raises ``HangError`` naming the late rank). ``None``: off.

    Launch pitfalls (a script option torchrun takes as its own, multi-node gloo without
    ``GLOO_SOCKET_IFNAME``) are logged once, on each node's local rank 0.

    Example:
        >>> info = init_distributed(device="cpu")
        >>> info.device
        device(type='cpu')
        >>> init_distributed(device="cpu") is info   # idempotent
        True
        >>> destroy_distributed()
    """
    global _current
    request = _normalize(device, backend, timeout, watchdog)
    if _current is not None:
        if _current.info.has_group and not dist.is_initialized():
            _current = None  # someone destroyed our group behind our back: start again
        else:
            if request != _current.request:
                warnings.warn(
                    f"init_distributed() already ran with ({_current.request}); ignoring the new "
                    f"arguments ({request}) and returning the existing DistInfo",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return _current.info
    launch = env if env is not None else LaunchEnv.from_environ()
    if _group_active():
        info = _adopt(device, timeout, launch)
    elif not launch.is_distributed:
        info = _single_process(device, timeout, launch)
    else:
        _log_launch_pitfalls(launch, backend)
        info = _create_group(device, backend, timeout, launch)
    _current = _Lifecycle(info=info, request=request, watchdog=_start_watchdog(watchdog))
    return info


def _log_launch_pitfalls(launch: LaunchEnv, backend: str | None) -> None:
    from distcompat.diagnostics import log_launch_pitfalls

    log_launch_pitfalls(launch, backend=backend)


def _start_watchdog(timeout: float | None) -> Any:
    if timeout is None:
        return None
    from distcompat.diagnostics import watchdog

    return watchdog(timeout).start()


def _bind(choice: DeviceChoice) -> None:
    if choice.device.type == "cuda":
        torch.cuda.set_device(choice.device)
    elif choice.device.type == "xpu":
        torch.xpu.set_device(choice.device)


def _single_process(
    device: str | torch.device, timeout: float | timedelta | None, launch: LaunchEnv
) -> DistInfo:
    chosen = resolve_device(device, local_rank=0, env=launch, host=probe_host())
    _bind(chosen)
    waited = choose_timeout(timeout)
    return DistInfo(
        rank=0,
        local_rank=0,
        world_size=1,
        local_world_size=1,
        node_rank=0,
        device=chosen.device,
        backend=None,
        timeout=waited.timeout,
        launcher=launch.launcher,
        has_group=False,
        adopted=False,
        device_reason=chosen.reason,
        backend_reason="none: no launcher environment, so one process and no process group",
        timeout_reason=waited.reason,
    )


def _adopt(
    device: str | torch.device, timeout: float | timedelta | None, launch: LaunchEnv
) -> DistInfo:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    backend = str(dist.get_backend())
    if launch.is_distributed:
        local_rank, local_world_size, node_rank = (
            launch.local_rank,
            launch.local_world_size,
            launch.node_rank,
        )
        where = f"LOCAL_RANK from the {launch.launcher} environment"
    else:
        local_rank, local_world_size, node_rank = rank, world_size, 0
        where = "no launcher env: assumed one node, LOCAL_RANK = RANK"
    if device == "auto":
        # Follow the adopted group's backend: a gloo group means the owner chose the CPU.
        device = "cuda" if "nccl" in backend else "xpu" if "xccl" in backend else "cpu"
    chosen = resolve_device(device, local_rank=local_rank, env=launch, host=probe_host())
    _bind(chosen)
    publish_identity()
    if timeout is None:
        group_timeout, timeout_reason = None, "unknown: the adopted group keeps its owner's timeout"
    else:
        group_timeout = choose_timeout(timeout).timeout
        dist.group.WORLD.set_timeout(group_timeout)  # type: ignore[union-attr]
        timeout_reason = f"{group_timeout}: requested, applied to the adopted group"
    return DistInfo(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=node_rank,
        device=chosen.device,
        backend=backend,
        timeout=group_timeout,
        launcher=launch.launcher,
        has_group=True,
        adopted=True,
        device_reason=f"{chosen.reason} ({where})",
        backend_reason=f"{backend}: adopted the process group that already existed",
        timeout_reason=timeout_reason,
    )


def _make_store(launch: LaunchEnv, timeout: timedelta) -> dist.Store:
    if launch.master_addr is None or launch.master_port is None:
        raise DistInitError(
            f"the {launch.launcher} launch gives no rendezvous address "
            f"(master_addr={launch.master_addr!r}, master_port={launch.master_port!r}): "
            "set MASTER_ADDR and MASTER_PORT to rank 0's host and a free port"
        )
    host_here = launch.rank == 0 and not launch.agent_store
    try:
        return dist.TCPStore(
            launch.master_addr,
            launch.master_port,
            world_size=launch.world_size,
            is_master=host_here,
            timeout=timeout,
            wait_for_workers=False,
            multi_tenant=host_here,
        )
    except (RuntimeError, OSError) as exc:
        role = "host" if host_here else "reach"
        raise DistInitError(
            f"rank {launch.rank} could not {role} the rendezvous store at "
            f"{launch.master_addr}:{launch.master_port} ({launch.launcher}): {exc}"
        ) from exc


def _create_group(
    device: str | torch.device,
    backend: str | None,
    timeout: float | timedelta | None,
    launch: LaunchEnv,
) -> DistInfo:
    host = probe_host()
    chosen: DeviceChoice = resolve_device(
        device, local_rank=launch.local_rank, env=launch, host=host
    )
    picked: BackendChoice = choose_backend(chosen.device, backend, host=host)
    waited: TimeoutChoice = choose_timeout(timeout)
    _bind(chosen)
    global _rendezvous
    store = _make_store(launch, waited.timeout)
    # Each rank counts its own inits in the store; ranks init together, so the counts agree and
    # every generation rendezvouses under keys no earlier group has written.
    generation = store.add(f"distcompat/init_count/rank{launch.rank}", 1)
    _rendezvous = (store, generation)
    dist.init_process_group(
        backend=picked.backend,
        store=dist.PrefixStore(f"distcompat/generation{generation}", store),
        rank=launch.rank,
        world_size=launch.world_size,
        timeout=waited.timeout,
        device_id=chosen.device if "nccl" in picked.backend else None,  # eager NCCL init
    )
    publish_identity()  # so a lost peer can be named in groups larger than two
    return DistInfo(
        rank=launch.rank,
        local_rank=launch.local_rank,
        world_size=launch.world_size,
        local_world_size=launch.local_world_size,
        node_rank=launch.node_rank,
        device=chosen.device,
        backend=picked.backend,
        timeout=waited.timeout,
        launcher=launch.launcher,
        has_group=True,
        adopted=False,
        device_reason=chosen.reason,
        backend_reason=picked.reason,
        timeout_reason=waited.reason,
    )


def destroy_distributed() -> None:
    """Destroy the group :func:`init_distributed` created; safe to call twice or before init.

    An adopted group belongs to whoever made it (Ray Train, user code) and is left running;
    only distcompat's record of it is dropped.

    Example:
        >>> destroy_distributed()   # nothing to do: a no-op
    """
    global _current, _rendezvous
    state, _current = _current, None
    if state is not None and state.watchdog is not None:
        state.watchdog.stop()
    if state is None or state.info.adopted or not state.info.has_group:
        return
    _rendezvous = None
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def distributed_session(
    device: str | torch.device = "auto",
    backend: str | None = None,
    timeout: float | timedelta | None = None,
    *,
    env: LaunchEnv | None = None,
) -> Iterator[DistInfo]:
    """Context-manager form of :func:`init_distributed`: destroys on exit what it created.

    If a group was already set up when the block starts, it is left in place at the end.

    Example:
        >>> with distributed_session(device="cpu") as info:
        ...     info.world_size
        1
    """
    already = _current is not None or _group_active()
    info = init_distributed(device, backend, timeout, env=env)
    try:
        yield info
    finally:
        if not already:
            destroy_distributed()


def _group_active() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """Return the global rank: from the group if one exists, else the launcher env (0 if none).

    Example:
        >>> get_rank()
        0
    """
    if _current is not None:
        return _current.info.rank
    if _group_active():
        return dist.get_rank()
    return LaunchEnv.from_environ().rank


def get_world_size() -> int:
    """Return the number of ranks: from the group if one exists, else the launcher env (1 if none).

    Example:
        >>> get_world_size()
        1
    """
    if _current is not None:
        return _current.info.world_size
    if _group_active():
        return dist.get_world_size()
    return LaunchEnv.from_environ().world_size


def get_local_rank() -> int:
    """Return the rank within this node, from the launcher env (0 if none).

    Example:
        >>> get_local_rank()
        0
    """
    if _current is not None:
        return _current.info.local_rank
    return LaunchEnv.from_environ().local_rank


def is_main_process() -> bool:
    """Return True on global rank 0 (and in a plain single process).

    Example:
        >>> is_main_process()
        True
    """
    return get_rank() == 0


def barrier() -> None:
    """Block until every rank arrives; the identity without a group or at world size 1.

    Every rank must call it (never inside ``if rank == 0:``).

    Example:
        >>> barrier()   # single process: returns at once
    """
    if not _group_active() or dist.get_world_size() == 1:
        return
    if (
        _current is not None
        and _current.info.device.type == "cuda"
        and "nccl" in str(dist.get_backend())
    ):
        dist.barrier(device_ids=[_current.info.device.index or 0])
    else:
        dist.barrier()
