"""A peer on another machine that ends is named within a second (``peers._links``).

Two "machines" on this one (``_two_hosts``): each rank in its own network namespace and its
own pid namespace, so its identity's machine (boot id + pid namespace) differs from the other's
and no pidfd can watch it: only the TCP link can. What is simulated: the shared kernel and boot
id (the pid namespace stands for "another boot"). Real processes, every default on, torchrun's
environment contract (rank 0 hosts the store on its node, as under ``torchrun --nnodes=2``).
Needs root and ``ip`` / ``unshare``; skipped without them. The pure parts (:func:`linked`, the
line protocol) are tested without processes at the end, two ``Links`` in this process.
"""

from __future__ import annotations

import os
import re
import select
import signal
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from _two_hosts import Ran, needs_namespaces, run_pair, two_nodes
from distcompat.peers import LEFT, Identity, job_secret, read_clock
from distcompat.peers._links import (
    Ended,
    Links,
    all_linked,
    linked,
    unproven_cap,
)
from distcompat.testing import run_on_ranks

SCRIPT = Path(__file__).with_name("_peer_watch_script.py")
SEEN = re.compile(
    r"distcompat: rank 1 \(pid \d+ on \S+\) (ended|exited after .*) \(seen at ([\d:.]+ UTC)\)"
)


Job = tuple[list[Ran], Path]  # each rank's outcome, and the job's directory


@pytest.fixture(scope="module")
def two_hosts(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Job]]:
    """The ``loop`` (rank 1 SIGKILLed), ``leave`` (rank 1 destroys) and ``raise`` jobs, at once."""
    needs_namespaces()
    with two_nodes() as nodes, ThreadPoolExecutor(3) as pool:
        # the namespaces are this test's own: nothing else listens on these ports there
        jobs = {
            scenario: (pool.submit(run_pair, nodes, SCRIPT, (scenario, str(path)), port), path)
            for scenario, port in (("loop", 29511), ("leave", 29512), ("raise", 29513))
            for path in (tmp_path_factory.mktemp(scenario),)
        }
        yield {scenario: (job.result(), directory) for scenario, (job, directory) in jobs.items()}


@pytest.mark.slow
def test_a_peer_killed_on_another_machine_is_named_within_a_second(
    two_hosts: dict[str, Job],
) -> None:
    ranks, directory = two_hosts["loop"]
    assert ranks[1].returncode == -9 or ranks[1].returncode == 137, ranks[1].stderr[-3000:]
    assert ranks[0].returncode == 3, ranks[0].stderr[-3000:]
    match = SEEN.search(ranks[0].stderr)
    assert match, ranks[0].stderr[-3000:]
    assert match.group(1) == "ended"  # a SIGKILLed rank leaves no farewell
    killed = float((directory / "killed").read_text())
    after = read_clock(match.group(2), near=killed) - killed
    assert 0 <= after < 1.0, f"rank 0 named rank 1 {after:.3f} s after its kill"
    assert "rank 0: raised PeerLostError" in ranks[0].stdout, ranks[0].stdout


@pytest.mark.slow
def test_a_peer_on_another_machine_that_destroys_its_group_is_not_reported(
    two_hosts: dict[str, Job],
) -> None:
    ranks, _ = two_hosts["leave"]
    assert [r.returncode for r in ranks] == [0, 0], ranks[0].stderr[-3000:]
    assert "rank 0: left" in ranks[0].stdout
    assert "distcompat: rank 1" not in ranks[0].stderr
    assert "no link to rank" not in ranks[0].stderr + ranks[1].stderr


@pytest.mark.slow
def test_the_exception_that_ended_a_peer_on_another_machine_is_told(
    two_hosts: dict[str, Job],
) -> None:
    ranks, _ = two_hosts["raise"]
    assert ranks[1].returncode == 1, ranks[1].stderr[-3000:]
    assert ranks[0].returncode == 3, ranks[0].stderr[-3000:]
    match = SEEN.search(ranks[0].stderr)
    assert match, ranks[0].stderr[-3000:]
    assert re.fullmatch(r"exited after ValueError: bad batch 7 at _peer_watch_script.py:\d+",
                        match.group(1))  # fmt: skip
    assert "raised PeerLostError" in ranks[0].stdout, ranks[0].stdout


def _relayed() -> list[tuple[int, str]]:
    """Rank 0 posts two losses; every rank reads them back, then nothing more."""
    import distcompat.distributed as dist
    from distcompat.peers import Lost, _relay

    if dist.get_rank() == 0:
        _relay.post(Lost(5, 11, "node5", 0.0, ""))
        _relay.post(Lost(6, 12, "node6", 0.0, "KeyError: 'x' at a.py:3"))
    dist.barrier()
    count, found = _relay.read_since(0, seen=1.0)
    assert _relay.read_since(count) == (count, [])
    return [(lost.rank, lost.describe()) for lost in found if lost.seen == 1.0]


def test_a_loss_posted_by_one_watch_is_read_by_every_rank() -> None:
    """The relay of worlds too large to link every pair (its store keys; run_on_ranks)."""
    for found in run_on_ranks(_relayed, 2):
        assert found[-2:] == [
            (5, "rank 5 (pid 11 on node5) ended"),
            (6, "rank 6 (pid 12 on node6) exited after KeyError: 'x' at a.py:3"),
        ]


# --- without processes: which pairs link, and what a link says --------------------------------


def test_every_pair_links_in_a_small_world_and_ring_neighbours_in_a_large_one() -> None:
    assert all(linked(a, b, 65) for a in range(65) for b in range(65) if a != b)
    assert all_linked(65)
    assert not all_linked(66)
    degree = [sum(linked(a, b, 1000) for b in range(1000)) for a in range(1000)]
    assert set(degree) == {64}
    assert all(
        linked(a, b, 1000) == linked(b, a, 1000) for a in range(0, 1000, 7) for b in (0, 999)
    )


def _identity(pid: int, port: int) -> Identity:
    """A peer "elsewhere" that listens at ``port`` on this machine's addresses."""
    return Identity("other", "elsewhere", pid, 0, ("127.0.0.1", *Identity.here().addrs), port)


SECRET = b"0123456789abcdef" * 4


def _serve_one(links: Links) -> int | None:
    """Accept one link and read its greeting and proof; return its fd (None: refused)."""
    if not select.select([links.listener], [], [], 5)[0]:
        return None
    fd = links.accept()
    while fd is not None and links.links[fd].rank is None:
        if not select.select([fd], [], [], 5)[0]:
            return None
        heard = links.read(fd)  # None: a greeting answered, or a proof taken
        if heard is not None:  # a stranger, dropped: no rank, so no loss to record
            assert heard == Ended(None, "")
            return None
    return fd


def _ended(links: Links, fd: int) -> Ended | None:
    """Read link ``fd`` until it ends (5 s at most)."""
    while select.select([fd], [], [], 5)[0]:
        ended = links.read(fd)
        if ended is not None:
            return ended
    return None


@pytest.fixture
def pair() -> Iterator[tuple[Links, Links]]:
    if not [a for a in Identity.here().addrs if not a.startswith("127.")]:
        pytest.skip("no address but loopback (a link never dials loopback)")
    low, high = Links(0, 2, SECRET), Links(1, 2, SECRET)
    yield low, high
    low.close(LEFT)
    high.close(LEFT)


def test_a_link_carries_the_farewell_and_then_its_end(pair: tuple[Links, Links]) -> None:
    low, high = pair
    with ThreadPoolExecutor(1) as pool:
        served = pool.submit(_serve_one, high)
        assert low.dial(1, _identity(os.getpid(), high.port)) is not None
        accepted = served.result()
    assert accepted is not None
    low.close("ValueError: bad batch 7 at train.py:3")
    assert _ended(high, accepted) == Ended(0, "ValueError: bad batch 7 at train.py:3")


def _linked(low: Links, high: Links) -> tuple[int, int]:
    """Link ``low`` to ``high``: the dialled fd, and the accepted one."""
    with ThreadPoolExecutor(1) as pool:
        served = pool.submit(_serve_one, high)
        dialled = low.dial(1, _identity(os.getpid(), high.port))
        accepted = served.result()
    assert dialled is not None
    assert accepted is not None
    return dialled, accepted


def test_a_link_whose_peer_says_nothing_ends_with_nothing_said(pair: tuple[Links, Links]) -> None:
    low, high = pair
    dialled, accepted = _linked(low, high)
    low.links.pop(dialled).sock.close()  # as a SIGKILL does: no bye, the kernel closes it
    assert _ended(high, accepted) == Ended(0, "")


def test_a_link_ends_when_its_rank_does_though_a_child_it_forked_lives(
    pair: tuple[Links, Links],
) -> None:
    """A child forked after the link exists (a DataLoader worker) closes its copy of the socket:
    the rank's end still ends the link while the child sleeps on."""
    low, high = pair
    dialled, accepted = _linked(low, high)
    child = os.fork()
    if child == 0:  # the worker: holds whatever it inherited, for 30 s
        time.sleep(30)
        os._exit(0)
    try:
        low.links.pop(dialled).sock.close()  # the rank's end, as a SIGKILL closes it
        assert _ended(high, accepted) == Ended(0, "")
        assert os.waitpid(child, os.WNOHANG) == (0, 0)  # the child still lives
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_a_link_meant_for_another_process_is_refused_on_both_sides(
    pair: tuple[Links, Links],
) -> None:
    """The dialler means pid + 1 (another job's rank at a reused address): the listener drops
    it without naming a rank (its end is no loss), and the dialler refuses the answer."""
    low, high = pair
    with ThreadPoolExecutor(1) as pool:
        served = pool.submit(_serve_one, high)
        assert low.dial(1, _identity(os.getpid() + 1, high.port)) is None  # not that pid
        assert served.result() is None
    assert low.links == {}
    assert high.links == {}


def test_a_stranger_that_connects_is_dropped_without_a_loss(pair: tuple[Links, Links]) -> None:
    """A port scan, or a line that is not a link's: dropped, never read as a rank that ended."""
    _, high = pair
    with ThreadPoolExecutor(1) as pool:
        served = pool.submit(_serve_one, high)
        with socket.create_connection(("127.0.0.1", high.port), timeout=5) as stranger:
            stranger.sendall(b"distcompat-link 0 1\n")  # the old form: who, not whom
        assert served.result() is None
    assert high.links == {}


def _published_ports() -> list[int]:
    import torch.distributed as dist

    from distcompat import peers

    return [who.port for who in peers.identities_of(set(range(dist.get_world_size()))).values()]


def test_a_job_on_one_machine_opens_no_port() -> None:
    """``run_on_ranks`` launches as torchrun on one node does (LOCAL_WORLD_SIZE = WORLD_SIZE): no
    rank listens for links, so no port is open to the network."""
    for ports in run_on_ranks(_published_ports, 2):
        assert ports == [0, 0]


# --- strangers: what a connection must prove, by when, and how many may wait ----------------


def test_a_peer_without_the_jobs_secret_is_refused_on_both_sides() -> None:
    """Another job's rank (its own secret) at the right address, rank and pid: no link."""
    if not [a for a in Identity.here().addrs if not a.startswith("127.")]:
        pytest.skip("no address but loopback (a link never dials loopback)")
    low, high = Links(0, 2, b"another job's secret"), Links(1, 2, SECRET)
    try:
        with ThreadPoolExecutor(1) as pool:
            served = pool.submit(_serve_one, high)
            assert low.dial(1, _identity(os.getpid(), high.port)) is None
            assert served.result() is None
        assert low.links == {}
        assert high.links == {}
    finally:
        low.close(LEFT)
        high.close(LEFT)


def _stranger(links: Links, payload: bytes) -> socket.socket:
    """Connect to ``links``' listener, send ``payload``, and have the listener take it."""
    stranger = socket.create_connection(("127.0.0.1", links.port), timeout=5)
    if payload:
        stranger.sendall(payload)
    assert select.select([links.listener], [], [], 5)[0]
    assert links.accept() is not None
    return stranger


def _closed_by_listener(stranger: socket.socket) -> bool:
    """Whether the listener closed ``stranger``'s connection (end of file, or a reset)."""
    stranger.settimeout(5)
    try:
        while stranger.recv(4096):  # a challenge may come first
            pass
    except ConnectionResetError:
        pass
    return True


def test_bytes_that_are_not_a_greeting_are_dropped_at_once(pair: tuple[Links, Links]) -> None:
    _, high = pair
    with _stranger(high, b"GET / HTTP/1.1\r\n") as stranger:
        (fd,) = high.links
        assert select.select([fd], [], [], 5)[0]
        assert high.read(fd) == Ended(None, "")
        assert high.links == {}
        assert _closed_by_listener(stranger)


def test_a_forged_greeting_without_the_proof_ends_with_no_loss(pair: tuple[Links, Links]) -> None:
    """The right rank and pids (a stranger sees every pid on the host), a made-up proof."""
    _, high = pair
    greeting = f"distcompat-link2 0 {os.getpid()} 1 {os.getpid()} {'ab' * 16}\n".encode()
    with _stranger(high, greeting) as stranger:
        (fd,) = high.links
        assert select.select([fd], [], [], 5)[0]
        assert high.read(fd) is None  # answered with a challenge: not proven
        assert high.links[fd].rank is None
        stranger.sendall(b"0" * 64 + b"\n")
        assert select.select([fd], [], [], 5)[0]
        assert high.read(fd) == Ended(None, "")  # no rank: no loss is recorded
        assert _closed_by_listener(stranger)


def test_an_idle_connection_is_closed_at_its_handshake_deadline(
    pair: tuple[Links, Links], monkeypatch: pytest.MonkeyPatch
) -> None:
    from distcompat.peers import _links

    monkeypatch.setattr(_links, "HANDSHAKE_S", 0.2)
    _, high = pair
    with _stranger(high, b"") as stranger:
        due = high.tick()
        assert due is not None
        assert 0 < due <= 0.2
        select.select([], [], [], due + 0.05)
        assert high.tick() is None  # nothing left waiting
        assert high.links == {}
        assert high.refused == 1
        assert _closed_by_listener(stranger)


def test_past_the_cap_a_new_connection_closes_the_oldest_waiting(pair: tuple[Links, Links]) -> None:
    """Strangers hold at most ``unproven_cap`` of the listener's descriptors, however many."""
    _, high = pair
    strangers = [_stranger(high, b"") for _ in range(high.cap + 5)]
    try:
        assert len(high.links) == high.cap == unproven_cap(2)
        assert high.refused == 5
        kept = sorted(high.links)
        assert all(_closed_by_listener(s) for s in strangers[:5])  # the oldest went
        assert sorted(high.links) == kept
    finally:
        for stranger in strangers:
            stranger.close()


def test_the_job_secret_is_the_first_ranks_for_every_rank() -> None:
    import torch.distributed as dist

    store = dist.HashStore()
    first = job_secret(store)
    assert first is not None
    assert len(first) == 64
    assert all(job_secret(store) == first for _ in range(3))
    assert job_secret(None) is None  # no store: no secret, so no links


def test_a_listener_out_of_descriptors_rests_and_says_what_ran_out(
    pair: tuple[Links, Links], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """accept's EMFILE: the listener leaves the poll for REST_S (no busy loop), one line why."""
    from _no_fds import no_fds
    from distcompat.peers import _links

    monkeypatch.setattr(_links, "REST_S", 0.2)
    _, high = pair
    poller = select.poll()
    high.attach(poller)
    with socket.create_connection(("127.0.0.1", high.port), timeout=5):
        assert poller.poll(5000) == [(high.listener.fileno(), select.POLLIN)]
        with no_fds(), caplog.at_level("WARNING", "distcompat.peers"):
            assert high.accept() is None
        assert "too many open files: this process holds all" in caplog.text
        assert poller.poll(0) == []  # out of the poll while it rests
        due = high.tick()
        assert due is not None
        assert 0 < due <= 0.2
        select.select([], [], [], due + 0.05)
        high.tick()
        assert poller.poll(5000) == [(high.listener.fileno(), select.POLLIN)]  # back
        assert high.accept() is not None


@pytest.mark.parametrize(
    ("setting", "bound"),
    [(None, "0.0.0.0"), ("127.0.0.1", "127.0.0.1"), ("lo", "127.0.0.1"), ("off", None)],
)
def test_the_listener_binds_where_distcompat_peer_links_says(
    setting: str | None, bound: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``DISTCOMPAT_PEER_LINKS`` (read by ``launch._settings``): unset listens on every
    interface, an address or an interface name on that address only, ``off`` nowhere. The
    store that gives the secret is a HashStore here (no group)."""
    import torch.distributed as dist

    from distcompat.peers import _registry, _watch

    if setting is None:
        monkeypatch.delenv("DISTCOMPAT_PEER_LINKS", raising=False)
    else:
        monkeypatch.setenv("DISTCOMPAT_PEER_LINKS", setting)
    monkeypatch.setattr(_registry, "rendezvous_store", dist.HashStore)
    links = _watch._listener(1, 2)
    try:
        address = None if links is None else links.listener.getsockname()[0]
        assert address == bound
    finally:
        if links is not None:
            links.close(LEFT)


def test_an_interface_without_an_address_opens_no_listener_and_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import torch.distributed as dist

    from distcompat.peers import _registry, _watch

    monkeypatch.setenv("DISTCOMPAT_PEER_LINKS", "nosuchif0")
    monkeypatch.setattr(_registry, "rendezvous_store", dist.HashStore)
    with caplog.at_level("WARNING", "distcompat.peers"):
        assert _watch._listener(1, 2) is None
    assert "not watched: nosuchif0 has no IPv4 address" in caplog.text


def test_a_dial_closed_unanswered_is_made_again(pair: tuple[Links, Links]) -> None:
    """The listener closes the first connection before reading it, as its cap does to the oldest
    waiting one when a stranger floods it: the dialler connects again and gets its link."""
    low, high = pair

    def evict_then_serve() -> int | None:
        assert select.select([high.listener], [], [], 5)[0]
        first = high.accept()
        assert first is not None
        high._drop(first, Ended(None, ""))
        return _serve_one(high)

    address = next(a for a in Identity.here().addrs if not a.startswith("127."))
    only = Identity("other", "elsewhere", os.getpid(), 0, (address,), high.port)  # one address
    with ThreadPoolExecutor(1) as pool:
        served = pool.submit(evict_then_serve)
        assert low.dial(1, only) is not None
        accepted = served.result()
    assert accepted is not None
    assert high.links[accepted].rank == 0


def test_a_link_closed_after_its_proof_but_before_it_was_taken_is_no_link(
    pair: tuple[Links, Links],
) -> None:
    """A stranger's flood can close a greeted connection before the listener reads its proof:
    the dialler counts a link only once the listener says it took it, so that close is no
    loss; it dials again instead."""
    low, high = pair

    def greet_evict_then_serve() -> int | None:
        assert select.select([high.listener], [], [], 5)[0]
        first = high.accept()
        assert first is not None
        assert select.select([first], [], [], 5)[0]
        assert high.read(first) is None  # the greeting, answered with a challenge
        high._drop(first, Ended(None, ""))  # closed before the proof is read
        return _serve_one(high)

    address = next(a for a in Identity.here().addrs if not a.startswith("127."))
    only = Identity("other", "elsewhere", os.getpid(), 0, (address,), high.port)
    with ThreadPoolExecutor(1) as pool:
        served = pool.submit(greet_evict_then_serve)
        dialled = low.dial(1, only)
        accepted = served.result()
    assert dialled is not None
    assert accepted is not None
    assert list(low.links) == [dialled]  # one link, the second one: the first was never counted
