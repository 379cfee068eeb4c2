"""Naming the peer behind a lost connection (``peers._lost``, ``_identity``, ``_registry``).

The end-to-end cases (a SIGKILLed or SIGSTOPped rank in groups of 2 and 3) are in
test_collectives_work.py. These tests check the pieces: process identity, liveness from /proc,
and the address match used for peers on other machines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

import distcompat.distributed as dist
from distcompat.peers import Identity, lost_peers
from distcompat.peers._identity import _dead, _read, _stat
from distcompat.testing import run_on_ranks

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_identity_round_trips_through_json() -> None:
    me = Identity.here()
    assert me.pid == os.getpid()
    assert me.start > 0
    assert Identity.from_json(me.to_json()) == me
    assert not _dead(me)


def test_an_identity_without_a_port_or_with_unknown_fields_is_read() -> None:
    me = Identity.here()
    assert me.port == 0  # publish adds the peer watch's port
    written = json.loads(me.to_json())
    del written["port"]  # as distcompat wrote it before links
    assert Identity.from_json(json.dumps(written)) == me
    assert Identity.from_json(json.dumps({**written, "port": 7, "later": 1})).port == 7


def test_a_recycled_pid_is_not_the_same_process() -> None:
    me = Identity.here()
    impostor = Identity(me.host, me.machine, me.pid, me.start + 1, me.addrs)
    assert _dead(impostor)


def test_zombie_and_reaped_processes_are_dead() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while _stat(child.pid)[0] != "Z" and time.monotonic() < deadline:
        time.sleep(0.01)  # exited but not yet waited for: a zombie
    state, start = _stat(child.pid)
    assert state == "Z"
    identity = Identity("h", Identity.here().machine, child.pid, start, ())
    assert _dead(identity)
    child.wait()
    assert _stat(child.pid) == ("", 0)
    assert _dead(identity)


def test_stat_reads_a_command_name_with_spaces_and_parens() -> None:
    code = "open('/proc/self/comm', 'w').write('x) (y z'); import time; time.sleep(30)"
    odd = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 10
        while _read(f"/proc/{odd.pid}/comm") != "x) (y z" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _read(f"/proc/{odd.pid}/comm") == "x) (y z"
        state, start = _stat(odd.pid)
        assert state in ("S", "R")
        assert start > 0
    finally:
        odd.kill()
        odd.wait()


def _name_from_address(message: str, shared: bool) -> list[int]:
    """Pretend every other rank runs on its own machine with address 10.9.0.<rank>.

    A stand-in for hardware we do not have (several hosts): the published identities are
    rewritten in the real group's store, then ``lost_peers`` reads them back.
    """
    from distcompat.peers._lost import _known
    from distcompat.peers._registry import _KEY, _store, publish

    rank, world = dist.get_rank(), dist.get_world_size()
    store = _store()
    dist.barrier()  # every rank has published its own identity (at init) before it is rewritten
    if rank == 0:
        for other in range(1, world):
            last = 1 if shared else other  # shared: every other rank behind one address
            fake = Identity(f"node{other}", f"elsewhere{other}", 1, 1, (f"10.9.0.{last}",))
            store.set(_KEY.format(other), fake.to_json())
    dist.barrier()
    _known.clear()  # identities are read once per group: forget the true ones read before
    named = list(lost_peers(None, message)) if rank == 0 else []
    dist.barrier()
    publish()  # put the true identities back for later tests on these ranks
    dist.barrier()
    _known.clear()
    return named


@pytest.mark.parametrize(
    ("message", "shared", "expected"),
    [
        ("Read error [10.9.0.2]:4242: Connection reset by peer", False, [2]),
        ("pair.cc:553 Connection closed by peer [10.9.0.1]:40138", False, [1]),
        ("Read error [10.9.0.1]:4242: Connection reset by peer", True, []),  # two ranks there
        ("Read error [10.9.0.7]:4242: Connection reset by peer", False, []),  # nobody's address
        ("Read error [127.0.0.1]:4242: Connection reset by peer", False, []),  # loopback
        ("Connection reset by peer", False, []),  # no address at all
    ],
)
def test_a_remote_peer_is_named_only_by_an_unambiguous_address(
    message: str, shared: bool, expected: list[int]
) -> None:
    assert run_on_ranks(_name_from_address, 3, args=(message, shared))[0] == expected


def test_a_process_out_of_file_descriptors_reads_no_peer_as_dead() -> None:
    """EMFILE on /proc is no evidence that a process ended (it read as "gone" before)."""
    from _no_fds import no_fds
    from distcompat.peers import UNKNOWN

    me = Identity.here()
    with no_fds():
        state = _stat(me.pid)
        dead = _dead(me)
    assert state == (UNKNOWN, 0)
    assert not dead
    assert _stat(me.pid)[0] in "RS"  # read again once descriptors are free
