"""torch's names for a group that changes its members in place: gloo reconfigure, world maps.

A lost rank's survivors go on in the same group object (``distcompat.inplace``). Where the
installed torch's gloo can be reconfigured (2.14+: ``get_reconfigure_handle``, ``reconfigure``;
experimental in torch), the backend itself takes the new members, and with it every C++ caller
(DDP's reducer, functional collectives) sees the new rank and size, since from 2.14 a group's
``getRank``/``getSize`` ask its default backend. Elsewhere a new gloo backend is made and only
Python sees the new numbers (:func:`can_reconfigure` says which). torch's own record of each
group (``_world.pg_group_ranks``, ``_world.pg_map``) is brought up to date here either way.

Example:
    >>> can_reconfigure(None)
    False
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d_ext
from torch.distributed import distributed_c10d as _c10d

__all__ = [
    "can_reconfigure",
    "ddp_comm_hooks",
    "device_meshes",
    "fence_mesh",
    "forget_group_ranks",
    "joining_gloo",
    "other_groups",
    "reconfigure",
    "reconfigure_handle",
    "set_world_view",
    "update_ddp_group",
]


def can_reconfigure(backend: Any) -> bool:
    """Return whether ``backend`` (a gloo backend, or None) takes new members in place.

    Example:
        >>> import torch.distributed as dist
        >>> gloo = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=5))
        >>> can_reconfigure(gloo) == hasattr(gloo, "reconfigure")
        True
    """
    if backend is None or not hasattr(_c10d_ext, "ReconfigureOptions"):
        return False
    supports = getattr(backend, "supports_reconfigure", None)
    return bool(supports()) if callable(supports) else hasattr(backend, "reconfigure")


def reconfigure_handle(backend: Any) -> str:
    """Return the opaque handle this rank gives its peers for a reconfigure (2.14+).

    Example:
        >>> callable(reconfigure_handle)
        True
    """
    handle: str = backend.get_reconfigure_handle()
    return handle


def reconfigure(backend: Any, uuid: int, handles: list[str], timeout: timedelta) -> None:
    """Make ``backend`` a group of the ranks whose ``handles`` are listed (rank = position).

    ``uuid`` must be new to this backend (each reconfigure of one group takes the next number).
    Waits for the new connections, at most ``timeout``.

    Example:
        >>> callable(reconfigure)
        True
    """
    options: Any = _c10d_ext.ReconfigureOptions()
    options.uuid = uuid
    options.handles = list(handles)
    options.timeout = timeout
    backend.reconfigure(options).wait()


def joining_gloo(store: Any, group_name: str, rank: int, timeout: timedelta) -> Any:
    """Return a gloo backend that a running group's reconfigure can take (a newcomer's, 2.14+).

    ``store``: the store the running group's default group was made from (``init_process_group(
    store=...)``), ``group_name``: that group's name. A reconfigure meets its peers under its
    backend's store, which torch's group helper puts under ``"{group_name}/"`` and
    ``"{device}/"``; this backend is made under the same keys. ``rank``: unique among the
    handles (a newcomer's id), since a handle names the rank it was made with; the backend
    connects to no one until reconfigured (``enable_reconfigure``).

    Example:
        >>> callable(joining_gloo)
        True
    """
    backend_store = dist.PrefixStore("cpu/", dist.PrefixStore(f"{group_name}/", store))
    return dist.ProcessGroupGloo(backend_store, rank, rank + 1, timeout, True)


def other_groups(group: Any) -> list[Any]:
    """Return the groups torch knows besides ``group`` (the default one): subgroups, meshes'.

    Example:
        >>> other_groups(None)
        []
    """
    world: Any = _c10d._world
    return [known for known in world.pg_map if known is not group]


def forget_group_ranks(groups: list[Any]) -> None:
    """Empty torch's record of ``groups``' ranks (groups of members the default group lost).

    ``get_rank(group)`` then raises torch's "not part of group" error, not the old rank.

    Example:
        >>> forget_group_ranks([])
    """
    world: Any = _c10d._world
    for group in groups:
        if group in world.pg_group_ranks:
            world.pg_group_ranks[group] = {}


def device_meshes() -> list[Any]:
    """Return the device meshes alive in this process (torch keeps no registry of them).

    Each instance refers to its class, so one pass of the garbage collector over the tracked
    objects finds them all (``gc.get_referrers``: 28-35 ms for the 330,000 objects of a
    process with the demo's GPT here). A pass that found none notes the class's reference
    count; while it is the same, no mesh (nor subclass) was made since, and the next call
    returns at once: ``InPlace`` asks once when it is made, so a regroup of a job without
    meshes pays nothing. Empty when ``torch.distributed.device_mesh`` was never imported.

    Example:
        >>> isinstance(device_meshes(), list)
        True
    """
    module = sys.modules.get("torch.distributed.device_mesh")
    mesh_class = getattr(module, "DeviceMesh", None)
    if not isinstance(mesh_class, type):
        return []
    noted = _NONE_AT.setdefault(mesh_class, -1)  # (the key holds a reference of its own)
    references = sys.getrefcount(mesh_class)  # every instance holds one
    if noted == references:
        return []
    classes = _subclasses(mesh_class) - set(_FENCED.values())
    # type(), not isinstance: DeviceMesh's metaclass (2.15) asks the object's attributes
    found = [known for known in gc.get_referrers(*classes) if type(known) in classes]
    _NONE_AT[mesh_class] = -1 if found else references
    return found


def fence_mesh(mesh: Any, error: Callable[[], BaseException]) -> None:
    """Make every use of ``mesh`` (a device mesh of old members) raise ``error()``.

    Its size, shape, groups, coordinates and slices all read the old world: the mesh's class
    becomes a subclass that raises on every attribute. ``repr``, ``hash`` (the one it had, so
    torch's caches keyed by it stay whole) and ``==`` (identity) keep working.

    Example:
        >>> callable(fence_mesh)
        True
    """
    vars(mesh)["_distcompat_fence"] = (error, hash(mesh))
    mesh.__class__ = _fenced_class(type(mesh))


#: The mesh class's reference count when a pass found no mesh (-1: it found some).
_NONE_AT: dict[type, int] = {}
#: Each mesh class's fenced subclass, made once.
_FENCED: dict[type, type] = {}
#: What a fenced mesh still answers.
_OPEN = frozenset({"__class__", "_distcompat_fence"})


def _subclasses(cls: type) -> set[type]:
    found: set[type] = {cls}
    pending = [cls]
    while pending:
        subclasses: list[type] = pending.pop().__subclasses__()
        for sub in subclasses:
            if sub not in found:
                found.add(sub)
                pending.append(sub)
    return found


def _fenced_class(cls: type) -> type:
    if cls not in _FENCED:

        def refuse(self: Any, name: str) -> Any:
            if name in _OPEN:
                return object.__getattribute__(self, name)
            error, _ = object.__getattribute__(self, "_distcompat_fence")
            raise error()

        def fenced_hash(self: Any) -> int:
            _, old = object.__getattribute__(self, "_distcompat_fence")
            return int(old)

        def fenced_repr(self: Any) -> str:
            return f"<{cls.__name__} of members before an in-place regroup: fenced>"

        namespace = {
            "__getattribute__": refuse,
            "__hash__": fenced_hash,
            "__eq__": lambda self, other: self is other,
            "__ne__": lambda self, other: self is not other,
            "__repr__": fenced_repr,
            "__module__": __name__,
        }
        _FENCED[cls] = type(cls)(f"Fenced{cls.__name__}", (cls,), namespace)
    return _FENCED[cls]


def set_world_view(group: Any, size: int, store: Any) -> None:
    """Tell torch's record that ``group`` (the default one) now has ``size`` ranks and ``store``.

    ``get_process_group_ranks``, ``get_global_rank`` and the default store read this record;
    after a regroup it would name the ranks and the store of the group before.

    Example:
        >>> callable(set_world_view)
        True
    """
    world: Any = _c10d._world
    world.pg_group_ranks[group] = {rank: rank for rank in range(size)}
    name, _ = world.pg_map[group]
    world.pg_map[group] = (name, store)


def update_ddp_group(module: Any, group: Any) -> None:
    """Tell a ``DistributedDataParallel`` that ``group`` changed members (torch's own way).

    Its reducer forgets the step in flight (a backward a lost rank broke) and rebuilds its
    buckets at the next forward, on every rank together (``_update_process_group``).

    Example:
        >>> callable(update_ddp_group)
        True
    """
    module._update_process_group(group)


def ddp_comm_hooks(module: Any) -> list[Any]:
    """Return the comm hooks registered on a ``DistributedDataParallel`` (its own record).

    Example:
        >>> ddp_comm_hooks(object())
        []
    """
    return list(getattr(module, "_comm_hooks", []))
