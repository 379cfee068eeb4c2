"""The protected group: DDP, FSDP2, DCP and raw ``torch.distributed`` calls go through distcompat.

Every test runs real rank processes (``_protected_script.py``, torchrun's worker contract) whose
only distcompat line is ``distcompat.distributed.init_process_group(backend="gloo")``, with every
default on (watchdog, mismatch check, shared memory on or off as parametrized).
"""

from __future__ import annotations

import ast
import functools
import re
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from _rank_processes import Ended, run_ranks
from distcompat import _torch
from distcompat.collectives import _entry
from distcompat.collectives._protected import GroupWork, ProtectedGroup, make_group
from distcompat.collectives._work import CompatWork
from distcompat.launch import LaunchEnvError
from distcompat.launch._settings import choose_protection

SCRIPT = Path(__file__).with_name("_protected_script.py")
SHM = pytest.mark.parametrize("shm", ["auto", "off"])


def _said(ranks: list[Ended], rank: int, what: str) -> str:
    """Return the rest of ``rank``'s ``rank R: what ...`` line (fails if it never said it)."""
    for line in ranks[rank].stdout.splitlines():
        if line.startswith(f"rank {rank}: {what}"):
            return line.removeprefix(f"rank {rank}: {what}").strip()
    said = ranks[rank].stdout + ranks[rank].stderr[-3000:]
    raise AssertionError(f"rank {rank} never said {what!r}:\n{said}")


def _line_of(text: str, nth: int = 1) -> int:
    """Return the line of ``_protected_script.py`` holding ``text`` the ``nth`` time."""
    lines = SCRIPT.read_text().splitlines()
    return [i for i, line in enumerate(lines, 1) if text in line][nth - 1]


@SHM
@pytest.mark.slow
def test_a_ddp_stall_is_reported_naming_the_rank_and_the_job_completes(shm: str) -> None:
    """rank 1 sleeps 7 s inside a DDP loop; the 2 s watchdog names it and its line; both finish."""
    env = {"DISTCOMPAT_WATCHDOG": "2", "DISTCOMPAT_SHM": shm}
    ranks = run_ranks(SCRIPT, 2, args=("ddp-stall",), env=env, timeout=90)
    assert [r.returncode for r in ranks] == [0, 0], [r.stderr[-2000:] for r in ranks]
    assert _said(ranks, 0, "ddp done") == _said(ranks, 1, "ddp done")  # replicas equal
    output = "".join(r.stdout + r.stderr for r in ranks)
    assert "hang report" in output
    assert re.search(rf"rank 1.*_protected_script\.py:{_line_of('time.sleep(7)')}", output)
    calls = int(_said(ranks, 0, "shm calls"))  # DDP's buckets took shared memory, unasked
    assert calls >= 6 if shm == "auto" else calls == 0


@pytest.mark.slow
def test_a_group_torch_made_is_adopted_with_its_store() -> None:
    """``torch.distributed.init_process_group("gloo")``, then ``init_distributed()``: a rank late
    to a distcompat all_reduce (7 s) is named with its line, from the other rank's report too."""
    env = {"DISTCOMPAT_WATCHDOG": "2"}
    ranks = run_ranks(SCRIPT, 2, args=("adopt-late",), env=env, timeout=90)
    assert [r.returncode for r in ranks] == [0, 0], [r.stderr[-2000:] for r in ranks]
    assert _said(ranks, 0, "adopted") == "True"
    assert _said(ranks, 0, "total") == "2.0"
    report = ranks[0].stdout + ranks[0].stderr  # rank 0 waits: its report covers rank 1 too
    assert re.search(rf"rank 1.*_protected_script\.py:{_line_of('time.sleep(7)', 2)}", report)


@SHM
@pytest.mark.slow
def test_a_killed_ddp_peer_is_named_as_lost_not_a_crash(shm: str) -> None:
    """rank 1 is SIGKILLed between DDP steps: rank 0 ends with an error naming PeerLostError and
    rank 1, promptly, never with SIGSEGV (torch 2.13's reducer crashes on a future that failed in
    Python: see _handover). The error is raised in rank 0's thread once backward()'s C++ call
    returns; where torch's C++ meets it first it comes out as a RuntimeError holding its text,
    so the test asserts what the output says, not the type."""
    ranks = run_ranks(SCRIPT, 2, args=("ddp-kill",), env={"DISTCOMPAT_SHM": shm}, timeout=90)
    assert ranks[1].returncode == -9
    assert ranks[0].returncode not in (0, None, -11), ranks[0].stderr[-3000:]
    said = ranks[0].stdout + ranks[0].stderr
    assert re.search(r"PeerLostError: all_reduce: a peer process went away \(rank 1\)", said)


@pytest.mark.slow
def test_a_killed_ddp_peer_whose_child_holds_its_sockets_ends_backward_while_it_lives() -> None:
    """As above, rank 1 having forked a child first (a DataLoader worker: it holds rank 1's gloo
    sockets, so gloo's op waits on): DDP's reducer waits for its bucket in C++, where no slice
    looks for lost peers; the peer watch's record of the loss ends that wait, and rank 0's
    ``backward()`` raises PeerLostError naming rank 1 while the child lives. Shared memory is
    off: its barrier names a dead peer itself."""
    env = {"DISTCOMPAT_SHM": "off"}
    ranks = run_ranks(SCRIPT, 2, args=("ddp-fork-kill",), env=env, timeout=90)
    assert ranks[1].returncode == -9
    said = ranks[0].stdout + ranks[0].stderr
    assert re.search(r"PeerLostError: all_reduce: a peer process went away \(rank 1\)", said)
    assert _said(ranks, 0, "child alive then") == "True", said[-3000:]


@pytest.mark.slow
def test_a_killed_peer_whose_child_holds_its_sockets_is_named_while_the_child_lives() -> None:
    """rank 1 forks a child (a DataLoader worker's case: it holds rank 1's gloo sockets, so gloo
    waits on) and is SIGKILLed; rank 0's ``torch.distributed.all_reduce`` (the group's async op
    and its wait) raises PeerLostError naming rank 1 while the child still lives: the wait looks
    for lost peers between slices, as a synchronous call's does. Shared memory is off, since
    its own barrier names a dead peer itself: the backend's wait is the one tested."""
    ranks = run_ranks(SCRIPT, 2, args=("fork-kill",), env={"DISTCOMPAT_SHM": "off"}, timeout=90)
    assert ranks[1].returncode == -9
    assert ranks[0].returncode == 1, ranks[0].stderr[-3000:]
    raised = _said(ranks, 0, "raised")
    assert re.match(r"PeerLostError: all_reduce: .*\(rank 1\)", raised), raised
    assert "in the backend wait" in raised, raised  # not the mismatch check's own look
    assert _said(ranks, 0, "child alive then") == "True"


@pytest.mark.slow
def test_raw_calls_are_checked_compiled_and_checkpointed(tmp_path: Path) -> None:
    """Raw torch on 2 ranks: a mismatched all_reduce raises CollectiveMismatchError on both; a
    compiled functional all_reduce is one graph (fullgraph) with the right sum; a DCP save made
    on 2 ranks loads on 1 and on 3."""
    saved = str(tmp_path / "ckpt")
    ranks = run_ranks(SCRIPT, 2, args=("raw", saved), timeout=120)
    assert [r.returncode for r in ranks] == [0, 0], [r.stderr[-2000:] for r in ranks]
    for rank in (0, 1):
        assert _said(ranks, rank, "raised") == "CollectiveMismatchError"
        assert ast.literal_eval(_said(ranks, rank, "compiled")) == [7.0, 7.0, 7.0]  # 2*(1+2)+1
    for world in (1, 3):
        loaded = run_ranks(SCRIPT, world, args=("load", saved), timeout=120)
        assert [r.returncode for r in loaded] == [0] * world, [r.stderr[-2000:] for r in loaded]
        for rank in range(world):
            weights, step = _said(loaded, rank, "loaded").rsplit(" ", 1)
            assert ast.literal_eval(weights) == [float(i) for i in range(12)]  # rank 0's
            assert step == "7"


@pytest.mark.plain_gloo
@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2_trains_to_plain_gloos_losses_and_a_stall_is_named(
    world: int, tmp_path: Path
) -> None:
    """FSDP2 through the protected group gives plain gloo's losses: bitwise at 2 ranks (a sum of
    two terms is the same in either order), within 1e-6 relative at 3, where the protected
    group's reduce-scatter (shared memory, or an all-to-all and a local sum) may add in another
    order than gloo's (measured: bitwise there too, on torch 2.13). At 2 ranks rank 1 also sleeps
    7 s between steps: the 2 s watchdog names it and its line, and the job completes. The
    sharded state dict saved with DCP loads on the other world size (2 -> 3, 3 -> 2) into the
    same full state dict, bit for bit."""
    saved = str(tmp_path / "ckpt")
    stall = {"DISTCOMPAT_WATCHDOG": "2", "STALL": "1"} if world == 2 else {}
    protected = run_ranks(SCRIPT, world, args=("fsdp", saved), env=stall, timeout=120)
    plain = run_ranks(
        SCRIPT, world, args=("fsdp",), env={"DISTCOMPAT_PROTECT_GROUP": "off"}, timeout=120
    )
    for ended in (protected, plain):
        assert [r.returncode for r in ended] == [0] * world, [r.stderr[-2000:] for r in ended]
    for rank in range(world):
        got = ast.literal_eval(_said(protected, rank, "fsdp losses"))
        want = ast.literal_eval(_said(plain, rank, "fsdp losses"))
        assert got == (want if world == 2 else pytest.approx(want, rel=1e-6))
        digest, total = _said(protected, rank, "fsdp state").split()
        plain_digest, plain_total = _said(plain, rank, "fsdp state").split()
        if world == 2:
            assert digest == plain_digest
        assert float(total) == pytest.approx(float(plain_total), rel=1e-6)
    if stall:
        output = "".join(r.stdout + r.stderr for r in protected)
        sleep_line = _line_of("time.sleep(7)", 3)
        assert re.search(rf"rank 1.*_protected_script\.py:{sleep_line}", output)
    other = 5 - world
    loaded = run_ranks(SCRIPT, other, args=("fsdp-load", saved), timeout=120)
    assert [r.returncode for r in loaded] == [0] * other, [r.stderr[-2000:] for r in loaded]
    assert _said(loaded, 0, "fsdp state") == _said(protected, 0, "fsdp state")


@pytest.mark.plain_gloo
def test_hsdp_on_a_two_dimensional_mesh_gives_plain_gloos_bits() -> None:
    """HSDP (FSDP2 on a 2 x 2 mesh: sharded across pairs, replicated between them) on 4 ranks:
    the losses and the full state dict are plain gloo's, bit for bit (each reduction adds two
    terms: the same in any order)."""
    protected = run_ranks(SCRIPT, 4, args=("hsdp",), timeout=180)
    plain_env = {"DISTCOMPAT_PROTECT_GROUP": "off"}
    plain = run_ranks(SCRIPT, 4, args=("hsdp",), env=plain_env, timeout=180)
    for ended in (protected, plain):
        assert [r.returncode for r in ended] == [0] * 4, [r.stderr[-2000:] for r in ended]
    for rank in range(4):
        for what in ("fsdp losses", "fsdp state"):
            assert _said(protected, rank, what) == _said(plain, rank, what), (rank, what)


@functools.cache
def _plain_functional() -> list[Ended]:
    """The functional mix on torch's own gloo group: the reference, run once for both tests."""
    plain = {"DISTCOMPAT_PROTECT_GROUP": "off"}
    return run_ranks(SCRIPT, 2, args=("functional", "30"), env=plain, timeout=120)


@pytest.mark.plain_gloo
@SHM
def test_functional_collectives_between_distcompat_calls_match_plain_gloo(shm: str) -> None:
    """The mix that hung in 2 of 3 runs (issue 40): distcompat all_reduces, sync and async waited
    late, between functional all-gathers, all-reduces and reduce-scatters, 30 iterations, every
    default on. The results are bitwise plain gloo's. With shared memory off (the functional ops
    take gloo, where the deadlock was), a 7 s late rank 1 in a functional all-gather is named with
    its line by the 2 s watchdog: functional collectives reach distcompat."""
    stall = shm == "off"
    env = {"DISTCOMPAT_WATCHDOG": "2", "DISTCOMPAT_SHM": shm, "STALL": "1" if stall else "0"}
    protected = run_ranks(SCRIPT, 2, args=("functional", "30"), env=env, timeout=120)
    plain = _plain_functional()
    for ended in (protected, plain):
        assert [r.returncode for r in ended] == [0, 0], [r.stderr[-2000:] for r in ended]
    for rank in (0, 1):
        assert _said(protected, rank, "functional") == _said(plain, rank, "functional")
    if stall:
        report = protected[0].stdout + protected[0].stderr
        assert re.search(rf"rank 1.*_protected_script\.py:{_line_of('time.sleep(7)', 4)}", report)


def test_every_method_torch_offers_python_is_the_groups_own() -> None:
    """torch's C++ (functional collectives, DDP's reducer) calls a Python process group through a
    trampoline (PyProcessGroup.hpp, in the wheel; read by distcompat._torch for each release); a
    method the group leaves undefined falls back to torch's own, which issues the op to gloo with
    the GIL held. gloo's worker may need the GIL to free a finished op while it holds its queue's
    lock: the two deadlock (the functional all-gather hangs of issue 40). Every such method must
    be ProtectedGroup's own, on the installed release (2.14 added recvAnysource, the coalescing
    pair, reconfigure and six collectives)."""
    offered = _torch.trampoline_methods()
    assert "allreduce" in offered
    own = {name for klass in ProtectedGroup.__mro__[:-3] for name in vars(klass)}
    assert ProtectedGroup.__mro__[-3] is dist.ProcessGroup
    assert offered - own == set()


def test_the_group_forwards_inside_an_entry_and_wraps_outside() -> None:
    """One rank (a HashStore): outside an entry the group hands back a GroupWork over a
    CompatWork; inside one, the backend's own Work."""
    group = make_group(dist.HashStore(), 0, 1, timedelta(seconds=30))
    assert isinstance(group, ProtectedGroup)
    assert group.protects == "gloo"
    t = torch.ones(2)
    inside = _entry.entry(group.allreduce)([t], dist.AllreduceOptions())
    assert not isinstance(inside, GroupWork)
    inside.wait()
    work = GroupWork(CompatWork.completed([t]), [t])
    assert work.wait()
    assert work.result() == [t]
    assert work.is_success()


def test_protection_is_chosen_per_backend_and_variable() -> None:
    """gloo and device maps of gloo only: on unless DISTCOMPAT_PROTECT_GROUP=off; nccl, and a map
    that names it beside gloo: torch's own, saying the gloo half is not checked; a bad value is
    named."""
    assert choose_protection("gloo", environ={}).on
    assert choose_protection("cpu:gloo", environ={}).on
    assert choose_protection("cpu:gloo, cuda:gloo", environ={}).on
    assert not choose_protection("cpu:gloo", environ={"DISTCOMPAT_PROTECT_GROUP": "0"}).on
    mixed = choose_protection("cpu:gloo,cuda:nccl", environ={})
    assert not mixed.on
    assert "gloo half is not checked" in mixed.reason
    assert not choose_protection("gloo", environ={"DISTCOMPAT_PROTECT_GROUP": "off"}).on
    assert not choose_protection("nccl", environ={}).on
    with pytest.raises(LaunchEnvError, match="DISTCOMPAT_PROTECT_GROUP='maybe'"):
        choose_protection("gloo", environ={"DISTCOMPAT_PROTECT_GROUP": "maybe"})
