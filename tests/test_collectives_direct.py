"""The fast paths (``collectives.direct``) on a real 2-rank gloo group.

The fast ``allreduce`` numbers its calls for the mismatch check as the general path's
``_agree.count`` does (it counts through it): a replay through ``count`` must match.
"""

from __future__ import annotations

import time
from typing import Any

import torch

import distcompat.distributed as dist
from distcompat.collectives import unchecked
from distcompat.collectives.agree import _state as _agree
from distcompat.collectives.direct import _common, _reduce
from distcompat.testing import run_on_ranks


def _numbering() -> dict[str, Any]:
    group = dist.new_group(ranks=[0, 1])
    tensor = torch.ones(3)
    dist.all_reduce(tensor, group=group)  # the group's first call looks it up (general path)
    state = _agree.state_for(group)
    before, agreed_before = state.seq, len(state.agreed)
    for _ in range(4):
        dist.all_reduce(tensor, group=group)  # fast path: the step repeats
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)  # a new step: checked
    after_fast = (state.seq, state.previous, list(state.history[before : state.seq]))
    with unchecked():
        dist.all_reduce(tensor, group=group)
    paused_seq = state.seq
    # the same calls through count() on a fresh record, from the same starting point
    replay = _agree._State(store=state.store, rank=state.rank, world=state.world)
    replay.seq, replay.previous = before, hash(state.history[before - 1])
    for name in ("SUM",) * 4 + ("MAX",):
        _agree.count(replay, ("all_reduce", torch.float32, torch.Size([3]), name, None))
    dist.destroy_process_group(group)
    return {
        "fast": after_fast,
        "replay": (replay.seq, replay.previous, list(replay.history[before : replay.seq])),
        "new_steps": len(state.agreed) - agreed_before,
        "paused_seq": paused_seq,
        "value": tensor[0].item(),
    }


def test_fast_all_reduce_numbers_calls_as_count_does() -> None:
    for found in run_on_ranks(_numbering, 2, timeout=60):
        assert found["fast"] == found["replay"]
        assert found["fast"][0] == found["paused_seq"]  # unchecked(): not numbered
        assert found["new_steps"] == 2  # SUM after SUM, MAX after SUM: checked, remembered
        assert found["value"] == 64.0  # six sums of two ranks' equal values, one max


def _default_groups() -> bool:
    return _common._default_group() is dist.GroupMember.WORLD is not None


def test_the_default_group_is_read_where_torch_keeps_it() -> None:
    """The fast paths' shortcut to torch's default group names the same group as the property."""
    assert all(run_on_ranks(_default_groups, 2, timeout=60))


def _reuse() -> dict[str, Any]:
    from shm_cases import configured

    with configured("off"):  # the gloo fast path is under test (auto sends these to shared memory)
        return _reuse_on_gloo()


def _reuse_on_gloo() -> dict[str, Any]:
    rank = dist.get_rank()
    dist.all_reduce(torch.ones(1))  # the group's first call looks it up (general path)
    _reduce._spare_rows.clear()
    out = torch.empty(3)
    results = []
    for step in range(4):  # sync calls: the second onwards receives into the first's buffer
        data = torch.arange(6.0) * (rank + 1) + step
        dist.reduce_scatter_tensor(out, data)
        results.append(out.tolist())
    kept = [id(rows) for rows in _reduce._spare_rows[(torch.float32, 2, 3)]]
    # Two in flight at once on rank 0: each needs a buffer of its own. Rank 1 joins late, so
    # rank 0's first call cannot finish before its second starts; rank 1's may (then it reuses).
    first, second = torch.empty(3), torch.empty(3)
    if rank == 1:
        time.sleep(0.5)
    a = dist.reduce_scatter_tensor(first, torch.full((6,), 1.0 + rank), async_op=True)
    b = dist.reduce_scatter_tensor(second, torch.full((6,), 10.0 * (rank + 1)), async_op=True)
    b.wait()
    a.wait()
    maxed = torch.empty(2)
    dist.reduce_scatter_tensor(
        maxed, torch.tensor([rank, -rank, 5.0, 2.0 * rank]), op=dist.ReduceOp.MAX
    )
    return {
        "results": results,
        "kept": len(kept),
        "async": (first.tolist(), second.tolist()),
        "kept_after": len(_reduce._spare_rows[(torch.float32, 2, 3)]),
        "max": maxed.tolist(),
    }


def test_reduce_scatter_reuses_only_finished_receive_buffers() -> None:
    """Tiny reduce-scatters keep their receive buffer for the next call, never one in use."""
    found = run_on_ranks(_reuse, 2, timeout=60)
    for rank, got in enumerate(found):
        for step, result in enumerate(got["results"]):
            data = [(torch.arange(6.0) * (r + 1) + step) for r in range(2)]
            expected = (data[0] + data[1])[3 * rank : 3 * rank + 3].tolist()
            assert result == expected
        assert got["kept"] == 1  # one sync call at a time: one buffer, reused
        assert got["async"] == ([3.0] * 3, [30.0] * 3)
        # rank 0's two async calls each had their own; rank 1's first may have finished first
        assert got["kept_after"] == 2 if rank == 0 else 1 <= got["kept_after"] <= 2
    assert found[0]["max"] == [1.0, 0.0]
    assert found[1]["max"] == [5.0, 2.0]
