"""torch's profiler sees distcompat's collectives as plain gloo's (``collectives._profiled``).

Real gloo process groups, every default on: the protected default group (its CPU collectives on
shared memory) beside a plain gloo group of the same ranks. torch's own distributed tests count
``gloo:<op>`` events per call, async, with the caller's shapes; so do users' traces. On a torch
whose profiler drops an event ended on another thread (2.9), the events are async and named as
gloo's but carry no shapes, and the process says so once (``distcompat._torch.begin_record``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from distcompat import _torch
from distcompat._torch import _autograd
from distcompat.collectives.shm import _path as shm
from distcompat.testing import run_on_ranks

Event = tuple[str, bool, list[list[int]]]


def _calls(group: Any) -> dict[str, Callable[[], object]]:
    """One call of each collective the shared-memory path runs, on ``group`` (fresh tensors)."""
    rank = dist.get_rank()
    t = torch.arange(12, dtype=torch.float32).view(3, 4) + rank
    return {
        "all_reduce": lambda: dist.all_reduce(t, group=group),
        "all_reduce async": lambda: dist.all_reduce(t, group=group, async_op=True).wait(),
        "broadcast": lambda: dist.broadcast(t, 0, group=group),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(
            torch.empty(6, 4), t, group=group
        ),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(
            torch.empty(3, 4), torch.ones(6, 4), group=group
        ),
        "all_reduce_coalesced": lambda: dist.all_reduce_coalesced(
            [t, torch.ones(2, 5)], group=group
        ),
    }


def _events(call: Callable[[], object]) -> list[Event]:
    """The profiler's collective events of ``call``: gloo's, and distcompat's own."""
    with torch.autograd.profiler.profile(record_shapes=True) as prof:
        call()
    return [
        (e.name, e.is_async, e.input_shapes)
        for e in prof.function_events
        if e.name.startswith(("gloo:", "distcompat:"))
    ]


def _both_groups() -> dict[str, tuple[list[Event], list[Event]]]:
    plain = dist.new_group(backend="gloo")
    seen = {}
    for name, call in _calls(None).items():
        call()  # the step is agreed: no mismatch check below
        engine = shm.engaged(dist.group.WORLD)
        assert engine is not None, shm.status(None).reason
        before = engine.calls
        protected = _events(call)
        assert engine.calls == before + 1, f"{name} did not take shared memory"
        seen[name] = (protected, _events(_calls(plain)[name]))
    dist.destroy_process_group(plain)
    return seen


def _as_recorded_here(events: list[Event]) -> list[Event]:
    """Plain gloo's events as the shared-memory path records them on this torch: the same, or
    before ``CROSS_THREAD_SHAPES`` without the gloo events' input shapes."""
    if _torch.release() >= _torch.CROSS_THREAD_SHAPES:
        return events
    return [(name, way, [] if name.startswith("gloo:") else shown) for name, way, shown in events]


def test_each_collective_records_the_event_plain_gloo_records() -> None:
    for rank_seen in run_on_ranks(_both_groups, 2):
        for name, (protected, plain) in rank_seen.items():
            assert protected == _as_recorded_here(plain), name
            assert len(plain) == 1, (name, plain)  # one event per call
            assert plain[0][1], (name, plain)  # async, as gloo's


def _first_call() -> list[Event]:
    group: Any = dist.new_group()  # protected, as the default group
    t = torch.ones(7, 3) * dist.get_rank()
    events = _events(lambda: dist.all_reduce(t, group=group))
    dist.destroy_process_group(group)
    return events


def test_a_mismatch_check_is_one_distcompat_event_not_a_gloo_one() -> None:
    """A group's first call is checked with one tiny all-gather on the group itself."""
    for events in run_on_ranks(_first_call, 2):
        assert events == _as_recorded_here(
            [("distcompat:mismatch check", False, []), ("gloo:all_reduce", True, [[7, 3]])]
        )


def _said_when_profiled() -> list[str]:
    import warnings

    _autograd._said.clear()  # a warm rank process may have said it for an earlier test
    t = torch.ones(64, 64)
    dist.all_reduce(t)  # the step is agreed: the profiled call takes shared memory
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _events(lambda: dist.all_reduce(t))
        _events(lambda: dist.all_reduce(t))
    return [str(w.message) for w in caught if "distcompat" in str(w.message)]


def test_a_torch_that_drops_shapes_says_so_once_and_a_newer_one_says_nothing() -> None:
    for said in run_on_ranks(_said_when_profiled, 2):
        if _torch.release() >= _torch.CROSS_THREAD_SHAPES:
            assert said == []
        else:
            assert len(said) == 1
            assert "without input shapes" in said[0]
            assert torch.__version__ in said[0]


def _step(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, root: int, group: Any) -> None:
    work = dist.all_reduce(a, group=group, async_op=True)
    dist.all_gather_into_tensor(out, b, group=group)
    dist.broadcast(b, root, group=group)
    assert work is not None
    work.wait()


def _profiled_on_rank_0_only(iterations: int) -> list[torch.Tensor]:
    """Sync and async collectives waited late, rank 0 profiling, rank 1 not; the results of
    the protected group and of plain gloo, per iteration."""
    rank = dist.get_rank()
    plain = dist.new_group(backend="gloo")
    results = []
    for i in range(iterations):
        for group in (None, plain):
            a = torch.arange(64, dtype=torch.float64) * (rank + 1) / (i + 3)
            b = torch.full((5, 4), float(rank + i))
            out = torch.empty(10, 4)

            if rank == 0 and i % 3 != 2:
                with torch.autograd.profiler.profile():
                    _step(a, b, out, i % 2, group)
            else:
                _step(a, b, out, i % 2, group)
            results.append(torch.cat([a, out.view(-1), b.view(-1).double()]))
    dist.destroy_process_group(plain)
    return results


def test_a_profiler_on_one_rank_changes_no_bit_and_hangs_nothing() -> None:
    """The profiled rank runs its ops on the group's thread, the other in place: the same ops,
    order and bits as plain gloo, 30 iterations."""
    for results in run_on_ranks(_profiled_on_rank_0_only, 2, args=(30,), timeout=120):
        for protected, plain in zip(results[::2], results[1::2], strict=True):
            assert torch.equal(protected, plain)
