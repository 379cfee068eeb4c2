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

* Every group made or adopted is watched: by default a report-only watchdog (one report naming
  the late rank, the job goes on; ``DISTCOMPAT_WATCHDOG=<seconds>|off``), or a raising one with
  ``watchdog=<seconds>``. A collective that failed (hang declared, group timeout, lost peer) ends
  the process within seconds once its error goes unhandled (``diagnostics._exit``).
* Rank 0 logs which group it made, once, at INFO on the ``distcompat.process_group`` logger.
* A group distcompat made is destroyed at exit (``atexit``) if the script did not destroy it,
  while the interpreter still runs every thread: gloo's threads then finish distcompat's future
  callbacks and are joined, instead of meeting a half torn-down interpreter (measured: 5 of 10
  two-rank scripts that returned after waiting on async all_reduce futures ended in SIGABRT,
  "terminate called without an active exception"; 0 of 10 with the teardown).

This is the layer that wires the others together (docs/architecture.md): it asks ``launch`` for
the placement and the watchdog setting, publishes this rank's identity for ``collectives`` to
name lost peers, logs launch pitfalls and starts the watchdog from ``diagnostics``. The group
itself is made in ``_create``; the rank queries read the record kept in ``distcompat._ranks``.
``diagnostics`` and ``collectives`` are imported by the first init, not with this module, so that
reaching ``distcompat.init_distributed`` costs about what ``import torch`` costs.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import time
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist

from distcompat._ranks import DistInfo, group_active, record
from distcompat.launch import LaunchEnv
from distcompat.launch._flight_recorder import plan_flight_recorder
from distcompat.launch._placement import choose_timeout
from distcompat.launch._settings import WatchdogChoice, choose_mismatch_check, choose_watchdog
from distcompat.process_group._create import adopt_group, create_group, single_process
from distcompat.process_group._environ import (
    EnvironWrites,
    bind_gloo_interface,
    export_torchrun_contract,
)
from distcompat.process_group._joining import forget as forget_joining

if TYPE_CHECKING:  # the diagnostics are imported by init_distributed (see there)
    from distcompat.diagnostics import Watchdog

__all__ = ["destroy_distributed", "distributed_session", "init_distributed"]


WatchdogArg = float | Literal[False] | None


@dataclass(frozen=True, slots=True)
class _Request:
    device: str
    backend: str | None
    timeout: timedelta | None
    watchdog: WatchdogArg = None

    def __str__(self) -> str:
        text = f"device={self.device!r}, backend={self.backend!r}, timeout={self.timeout}"
        return text + (f", watchdog={self.watchdog}" if self.watchdog is not None else "")


@dataclass(slots=True)
class _Lifecycle:
    info: DistInfo
    request: _Request
    watchdog: Watchdog | None = None  # the watchdog init started, if any
    environ: EnvironWrites | None = None  # the variables init set, withdrawn at destroy


# What init_distributed set up, with the arguments it was called with (for idempotence).
_current: _Lifecycle | None = None
# Whether _destroy_at_exit is registered with atexit (once per process).
_exit_registered = False


def _destroy_at_exit() -> None:
    """Undo init before the interpreter tears down.

    A group init made and the script left is destroyed; of an adopted group, distcompat's record
    and the store connections it made are dropped (the group stays its owner's).
    """
    if _current is not None and _current.info.has_group:
        destroy_distributed()


def _normalize(
    device: str | torch.device,
    backend: str | None,
    timeout: float | timedelta | None,
    watchdog: WatchdogArg = None,
) -> _Request:
    seconds = timedelta(seconds=timeout) if isinstance(timeout, (int, float)) else timeout
    return _Request(str(device), backend, seconds, watchdog)


def init_distributed(
    device: str | torch.device = "auto",
    backend: str | None = None,
    timeout: float | timedelta | None = None,
    *,
    env: LaunchEnv | None = None,
    watchdog: WatchdogArg = None,
) -> DistInfo:
    """Create (or adopt) the default process group for this launch and bind the run device.

    Args:
        device: ``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"xpu"`` or ``"mps"``.
            A type without an index is bound to ``LOCAL_RANK``.
        backend: ``None`` to follow the run device, a name (``"gloo"``), or a per-device map
            (``"cpu:gloo,cuda:nccl"``).
        timeout: seconds or a timedelta; ``None`` means 10 minutes (torch's gloo default is 30).
        env: the launcher environment; ``None`` reads it with :meth:`LaunchEnv.from_environ`.
        watchdog: ``None`` (the default): a report-only watchdog for the life of the group,
            after ``DISTCOMPAT_WATCHDOG`` seconds if set (``off`` for none), else 120 s (half
            the group timeout if that is shorter): a collective waiting longer is reported,
            naming the late rank, and the job goes on. Seconds: a :func:`distcompat.watchdog`
            that raises ``HangError`` after that long. ``False``: no watchdog.

    Launch pitfalls (a script option torchrun takes as its own, multi-node gloo without
    ``GLOO_SOCKET_IFNAME``) are logged once, on each node's local rank 0. With a group, the
    torchrun variables the launcher left unset (``RANK``, ``WORLD_SIZE``, ...) are set from what
    init resolved, and a multi-node gloo launch without ``GLOO_SOCKET_IFNAME`` gets the interface
    that reaches the master; ``DistInfo.environ_reason`` lists both, and destroy unsets them.
    Rank 0 logs the group it made at INFO (``distcompat.process_group``). ``info.reason`` says
    what was chosen and why, the watchdog included.

    Example:
        >>> info = init_distributed(device="cpu")
        >>> info.device
        device(type='cpu')
        >>> init_distributed(device="cpu") is info   # idempotent
        True
        >>> destroy_distributed()
    """
    return _initialize(_normalize(device, backend, timeout, watchdog), env, made_by=None)


def _initialize(request: _Request, env: LaunchEnv | None, made_by: str | None) -> DistInfo:
    """Init for ``request``; ``made_by``: how distcompat had torch make the group that exists."""
    global _current, _exit_registered
    device, backend, timeout, watchdog = (
        request.device,
        request.backend,
        request.timeout,
        request.watchdog,
    )
    if _current is not None:
        if _current.info.has_group and not dist.is_initialized():
            _current = None  # someone destroyed our group behind our back: start again
            record(None)
        else:
            if request != _current.request:
                warnings.warn(
                    f"init_distributed() already ran with ({_current.request}); ignoring the new "
                    f"arguments ({request}) and returning the existing DistInfo",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return _current.info
    # Imported by the first init, not with this module: the diagnostics import the collectives
    # face they watch (shm, agree, direct), and `import distcompat.process_group` (what
    # `distcompat.init_distributed` imports) stays within 1.05x of `import torch` (issue 28).
    # Everything they install (exit guard, watchdog hooks, teardown) is installed below.
    from distcompat.diagnostics import log_launch_pitfalls
    from distcompat.diagnostics._config import default_dump_dir
    from distcompat.diagnostics._exit import forget_failures
    from distcompat.diagnostics._exit import install as install_exit_guard
    from distcompat.rank_logging import get_logger

    launch = env if env is not None else LaunchEnv.from_environ()
    choose_watchdog(watchdog, group_timeout=None)  # a bad DISTCOMPAT_WATCHDOG fails before init
    if not group_active():
        forget_failures()  # the group that held a failed op is gone
    writes = EnvironWrites()
    if group_active():
        info = adopt_group(device, timeout, launch, made_by)
    elif not launch.is_distributed:
        info = single_process(device, timeout, launch)
    else:
        log_launch_pitfalls(launch, backend=backend)
        writes = bind_gloo_interface(launch, backend)  # GLOO_SOCKET_IFNAME, before the group
        try:
            # torch's Flight Recorder on NCCL (dumps on timeout), set before the group is made
            flight = plan_flight_recorder(device, backend, launch, dump_dir=default_dump_dir())
            flight.make_folder()
            if flight.reason:
                writes.set(flight.values, flight.reason)
            early = choose_watchdog(watchdog, group_timeout=choose_timeout(timeout).timeout)
            info = create_group(device, backend, timeout, launch, watch_s=early.seconds)
        except BaseException:
            writes.withdraw()
            raise
    # torchrun's RANK, WORLD_SIZE, ... where the launcher left them unset (none without a group)
    info = export_torchrun_contract(info, launch, writes)
    if writes.reasons and not info.environ_reason:  # only "kept the user's TORCH_FR_..." to say
        info = replace(info, environ_reason="; ".join(writes.reasons))
    record(info)
    started, info = _watch(info, choose_watchdog(watchdog, group_timeout=info.timeout))
    info = replace(info, mismatch_reason=_mismatch_reason(info))
    record(info)
    if info.has_group:
        install_exit_guard()
        if not _exit_registered:
            atexit.register(_destroy_at_exit)
            _exit_registered = True
    _current = _Lifecycle(info=info, request=request, watchdog=started, environ=writes)
    get_logger("distcompat.process_group", prefix=False).info(
        "distcompat: %s; watchdog %s", info.summary, info.watchdog_reason.split(":")[0]
    )
    return info


def _watch(info: DistInfo, choice: WatchdogChoice) -> tuple[Watchdog | None, DistInfo]:
    """Start the chosen watchdog over the group; return it and ``info`` with the reason."""
    if not info.has_group:
        return None, replace(info, watchdog_reason="none: one process, no collective to watch")
    if choice.seconds is None:
        return None, replace(info, watchdog_reason=choice.reason)
    # init_distributed imported the diagnostics already (it says why they are late)
    from distcompat.diagnostics import watchdog as make_watchdog
    from distcompat.diagnostics._on_demand import install as install_dump_signal

    started = make_watchdog(choice.seconds, action=choice.action).start()
    install_dump_signal()  # kill -USR2 to any rank: every rank dumps where it is
    covers = started.why()
    return started, replace(info, watchdog_reason=f"{choice.reason}; covers {covers}")


def _mismatch_reason(info: DistInfo) -> str:
    """Say whether the default mismatch check covers this group, and why."""
    if not info.has_group:
        return "none: one process, no collective to compare"
    return choose_mismatch_check().reason


def note_regroup(rank: int, world_size: int) -> DistInfo:
    """Record that the group init made goes on in place with new members (``inplace``).

    The same group object, now rank ``rank`` of ``world_size``: what :func:`init_distributed`
    returns again, and what the rank queries answer, say so. Returns the new record.
    """
    if _current is None or not _current.info.has_group:
        raise RuntimeError("no process group made by init_distributed to regroup")
    _current.info = replace(_current.info, rank=rank, world_size=world_size)
    record(_current.info)
    return _current.info


def destroy_distributed() -> None:
    """Destroy the group :func:`init_distributed` created; safe to call twice or before init.

    An adopted group belongs to whoever made it (Ray Train, user code) and is left running;
    only distcompat's record of it is dropped. After a collective failed (a declared hang, a
    group timeout, a lost peer; also while such an error propagates, as in a ``finally:``), the
    group still holds the failed op and destroying it would wait for that op until the group
    timeout: the group is then left to the process exit, which distcompat ends within seconds.

    Example:
        >>> destroy_distributed()   # nothing to do: a no-op
    """
    global _current
    state, _current = _current, None
    record(None)
    forget_joining()
    if state is not None and state.watchdog is not None:
        state.watchdog.stop()
    if state is not None and state.environ is not None:
        state.environ.withdraw()  # the variables init set, where they still hold its values
    if state is None or not state.info.has_group:
        return
    # imported by init already (it says why they are late)
    from distcompat._store import shut_down
    from distcompat.collectives.shm._path import close_all
    from distcompat.peers import leave_farewell
    from distcompat.peers import stop as stop_watching

    stop_watching()
    if state.info.adopted:
        # The group is its owner's; the threads distcompat started beside it are not (the
        # store requests' thread: a thread left to the process exit can abort it, issue 28).
        shut_down()
        return
    # init_distributed imported the diagnostics already (it says why they are late)
    from distcompat.diagnostics._exit import failure_seen

    failed = failure_seen()
    if failed is not None:
        logging.getLogger("distcompat.process_group").warning(
            "distcompat: not destroying the process group: a collective failed (%s) and its op "
            "is still pending in the backend, so destroying would wait for it; the process "
            "exit ends it",
            failed,
        )
        return
    if dist.is_initialized():
        leave_farewell(None)  # its peers' watches see it leave on purpose, not a loss
        _destroy_group()
    close_all()  # the engines of groups torch keeps alive after destroy (threads, segments)
    shut_down()


#: How long destroy releases the GIL when torch keeps a destroyed group alive (seconds).
SETTLE_S = 0.05


def _destroy_group() -> None:
    """Destroy every group; if something still holds the default one, let its threads settle.

    Destroying normally frees the group, and its backend joins its worker threads. A group that
    something else still holds (a script's own reference; ``torch.distributed.nn.functional``,
    which binds ``group.WORLD`` into its defaults when first imported after init, as
    ``torch.optim`` does: ``_create`` imports it before the group exists) lives with its gloo
    threads until interpreter teardown. Such a thread, dropping the last op's Work, needs the
    GIL when the op's tensors died first on the Python side (every internal all-gather's tensors
    do); if the interpreter starts finalizing meanwhile, the thread is ended by ``pthread_exit``
    through C++ and the process aborts ("terminate called without an active exception": 1-5 of
    10 two-rank training runs under mpirun whose last step saved a checkpoint). Releasing the GIL
    for :data:`SETTLE_S` lets such a thread finish first.
    """
    world = dist.group.WORLD
    survivor = weakref.ref(world) if world is not None else None
    del world
    dist.destroy_process_group()
    if survivor is not None and survivor() is not None:
        time.sleep(SETTLE_S)


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
    already = _current is not None or group_active()
    info = init_distributed(device, backend, timeout, env=env)
    try:
        yield info
    finally:
        if not already:
            destroy_distributed()
