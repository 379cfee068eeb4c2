"""The mismatch check's per-group bookkeeping (``collectives._agree.count``), in one process.

Only the counting is exercised here: no peer is asked (``check`` needs a group; the
distributed behaviour is tested with real gloo groups in tests/test_collectives_mismatch.py).
The store is a placeholder object, never called by ``count``.
"""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch

from distcompat.collectives.agree import _state as _agree


def _state() -> Any:
    return _agree._State(store=cast(Any, object()), rank=0, world=2)


def test_count_hands_each_new_call_its_own_number() -> None:
    state = _state()
    first = ("all_reduce", torch.float32, torch.Size([4]), "SUM", None)
    second = ("broadcast", torch.float32, torch.Size([4]), None, 0)
    counted_first = _agree.count(state, first)
    counted_second = _agree.count(state, second)  # counted before the first is checked
    assert counted_first is not None
    assert counted_second is not None
    assert (counted_first[0], counted_second[0]) == (0, 1)
    assert state.history[:2] == [first, second]


def test_count_returns_nothing_for_a_step_agreed_before() -> None:
    state = _state()
    sig = ("all_reduce", torch.float32, torch.Size([4]), "SUM", None)
    counted = _agree.count(state, sig)
    assert counted is not None
    state.agreed.add(counted[1])  # what check() does once every rank agreed
    state.previous = 0  # the same step again: (previous code, code)
    assert _agree.count(state, sig) is None
    assert state.seq == 2  # still counted


def test_count_is_off_without_a_store() -> None:
    state = _agree._State(store=None, rank=0, world=2)
    assert _agree.count(state, ("barrier", None, None, None, None)) is None
    assert state.seq == 0


def _paused() -> bool:
    return _agree.paused  # read through a call: mypy would narrow the attribute after an assert


def test_unchecked_pauses_counting_and_restores_it() -> None:
    state = _state()
    sig = ("all_reduce", torch.float32, torch.Size([4]), "SUM", None)
    with _agree.unchecked():
        assert _paused()
        with _agree.unchecked():  # nested: still paused after the inner block
            pass
        assert _paused()
        assert _agree.count(state, sig) is None
    assert not _paused()
    assert state.seq == 0


def test_a_rebuilt_call_keeps_every_dimension_of_the_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """The call a rank makes to join a peer's pending one after a mismatch has the peer's shape,
    all of it (a 2-d shape was read as its first dimension). Mocked: no process group, no shared
    memory, the backend call replaced by one that notes the tensor's shape."""
    from distcompat.collectives.agree._posts import rebuild_call
    from distcompat.collectives.shm import _path as shm

    seen: list[torch.Size] = []
    monkeypatch.setattr(shm, "engine_for", lambda *_: None)  # no shared memory here
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, **_: seen.append(t.shape))
    call = rebuild_call("all_reduce, dtype=torch.float32, shape=[4, 5], reduce_op=SUM", None)
    assert call is not None
    call()
    assert seen == [torch.Size([4, 5])]
