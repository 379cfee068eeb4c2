"""The watchdog's in-memory history (``diagnostics._records``): lean records, derived counts."""

from __future__ import annotations

import os
from typing import Any

import torch

from distcompat.diagnostics._records import Raw, Recorder, to_record


class _Group:
    """A stand-in process group: the records only read its (rank-independent) name."""

    group_name = "0"


G = _Group()


def _note_through_three_frames(recorder: Recorder, t: torch.Tensor) -> Raw:
    """Stand in for ``Watchdog.note`` <- ``_direct`` <- the public function (note looks 4 up)."""

    def public() -> Raw:
        return direct()

    def direct() -> Raw:
        return watchdog_note()

    def watchdog_note() -> Raw:
        return recorder.note("all_reduce", t.shape, t.dtype, G, "SUM", None)

    return public()


def test_note_keeps_no_site_until_late_finds_it_from_live_frames() -> None:
    recorder = Recorder(capacity=4)
    t = torch.ones(3)
    raw = _note_through_three_frames(recorder, t)
    assert raw[0] is None  # not numbered yet: the hot path only queues it
    assert recorder.started == {}
    recorder.drain()
    assert recorder.started == {"0": 1}
    assert to_record(raw).site == "?"

    def still_in_the_call() -> Raw:
        return recorder.late(7, raw)  # the frames of this test are live: the site is here

    late = still_in_the_call()
    record = to_record(late)
    assert record.site.startswith(__file__ + ":")
    assert record.describe().startswith("#0 all_reduce(float32[3], op=SUM) on group 0 at ")
    assert recorder.open[7][0] is late


def test_completed_is_started_less_in_flight() -> None:
    recorder = Recorder()
    t = torch.ones(1)
    for _ in range(3):
        recorder.begin("all_reduce", t, G, None, None)
    raw = recorder.issued(1)
    assert raw is not None
    assert recorder.completed() == {"0": 2}  # one of three is still in flight
    recorder.finished(1)
    assert recorder.completed() == {"0": 3}
    assert recorder.snapshot()["completed"] == {"0": 3}


def test_current_is_the_pending_record_else_the_newest() -> None:
    recorder = Recorder()
    t = torch.ones(1)
    assert recorder.current() is None
    recorder.begin("broadcast", t, G, None, 0)
    pending = recorder.current()
    assert pending is not None
    assert pending[1] == "broadcast"
    # a fast-path record leaves no pending one: the left-over pending is not the newest, so
    # current() is the note (what the agreement wait reports)
    noted = recorder.note("all_reduce", t.shape, t.dtype, G, "SUM", None)
    assert recorder.current() is noted


def test_in_call_is_only_the_call_this_thread_is_making() -> None:
    """A wait before a fast path records its call (a set-up) must not age an earlier call."""
    recorder = Recorder()
    t = torch.ones(1)
    recorder.begin("broadcast", t, G, None, 0)
    assert recorder.in_call() is recorder.current()  # the general path: recorded at entry
    recorder.issued(1)
    recorder.finished(1)
    assert recorder.in_call() is None  # issued and done: no call in progress
    assert recorder.current() is not None  # though the newest record is still that one
    recorder.note("all_reduce", t.shape, t.dtype, G, "SUM", None)
    assert recorder.in_call() is None  # a fast-path record is never this thread's pending one


def test_records_are_numbered_per_group_in_call_order() -> None:
    class _Other:
        group_name = "7"

    recorder = Recorder(capacity=3)
    t = torch.ones(1)
    for group in (G, _Other(), G, G):
        recorder.note("all_reduce", t.shape, t.dtype, group, "SUM", None)
    recorder.begin("barrier", None, G, None, None)
    snapshot = recorder.snapshot()
    assert snapshot["started"] == {"0": 4, "7": 1}
    # the ring keeps the newest three, each numbered within its group
    assert [(r["group"], r["seq"], r["op"]) for r in snapshot["history"]] == [
        ("0", 1, "all_reduce"),
        ("0", 2, "all_reduce"),
        ("0", 3, "barrier"),
    ]


def _fast_path_records() -> dict[str, Any]:
    """Rank body: 100 rounds of the five fast-path ops under the default watchdog."""
    import torch.distributed as tdist

    import distcompat.collectives as dc
    from distcompat.collectives import _checked, _probed
    from distcompat.collectives.shm import _path as shm

    os.environ["DISTCOMPAT_SHM"] = "off"  # tiny gathers would take shared memory under auto
    shm.reset()
    _probed.forget(None)  # a probe an earlier test ran on this pool's group sends calls aside
    watcher = _checked.watch
    assert watcher is not None, "run_on_ranks starts the default watchdog"
    recorder = watcher._recorder
    world = tdist.get_world_size()
    t = torch.ones(2 * world)
    for _ in range(2):  # the mismatch check's first call of each step: recorded by note()
        dc.all_reduce(t)
    started = dict(recorder.snapshot()["started"])
    longest = 0
    for _ in range(100):
        dc.all_reduce(t)
        dc.broadcast(t, src=0)
        dc.all_to_all_single(torch.empty(2 * world), t)
        dc.all_gather_into_tensor(torch.empty(2 * world * world), t)
        dc.reduce_scatter_tensor(torch.empty(2), t)
        longest = max(longest, len(recorder.queue))
    snapshot = recorder.snapshot()
    return {
        "longest": longest,
        "added": {k: v - started.get(k, 0) for k, v in snapshot["started"].items()},
        "last": [(r["op"], r["site"], r["shape"], r["dtype"]) for r in snapshot["history"][-5:]],
        "seqs": [r["seq"] for r in snapshot["history"][-5:]],
        "total": snapshot["started"]["0"],
    }


def test_fast_path_records_are_numbered_bounded_and_described() -> None:
    """The fast paths append their records in place (``collectives._direct``): the records
    must read as ``Recorder.note``'s do, numbered per group in call order, and the queue stays
    bounded without a reader."""
    from distcompat.testing import run_on_ranks

    seen = run_on_ranks(_fast_path_records, 2)
    # only the default group's records grew; a group an earlier test made on this pool's ranks
    # may be listed with none added (seen under -n 2 once the tests' order changed)
    for rank in seen:
        assert {group: n for group, n in rank["added"].items() if n} == {"0": 500}
    for rank in seen:
        assert rank["longest"] < 256
        assert rank["last"] == [
            ("all_reduce", "?", (4,), "float32"),
            ("broadcast", "?", (4,), "float32"),
            ("all_to_all_single", "?", (4,), "float32"),
            ("all_gather_into_tensor", "?", (4,), "float32"),
            ("reduce_scatter_tensor", "?", (4,), "float32"),
        ]
        assert rank["seqs"] == list(range(rank["total"] - 5, rank["total"]))
