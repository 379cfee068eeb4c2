"""``init_process_group`` and ``destroy_process_group`` as torch spells them, doing what init does.

A script that keeps its own init changes one import and gets what
:func:`~distcompat.init_distributed` gives (the protected group, the watchdog, the mismatch
check, hang dumps, exit handling, lost peers named)::

    import distcompat.distributed as dist               # was: import torch.distributed as dist
    dist.init_process_group(backend="gloo")             # any of torch's signatures
    model = DistributedDataParallel(model)              # checked, watched, shared memory
    dist.destroy_process_group()

Under a launcher with the default ``env://`` rendezvous this is ``init_distributed`` itself (its
fresh store prefix per init included). An explicit rendezvous (``store=``, ``tcp://``,
``file://``, or ``rank=`` / ``world_size=`` of the caller's own) is torch's, with distcompat's
protected backend in place of gloo; the group is then set up as ``init_distributed`` sets up
one it made.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from distcompat import _torch
from distcompat._ranks import recorded
from distcompat.launch import LaunchEnv, LaunchEnvError
from distcompat.launch._placement import choose_timeout
from distcompat.launch._settings import choose_protection, choose_watchdog
from distcompat.process_group._create import _protected_backend
from distcompat.process_group._init_watch import watched
from distcompat.process_group._lifecycle import _initialize, _normalize, destroy_distributed

__all__ = ["destroy_process_group", "init_process_group", "monitored_barrier", "set_timeout"]

#: Backends whose groups carry CPU tensors, and the run device each means.
_DEVICES = {"gloo": "cpu", "nccl": "cuda", "xccl": "xpu"}


def _device_for(backend: str | None, device_id: Any) -> str:
    """Return the run device a torch-style call asks for: ``device_id``, else the backend's."""
    if device_id is not None:
        return str(device_id if isinstance(device_id, torch.device) else f"cuda:{device_id}")
    if backend is None or ":" in backend or "," in backend:
        return "auto"
    return _DEVICES.get(str(backend).lower(), "auto")


def _launch_env(explicit: bool, rank: int, world_size: int) -> LaunchEnv:
    """Return the launcher's environment, or none where the caller's own rendezvous overrides it.

    As in torch, explicit arguments beat the environment: a harness that exports ``WORLD_SIZE``
    but passes each rank its ``rank`` (torch's own tests do) is no launcher error, and a launcher
    environment whose rank or world size the arguments contradict does not describe this group.
    """
    try:
        launch = LaunchEnv.from_environ()
    except LaunchEnvError:
        if not explicit:
            raise
        return LaunchEnv.from_environ({})
    contradicted = (rank >= 0 and rank != launch.rank) or (
        world_size >= 0 and world_size != launch.world_size
    )
    return LaunchEnv.from_environ({}) if explicit and contradicted else launch


def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: timedelta | None = None,
    world_size: int = -1,
    rank: int = -1,
    store: dist.Store | None = None,
    group_name: str = "",
    pg_options: Any | None = None,
    device_id: torch.device | int | None = None,
    _ranks: list[int] | None = None,
    enable_reconfigure: bool = False,
) -> None:
    """Make the default group as ``torch.distributed.init_process_group`` does, protected.

    The arguments are the newest torch's. The group is distcompat's: every collective on it,
    DDP's and FSDP2's included, is checked, watched and typed (``distcompat.DistInfo.reason``
    through :func:`distcompat.init_distributed`, which returns the same record, says what was
    chosen). A second call returns quietly, as :func:`distcompat.init_distributed` does.

    Two requests get torch's own group: ``_ranks=`` (a default group of some ranks only) is
    torch's init, untouched; ``enable_reconfigure=True`` (torch 2.14+) is torch's reconfigurable
    gloo group, which distcompat then watches as one it adopted (its ``backend_reason`` says
    so). A parameter the installed torch lacks raises
    :class:`~distcompat._torch.TorchReleaseError` (a ``TypeError``) naming the release.

    Example:
        >>> init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> dist.get_world_size()
        1
        >>> destroy_process_group()
    """
    if _ranks:
        _torch.require_takes("init_process_group", "_ranks", _ranks)
        dist.init_process_group(
            backend=backend, init_method=init_method, timeout=timeout, world_size=world_size,
            rank=rank, store=store, group_name=group_name, pg_options=pg_options,
            device_id=device_id, _ranks=_ranks,
        )  # fmt: skip
        return
    newer: dict[str, Any] = {"enable_reconfigure": True} if enable_reconfigure else {}
    for name, value in newer.items():
        _torch.require_takes("init_process_group", name, value)
    device = _device_for(backend, device_id)
    request = _normalize(device, backend, timeout)
    explicit = store is not None or init_method not in (None, "env://") or rank >= 0
    launch = _launch_env(explicit, rank, world_size)
    own_init = not explicit and world_size < 0 and launch.is_distributed and not newer
    if own_init or dist.is_initialized():
        made = not dist.is_initialized()
        _initialize(request, launch, made_by=None)
        if made:
            _name_as_asked(backend)
        return
    protected = not newer and choose_protection(str(backend).lower() if backend else "gloo").on
    waited = choose_timeout(timeout).timeout
    early = choose_watchdog(None, group_timeout=waited).seconds
    where = "the given store" if store is not None else str(init_method or "env://")
    with watched(early, rank, world_size, where) as watch:
        watch.phase("rendezvous (torch's init)")
        dist.init_process_group(
            backend=_protected_backend(backend) if protected else backend,
            init_method=init_method,
            timeout=waited,
            world_size=world_size,
            rank=rank,
            store=store,
            group_name=group_name,
            pg_options=pg_options,
            device_id=device_id,
            **newer,
        )
    how = f"made by distcompat.distributed.init_process_group (init_method={init_method!r}"
    how += ", store given" if store is not None else ""
    how += (
        "; enable_reconfigure=True: torch's own reconfigurable gloo group, which distcompat's "
        "protected group is not)"
        if newer
        else ")"
    )
    _initialize(request, launch, made_by=how)
    _name_as_asked(backend)


def _name_as_asked(backend: str | None) -> None:
    """Make a protected default group made without a backend name itself ``"undefined"``.

    torch's own group answers ``get_backend()`` so, and a framework may branch on the name.
    """
    world = dist.group.WORLD
    if backend is None and hasattr(world, "protects"):
        world.asked_as = "undefined"  # type: ignore[union-attr]  # a ProtectedGroup's attribute


def destroy_process_group(group: Any | None = None) -> None:
    """Destroy ``group`` as torch does; the default group as ``destroy_distributed`` does.

    A default group distcompat made is destroyed by it; of one it adopted, distcompat first drops
    its record (watchdog, store connections), then torch destroys the group.

    Example:
        >>> destroy_process_group()   # nothing to destroy: a no-op
    """
    if group is None or group is dist.group.WORLD:
        info = recorded()
        if info is not None and info.has_group:
            destroy_distributed()  # its own group destroyed; of an adopted one, its record dropped
            if not info.adopted:
                return
        if not dist.is_initialized():
            return
    dist.destroy_process_group(group)


def monitored_barrier(
    group: Any | None = None, timeout: timedelta | None = None, wait_all_ranks: bool = False
) -> None:
    """Run torch's ``monitored_barrier``, also on the protected group.

    torch's refuses every backend it does not name ``gloo``; the protected group's gloo backend
    runs it here.

    Example:
        >>> monitored_barrier()   # no group here: nothing to wait for
    """
    target: Any = group if group is not None else dist.group.WORLD
    if target is None:
        return
    if not hasattr(target, "protects"):
        dist.monitored_barrier(group, timeout, wait_all_ranks=wait_all_ranks)
        return
    # Imported with a group, not with this module (as in _create: the collectives face).
    from distcompat.collectives._group import group_timeout_s

    waited = timeout if timeout is not None else timedelta(seconds=group_timeout_s(target))
    target.monitored_barrier(waited, wait_all_ranks=wait_all_ranks)


def set_timeout(timeout: timedelta, group: Any | None = None) -> None:
    """Set ``group``'s timeout (the default group's without one) for the operations that follow.

    torch 2.14's ``set_timeout``, on every release: the group's backends and distcompat's
    bounded waits (which read the group's own timeout) take the new value.

    Example:
        >>> set_timeout(timedelta(minutes=5))   # no group here: nothing to set
    """
    if not isinstance(timeout, timedelta):
        raise TypeError(f"set_timeout: timeout must be a datetime.timedelta, not {timeout!r}")
    target: Any = group if group is not None else dist.group.WORLD
    if target is None:
        return
    target.set_timeout(timeout)
