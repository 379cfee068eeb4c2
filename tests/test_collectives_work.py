"""CompatWork: futures on every async op, on real gloo groups (where gloo itself has none)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch

import distcompat.distributed as dist
from _rank_processes import end_stopped_rank
from distcompat.collectives import CompatWork
from distcompat.testing import run_on_ranks


def _issue_every_op() -> dict[str, Any]:
    """Start every async op; return, per op, (strategy, future value ok, then ok)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    peer = (rank + 1) % world
    ones = torch.ones(4)
    works: dict[str, tuple[CompatWork, Any]] = {}

    def add(name: str, work: Any, check: Any) -> None:
        works[name] = (work, check)

    t = ones.clone()
    add("all_reduce", dist.all_reduce(t, async_op=True), lambda: t.eq(world).all())
    r = ones.clone()
    add(
        "reduce",
        dist.reduce(r, dst=0, async_op=True),
        lambda: r.eq(world if rank == 0 else 1).all(),
    )
    b = torch.full((4,), float(rank))
    add("broadcast", dist.broadcast(b, src=0, async_op=True), lambda: b.eq(0).all())
    gl = [torch.empty(4) for _ in range(world)]
    add("all_gather", dist.all_gather(gl, ones * rank, async_op=True),
        lambda: all(g.eq(i).all() for i, g in enumerate(gl)))  # fmt: skip
    gt = torch.empty(world * 4)
    add("all_gather_into_tensor", dist.all_gather_into_tensor(gt, ones, async_op=True),
        lambda: gt.eq(1).all())  # fmt: skip
    rs, flat = torch.empty(4), torch.ones(world * 4)
    add("reduce_scatter_tensor", dist.reduce_scatter_tensor(rs, flat, async_op=True),
        lambda: rs.eq(world).all())  # fmt: skip
    rl, pieces = torch.empty(4), [ones.clone() for _ in range(world)]
    add("reduce_scatter", dist.reduce_scatter(rl, pieces, async_op=True),
        lambda: rl.eq(world).all())  # fmt: skip
    a2 = torch.empty(world * 4)
    add("all_to_all_single", dist.all_to_all_single(a2, torch.ones(world * 4), async_op=True),
        lambda: a2.eq(1).all())  # fmt: skip
    al = [torch.empty(4) for _ in range(world)]
    add("all_to_all", dist.all_to_all(al, [ones * rank for _ in range(world)], async_op=True),
        lambda: all(x.eq(i).all() for i, x in enumerate(al)))  # fmt: skip
    gg = [torch.empty(4) for _ in range(world)] if rank == 0 else None
    add("gather", dist.gather(ones * rank, gg, dst=0, async_op=True),
        lambda: gg is None or all(x.eq(i).all() for i, x in enumerate(gg)))  # fmt: skip
    sc = torch.empty(4)
    add("scatter", dist.scatter(sc, [ones * i for i in range(world)] if rank == 0 else None,
        src=0, async_op=True), lambda: sc.eq(rank).all())  # fmt: skip
    add("barrier", dist.barrier(async_op=True), lambda: True)
    got = torch.empty(4)
    add("irecv", dist.irecv(got, src=(rank - 1) % world), lambda: got.eq((rank - 1) % world).all())
    add("isend", dist.isend(ones * rank, dst=peer), lambda: True)

    report = {}
    futures = [work.get_future() for work, _ in works.values()]
    derived = [f.then(lambda f: "callback ran") for f in futures]
    torch.futures.collect_all(futures + derived).wait()
    for (name, (work, check)), then_future in zip(works.items(), derived, strict=True):
        assert isinstance(work, CompatWork)
        first, second = work.wait(), work.wait()  # safe to repeat
        report[name] = (
            work.strategy,
            bool(check()),
            then_future.value() == "callback ran",
            first and second and work.is_completed() and work.exception() is None,
        )
    return report


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_async_op_has_a_working_future(world_size: int) -> None:
    for report in run_on_ranks(_issue_every_op, world_size):
        for name, (strategy, values_ok, then_ok, waits_ok) in report.items():
            assert values_ok, name
            assert then_ok, name
            assert waits_ok, name
            # gloo has no future for p2p: the group's worker completes them
            assert strategy == ("worker" if name in ("irecv", "isend") else "native"), name


def _error_reaches_every_handle() -> tuple[str, str, str] | None:
    rank = dist.get_rank()
    doomed = dist.new_group(ranks=[0, 1], timeout=timedelta(seconds=1))
    if rank != 0:
        return None  # rank 1 never answers on the doomed group
    swallowing = lambda f: "a callback that never looks at f.value()"  # noqa: E731
    work = dist.irecv(torch.empty(2), src=1, group=doomed)
    derived = work.get_future().then(swallowing)
    with pytest.raises(RuntimeError) as from_then:
        derived.wait()
    with pytest.raises(RuntimeError) as from_wait:
        work.wait()
    with pytest.raises(RuntimeError):
        work.wait()  # and again
    error = work.exception()
    assert error is not None
    return str(from_then.value), str(from_wait.value), work.strategy


def test_errors_propagate_through_then_and_wait() -> None:
    first, _ = run_on_ranks(_error_reaches_every_handle, 2)
    assert first is not None
    from_then, from_wait, strategy = first
    assert strategy == "worker"
    assert "Timed out" in from_then or "timed out" in from_then.lower()
    assert (
        from_wait in from_then
    )  # torch prefixes "Got the following error when running the callback"


def _wait_with_timeout() -> str:
    rank = dist.get_rank()
    # A step new on the group is first agreed by every rank (the default mismatch check), which
    # waits for the late rank; these calls make the one below an agreed step (the same call
    # after itself).
    dist.all_reduce(torch.ones(1))
    dist.all_reduce(torch.ones(1))
    if rank == 1:
        import time

        time.sleep(1.5)  # late: rank 0's bounded wait gives up first, the op still completes
    work = dist.all_reduce(torch.ones(1), async_op=True)
    assert work is not None
    if rank == 0:
        try:
            work.wait(timeout=0.2)
        except TimeoutError as exc:
            message = str(exc)
        else:
            message = "no timeout"
    else:
        message = ""
    work.wait()
    return message


def test_bounded_wait_raises_and_keeps_group_usable() -> None:
    message, _ = run_on_ranks(_wait_with_timeout, 2)
    assert "not complete after 0.2s" in message
    assert run_on_ranks(_wait_with_timeout, 2)[1] == ""  # the group still works


def _survivor_sees(fault: str, record: str) -> None:
    """The last rank is SIGKILLed or SIGSTOPped mid all_reduce; the others record what they saw."""
    import json
    import os
    import signal
    import time

    from distcompat.collectives import CollectiveTimeoutError, PeerLostError

    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(ranks=list(range(world)), timeout=timedelta(seconds=2))
    # The steps below are agreed before the fault (barrier, then all_reduce, then all_reduce), so
    # the fault meets the collective itself, not the default mismatch check's comparison through
    # the store, which notices only a dead peer on this machine (docs/collectives.md).
    for _ in range(2):
        dist.barrier(group=group)
        dist.all_reduce(torch.ones(1 << 16), group=group)
        dist.all_reduce(torch.ones(1 << 16), group=group)
    dist.barrier(group=group)
    if rank == world - 1:
        with open(f"{record}.pid", "w") as out:
            out.write(str(os.getpid()))
        time.sleep(0.3)  # let the others enter the collective first
        os.kill(os.getpid(), signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        time.sleep(60)
    started = time.monotonic()
    try:
        for _ in range(1000):
            dist.all_reduce(torch.ones(1 << 16), group=group)
        seen: dict[str, Any] = {"error": "none"}
    except (PeerLostError, CollectiveTimeoutError) as exc:
        seen = {
            "error": type(exc).__name__,
            "bases": [base.__name__ for base in type(exc).__mro__],
            "peer": exc.peer,
            "peers": list(exc.peers),
            "message": str(exc),
        }
    seen["after_s"] = time.monotonic() - started
    with open(f"{record}.rank{rank}", "w") as out:
        json.dump(seen, out)
    if fault == "stop" and rank == 0:  # end the stopped rank, so the test need not wait for it
        with open(f"{record}.pid") as pid:
            end_stopped_rank(int(pid.read()), record, world - 1)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize(
    ("fault", "error", "base", "within_s"),
    [
        ("kill", "PeerLostError", "ConnectionError", 2.0),
        ("stop", "CollectiveTimeoutError", "TimeoutError", 2.0 + 3.0),  # the group timeout + slack
    ],
)
def test_lost_and_stuck_peers_raise_typed_errors(
    fault: str, error: str, base: str, within_s: float, world_size: int, tmp_path: Any
) -> None:
    """Every survivor gets the typed error naming the victim: in a pair it is the other rank; in
    a group of three it is found from the identities ranks published at init (a killed process
    is gone or a zombie, a stopped one is in state T)."""
    import json

    from distcompat.testing import RankFailedError, RankTimeoutError

    record = tmp_path / "seen"
    victim = world_size - 1
    with pytest.raises((RankFailedError, RankTimeoutError)):  # the victim died or hung, by design
        run_on_ranks(_survivor_sees, world_size, args=(fault, str(record)), timeout=15)
    for rank in range(victim):
        seen = json.loads((tmp_path / f"seen.rank{rank}").read_text())
        assert seen["error"] == error
        assert base in seen["bases"]
        assert seen["peer"] == victim
        assert seen["peers"] == [victim]
        assert f"(rank {victim})" in seen["message"]
        assert seen["after_s"] < within_s
