"""What ``init_distributed`` writes into its own process's environment, and takes back at destroy.

Two writes, both only where the launcher (or the user) left the variable unset:

* before a multi-node gloo group is made, ``GLOO_SOCKET_IFNAME`` = the interface whose route
  reaches the master (:func:`distcompat.launch.pick_gloo_interface`), since gloo reads it when the
  group is created;
* after any group exists, torchrun's ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
  ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` from what init resolved,
  so a script's own ``int(os.environ["RANK"])`` agrees with the group under ``mpiexec``/``srun``.

The lifecycle calls them in this order and keeps the record::

    writes = bind_gloo_interface(launch, backend)        # before the group
    info = export_torchrun_contract(info, launch, writes)  # after; info.environ_reason says what
    writes.withdraw()                                    # at destroy: our values only

Only ``os.environ`` of this process changes (children started later inherit it); nothing is
written at import time, and a single process with no launcher gets no write.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from dataclasses import dataclass, field, replace

from distcompat._ranks import DistInfo
from distcompat.launch import (
    LaunchEnv,
    TorchrunValues,
    pick_gloo_interface,
    torchrun_exports,
)
from distcompat.launch._pitfalls import PickInterface

__all__ = ["EnvironWrites", "bind_gloo_interface", "export_torchrun_contract"]


@dataclass(slots=True)
class EnvironWrites:
    """The variables init set in ``environ`` (name -> value), and one reason per kind of write."""

    environ: MutableMapping[str, str] = field(default_factory=lambda: os.environ)
    values: dict[str, str] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)

    def set(self, values: dict[str, str], reason: str) -> None:
        """Write ``values`` into the environment and remember them with ``reason``."""
        self.environ.update(values)
        self.values.update(values)
        self.reasons.append(reason)

    def withdraw(self) -> None:
        """Unset each variable init set that still holds init's value (someone else's stays)."""
        for name, value in self.values.items():
            if self.environ.get(name) == value:
                del self.environ[name]
        self.values.clear()
        self.reasons.clear()


def bind_gloo_interface(
    launch: LaunchEnv,
    backend: str | None,
    *,
    environ: MutableMapping[str, str] | None = None,
    pick: PickInterface = pick_gloo_interface,
) -> EnvironWrites:
    """Set ``GLOO_SOCKET_IFNAME`` for a multi-node gloo launch that left it unset, if one fits.

    ``backend`` None means gloo may be used (the run device decides later). When no interface
    fits, nothing is set: the ``gloo-interface`` launch pitfall (logged by init) says why.
    """
    writes = EnvironWrites(os.environ if environ is None else environ)
    if "GLOO_SOCKET_IFNAME" in writes.environ:
        return writes  # the user's setting always wins, also over a LaunchEnv passed in
    chosen = pick(launch, backend)
    if chosen is not None and chosen.name is not None:
        writes.set(
            {"GLOO_SOCKET_IFNAME": chosen.name},
            f"GLOO_SOCKET_IFNAME={chosen.name} for this process, set before the group was made "
            f"(multi-node gloo launch without it; {chosen.reason})",
        )
    return writes


def export_torchrun_contract(info: DistInfo, launch: LaunchEnv, writes: EnvironWrites) -> DistInfo:
    """Set the torchrun variables the environment lacks; return ``info`` saying what was set.

    Nothing happens without a group (a single process keeps an untouched environment).
    """
    if info.has_group:
        master = launch.is_distributed
        missing = torchrun_exports(
            TorchrunValues(
                rank=info.rank,
                local_rank=info.local_rank,
                world_size=info.world_size,
                local_world_size=info.local_world_size,
                node_rank=info.node_rank,
                master_addr=launch.master_addr if master else None,
                master_port=launch.master_port if master else None,
            ),
            writes.environ,
        )
        if missing:
            listed = " ".join(f"{name}={value}" for name, value in missing.items())
            who = f"the {info.launcher} launch" if master else "whoever made the group"
            writes.set(
                missing,
                f"exported {listed} (torchrun's variables, left unset by {who}, so code that "
                "reads RANK / WORLD_SIZE agrees with the group)",
            )
    if not writes.values:
        return info
    return replace(info, exported=tuple(writes.values), environ_reason="; ".join(writes.reasons))
