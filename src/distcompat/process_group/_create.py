"""Making the group: a single process, an adopted group, or a new one from the launcher env.

:func:`distcompat.init_distributed` (``_lifecycle``) calls exactly one of these per init; each
binds the run device and returns the :class:`~distcompat.DistInfo` with its reasons::

    info = create_group(device, backend, timeout, LaunchEnv.from_environ())
"""

from __future__ import annotations

import contextlib
from datetime import timedelta

import torch
import torch.distributed as dist

from distcompat import _torch, peers
from distcompat._ranks import DistInfo, keep_rendezvous
from distcompat.launch import LaunchEnv
from distcompat.launch._host import probe_host
from distcompat.launch._placement import (
    BackendChoice,
    DeviceChoice,
    TimeoutChoice,
    backend_map,
    choose_backend,
    choose_timeout,
    resolve_device,
)
from distcompat.launch._settings import choose_protection
from distcompat.process_group._init_watch import watched
from distcompat.process_group._joining import Joining, ask_to_join, init_prefix, prefix

__all__ = ["DistInitError", "adopt_group", "create_group", "single_process"]


class DistInitError(RuntimeError):
    """The process group cannot be created from what the launcher environment says."""


def _publish_identity(launch: LaunchEnv) -> None:
    """Publish this rank's identity (a lost peer can be named) and watch its peers.

    A peer that ends is then named at once (``distcompat.peers``), on this machine or
    another. Links to other machines listen on a port only where the launcher does not say that
    every rank runs here (its local world is the whole world).
    """
    world = dist.get_world_size()
    one_machine = launch.is_distributed and launch.local_world_size == world
    peers.start(dist.get_rank(), world, links=not one_machine)  # publishes the identity


def _protected_backend(requested: str | None = None) -> str:
    """Register distcompat's protected gloo group with torch; return the backend name to init.

    A per-device map of gloo (``"cpu:gloo"``) keeps its devices, each naming the protected
    group (``"cpu:distcompat"``), so ``get_backend()`` answers the map as on plain torch.
    """
    # Imported by the first group, not with this module: any collectives module brings the whole
    # collectives face (shm, agree, direct), which `import distcompat.process_group` should not
    # pay for (issue 28); a program that makes a group goes on to use it.
    from distcompat.collectives._protected import register

    name = register()
    if requested is None or ":" not in requested:
        return name
    return ",".join(f"{device}:{name}" for device in backend_map(requested.lower()))


def _bind(choice: DeviceChoice) -> None:
    if choice.device.type == "cuda":
        torch.cuda.set_device(choice.device)
    elif choice.device.type == "xpu":
        torch.xpu.set_device(choice.device)


def single_process(
    device: str | torch.device, timeout: float | timedelta | None, launch: LaunchEnv
) -> DistInfo:
    """No launcher env: bind the run device and describe one process with no group."""
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


def _keep_default_store(rank: int) -> None:
    """Keep the rendezvous store of a group torch made, for the watchdog and the mismatch check.

    Their keys go under a fresh ``distcompat/`` prefix (counted per rank, as in
    :func:`create_group`), so they meet no key of the group's owner.
    """
    store = _torch.default_store()
    keep_rendezvous(store, store.add(f"distcompat/init_count/rank{rank}", 1))


def adopt_group(
    device: str | torch.device,
    timeout: float | timedelta | None,
    launch: LaunchEnv,
    made_by: str | None = None,
) -> DistInfo:
    """Describe (never recreate) the default group torch made; bind the run device.

    ``made_by`` says how distcompat had torch make it (``distributed.init_process_group``): the
    group is then distcompat's to destroy. Else someone else made it and keeps it.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    world = dist.group.WORLD
    backend = getattr(world, "protects", None) or str(dist.get_backend())
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
    _keep_default_store(rank)
    _publish_identity(launch)
    if made_by is not None:  # torch made it with the timeout distcompat chose
        waited = choose_timeout(timeout)
        group_timeout, timeout_reason = waited.timeout, waited.reason
    elif timeout is None:
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
        adopted=made_by is None,
        device_reason=f"{chosen.reason} ({where})",
        backend_reason=f"{backend}: {made_by or 'adopted the process group that already existed'}",
        timeout_reason=timeout_reason,
        group_reason=(
            choose_protection(backend).reason
            if hasattr(world, "protects")
            else f"torch's own {backend} group: distcompat's functions are checked on it, calls "
            "past them (DDP, FSDP2, torch.distributed.*) are not; make it with "
            "distcompat.distributed.init_process_group to protect them"
        ),
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


def _import_before_the_group() -> None:
    """Import ``torch.distributed.nn.functional`` while no default group exists (about 3 ms).

    Its functions take ``group=group.WORLD`` as a default argument, evaluated at import. First
    imported after init (``torch.optim`` and ``torch._dynamo`` import it), they hold that group
    for good: ``destroy_process_group`` then leaves it and its gloo threads alive until
    interpreter teardown, where such a thread can abort the process (see
    ``_lifecycle._destroy_group``), and those functions go on using the destroyed group. Imported
    now, their default is None: the default group at call time.
    """
    with contextlib.suppress(ImportError):  # a build without it: nothing can pin the group
        # at init, not with distcompat: importing it costs what a first init may spend
        import torch.distributed.nn.functional  # noqa: F401


def _can_join(protected: bool, picked: BackendChoice) -> bool:
    """Whether this group could join a running one in place: distcompat's gloo group only."""
    return protected and picked.backend == "gloo"


def _join_alone(
    store: dist.Store,
    joining: Joining,
    launch: LaunchEnv,
    chosen: DeviceChoice,
    picked: BackendChoice,
    waited: TimeoutChoice,
    group_reason: str,
) -> DistInfo:
    """Be a group of one until ``InPlace`` admits this process to the running group.

    Its keys are its own (under the running group's, per newcomer id); its peer watch is empty.
    """
    keep_rendezvous(store, f"{joining.group.base}.newcomer{joining.id}")
    _import_before_the_group()
    dist.init_process_group(
        backend=_protected_backend(picked.backend),
        store=dist.PrefixStore(f"{prefix(joining.group.base)}/newcomer{joining.id}", store),
        rank=0,
        world_size=1,
        timeout=waited.timeout,
    )
    peers.start(0, 1, links=joining.group.links)
    reason = (
        f"{group_reason}; joining the group that runs in place (launch rank {launch.rank}, "
        f"newcomer {joining.id}): one rank of its own until InPlace admits it at a step boundary"
    )
    return _made(launch, chosen, picked, waited, rank=0, world_size=1, group_reason=reason)


def _made(
    launch: LaunchEnv,
    chosen: DeviceChoice,
    picked: BackendChoice,
    waited: TimeoutChoice,
    *,
    rank: int,
    world_size: int,
    group_reason: str,
) -> DistInfo:
    """Describe a group this init made: rank ``rank`` of ``world_size``, with every reason."""
    return DistInfo(
        rank=rank,
        local_rank=launch.local_rank,
        world_size=world_size,
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
        group_reason=group_reason,
    )


def create_group(
    device: str | torch.device,
    backend: str | None,
    timeout: float | timedelta | None,
    launch: LaunchEnv,
    watch_s: float | None = None,
) -> DistInfo:
    """Rendezvous through a fresh store prefix and create the default group for ``launch``.

    ``watch_s``: the watchdog's threshold; past it, the phase init waits in is reported, and
    the ranks that have not arrived (``_init_watch``). None: not watched.
    """
    host = probe_host()
    chosen: DeviceChoice = resolve_device(
        device, local_rank=launch.local_rank, env=launch, host=host
    )
    picked: BackendChoice = choose_backend(chosen.device, backend, host=host)
    waited: TimeoutChoice = choose_timeout(timeout)
    _bind(chosen)
    owner = "the launcher's agent" if launch.agent_store else "rank 0"
    where = f"{launch.master_addr}:{launch.master_port} (hosted by {owner})"
    protection = choose_protection(picked.backend)
    with watched(watch_s, launch.rank, launch.world_size, where) as watch:
        store = _make_store(launch, waited.timeout)
        joining = ask_to_join(store, launch.rank) if _can_join(protection.on, picked) else None
        if joining is not None:
            return _join_alone(store, joining, launch, chosen, picked, waited, protection.reason)
        # Each rank counts its own inits in the store; ranks init together, so the counts agree
        # and every generation rendezvouses under keys no earlier group has written.
        generation = store.add(f"distcompat/init_count/rank{launch.rank}", 1)
        watch.arrived(store, f"distcompat/arrived/generation{generation}")
        keep_rendezvous(store, generation)
        _import_before_the_group()
        dist.init_process_group(
            backend=_protected_backend(picked.backend) if protection.on else picked.backend,
            store=dist.PrefixStore(init_prefix(str(generation)), store),
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=waited.timeout,
            device_id=chosen.device if "nccl" in picked.backend else None,  # eager NCCL init
        )
    _publish_identity(launch)  # so a lost peer can be named in groups larger than two
    return _made(
        launch, chosen, picked, waited, rank=launch.rank, world_size=launch.world_size,
        group_reason=protection.reason,
    )  # fmt: skip
