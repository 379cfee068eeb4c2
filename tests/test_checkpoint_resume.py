"""``resume`` / ``training_state``: the newest checkpoint every rank has, loaded on every rank.

Single-process behaviour runs in this process. Agreement between ranks runs on real gloo groups
through ``run_on_ranks``. Kills are real: ``tests/_resume_script.py`` runs as one process per
rank (torchrun's worker contract, ``_rank_processes.run_ranks``), a rank SIGKILLs itself, and a
second launch of the same script resumes; its result is compared with an uninterrupted launch.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import distcompat
from _rank_processes import Ended, run_ranks
from distcompat.checkpoint import (
    ResumeStateError,
    committed_steps,
    resume,
    save_checkpoint,
    training_state,
)
from distcompat.data import ShardedSampler
from distcompat.testing import RankFailedError

Runner = Callable[..., list[Any]]
SCRIPT = Path(__file__).with_name("_resume_script.py")


def _trio() -> tuple[torch.nn.Linear, torch.optim.Optimizer, ShardedSampler]:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, optimizer, ShardedSampler(range(10), num_replicas=1, rank=0, seed=3)


def _train_one(model: torch.nn.Linear, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


# --- single process ------------------------------------------------------------------------------


def test_nothing_saved_is_a_fresh_start_that_changes_nothing(tmp_path: Path) -> None:
    model, optimizer, sampler = _trio()
    before = [p.clone() for p in model.parameters()]
    resumed = resume(tmp_path / "absent", model=model, optimizer=optimizer, loader=sampler)
    assert (resumed.step, resumed.fresh, resumed.directory, resumed.skipped) == (0, True, None, ())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_resume_restores_model_optimizer_loader_rng_and_extra(tmp_path: Path) -> None:
    model, optimizer, sampler = _trio()
    _train_one(model, optimizer)
    it = iter(sampler)
    _ = next(it), next(it), next(it)
    torch.manual_seed(11)
    random.seed(12)
    state = training_state(
        model=model, optimizer=optimizer, loader=sampler, extra={"losses": [3.5, 2.5]}
    )
    save_checkpoint(tmp_path, 30, state)
    after_save = (torch.rand(3), random.random())
    expected_model = {k: v.clone() for k, v in model.state_dict().items()}
    expected_rest = list(it)

    fresh_model, fresh_optimizer, fresh_sampler = _trio()
    _train_one(fresh_model, fresh_optimizer)  # different weights and moments: must be replaced
    resumed = resume(tmp_path, model=fresh_model, optimizer=fresh_optimizer, loader=fresh_sampler)
    assert resumed.step == 30
    assert resumed.world_size == 1
    assert resumed.directory == tmp_path / "step-30"
    assert resumed.extra == {"losses": [3.5, 2.5]}
    for key, value in fresh_model.state_dict().items():
        assert torch.equal(value, expected_model[key]), key
    assert fresh_optimizer.state_dict()["state"][0]["step"] == 1
    assert torch.equal(
        fresh_optimizer.state_dict()["state"][0]["exp_avg"],
        optimizer.state_dict()["state"][0]["exp_avg"],
    )
    assert list(fresh_sampler) == expected_rest  # the loader continues where the save was
    assert torch.equal(torch.rand(3), after_save[0])  # the RNG streams continue from the save
    assert random.random() == after_save[1]


def test_torn_and_damaged_newer_folders_are_skipped_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, optimizer, _ = _trio()
    save_checkpoint(tmp_path, 10, training_state(model=model, optimizer=optimizer))
    save_checkpoint(tmp_path, 20, training_state(model=model, optimizer=optimizer))
    (tmp_path / "step-30.tmp-0123abcd").mkdir()  # a save killed mid-way: never committed
    (tmp_path / "step-30.tmp-0123abcd" / "rank-00000.pt").write_bytes(b"torn")
    with (tmp_path / "step-20" / "rank-00000.pt").open("ab") as f:  # damaged after its commit
        f.write(b"x")
    with caplog.at_level(logging.INFO, logger="distcompat.checkpoint"):
        resumed = resume(tmp_path, model=model, optimizer=optimizer)
    assert resumed.step == 10
    assert any(s.startswith("step-30.tmp-0123abcd: never committed") for s in resumed.skipped)
    assert any(s.startswith("step-20:") and "bytes" in s for s in resumed.skipped)
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("step-30.tmp-0123abcd" in m for m in logged)
    assert any("step-20" in m for m in logged)


def test_a_checksum_failure_falls_back_to_the_previous_step(tmp_path: Path) -> None:
    model, _, _ = _trio()
    save_checkpoint(tmp_path, 1, training_state(model=model))
    save_checkpoint(tmp_path, 2, training_state(model=model))
    path = tmp_path / "step-2" / "rank-00000.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the load's SHA-256 check sees it
    path.write_bytes(bytes(data))
    resumed = resume(tmp_path, model=model)
    assert resumed.step == 1
    assert "CheckpointCorruptError" in resumed.skipped[-1]


def test_a_plain_state_dict_is_refused_with_the_fix(tmp_path: Path) -> None:
    model, _, _ = _trio()
    save_checkpoint(tmp_path, 5, {"model": model.state_dict()})
    with pytest.raises(ResumeStateError, match=r"not saved with training_state\(\)"):
        resume(tmp_path, model=model)
    save_checkpoint(tmp_path, 6, training_state(model=model))
    with pytest.raises(ResumeStateError, match="holds no optimizer state"):
        resume(tmp_path, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_world_change_argument_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="world_change='never'"):
        resume(tmp_path, world_change="never")  # type: ignore[arg-type]


# --- ranks that see different folders (real gloo groups) ------------------------------------------


def _rank_resume_from_own_view(views: list[str]) -> tuple[int, tuple[str, ...]]:
    model = torch.nn.Linear(2, 2)
    resumed = resume(views[distcompat.get_rank()], model=model)
    return resumed.step, resumed.skipped


def _rank_save(root: str, steps: list[int]) -> None:
    for step in steps:
        save_checkpoint(root, step, training_state(model=torch.nn.Linear(2, 2)))


def _save_views(root: Path, run_on_ranks: Runner, steps_per_rank: list[list[int]]) -> list[str]:
    """Save on 2 real ranks, then give each rank a copy of the root with the steps it sees."""
    full = root / "full"
    run_on_ranks(_rank_save, 2, args=(str(full), sorted({s for v in steps_per_rank for s in v})))
    views = []
    for rank, steps in enumerate(steps_per_rank):
        for step in steps:
            shutil.copytree(full / f"step-{step}", root / f"view{rank}" / f"step-{step}")
        views.append(str(root / f"view{rank}"))
    return views


def test_a_rank_that_lags_holds_the_others_to_a_step_it_sees(
    tmp_path: Path, run_on_ranks: Runner
) -> None:
    """Simulated lag: each rank reads its own copy of the root, rank 1's without step-20 yet."""
    views = _save_views(tmp_path, run_on_ranks, [[10, 20], [10]])
    results = run_on_ranks(_rank_resume_from_own_view, 2, args=(views,))
    assert [step for step, _ in results] == [10, 10]
    assert any("step-20: not seen by rank(s) [1]" in note for note in results[0][1])


def test_ranks_with_no_step_in_common_fail_together(tmp_path: Path, run_on_ranks: Runner) -> None:
    """Simulated: rank 0's copy holds only step-10, rank 1's only step-20 (a node-local root)."""
    views = _save_views(tmp_path, run_on_ranks, [[10], [20]])
    with pytest.raises(RankFailedError, match="none in common") as failure:
        run_on_ranks(_rank_resume_from_own_view, 2, args=(views,))
    assert "CheckpointSyncError" in str(failure.value)


def _rank_resume_strict(root: str) -> int:
    return resume(root, model=torch.nn.Linear(2, 2), world_change="error").step


def test_another_world_size_can_be_refused(tmp_path: Path, run_on_ranks: Runner) -> None:
    save_checkpoint(tmp_path, 3, training_state(model=torch.nn.Linear(2, 2)))  # world size 1
    with pytest.raises(RankFailedError, match="WorldSizeMismatchError"):
        run_on_ranks(_rank_resume_strict, 2, args=(str(tmp_path),))


# --- real kills, then a restart ------------------------------------------------------------------


def _launch(tmp_path: Path, world: int, name: str, *flags: str) -> list[Ended]:
    args = ["--ckpt", str(tmp_path / "ckpt"), "--result", str(tmp_path / f"{name}.json"), *flags]
    return run_ranks(SCRIPT, world, args=args, timeout=90)


def _result(tmp_path: Path, name: str, ends: list[Ended]) -> dict[str, Any]:
    codes = [e.returncode for e in ends]
    assert codes == [0] * len(ends), f"{name}: exit codes {codes}\n{ends[0].stderr[-3000:]}"
    result: dict[str, Any] = json.loads((tmp_path / f"{name}.json").read_text())
    return result


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("uninterrupted")
    return _result(root, "ref", _launch(root, 2, "ref"))


def _killed(ends: list[Ended], rank: int) -> None:
    assert ends[rank].returncode == -signal.SIGKILL, [e.returncode for e in ends]
    survivors = [e.returncode for e in ends if e.rank != rank]
    assert all(code not in (0, None) for code in survivors), survivors  # failed fast, not hung


@pytest.mark.slow
def test_kills_between_and_during_saves_resume_bit_identically(
    tmp_path: Path, uninterrupted: dict[str, Any]
) -> None:
    """Launch 1 loses rank 1 between two saves; launch 2 resumes and loses it inside a save."""
    root = tmp_path / "ckpt"
    _killed(_launch(tmp_path, 2, "first", "--kill", "1@5"), rank=1)
    assert committed_steps(root) == [2, 4]  # saves every 2 steps; step 5 never finished

    _killed(_launch(tmp_path, 2, "second", "--kill", "1@8", "--kill-in", "save"), rank=1)
    assert committed_steps(root) == [4, 6]  # resumed after 4, saved 6, killed writing 8
    assert [p.name for p in root.iterdir() if p.name.startswith("step-8.tmp-")]  # torn, left

    result = _result(tmp_path, "third", _launch(tmp_path, 2, "third"))
    assert result["resumed_step"] == 6
    assert any(s.startswith("step-8.tmp-") for s in result["skipped"])
    assert result["seen"] == [1] * 24  # each sample trained on once in the committed history
    assert result["sha256"] == uninterrupted["sha256"]


@pytest.mark.slow
def test_a_restart_on_fewer_ranks_sees_every_sample_exactly_once(tmp_path: Path) -> None:
    # 30 samples, 1 per rank per step: 3 ranks consumed 12 by the commit of step 4; the 18 left
    # re-shard over 2 ranks as 9 steps (mode "drop" drops none of them), none repeated.
    _killed(_launch(tmp_path, 3, "killed", "--samples", "30", "--kill", "2@5"), rank=2)
    assert committed_steps(tmp_path / "ckpt") == [2, 4]
    result = _result(tmp_path, "restart", _launch(tmp_path, 2, "restart", "--samples", "30"))
    assert result["world_size"] == 2
    assert result["resumed_step"] == 4
    assert result["last_step"] == 4 + 9
    assert result["seen"] == [1] * 30
