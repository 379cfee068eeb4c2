"""The shared-memory path for same-host CPU collectives (``collectives._shm_*``) on gloo groups.

Property tests draw the collective, dtype, ReduceOp, an odd size and a memory layout at world
sizes 2, 3 and 4 (4 ranks on this 2-core machine: the barrier must not starve anyone); every rank
checks its result against raw gloo or a local fold and against every other rank's bytes
(tests/shm_cases.py). Then the failure modes: a killed or stopped peer, leftovers in /dev/shm, a
segment that cannot be made, and the switch.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _rank_processes import end_stopped_rank, run_ranks
from distcompat.collectives.shm import Engine
from distcompat.collectives.shm import _path as shm
from distcompat.collectives.shm._segment import SHM_DIR, Segment, sweep_leftovers
from distcompat.testing import RankFailedError, RankTimeoutError, run_on_ranks
from shm_cases import (
    DTYPES,
    LAYOUTS,
    OPS,
    TEST_SLOT_BYTES,
    ShmCase,
    calls_on_path,
    configure,
    run_shm_case,
)

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.uname().machine != "x86_64",
    reason="the shared-memory path is offered on Linux x86-64 only",
)
SETTINGS = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
_PREFIX = "distcompat-shm-"


def _defined(case: ShmCase) -> bool:
    floating = DTYPES[case.dtype].is_floating_point
    return not (case.op == "AVG" and not floating)


_cases = st.builds(
    ShmCase,
    collective=st.sampled_from(
        ["all_reduce", "all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor"]
    ),
    dtype=st.sampled_from(sorted(DTYPES)),
    op=st.sampled_from(OPS),
    numel=st.one_of(st.integers(1, 40), st.integers(1, 1500).map(lambda n: 2 * n + 1)),
    layout=st.sampled_from(LAYOUTS),
    seed=st.integers(0, 10_000),
).filter(_defined)


@pytest.mark.parametrize("world_size", [2, 3, 4])
@SETTINGS
@given(case=_cases)
def test_shared_memory_equals_gloo_and_is_identical_on_every_rank(
    world_size: int, case: ShmCase
) -> None:
    assert run_on_ranks(run_shm_case, world_size, args=(case,)) == ["ok"] * world_size


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("threads", [1, 2])
def test_chunks_larger_than_one_serial_op_reduce_the_same(world_size: int, threads: int) -> None:
    """Parts of a chunk above torch's grain size: one op per part with one intra-op thread,
    pieces of ``_SERIAL`` elements with two; every rank's bytes equal, close to gloo's."""
    big = 150_001  # two rows: 300,002 elements, two or three chunks of 512 KiB slots
    cases = [
        ShmCase("all_reduce", "float32", "SUM", big, "contiguous", 1),
        ShmCase("all_reduce", "bfloat16", "AVG", big, "strided", 2),
        ShmCase("all_reduce", "int32", "MAX", big, "contiguous", 3),
        ShmCase("reduce_scatter_tensor", "float32", "SUM", big, "contiguous", 4),
    ]
    for case in cases:
        got = run_on_ranks(run_shm_case, world_size, args=(case, 512 << 10, threads))
        assert got == ["ok"] * world_size, case


def test_one_thread_reduces_a_part_in_one_op() -> None:
    from distcompat.collectives.shm._folds import _SERIAL, _grain

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert _grain(10 * _SERIAL) == 10 * _SERIAL
        torch.set_num_threads(2)
        assert _grain(10 * _SERIAL) == _SERIAL
    finally:
        torch.set_num_threads(before)


def _async_and_sizes() -> dict[str, Any]:
    """Async handles, 0-d and empty tensors, and sizes around the chunk size on the path."""
    import distcompat.distributed as dist
    from distcompat.collectives import CompatWork, all_reduce

    configure()
    world = dist.get_world_size()
    seen: dict[str, Any] = {"engaged": shm.status(None).engaged}
    work = all_reduce(torch.ones(1001), async_op=True)
    assert isinstance(work, CompatWork)
    doubled = work.get_future().then(lambda f: f.value()[0] * 2)
    seen["then"] = doubled.wait()[:2].tolist()
    seen["async_value"] = work.wait()
    pending = [all_reduce(torch.full((300,), float(i)), async_op=True) for i in range(5)]
    sync = torch.ones(7)
    all_reduce(sync)  # waits for the async ops before it, then runs in this thread
    seen["in_order"] = [int(w.get_future().value()[0][0]) for w in pending] + [int(sync[0])]
    scalar, empty = torch.tensor(2.0), torch.empty(0, 3)
    all_reduce(scalar)
    all_reduce(empty)
    seen["scalar"], seen["empty"] = float(scalar), list(empty.shape)
    per_chunk = TEST_SLOT_BYTES // 4
    for n in (per_chunk - 1, per_chunk, per_chunk + 1, 2 * per_chunk, 7 * per_chunk + 3):
        t = torch.arange(n, dtype=torch.float32)
        all_reduce(t)
        assert torch.equal(t, torch.arange(n, dtype=torch.float32) * world), n
    seen["world"] = world
    return seen


def test_async_ops_have_working_futures_and_keep_issue_order() -> None:
    seen = run_on_ranks(_async_and_sizes, 2)[0]
    assert seen["engaged"]
    assert seen["then"] == [4.0, 4.0]
    assert seen["async_value"] is True
    assert seen["in_order"] == [0, 2, 4, 6, 8, 2]
    assert (seen["scalar"], seen["empty"]) == (4.0, [0, 3])


def _fault(fault: str, record: str) -> None:
    """The last rank is SIGKILLed or SIGSTOPped while the others are in a shared-memory op."""
    import distcompat.distributed as dist
    from distcompat.collectives import CollectiveTimeoutError, PeerLostError, all_reduce

    configure()
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(ranks=list(range(world)), timeout=timedelta(seconds=2))
    for _ in range(3):
        all_reduce(torch.ones(1 << 12), group=group)
    assert shm.status(group).engaged
    dist.barrier(group=group)
    if rank == world - 1:
        time.sleep(0.3)  # let the others enter the collective first
        os.kill(os.getpid(), signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        time.sleep(60)
    started = time.monotonic()
    try:
        for _ in range(100_000):
            all_reduce(torch.ones(1 << 12), group=group)
        seen: dict[str, Any] = {"error": "none"}
    except (PeerLostError, CollectiveTimeoutError) as exc:
        seen = {
            "error": type(exc).__name__,
            "bases": [base.__name__ for base in type(exc).__mro__],
            "peers": list(exc.peers),
            "message": str(exc),
        }
    seen["after_s"] = time.monotonic() - started
    seen["leftovers"] = [n for n in os.listdir(SHM_DIR) if n.startswith(_PREFIX)]
    with open(f"{record}.rank{rank}", "w") as out:
        json.dump(seen, out)
    if fault == "stop" and rank == 0:  # end the stopped rank, so the test need not wait for it
        engine = shm._groups[group]
        assert isinstance(engine, Engine)
        end_stopped_rank(engine.barrier.peers[world - 1][1].pid, record, world - 1)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize(
    ("fault", "error", "base", "within_s"),
    [
        ("kill", "PeerLostError", "ConnectionError", 2.0),
        ("stop", "CollectiveTimeoutError", "TimeoutError", 2.0 + 3.0),  # the group timeout + slack
    ],
)
def test_a_killed_or_stopped_peer_raises_the_typed_error_naming_it(
    fault: str, error: str, base: str, within_s: float, world_size: int, tmp_path: Any
) -> None:
    """The same errors and bounds as the gloo path (test_collectives_work.py)."""
    victim = world_size - 1
    record = tmp_path / "seen"
    with pytest.raises((RankFailedError, RankTimeoutError)):  # the victim died, by design
        run_on_ranks(_fault, world_size, args=(fault, str(record)), timeout=15)
    for rank in range(victim):
        seen = json.loads((tmp_path / f"seen.rank{rank}").read_text())
        assert seen["error"] == error, seen
        assert base in seen["bases"]
        assert seen["peers"] == [victim]
        assert f"(rank {victim})" in seen["message"]
        assert seen["after_s"] < within_s
        assert seen["leftovers"] == []  # unlinked at setup: a crash leaves nothing behind


def _queued_behind_a_lost_peer(record: str) -> None:
    """Rank 0 queues two async all_reduces on the path; rank 1 is SIGKILLed before its part."""
    import distcompat.distributed as dist
    from distcompat.collectives import CollectiveError, all_reduce

    configure()
    rank = dist.get_rank()
    for _ in range(2):  # the calls below, checked in this order: no mismatch check waits
        dist.barrier()
        all_reduce(torch.ones(1 << 12))
        all_reduce(torch.ones(1 << 12))
    assert shm.status(None).engaged
    dist.barrier()
    if rank == 1:
        time.sleep(0.3)  # rank 0 has queued both ops by now
        os.kill(os.getpid(), signal.SIGKILL)
    handles = [all_reduce(torch.ones(1 << 12), async_op=True) for _ in range(2)]
    seen = []
    for handle in handles:
        assert handle is not None
        try:
            handle.wait()
        except CollectiveError as exc:
            seen.append({"error": type(exc).__name__, "peers": list(exc.peers), "text": str(exc)})
        time.sleep(0.2)  # the second op has met the broken path by now: its own error
    Path(record).write_text(json.dumps(seen))


def test_an_op_queued_behind_a_lost_peer_raises_peer_lost_naming_it(tmp_path: Path) -> None:
    """The first op sees rank 1 go; the one queued behind it meets the path broken, and says the
    same: a ``PeerLostError`` naming rank 1, not a bare ``CollectiveError`` (a metric all-reduce
    issued just after DDP's backward failed raised one, and the rank went unnamed)."""
    record = tmp_path / "seen"
    with pytest.raises((RankFailedError, RankTimeoutError)):  # rank 1 died, by design
        run_on_ranks(_queued_behind_a_lost_peer, 2, args=(str(record),), timeout=20)
    first, second = json.loads(record.read_text())
    for seen in (first, second):
        assert seen["error"] == "PeerLostError", seen
        assert seen["peers"] == [1], seen
        assert "(rank 1)" in seen["text"], seen
    assert "failed before" in second["text"], second


def _ours() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(_PREFIX)}


def test_nothing_is_left_in_dev_shm_after_a_normal_exit() -> None:
    """Fresh rank processes (a script, as a launcher starts it) set the path up and exit."""
    script = Path(__file__).with_name("_shm_script.py")
    ended = run_ranks(script, 2, env={"DISTCOMPAT_SHM": "on"}, timeout=60)
    assert [e.returncode for e in ended] == [0, 0], [e.stderr[-2000:] for e in ended]
    for one in ended:
        assert "ENGAGED True" in one.stdout
        assert "SUM 2" in one.stdout
    pids = [
        line.split()[1] for e in ended for line in e.stdout.splitlines() if line.startswith("PID")
    ]
    assert len(pids) == 2
    assert not [name for name in _ours() if name.split("-")[2] in pids]  # names carry the creator


def test_a_segment_left_by_a_killed_creator_is_swept() -> None:
    """A SIGKILL between create and unlink (the only window) leaves a name; setup sweeps it."""
    code = (
        "import os, signal\n"
        "from distcompat.collectives.shm._segment import Segment\n"
        "s = Segment.create(2, 4096)\n"
        "print(s.path, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert child.returncode == -signal.SIGKILL
    left = child.stdout.strip()
    assert os.path.exists(left)
    alive = Segment.create(2, 4096)  # this process is alive: its segment stays
    try:
        removed = sweep_leftovers()
        assert os.path.basename(left) in removed
        assert not os.path.exists(left)
        assert os.path.exists(alive.path)
    finally:
        alive.unlink()
        alive.close()


def _cannot_reserve() -> dict[str, Any]:
    """/dev/shm too small (faked: 4 KiB free, as rank 0 reads it): gloo, with a reason."""
    import warnings

    import distcompat.distributed as dist
    from distcompat.collectives import all_reduce
    from distcompat.collectives.shm import _segment

    real = _segment._free_bytes
    _segment._free_bytes = lambda: 4096  # what rank 0 reads when it sizes the segment
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            configure(slot_bytes=TEST_SLOT_BYTES * 2)  # a new setup
            t = torch.ones(5)
            all_reduce(t)
        status = shm.status(None)
    finally:
        _segment._free_bytes = real
    configure()  # back to the tests' slot size for later tests on these ranks
    return {
        "value": t.tolist(),
        "world": dist.get_world_size(),
        "engaged": status.engaged,
        "reason": status.reason,
        "warned": [str(w.message) for w in caught if w.category is shm.SharedMemoryFallbackWarning],
    }


def test_a_segment_that_cannot_be_made_falls_back_to_gloo_with_a_reason() -> None:
    seen = run_on_ranks(_cannot_reserve, 2)
    for rank, one in enumerate(seen):
        assert one["value"] == [2.0] * 5
        assert not one["engaged"]
        assert "failed on rank 0: /dev/shm has 0.0 MiB free" in one["reason"]
        assert len(one["warned"]) == (1 if rank == 0 else 0)  # rank 0 prints it


def _switched_off() -> tuple[bool, str, str]:
    from distcompat.collectives import all_reduce, explain_collective

    configure(mode="off")
    t = torch.ones(3)
    all_reduce(t)
    plan = str(explain_collective("all_reduce", t))
    engaged, reason = shm.status(None).engaged, shm.status(None).reason
    configure()
    return engaged, reason, plan


def test_distcompat_shm_off_keeps_gloo_and_says_so() -> None:
    engaged, reason, plan = run_on_ranks(_switched_off, 2)[0]
    assert not engaged
    assert reason == "off: DISTCOMPAT_SHM=off"
    assert "DISTCOMPAT_SHM=off" in plan


def _explained_reductions() -> list[str]:
    from distcompat.collectives import explain_collective

    configure(mode="on")
    torch.distributed.all_reduce(torch.ones(1))  # the group's path is set up by its first call
    dtypes = (torch.bool, torch.int16, torch.complex64, torch.float32)
    paths = [explain_collective("all_reduce", torch.ones(4, dtype=d)).path for d in dtypes]
    configure()
    return paths


def test_explain_names_shared_memory_for_the_dtype_a_reduction_runs_in() -> None:
    """bool runs as 0/1 bytes, int16 as int32, complex as its real view: the path reduces each
    (it reduces no bool, so asking about the caller's dtype would say it does not)."""
    for paths in run_on_ranks(_explained_reductions, 2):
        assert all(path.startswith("shared memory") for path in paths), paths


def _ddp_with_the_hook() -> tuple[list[list[float]], int]:
    """A DDP model whose gradient buckets go through the hook, on the shared-memory path."""
    import distcompat.distributed as dist
    from distcompat.collectives import allreduce_hook

    configure()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    model.register_comm_hook(None, allreduce_hook)
    before = calls_on_path()
    rank = dist.get_rank()
    model(torch.full((3, 4), float(rank + 1))).sum().backward()
    grad = model.module.weight.grad
    assert grad is not None
    return grad.tolist(), calls_on_path() - before


def test_the_ddp_hook_averages_gradients_through_shared_memory() -> None:
    for grads, calls in run_on_ranks(_ddp_with_the_hook, 2):
        assert grads == [[4.5] * 4] * 2  # d(sum)/dW = 3 rows of (rank + 1), averaged over 2 ranks
        assert calls >= 1


def _auto() -> tuple[bool, bool, bool, str, str]:
    from distcompat.collectives import all_reduce, broadcast, explain_collective

    configure(mode="auto")
    tiny, big = torch.ones(1), torch.ones(1 << 22)  # 4 bytes; 16 MiB
    before = calls_on_path()
    broadcast(tiny, src=0)
    tiny_took = calls_on_path() != before
    broadcast(big, src=0)
    big_took = calls_on_path() > max(before, 0)
    before = calls_on_path()
    all_reduce(tiny)
    tiny_reduce_took = calls_on_path() > before
    plans = (
        str(explain_collective("broadcast", tiny)),
        str(explain_collective("broadcast", big)),
    )
    configure()
    return tiny_took, big_took, tiny_reduce_took, *plans


def test_auto_keeps_tiny_broadcasts_of_more_than_two_ranks_on_gloo_and_says_why() -> None:
    """Under ``auto``: a 4-byte broadcast of 3 ranks stays on gloo (``MIN_BYTES``), a 16 MiB
    one takes the path, and so does a 4-byte all_reduce (no floor)."""
    tiny_took, big_took, tiny_reduce_took, tiny_plan, big_plan = run_on_ranks(_auto, 3)[0]
    assert (tiny_took, big_took, tiny_reduce_took) == (False, True, True)
    assert "gloo: 4 bytes is below the 16777216 bytes" in tiny_plan
    assert "path: shared memory: all 3 ranks on this machine" in big_plan


def _as_if_on_two_machines() -> tuple[bool, str, list[float]]:
    """Rank 1 posts another machine's boot id (a stand-in for a group that spans two hosts)."""
    import dataclasses

    import distcompat.distributed as dist
    from distcompat.collectives import all_reduce
    from distcompat.peers import Identity

    class Elsewhere(Identity):
        @classmethod
        def here(cls) -> Identity:
            me = Identity.here()
            return dataclasses.replace(me, host="node1", machine="another-boot/another-ns")

    from distcompat.collectives.shm import _setup

    elsewhere = mock.patch.object(_setup, "Identity", Elsewhere)
    with elsewhere if dist.get_rank() == 1 else contextlib.nullcontext():
        configure(slot_bytes=TEST_SLOT_BYTES * 4)  # a new setup, where the ranks post identities
        t = torch.ones(3)
        all_reduce(t)
        status = shm.status(None)
    configure()
    return status.engaged, status.reason, t.tolist()


def test_a_group_across_machines_stays_on_gloo() -> None:
    for engaged, reason, value in run_on_ranks(_as_if_on_two_machines, 2):
        assert not engaged
        assert "not all on one machine" in reason
        assert "node1" in reason
        assert value == [2.0, 2.0, 2.0]


def _paths_mixed_across_ranks() -> list[float]:
    """Rank 0 runs its small synchronous all_reduces in place (``Engine.all_reduce_now``, the
    group idle), while rank 1 has an async op still queued before each one, so its calls go
    through the work's machinery; the ranks must still meet at the same barriers and buffers."""
    import distcompat.distributed as dist
    from distcompat.collectives import all_reduce

    configure()
    rank = dist.get_rank()
    seen = []
    for size in (1, 100, 255, 256, 257, 3000):  # one barrier up to the (1 KiB) slot, then chunks
        pending = all_reduce(torch.full((size,), 2.0), async_op=True)
        if rank == 0:
            pending.wait()  # idle again: the next call takes the in-place path
        t = torch.full((size,), float(rank + 1))
        all_reduce(t)
        pending.wait()
        seen.append(float(t.sum()) / size)
        seen.append(float(pending.get_future().value()[0][0]))
    return seen


def test_ranks_may_run_one_call_by_different_paths() -> None:
    for seen in run_on_ranks(_paths_mixed_across_ranks, 2):
        assert seen == [3.0, 4.0] * 6


def _first_set_up_by_different_paths(op: str) -> list[float]:
    """A new group's first call that takes the path comes to rank 0 by its fast path
    (``direct``) and to rank 1 by the general one: the fast path reads which group was looked up
    last, process state that a background thread (an async checkpoint's save group) changes at
    any moment. Before the fix the fast path set the path up before its mismatch check and the
    general path after it: each rank waited in the other's step until the group's timeout (a CI
    failure of ``test_async_saves_on_three_ranks``)."""
    import distcompat.distributed as dist
    from distcompat.collectives import all_reduce, broadcast
    from distcompat.collectives.agree._state import state_for

    configure()
    rank = dist.get_rank()
    group = dist.new_group(ranks=[0, 1], timeout=timedelta(seconds=20))
    state_for(group if rank == 0 else dist.group.WORLD)  # the fast path's "last group"
    t = torch.full((4096,), float(rank + 1))  # 16 KiB: over every floor
    if op == "all_reduce":
        all_reduce(t, group=group)
    else:
        broadcast(t, src=1, group=group)
    all_reduce(t, group=group)  # and again, both by the fast path now
    return [float(t[0]), float(shm.status(group).engaged)]


@pytest.mark.parametrize("op", ["all_reduce", "broadcast"])
def test_a_groups_first_set_up_is_met_whichever_path_each_rank_takes(op: str) -> None:
    first = 3.0 if op == "all_reduce" else 2.0
    assert run_on_ranks(_first_set_up_by_different_paths, 2, args=(op,)) == [[first * 2, 1.0]] * 2


def _late_peer_under_a_watchdog() -> tuple[float, float, float, list[str]]:
    """Rank 1 arrives 1.2 s late: rank 0's in-place wait runs past the watchdog's first slice
    (0.5 s) and goes on as the watchdog's bounded wait, through the op's work."""
    import distcompat.distributed as dist
    from distcompat import diagnostics
    from distcompat.collectives import all_reduce

    configure()
    rank = dist.get_rank()
    handed: list[str] = []  # what each in-place call handed back
    in_place = Engine.all_reduce_now

    def recorded(self: Engine, *args: Any) -> Any:
        work = in_place(self, *args)
        handed.append("done" if work is None else "done later" if work.target else "?")
        return work

    with diagnostics.watchdog(timeout=30), mock.patch.object(Engine, "all_reduce_now", recorded):
        for late in (False, False, True):  # the same steps first: the mismatch check knows them
            dist.barrier()
            if late and rank == 1:
                time.sleep(1.2)
            started = time.monotonic()
            t = torch.full((10,), float(rank + 1))
            all_reduce(t)
            took = time.monotonic() - started
        after = torch.ones(5)
        all_reduce(after)  # the group is usable after it
    return float(t[0]), float(after[0]), took, handed


def test_a_small_wait_that_outlasts_the_first_slice_goes_on_and_completes() -> None:
    got = run_on_ranks(_late_peer_under_a_watchdog, 2)
    assert [(value, after) for value, after, _, _ in got] == [(3.0, 2.0), (3.0, 2.0)]
    assert got[0][2] > 1.0  # rank 0 did wait for its late peer
    assert got[0][3] == ["done", "done", "done later", "done"]


def _async_movement_ops() -> list[list[float]]:
    """Async broadcast, all_gather_into_tensor and reduce_scatter_tensor of plain tensors (the
    fast paths, ``collectives._direct``) on the path: futures, values, and each went through it."""
    import distcompat.distributed as dist
    from distcompat.collectives import all_gather_into_tensor, broadcast, reduce_scatter_tensor

    configure()
    rank, world = dist.get_rank(), dist.get_world_size()
    before = calls_on_path()
    sent = torch.full((300,), float(rank + 10))
    gathered = torch.empty(world * 300)
    scattered = torch.empty(300)
    works = [
        broadcast(sent, src=1, async_op=True),
        all_gather_into_tensor(gathered, torch.full((300,), float(rank)), async_op=True),
        reduce_scatter_tensor(
            scattered, torch.arange(world * 300, dtype=torch.float32), async_op=True
        ),
    ]
    futures = [work.get_future() for work in works]
    torch.futures.wait_all(futures)
    assert calls_on_path() == before + 3
    return [
        sorted(set(sent.tolist())),
        gathered.view(world, -1)[:, 0].tolist(),
        scattered[:2].tolist(),
    ]


def test_async_movement_ops_take_the_path_and_complete_their_futures() -> None:
    for rank, got in enumerate(run_on_ranks(_async_movement_ops, 3)):
        assert got == [[11.0], [0.0, 1.0, 2.0], [3.0 * 300 * rank, 3.0 * (300 * rank + 1)]]


def _thread_counts() -> dict[str, list[int]]:
    """With two intra-op threads in the rank, the path's folds run on one (whole chunks, not
    pieces); the caller's count, and the one a future's callback sees, stay two."""
    from distcompat.collectives import all_reduce
    from distcompat.collectives.shm import _folds

    configure(slot_bytes=1 << 20)
    seen: dict[str, list[int]] = {"fold": [], "callback": [], "caller": []}

    def add(*args: Any, **kwargs: Any) -> torch.Tensor:
        seen["fold"].append(torch.get_num_threads())
        return torch.add(*args, **kwargs)

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with mock.patch.dict(_folds.REDUCERS, {torch.distributed.ReduceOp.SUM: add}):
            for numel in (50_001, 300_001):  # in place, one barrier; chunked, two per chunk
                all_reduce(torch.ones(numel))
                seen["caller"].append(torch.get_num_threads())
            work = all_reduce(torch.ones(50_003), async_op=True)
            work.get_future().then(lambda _: seen["callback"].append(torch.get_num_threads()))
            work.wait()
            time.sleep(0.2)  # the callback ran (on the group's thread or here)
    finally:
        torch.set_num_threads(before)
    return seen


def test_folds_run_on_one_thread_and_the_callers_count_is_kept() -> None:
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("torch's thread count is per thread with OpenMP only")
    for seen in run_on_ranks(_thread_counts, 2):
        assert set(seen["fold"]) == {1}  # and not empty
        assert seen["caller"] == [2, 2]
        assert seen["callback"] == [2]


def test_a_segment_not_made_for_want_of_descriptors_says_so_with_the_limit() -> None:
    """EMFILE at the segment's creation: the fallback's reason names the open-file limit."""
    from _no_fds import no_fds
    from distcompat.collectives.shm._segment import SegmentError

    with no_fds(), pytest.raises(SegmentError) as caught:
        Segment.create(2, 1 << 16)
    assert "cannot create /dev/shm/" in str(caught.value)
    assert "too many open files: this process holds all " in str(caught.value)
    assert "(RLIMIT_NOFILE)" in str(caught.value)
