"""The distributed checkpoint protocol: save, latest, load, retention, verification, errors.

Single-process behaviour runs in this process; multi-rank saves run on real gloo groups through
distcompat.testing.run_on_ranks (the rank bodies are the module-level ``_rank_*`` functions).
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import distcompat
from distcompat.checkpoint import (
    CheckpointCorruptError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointSyncError,
    WorldSizeMismatchError,
    committed_steps,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from distcompat.collectives import PeerLostError
from distcompat.testing import RankFailedError

Runner = Callable[..., list[Any]]


def _state(step: int, rank: int = 0) -> dict[str, Any]:
    return {"step": step, "rank": rank, "w": torch.full((8,), float(10 * step + rank))}


# --- single process ------------------------------------------------------------------------------


def test_save_latest_load_round_trip(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path / "absent") is None
    for step in (1, 5, 3):
        save_checkpoint(tmp_path, step, _state(step), metadata={"loss": step / 10})
    assert committed_steps(tmp_path) == [1, 3, 5]
    assert latest_checkpoint(tmp_path) == 5
    loaded = load_checkpoint(tmp_path)
    assert loaded["step"] == 5
    assert torch.equal(loaded["w"], _state(5)["w"])
    assert load_checkpoint(tmp_path, 3)["step"] == 3
    assert verify_checkpoint(tmp_path, 1).metadata == {"loss": 0.1}


def test_no_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        load_checkpoint(tmp_path)
    save_checkpoint(tmp_path, 1, _state(1))
    with pytest.raises(CheckpointNotFoundError, match="step-2"):
        load_checkpoint(tmp_path, 2)


def test_a_committed_step_is_never_overwritten(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 4, _state(4))
    with pytest.raises(CheckpointExistsError, match="never overwritten"):
        save_checkpoint(tmp_path, 4, _state(99))
    assert load_checkpoint(tmp_path, 4)["step"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4"]


def test_retention_counts_committed_steps_only_and_deletes_after_commit(tmp_path: Path) -> None:
    (tmp_path / "step-0.tmp-abc123").mkdir(parents=True)  # a save killed long ago
    (tmp_path / "step-9.tmp-def456").mkdir()  # a save (maybe) still running: newer, kept
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, _state(step), keep_last=2)
        assert committed_steps(tmp_path)[-1] == step  # the new step is there before old go
    assert committed_steps(tmp_path) == [4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4", "step-5", "step-9.tmp-def456"]


def test_latest_skips_incomplete_and_damaged_steps(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, _state(step))
    (tmp_path / "step-3" / "rank-00000.pt").unlink()  # damaged after commit
    (tmp_path / "step-7.tmp-0a1b").mkdir()  # uncommitted
    (tmp_path / "step-8").mkdir()  # not made by us: no manifest
    assert latest_checkpoint(tmp_path) == 2
    with pytest.raises(CheckpointCorruptError, match="missing"):
        load_checkpoint(tmp_path, 3)


def test_a_flipped_byte_is_caught_by_the_checksum(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 1, _state(1))
    shard = tmp_path / "step-1" / "rank-00000.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match="sha256"):
        load_checkpoint(tmp_path, 1)
    assert latest_checkpoint(tmp_path) == 1  # sizes still match: only checksums see it
    assert latest_checkpoint(tmp_path, checksums=True) is None
    load_checkpoint(tmp_path, 1, verify=False)  # the opt-out skips the read (and the check)


def test_a_tampered_manifest_is_corrupt(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 1, _state(1))
    manifest = tmp_path / "step-1" / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["files"][0]["name"] = "../../etc/passwd"
    manifest.write_text(json.dumps(doc))
    with pytest.raises(CheckpointCorruptError, match="not a plain name"):
        verify_checkpoint(tmp_path, 1)
    manifest.write_text("{not json")
    with pytest.raises(CheckpointCorruptError, match="not valid JSON"):
        load_checkpoint(tmp_path, 1)


def test_bad_arguments_fail_before_anything_is_written(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="step=-1"):
        save_checkpoint(tmp_path, -1, {})
    with pytest.raises(ValueError, match="keep_last=0"):
        save_checkpoint(tmp_path, 1, {}, keep_last=0)
    with pytest.raises(TypeError, match="JSON"):
        save_checkpoint(tmp_path, 1, {}, metadata={"bad": object()})
    assert list(tmp_path.iterdir()) == []


def test_weights_only_is_the_default(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 1, {"obj": threading.Lock})  # a class: not allowed by weights_only
    with pytest.raises(Exception, match=r"[Ww]eights only"):
        load_checkpoint(tmp_path, 1)
    assert load_checkpoint(tmp_path, 1, weights_only=False)["obj"] is threading.Lock


def test_concurrent_saves_of_one_step_commit_exactly_one(tmp_path: Path) -> None:
    """Two savers (threads here; two jobs in life) race for one step in one directory."""
    barrier = threading.Barrier(4)
    outcomes: dict[int, str] = {}

    def save(who: int) -> None:
        barrier.wait()
        try:
            save_checkpoint(tmp_path, 7, _state(7, rank=who))
            outcomes[who] = "committed"
        except CheckpointExistsError:
            outcomes[who] = "refused"

    threads = [threading.Thread(target=save, args=(who,)) for who in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes.values()) == ["committed", "refused", "refused", "refused"]
    winner = next(who for who, outcome in outcomes.items() if outcome == "committed")
    assert load_checkpoint(tmp_path, 7)["rank"] == winner  # whole, and the winner's
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-7"]  # losers cleaned up


def test_concurrent_saves_of_different_steps_all_commit(tmp_path: Path) -> None:
    threads = [
        threading.Thread(target=save_checkpoint, args=(tmp_path, step, _state(step)))
        for step in range(1, 7)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert committed_steps(tmp_path) == list(range(1, 7))
    assert all(verify_checkpoint(tmp_path, step).step == step for step in range(1, 7))


# --- multi-rank, on real gloo groups --------------------------------------------------------------


def _rank_save(root: str, step: int, keep_last: int | None, replicated: bool) -> str:
    rank = dist.get_rank()
    return save_checkpoint(
        root, step, _state(step, rank), keep_last=keep_last, replicated=replicated
    ).name


def _rank_load(root: str, step: int | None) -> tuple[int, int]:
    state = load_checkpoint(root, step)
    return state["step"], state["rank"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_multi_rank_save_and_load(tmp_path: Path, run_on_ranks: Runner, world_size: int) -> None:
    root = str(tmp_path)
    for step in (1, 2, 3):
        names = run_on_ranks(_rank_save, world_size, args=(root, step, 2, False))
        assert names == [f"step-{step}"] * world_size
    assert committed_steps(tmp_path) == [2, 3]
    manifest = verify_checkpoint(tmp_path, 3)
    assert manifest.world_size == world_size
    assert [f.rank for f in manifest.files] == list(range(world_size))
    assert run_on_ranks(_rank_load, world_size, args=(root, None)) == [
        (3, rank) for rank in range(world_size)
    ]


def test_a_different_world_size_errors_clearly(tmp_path: Path, run_on_ranks: Runner) -> None:
    run_on_ranks(_rank_save, 2, args=(str(tmp_path), 1, None, False))
    with pytest.raises(WorldSizeMismatchError, match="2 ranks but this job has 1"):
        load_checkpoint(tmp_path, 1)
    assert load_checkpoint(tmp_path, 1, rank=1)["rank"] == 1  # explicit re-sharding by hand
    with pytest.raises(RankFailedError, match="WorldSizeMismatchError"):
        run_on_ranks(_rank_load, 3, args=(str(tmp_path), 1))


def test_replicated_state_loads_on_any_world_size(tmp_path: Path, run_on_ranks: Runner) -> None:
    run_on_ranks(_rank_save, 2, args=(str(tmp_path), 1, None, True))
    assert [f.name for f in verify_checkpoint(tmp_path, 1).files] == ["rank-00000.pt"]
    assert run_on_ranks(_rank_load, 3, args=(str(tmp_path), 1)) == [(1, 0)] * 3
    assert load_checkpoint(tmp_path, 1)["rank"] == 0


def _rank_save_only_on(root: str, callers: tuple[int, ...]) -> str:
    if dist.get_rank() not in callers:
        return "skipped"
    save_checkpoint(root, 1, _state(1), timeout=2.0)
    return "saved"


@pytest.mark.parametrize(
    ("world_size", "callers", "expected"),
    [
        (2, (0,), "on rank 0: rank(s) 1 of 2 did not call it within 2s"),
        (2, (1,), "on rank 1: rank 0 did not call it within 2s"),
        (3, (0, 1), "on rank 0: rank(s) 2 of 3 did not call it within 2s"),
    ],
)
def test_save_from_some_ranks_only_fails_fast_naming_the_missing(
    tmp_path: Path,
    run_on_ranks: Runner,
    world_size: int,
    callers: tuple[int, ...],
    expected: str,
) -> None:
    with pytest.raises(RankFailedError) as caught:
        run_on_ranks(_rank_save_only_on, world_size, args=(str(tmp_path), callers), timeout=60)
    assert isinstance(caught.value.exception, CheckpointSyncError)
    message = str(caught.value.exception)
    assert expected in message
    assert "never inside `if rank == 0:`" in message
    assert committed_steps(tmp_path) == []


def _rank_save_late(root: str, late_s: float, dump_dir: str) -> list[str] | None:
    """The last rank reaches the save late; the others' arrival wait is reported, then all save."""
    rank, world = dist.get_rank(), dist.get_world_size()
    with distcompat.watchdog(timeout=1.0, action="report", dump_dir=dump_dir) as watching:
        # a finished collective first: the arrival's wait must not be charged to its record
        distcompat.all_reduce(torch.ones(1))
        if rank == world - 1:
            time.sleep(late_s)
        save_checkpoint(root, 1, _state(1, rank), timeout=30.0)
        report = watching.last_report
    if rank != 0:
        return None
    assert report is not None, "no hang report"
    # the first rank to wait a second declares it: rank 0, or another rank that came in time
    pattern = r"rank \d+: save_checkpoint\(step=1\) at \S+test_checkpoint\.py:\d+ not complete"
    assert re.match(pattern, report.trigger), report.trigger
    return [state.phase if state is not None else "no answer" for state in report.states.values()]


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_arrival_wait_is_watched(tmp_path: Path, run_on_ranks: Runner, world_size: int) -> None:
    phases, *_ = run_on_ranks(
        _rank_save_late, world_size, args=(str(tmp_path / "ckpt"), 2.5, str(tmp_path)), timeout=60
    )
    waiting = "in the checkpoint arrival of save_checkpoint(step=1)"
    assert phases == [waiting] * (world_size - 1) + [""], phases  # the late rank waits nowhere
    assert committed_steps(tmp_path / "ckpt") == [1]


def _rank_save_killed(root: str, record: str) -> None:
    """The last rank dies before the save; the others' arrival ends with PeerLostError at once."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    started = time.monotonic()
    try:
        save_checkpoint(root, 1, _state(1, rank), timeout=30.0)
        seen: dict[str, Any] = {"error": "none"}
    except PeerLostError as exc:
        seen = {"error": type(exc).__name__, "peers": list(exc.peers), "message": str(exc)}
    seen["after_s"] = time.monotonic() - started
    Path(f"{record}.rank{rank}").write_text(json.dumps(seen))


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_rank_killed_before_the_save_is_named_at_once(
    tmp_path: Path, run_on_ranks: Runner, world_size: int
) -> None:
    record = tmp_path / "seen"
    with pytest.raises(RankFailedError):  # the victim died, by design
        run_on_ranks(_rank_save_killed, world_size, args=(str(tmp_path), str(record)), timeout=30)
    for rank in range(world_size - 1):
        seen = json.loads(Path(f"{record}.rank{rank}").read_text())
        assert seen["error"] == "PeerLostError", seen
        assert seen["peers"] == [world_size - 1], seen
        assert seen["after_s"] < 3.0, seen
    assert committed_steps(tmp_path) == []


def _rank_save_step(root: str) -> str:
    step = 5 if dist.get_rank() == 0 else 6
    return save_checkpoint(root, step, _state(step)).name


def test_ranks_saving_different_steps_are_refused(tmp_path: Path, run_on_ranks: Runner) -> None:
    with pytest.raises(RankFailedError, match=r"different steps \(rank 0: 5, rank 1: 6\)"):
        run_on_ranks(_rank_save_step, 2, args=(str(tmp_path),))
    assert list(tmp_path.iterdir()) == []


class _Unpicklable:
    def __reduce__(self) -> Any:
        raise RuntimeError("rank state cannot be pickled")


def _rank_save_failing_on(root: str, bad_rank: int) -> str:
    rank = dist.get_rank()
    state: dict[str, Any] = _state(2, rank)
    if rank == bad_rank:
        state["bad"] = _Unpicklable()
    try:
        save_checkpoint(root, 2, state)
    except (CheckpointSyncError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "committed"


def test_one_rank_failing_to_write_commits_nothing(tmp_path: Path, run_on_ranks: Runner) -> None:
    run_on_ranks(_rank_save, 3, args=(str(tmp_path), 1, None, False))
    results = run_on_ranks(_rank_save_failing_on, 3, args=(str(tmp_path), 1))
    assert len(set(results)) == 1  # the same error on every rank, the failing one too
    assert results[0].startswith(
        "CheckpointWriteError: save_checkpoint(step=2): not committed (step 1 stays the newest "
        "committed): rank 1 could not write "
    )
    assert results[0].endswith("rank-00001.pt: RuntimeError: rank state cannot be pickled")
    assert committed_steps(tmp_path) == [1]  # the earlier step is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]  # temp dir removed


def _rank_save_through_side_group(root: str) -> tuple[str, bool]:
    """Pretend the default group cannot carry CPU tensors (as under nccl): a gloo side group."""
    from distcompat.checkpoint import _sync

    real = _sync.carries_cpu_tensors
    _sync.carries_cpu_tensors = lambda backend: False
    try:
        name = save_checkpoint(root, 1, _state(1, dist.get_rank())).name
        side = _sync._side_group
        return name, side is not None and side[1] is not dist.group.WORLD
    finally:
        _sync.carries_cpu_tensors = real
        _sync._side_group = None


def test_a_gloo_side_group_serves_non_cpu_backends(tmp_path: Path, run_on_ranks: Runner) -> None:
    assert (
        run_on_ranks(_rank_save_through_side_group, 2, args=(str(tmp_path),))
        == [("step-1", True)] * 2
    )
    assert [f.rank for f in verify_checkpoint(tmp_path, 1).files] == [0, 1]
