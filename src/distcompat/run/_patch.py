"""What ``distcompat run`` puts in place of torch's init functions, and which calls it takes.

The bootstrap (``bootstrap/sitecustomize.py``) calls this once torch has executed
``torch.distributed.distributed_c10d``, before anything imports its names::

    patch_module(sys.modules["torch.distributed.distributed_c10d"])

Three functions of that module are replaced; every holder of them gets the replacement
(``torch.distributed``'s star import, ``device_mesh``'s ``from ... import init_process_group``,
FSDP's ``dist.distributed_c10d.init_process_group()``, a framework's ``dist.*`` lookup):

* ``init_process_group``: gloo and nccl requests (``None``, ``"gloo"``, ``"nccl"``, a device map
  of those) go to :func:`distcompat.distributed.init_process_group`, the drop-in: gloo gets
  distcompat's protected group, nccl what the drop-in gives CUDA (torch's group, watched).
  Every other backend (``"mpi"``, ``"ccl"``, ``"fake"``, a registered one), a call with
  ``_ranks=``, and one that gives a parameter the drop-in does not know (a newer torch's) go to
  torch untouched (:func:`route_init` says why); a parameter left at torch's default is
  dropped, so torch's next new parameter never breaks a program.
* ``destroy_process_group``: of the default group, through the drop-in (it stops the watchdog
  and tells the peers this rank leaves on purpose); of any other group, torch's.
* ``monitored_barrier``: the drop-in's, which also runs on the protected group (torch's refuses
  every backend not named gloo).

Calls from distcompat's own modules reach torch's functions: the drop-in's, and
``init_distributed``'s when it makes a group torch's way (``DISTCOMPAT_PROTECT_GROUP=off``, NCCL),
which must not start a second init inside the first. While the drop-in runs, every call reaches
torch's (a thread-local flag, for torch's own code it calls): no recursion. The replacements
keep torch's signature (``inspect.signature`` follows ``__wrapped__``), and a call torch would
reject with ``TypeError`` is handed to torch as it is.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

__all__ = ["DROP_IN_TAKES", "MARK", "Route", "patch_module", "route_init"]

#: The attribute a replacement carries (patching twice changes nothing).
MARK = "__distcompat_run__"
#: Backends whose requests the drop-in takes (the parts of a ``"cpu:gloo,cuda:nccl"`` map too).
_TAKEN = ("gloo", "nccl")
#: The parameters of distcompat's drop-in ``init_process_group`` (tests/test_run.py checks them
#: against it): named here so routing a call does not import distcompat's process group.
DROP_IN_TAKES = frozenset({
    "backend", "init_method", "timeout", "world_size", "rank", "store", "group_name",
    "pg_options", "device_id", "_ranks", "enable_reconfigure",
})  # fmt: skip

_state = threading.local()

Handler = Callable[[Callable[..., Any], inspect.BoundArguments], Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class Route:
    """Whether a call goes to distcompat's drop-in (``takes``) or to torch, and why."""

    takes: bool
    reason: str


def route_init(arguments: Mapping[str, Any], defaults: Mapping[str, Any] | None = None) -> Route:
    """Decide where an ``init_process_group`` call with these (bound) arguments goes.

    ``defaults``: torch's defaults; an argument the drop-in does not take goes to torch's init
    unless it equals its default (then it is dropped).

    Example:
        >>> route_init({"backend": "gloo"}).takes, route_init({"backend": "mpi"}).takes
        (True, False)
        >>> route_init({"backend": "cpu:gloo,cuda:nccl"}).takes
        True
        >>> route_init({"backend": "gloo", "new_knob": 3}, {"new_knob": 0}).reason
        "new_knob=3, which distcompat's drop-in does not take: torch's init"
    """
    known = defaults or {}
    unknown = sorted(
        name
        for name, value in arguments.items()
        if name not in DROP_IN_TAKES and not (name in known and _same(value, known[name]))
    )
    if unknown:
        given = ", ".join(f"{name}={arguments[name]!r}" for name in unknown)
        return Route(
            takes=False, reason=f"{given}, which distcompat's drop-in does not take: torch's init"
        )
    backend = arguments.get("backend")
    if arguments.get("_ranks"):
        return Route(takes=False, reason="_ranks= given (a group of some ranks only): torch's init")
    if backend is None or str(backend).lower() == "undefined":
        return Route(takes=True, reason="no backend: the drop-in picks gloo on CPU, nccl on CUDA")
    parts = {part.rpartition(":")[2].strip().lower() for part in str(backend).split(",")}
    other = sorted(parts - set(_TAKEN))
    if other:
        return Route(
            takes=False,
            reason=f"backend {str(backend)!r}: {', '.join(other)} is left to torch's own init",
        )
    return Route(takes=True, reason=f"backend {str(backend)!r}: distcompat's drop-in init")


def _same(value: Any, default: Any) -> bool:
    """Whether ``value`` is the parameter's default (by identity, or equal of the same type)."""
    return value is default or (type(value) is type(default) and bool(value == default))


@contextmanager
def _own_calls() -> Iterator[None]:
    """While distcompat's drop-in runs, the patched names mean torch's own functions."""
    _state.own = True
    try:
        yield
    finally:
        _state.own = False


def _init(original: Callable[..., Any], bound: inspect.BoundArguments) -> None:
    defaults = {name: parameter.default for name, parameter in bound.signature.parameters.items()}
    if not route_init(bound.arguments, defaults).takes:
        original(*bound.args, **bound.kwargs)
        return
    # Imported at the first init, not when torch.distributed is: the drop-in brings distcompat's
    # process group, which a process that never makes a group should not pay for
    from distcompat.process_group import init_process_group

    arguments = {k: v for k, v in bound.arguments.items() if k in DROP_IN_TAKES}
    existed = sys.modules["torch.distributed"].is_initialized()
    with _own_calls():
        init_process_group(**arguments)
    if not existed:  # a second call returns quietly, as the drop-in's does
        _announce()


def _destroy(original: Callable[..., Any], bound: inspect.BoundArguments) -> None:
    group = bound.arguments.get("group")
    world = getattr(sys.modules.get("torch.distributed"), "group", None)
    if group is not None and group is getattr(world, "WORLD", None):
        group = None
    if group is not None:
        original(*bound.args, **bound.kwargs)
        return
    # Imported at destroy, as at init (see _init): the drop-in's destroy
    from distcompat.process_group import destroy_process_group

    with _own_calls():
        destroy_process_group()


def _monitored_barrier(original: Callable[..., Any], bound: inspect.BoundArguments) -> None:
    del original  # the drop-in's runs torch's on any group but the protected one
    # Imported at the call, as at init (see _init): the drop-in's barrier
    from distcompat.process_group import monitored_barrier

    with _own_calls():
        monitored_barrier(**bound.arguments)


_HANDLERS: dict[str, Handler] = {
    "init_process_group": _init,
    "destroy_process_group": _destroy,
    "monitored_barrier": _monitored_barrier,
}


def _announce() -> None:
    """Say on rank 0, once per group, what ``distcompat run`` protects and how to turn it off.

    One line on stderr, written directly: the program's stdout and its logging stay its own.
    """
    # Imported after init made the group: the record it keeps, and the switch's name
    from distcompat._ranks import recorded
    from distcompat.launch._settings import RUN_VARIABLE

    info = recorded()
    if info is None or info.rank != 0 or not info.has_group:
        return
    world = getattr(sys.modules["torch.distributed"].group, "WORLD", None)
    if hasattr(world, "protects"):
        what = (
            "distcompat's protected group: every call on it (DDP, FSDP2, DCP, "
            "torch.distributed.* in any library) is checked for mismatched calls, watched, and "
            "names a lost peer"
        )
    else:
        what = info.group_reason or "torch's own group, watched"
    watchdog = info.watchdog_reason.split(":")[0]
    sys.stderr.write(
        f"distcompat run: torch's init_process_group made {info.summary} as {what}; watchdog "
        f"{watchdog}. {RUN_VARIABLE}=off runs this job on torch's own init\n"
    )
    sys.stderr.flush()


def _wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    handler = _HANDLERS[name]
    signature = inspect.signature(original)

    @functools.wraps(original)
    def replacement(*args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if getattr(_state, "own", False) or caller.startswith("distcompat."):
            return original(*args, **kwargs)
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:  # a call torch rejects: torch's own error
            return original(*args, **kwargs)
        bound.apply_defaults()
        return handler(original, bound)

    setattr(replacement, MARK, True)
    return replacement


def patch_module(module: ModuleType) -> list[str]:
    """Replace ``module``'s init functions (torch's ``distributed_c10d``); return those replaced.

    Idempotent. Modules already holding torch's function under the same name (a late patch,
    after ``torch.distributed`` imported them) get the replacement too.

    Example:
        >>> import types
        >>> def monitored_barrier(group=None, timeout=None, wait_all_ranks=False): ...
        >>> fake = types.ModuleType("fake_c10d")
        >>> fake.monitored_barrier = monitored_barrier
        >>> patch_module(fake), patch_module(fake)
        (['monitored_barrier'], [])
    """
    replaced = []
    for name in _HANDLERS:
        original = getattr(module, name, None)
        if original is None or getattr(original, MARK, False):
            continue
        replacement = _wrap(name, original)
        for holder in list(sys.modules.values()):
            if getattr(holder, "__dict__", {}).get(name) is original:
                setattr(holder, name, replacement)
        setattr(module, name, replacement)
        replaced.append(name)
    return replaced
