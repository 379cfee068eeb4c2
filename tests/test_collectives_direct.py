"""The fast paths (``collectives._direct``) on a real 2-rank gloo group.

``allreduce`` numbers its calls with ``_agree.count`` written out in place; these tests hold the
written-out copy to what ``count`` itself records.
"""

from __future__ import annotations

from typing import Any

import torch

import distcompat.distributed as dist
from distcompat.collectives import _agree, _direct, unchecked
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
    return _direct._WORLD._default_pg is dist.GroupMember.WORLD is not None


def test_the_default_group_is_read_where_torch_keeps_it() -> None:
    """The fast paths' shortcut to torch's default group names the same group as the property."""
    assert all(run_on_ranks(_default_groups, 2, timeout=60))
