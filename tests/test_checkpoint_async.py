"""AsyncCheckpointer: staged copies, background commit, one save in flight, errors surface."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist

from distcompat.checkpoint import (
    AsyncCheckpointer,
    CheckpointExistsError,
    CheckpointSyncError,
    committed_steps,
    load_checkpoint,
    verify_checkpoint,
)
from distcompat.checkpoint._async import stage

Runner = Callable[..., list[Any]]


class _Pair(NamedTuple):
    a: torch.Tensor
    b: int


def test_stage_copies_tensors_and_keeps_structure() -> None:
    weights, lrs = torch.zeros(3), [0.1]
    live: dict[str, Any] = {
        "w": weights,
        "nested": [torch.ones(1), (torch.ones(1), 2)],
        "pair": _Pair(torch.zeros(1), 5),
        "meta": {"lr": lrs},
    }
    staged = stage(live)
    weights.add_(7)
    lrs.append(0.2)
    assert torch.equal(staged["w"], torch.zeros(3))
    assert staged["meta"] == {"lr": [0.1]}
    assert isinstance(staged["nested"][1], tuple)
    assert isinstance(staged["pair"], _Pair)


def test_saves_run_in_the_background_from_staged_copies(tmp_path: Path) -> None:
    weights = torch.zeros(4)
    with AsyncCheckpointer() as checkpointer:
        for step in range(1, 4):
            checkpointer.save(tmp_path, step, {"w": weights}, keep_last=2, metadata={"s": step})
            weights.add_(1)  # the training loop moves on at once
    assert committed_steps(tmp_path) == [2, 3]
    for step in (2, 3):
        assert torch.equal(load_checkpoint(tmp_path, step)["w"], torch.full((4,), step - 1.0))
        assert verify_checkpoint(tmp_path, step).metadata == {"s": step}


def test_a_failed_background_save_raises_at_the_next_wait(tmp_path: Path) -> None:
    checkpointer = AsyncCheckpointer()
    checkpointer.save(tmp_path, 1, {"w": torch.ones(1)})
    checkpointer.save(tmp_path, 1, {"w": torch.ones(1)})  # waits for step 1, then tries again
    with pytest.raises(CheckpointExistsError):
        checkpointer.wait()
    assert checkpointer.wait() is None  # the error is reported once
    checkpointer.close()
    checkpointer.close()
    with pytest.raises(ValueError, match="step=-2"):
        checkpointer.save(tmp_path, -2, {})


def test_one_save_in_flight_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from distcompat.checkpoint import _async, _save

    gate = threading.Event()
    started: list[int] = []
    real = _save.save_with_group

    def slow(*args: Any, **kwargs: Any) -> Path:
        started.append(args[2])
        gate.wait(timeout=10)
        return real(*args, **kwargs)

    monkeypatch.setattr(_async, "save_with_group", slow)
    with AsyncCheckpointer() as checkpointer:
        first = checkpointer.save(tmp_path, 1, {"x": 1})
        assert not first.done()
        releaser = threading.Timer(0.2, gate.set)
        releaser.start()
        checkpointer.save(tmp_path, 2, {"x": 2})  # blocks until step 1 has committed
        assert first.done()
    releaser.join()
    assert started == [1, 2]
    assert committed_steps(tmp_path) == [1, 2]


def _rank_async(root: str) -> list[float]:
    rank = dist.get_rank()
    weights = torch.full((4,), float(rank))
    totals = []
    with AsyncCheckpointer(timeout=30) as checkpointer:
        for step in range(1, 4):
            checkpointer.save(root, step, {"w": weights, "rank": rank}, keep_last=2)
            weights.add_(10)
            total = torch.ones(1)
            dist.all_reduce(total)  # training collectives run beside the background save
            totals.append(total.item())
    return totals


def _rank_load(root: str, step: int) -> tuple[int, float]:
    state = load_checkpoint(root, step)
    return state["rank"], state["w"][0].item()


def test_async_saves_on_three_ranks(tmp_path: Path, run_on_ranks: Runner) -> None:
    assert run_on_ranks(_rank_async, 3, args=(str(tmp_path),)) == [[3.0, 3.0, 3.0]] * 3
    assert committed_steps(tmp_path) == [2, 3]
    assert run_on_ranks(_rank_load, 3, args=(str(tmp_path), 3)) == [
        (rank, rank + 20.0) for rank in range(3)
    ]


def _rank_async_alone(root: str) -> str:
    with AsyncCheckpointer(timeout=2) as checkpointer:
        if dist.get_rank() == 0:
            checkpointer.save(root, 1, {"x": 1})
            try:
                checkpointer.wait()
            except CheckpointSyncError as exc:
                return str(exc)
    return "skipped"


def test_async_save_from_one_rank_fails_fast(tmp_path: Path, run_on_ranks: Runner) -> None:
    message, skipped = run_on_ranks(_rank_async_alone, 2, args=(str(tmp_path),), timeout=60)
    assert "rank(s) 1 of 2 did not call it within 2s" in message
    assert skipped == "skipped"
    assert committed_steps(tmp_path) == []
