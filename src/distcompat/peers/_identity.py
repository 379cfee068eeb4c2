"""Which process a rank is, and whether it still runs: identities and liveness from ``/proc``.

Every rank publishes its :class:`Identity` at init (``_registry.publish``)::

    {"host": "node3", "machine": "<boot id>/<pid namespace>", "pid": 4121, "start": 88213,
     "addrs": ["10.0.0.3", ...], "port": 41823}

(``port``: where its peer watch listens for links from other machines, ``_links``; 0 or absent
in an identity written without one.) A peer on this machine (same boot id and pid namespace,
:func:`same_machine`) is dead when its process is gone, a zombie, or a different process under a
recycled pid (:func:`is_alive`); stopped (SIGSTOP, a debugger) when :func:`is_stopped`. Only a
missing ``/proc`` entry is evidence that a process ended: one that cannot be read (this process
is out of file descriptors) proves nothing, and nothing is reported for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import socket
import struct
from dataclasses import dataclass

__all__ = [
    "UNKNOWN",
    "Identity",
    "address_of",
    "is_alive",
    "is_stopped",
    "machine",
    "same_machine",
    "seen_ended",
]

_SIOCGIFADDR = 0x8915


@dataclass(frozen=True, slots=True)
class Identity:
    """What tells one rank's process apart: where it runs and which process it is."""

    host: str
    machine: str  # boot id + pid namespace: equal means a pid here names the same process
    pid: int
    start: int  # process start time in clock ticks since boot (guards against pid reuse)
    addrs: tuple[str, ...]
    port: int = 0  # where its peer watch takes links from other machines (0: it takes none)

    @classmethod
    def here(cls) -> Identity:
        """Return this process's identity (no link listener: ``publish`` adds its port)."""
        pid = os.getpid()
        return cls(socket.gethostname(), _machine(), pid, _stat(pid)[1], _addresses())

    def to_json(self) -> str:
        """Serialize for the store."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Identity:
        """Read an identity written by :meth:`to_json`."""
        data = json.loads(text)
        known = {field.name for field in dataclasses.fields(cls)} - {"addrs"}  # a newer writer's
        return cls(**{k: v for k, v in data.items() if k in known}, addrs=tuple(data["addrs"]))


def _read(path: str) -> str:
    try:
        with open(path) as handle:
            return handle.read().strip()
    except OSError:
        return ""


def _machine() -> str:
    """Return this process's boot id + pid namespace ("" where they cannot be read).

    Kept once read: they never change for a process, and reading them takes two file
    descriptors, which a process out of them (``EMFILE``) does not have.
    """
    global _this_machine
    if _this_machine:
        return _this_machine
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    boot = _read("/proc/sys/kernel/random/boot_id")
    found = f"{boot}/{namespace}" if boot and namespace else ""
    if found:
        _this_machine = found
    return found


_this_machine = ""

#: The state letter of a process whose ``/proc`` entry exists but could not be read (no file
#: descriptor left, ``EMFILE``): not known to be dead, so never reported as ended.
UNKNOWN = "?"


def _stat(pid: int) -> tuple[str, int]:
    """Return (state letter, start time) of ``pid`` from /proc, or ("", 0) if there is none.

    ("?", 0) when it exists but cannot be read (this process is out of file descriptors): only
    a missing entry is evidence that a process ended.
    """
    try:
        with open(f"/proc/{pid}/stat") as handle:
            text = handle.read().strip()
    except (FileNotFoundError, ProcessLookupError):
        return "", 0
    except OSError:
        return UNKNOWN, 0
    fields = text.rpartition(")")[2].split()  # the command name may hold spaces and parens
    if len(fields) < 20:
        return "", 0
    return fields[0], int(fields[19])


def address_of(interface: str) -> str | None:
    """Return the IPv4 address of ``interface`` (Linux), or None when it has none.

    Example:
        >>> address_of("no-such-interface") is None
        True
    """
    request = struct.pack("256s", interface.encode()[:15])
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
    except OSError:
        return None
    return socket.inet_ntoa(answer[20:24])


def _addresses() -> tuple[str, ...]:
    """Return this host's IPv4 addresses, one per interface (Linux; empty elsewhere)."""
    found: list[str] = []
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            with contextlib.suppress(OSError):
                answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
                found.append(socket.inet_ntoa(answer[20:24]))
    return tuple(found)


def same_machine(peer: Identity) -> bool:
    """Return True when ``peer``'s pid names a process here (same boot and pid namespace)."""
    here = _machine()
    return bool(here) and peer.machine == here


def is_alive(peer: Identity) -> bool:
    """Return True while ``peer``'s process (on this machine) runs and has not exited."""
    return not _dead(peer)


def seen_ended(peer: Identity) -> bool:
    """Return True when ``peer``'s process is on this machine and has ended.

    False for a process on another machine: there this machine holds no evidence either way.

    Example:
        >>> seen_ended(Identity.here())
        False
    """
    return same_machine(peer) and not is_alive(peer)


def is_stopped(peer: Identity) -> bool:
    """Return True while ``peer``'s process (on this machine) is stopped (SIGSTOP, a debugger)."""
    return _stat(peer.pid) in (("T", peer.start), ("t", peer.start))


def machine() -> str:
    """Return this process's boot id + pid namespace ("" where they cannot be read).

    Example:
        >>> isinstance(machine(), str)
        True
    """
    return _machine()


def _dead(peer: Identity) -> bool:
    """Return True on evidence that ``peer``'s process ended: gone, a zombie, or another's pid."""
    state, start = _stat(peer.pid)
    if state == UNKNOWN:  # /proc could not be read here: no evidence either way
        return False
    return state in ("", "Z", "X") or start != peer.start
