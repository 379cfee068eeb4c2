"""distcompat's own switches in the environment (``DISTCOMPAT_*``), read here and nowhere else.

The launcher's variables are read by ``_env``; this module reads the ones a user sets to change
distcompat itself without editing code, and decides from them with a reason, as ``_placement``
does for the device and the timeout::

    choice = choose_watchdog(None, group_timeout=timedelta(minutes=10))
    print(choice.reason)   # "report-only after 120s: distcompat's default ..."

* ``DISTCOMPAT_WATCHDOG``: ``<seconds>`` or ``off``. Sets the watchdog ``init_distributed`` starts
  when its ``watchdog=`` argument is left out; the watchdog then only reports (it never raises).
* ``DISTCOMPAT_MISMATCH_CHECK``: ``on`` (the default) or ``off``. Whether ranks compare each new
  collective signature before sending it (``distcompat.collectives``' default mismatch check).
* ``DISTCOMPAT_SHM``: ``auto`` (the default), ``on`` or ``off``. Whether CPU collectives of a group
  whose ranks all run on this machine go through shared memory instead of gloo (``auto``: for the
  ops and sizes where it measured faster; ``on``: for every op and size it supports).
* ``DISTCOMPAT_PEER_LINKS``: ``on`` (the default), ``off``, an IPv4 address or an interface
  name. Where a rank of a multi-machine job listens for its peers' links (``peers._links``):
  every interface, none, or that address (the interface's IPv4 address).

* ``DISTCOMPAT_RUN``: ``on`` (the default) or ``off``. Whether ``distcompat run`` puts distcompat's
  init in place of torch's (``off``: the command runs on torch's own). Read by the bootstrap
  (``distcompat.run.bootstrap.sitecustomize``), not here: it runs at every interpreter's
  start-up and so imports nothing of distcompat (this module imports torch's placement);
  tests/test_run.py checks that both spell the variable the same.

Why 120 s by default. A report-only watchdog's false alarm costs a log record and a dump, not the
job, but a report that fires during legitimate work teaches users to ignore it. Measured on the
2-core VM (docs/hangs.md): no collective of a healthy ``distcompat demo`` run waited 0.5 s, but
the first ``torch.compile`` step of the demo's small GPT took 28 s (3 s eager), so a rank that
recompiles alone keeps its peers waiting that long; a rank-0 evaluation or a large checkpoint
takes tens of seconds to minutes on real jobs. 120 s stays above those and still reports 8
minutes before the 10-minute group timeout ends the job. With a shorter group timeout the
default is half of it, so the report always comes first.
"""

from __future__ import annotations

import math
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

from distcompat.launch._placement import backend_map
from distcompat.launch._rules import LaunchEnvError

__all__ = [
    "DEFAULT_WATCHDOG_S",
    "MISMATCH_VARIABLE",
    "PEER_LINKS_VARIABLE",
    "PROTECT_VARIABLE",
    "RUN_VARIABLE",
    "SHM_VARIABLE",
    "WATCHDOG_VARIABLE",
    "MismatchChoice",
    "PeerLinksChoice",
    "ProtectChoice",
    "ShmChoice",
    "WatchdogChoice",
    "choose_mismatch_check",
    "choose_peer_links",
    "choose_protection",
    "choose_shm",
    "choose_watchdog",
]

#: Seconds a collective may wait before the default (report-only) watchdog reports it.
DEFAULT_WATCHDOG_S = 120.0
#: The variable that sets the default watchdog without code changes.
WATCHDOG_VARIABLE = "DISTCOMPAT_WATCHDOG"
#: The variable that turns the default mismatch check off (or on).
MISMATCH_VARIABLE = "DISTCOMPAT_MISMATCH_CHECK"
_OFF = ("off", "0", "false", "no", "none")
#: The variable that turns the shared-memory path for same-host CPU collectives on or off.
SHM_VARIABLE = "DISTCOMPAT_SHM"
_ON = ("on", "1", "true", "yes")


@dataclass(frozen=True, slots=True, kw_only=True)
class WatchdogChoice:
    """The watchdog init starts (``seconds`` None: none) and why.

    ``action`` is ``"raise"`` for an explicit ``watchdog=`` (a hang raises ``HangError``) and
    ``"report"`` for the default (it logs one report and the job goes on).

    Example:
        >>> choose_watchdog(30, group_timeout=None, environ={}).action
        'raise'
    """

    seconds: float | None
    action: Literal["raise", "report"]
    reason: str

    @property
    def headline(self) -> str:
        """The reason without its why: ``"off"``, ``"report-only after 120s"``, ..."""
        return self.reason.split(":", 1)[0]


def _parse(text: str) -> float | None:
    """``DISTCOMPAT_WATCHDOG``'s value as seconds, or None for ``off``."""
    if text.strip().lower() in _OFF:
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise LaunchEnvError(
            f"{WATCHDOG_VARIABLE}={text!r} is neither a positive number of seconds nor 'off'",
            variable=WATCHDOG_VARIABLE,
        )
    return seconds


def choose_watchdog(
    requested: float | Literal[False] | None,
    *,
    group_timeout: timedelta | None,
    environ: Mapping[str, str] | None = None,
) -> WatchdogChoice:
    """Decide which watchdog ``init_distributed`` starts, from its argument and the environment.

    ``requested`` is the ``watchdog=`` argument: seconds (a raising watchdog, as asked),
    ``False`` (none), or ``None`` (the default: ``DISTCOMPAT_WATCHDOG`` if set, else report-only
    after :data:`DEFAULT_WATCHDOG_S`, or half of ``group_timeout`` when that is shorter).
    ``environ`` defaults to ``os.environ``. A malformed variable raises :class:`LaunchEnvError`.

    Example:
        >>> choose_watchdog(None, group_timeout=timedelta(minutes=10), environ={}).seconds
        120.0
        >>> choose_watchdog(None, group_timeout=None, environ={"DISTCOMPAT_WATCHDOG": "off"}).reason
        'off: DISTCOMPAT_WATCHDOG=off'
    """
    if requested is True or (requested is not None and requested is not False and requested <= 0):
        raise ValueError(f"watchdog={requested!r} must be a positive number of seconds or False")
    if requested is False:
        return WatchdogChoice(seconds=None, action="report", reason="off: watchdog=False")
    if requested is not None:
        return WatchdogChoice(
            seconds=float(requested),
            action="raise",
            reason=f"raises HangError after {requested:g}s: watchdog={requested!r} requested",
        )
    env = os.environ if environ is None else environ
    text = env.get(WATCHDOG_VARIABLE)
    if text is not None:
        seconds = _parse(text)
        if seconds is None:
            return WatchdogChoice(
                seconds=None, action="report", reason=f"off: {WATCHDOG_VARIABLE}={text}"
            )
        return WatchdogChoice(
            seconds=seconds,
            action="report",
            reason=f"report-only after {seconds:g}s: {WATCHDOG_VARIABLE}={text}",
        )
    seconds, why = DEFAULT_WATCHDOG_S, "distcompat's default"
    if group_timeout is not None and group_timeout.total_seconds() / 2 < seconds:
        seconds = group_timeout.total_seconds() / 2
        why = f"half the {group_timeout} group timeout, so the report comes before it"
    return WatchdogChoice(
        seconds=seconds,
        action="report",
        reason=(
            f"report-only after {seconds:g}s: {why} (a stuck collective is reported and the job "
            f"goes on; {WATCHDOG_VARIABLE}=<seconds>|off or watchdog=<seconds> to raise)"
        ),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class MismatchChoice:
    """Whether the default mismatch check runs on groups distcompat creates, and why.

    Example:
        >>> choose_mismatch_check(environ={}).on
        True
    """

    on: bool
    reason: str


def choose_mismatch_check(environ: Mapping[str, str] | None = None) -> MismatchChoice:
    """Decide whether ranks compare each new collective signature (``DISTCOMPAT_MISMATCH_CHECK``).

    On unless the variable says ``off`` (or ``0``, ``false``, ``no``); any other value than those
    and ``on`` (``1``, ``true``, ``yes``) raises :class:`LaunchEnvError`. ``environ`` defaults to
    ``os.environ``.

    Example:
        >>> choose_mismatch_check(environ={"DISTCOMPAT_MISMATCH_CHECK": "off"}).reason
        'off: DISTCOMPAT_MISMATCH_CHECK=off'
    """
    env = os.environ if environ is None else environ
    text = env.get(MISMATCH_VARIABLE)
    if text is None or not text.strip():
        return MismatchChoice(
            on=True,
            reason=(
                "on: distcompat's default (ranks compare each new collective signature through "
                f"the rendezvous store; {MISMATCH_VARIABLE}=off turns it off)"
            ),
        )
    value = text.strip().lower()
    if value in _ON:
        return MismatchChoice(on=True, reason=f"on: {MISMATCH_VARIABLE}={text}")
    if value in _OFF:
        return MismatchChoice(on=False, reason=f"off: {MISMATCH_VARIABLE}={text}")
    raise LaunchEnvError(
        f"{MISMATCH_VARIABLE}={text!r}: expected 'on' or 'off' (or 1 / 0)",
        variable=MISMATCH_VARIABLE,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class ShmChoice:
    """Whether same-host CPU collectives may use shared memory, and why.

    ``mode`` is ``"auto"`` (where measured faster than gloo), ``"on"`` (every supported call) or
    ``"off"`` (never).

    Example:
        >>> choose_shm(environ={"DISTCOMPAT_SHM": "off"}).mode
        'off'
    """

    mode: Literal["auto", "on", "off"]
    reason: str


def choose_shm(environ: Mapping[str, str] | None = None) -> ShmChoice:
    """Read ``DISTCOMPAT_SHM`` (``auto`` when unset); a malformed value raises ``LaunchEnvError``.

    ``environ`` defaults to ``os.environ``.

    Example:
        >>> choose_shm(environ={}).reason
        "auto: distcompat's default (shared memory where it measured faster than gloo)"
    """
    env = os.environ if environ is None else environ
    text = env.get(SHM_VARIABLE)
    if text is None or text.strip().lower() in ("", "auto"):
        why = "distcompat's default" if text is None else f"{SHM_VARIABLE}={text}"
        return ShmChoice(
            mode="auto", reason=f"auto: {why} (shared memory where it measured faster than gloo)"
        )
    value = text.strip().lower()
    if value in _OFF:
        return ShmChoice(mode="off", reason=f"off: {SHM_VARIABLE}={text}")
    if value in _ON:
        return ShmChoice(
            mode="on", reason=f"on: {SHM_VARIABLE}={text} (every call the path supports)"
        )
    raise LaunchEnvError(
        f"{SHM_VARIABLE}={text!r} is not one of auto, on, off", variable=SHM_VARIABLE
    )


#: The variable that keeps torch's own process group instead of distcompat's protected one.
PROTECT_VARIABLE = "DISTCOMPAT_PROTECT_GROUP"


@dataclass(frozen=True, slots=True, kw_only=True)
class ProtectChoice:
    """Whether the group distcompat makes is its protected group (every caller checked), and why.

    Example:
        >>> choose_protection("gloo", environ={}).on
        True
    """

    on: bool
    reason: str


def choose_protection(backend: str, environ: Mapping[str, str] | None = None) -> ProtectChoice:
    """Decide whether a new ``backend`` group is distcompat's protected group.

    On for gloo, and for a per-device map of gloo only (``"cpu:gloo"``), unless
    ``DISTCOMPAT_PROTECT_GROUP`` says ``off``: DDP, FSDP2, checkpoints and ``torch.distributed``
    calls then go through distcompat's checks. Other backends (NCCL) keep torch's own group: a
    wrapped NCCL group has not been measured at 0.99x of raw NCCL or better. A map that names
    NCCL (``"cpu:gloo,cuda:nccl"``) is one group holding both backends, so its CPU half stays
    torch's too.

    Example:
        >>> choose_protection("nccl", environ={}).on, choose_protection("cpu:gloo", environ={}).on
        (False, True)
        >>> choose_protection("cpu:gloo,cuda:nccl", environ={}).on
        False
    """
    env = os.environ if environ is None else environ
    text = env.get(PROTECT_VARIABLE, "").strip()
    if text and text.lower() not in _ON + _OFF:
        raise LaunchEnvError(
            f"{PROTECT_VARIABLE}={text!r}: expected 'on' or 'off' (or 1 / 0)",
            variable=PROTECT_VARIABLE,
        )
    asked = backend.strip().lower()
    names = set(backend_map(asked).values()) if ":" in asked else {asked}
    if names != {"gloo"}:
        half = (
            "; one group holds every backend of a device map, so its gloo half is not checked "
            "either"
            if "gloo" in names
            else ""
        )
        return ProtectChoice(
            on=False,
            reason=(
                f"torch's own {backend} group: calls past distcompat's functions (DDP, FSDP2) are "
                "not checked (a wrapped NCCL group has not been measured at >= 0.99x of raw "
                f"NCCL){half}"
            ),
        )
    if text.lower() in _OFF:
        return ProtectChoice(on=False, reason=f"torch's own gloo group: {PROTECT_VARIABLE}={text}")
    return ProtectChoice(
        on=True,
        reason=(
            "protected: every call on the group (DDP's gradient buckets, FSDP2, checkpoints, "
            "torch.distributed.* in any library) goes through distcompat's mismatch check, "
            "watchdog and typed errors, and through shared memory where every rank is on this "
            f"machine ({PROTECT_VARIABLE}=off keeps torch's own group)"
        ),
    )


#: The variable that binds the peer links' listener to one interface, or turns the links off.
PEER_LINKS_VARIABLE = "DISTCOMPAT_PEER_LINKS"
_INTERFACE = re.compile(r"[A-Za-z0-9_.:@-]{1,15}")


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerLinksChoice:
    """Where a rank listens for links from peers on other machines (``on`` False: nowhere).

    ``bind`` is ``"0.0.0.0"`` (every interface), an IPv4 address, or an interface name whose
    IPv4 address the listener takes.

    Example:
        >>> choose_peer_links(environ={"DISTCOMPAT_PEER_LINKS": "eth0"}).bind
        'eth0'
    """

    on: bool
    bind: str
    reason: str


def choose_peer_links(environ: Mapping[str, str] | None = None) -> PeerLinksChoice:
    """Read ``DISTCOMPAT_PEER_LINKS`` (``on``, every interface, when unset).

    A malformed value raises ``LaunchEnvError`` naming it. ``environ`` defaults to ``os.environ``.

    Example:
        >>> choose_peer_links(environ={}).bind
        '0.0.0.0'
        >>> choose_peer_links(environ={"DISTCOMPAT_PEER_LINKS": "off"}).on
        False
    """
    env = os.environ if environ is None else environ
    text = env.get(PEER_LINKS_VARIABLE)
    value = (text or "").strip()
    if value.lower() in ("", *_ON):
        why = "distcompat's default" if text is None else f"{PEER_LINKS_VARIABLE}={text}"
        return PeerLinksChoice(
            on=True,
            bind="0.0.0.0",
            reason=f"every interface: {why} ({PEER_LINKS_VARIABLE}=off: none; an address or "
            "an interface: that one)",
        )
    if value.lower() in _OFF:
        return PeerLinksChoice(on=False, bind="", reason=f"off: {PEER_LINKS_VARIABLE}={text}")
    try:
        socket.inet_pton(socket.AF_INET, value)
    except OSError:
        if not _INTERFACE.fullmatch(value) or value.replace(".", "").isdigit():
            raise LaunchEnvError(
                f"{PEER_LINKS_VARIABLE}={text!r}: expected on, off, an IPv4 address or an "
                "interface name",
                variable=PEER_LINKS_VARIABLE,
            ) from None
        return PeerLinksChoice(
            on=True, bind=value, reason=f"interface {value}: {PEER_LINKS_VARIABLE}={text}"
        )
    return PeerLinksChoice(
        on=True, bind=value, reason=f"address {value}: {PEER_LINKS_VARIABLE}={text}"
    )


#: The variable that turns ``distcompat run`` off for one job (read by its bootstrap, see above).
RUN_VARIABLE = "DISTCOMPAT_RUN"
