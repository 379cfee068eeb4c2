"""``resume`` / ``training_state``: the newest checkpoint every rank has, loaded on every rank.

Single-process behaviour runs in this process. Agreement between ranks runs on real gloo groups
through ``run_on_ranks``. Kills are real: ``tests/_resume_script.py`` runs as one process per
rank (torchrun's worker contract, ``_rank_processes.run_ranks``), a rank SIGKILLs itself, and a
second launch of the same script resumes; its result is compared with an uninterrupted launch.
Resumes on another world size save with real gloo ranks at one size and resume at another (warm
``run_on_ranks`` pools); the 1 -> 4 and 4 -> 1 cases are marked ``anysize`` (their own nox
session).
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import signal
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import distcompat
from _rank_processes import Ended, run_ranks
from distcompat.checkpoint import (
    PerRankStateError,
    ResumeStateError,
    Stateful,
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


# --- another world size (real gloo groups at both sizes) -----------------------------------------

ROWS = 24  # samples of the sampler every cross-size run shares


class Plan:
    """A training plan's stand-in: replicated plain state, restored through ``plan=``."""

    def __init__(self, global_batch: int) -> None:
        self.global_batch, self.samples = global_batch, 0

    def state_dict(self) -> dict[str, int]:
        return {"global_batch": self.global_batch, "samples": self.samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.global_batch, self.samples = state["global_batch"], state["samples"]


class Slices:
    """A toy sharded state (as a ZeRO optimizer splits its moments): a vector of 10 split over
    the ranks with ``tensor_split`` (uneven at 3 ranks: 4, 3, 3), re-split by ``load_resharded``."""

    def __init__(self, whole: torch.Tensor) -> None:
        self.rank, self.world = distcompat.get_rank(), distcompat.get_world_size()
        self.part = torch.tensor_split(whole, self.world)[self.rank].clone()
        self.states_given = 0

    def state_dict(self) -> dict[str, Any]:
        return {"part": self.part, "rank": self.rank}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.part = state["part"].clone()

    def load_resharded(self, states: Sequence[dict[str, Any]]) -> None:
        self.states_given = len(states)
        whole = torch.cat([s["part"] for s in states])  # rank order: the whole vector again
        self.part = torch.tensor_split(whole, self.world)[self.rank].clone()


def _mlp(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)
    )


def _steps(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, sampler: ShardedSampler
) -> None:
    """Three steps of DDP (gradients all-reduced by its reducer) on this rank's samples."""
    ddp = DistributedDataParallel(model)
    indices = iter(sampler)
    for _ in range(3):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(next(indices)))
        ddp(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _rank_save_replicated(root: str) -> dict[str, Any]:
    """A DDP model and its AdamW (replicated on every rank), a sampler and a plan, saved."""
    model = _mlp(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    sampler, plan = ShardedSampler(range(ROWS), seed=5), Plan(12)
    _steps(model, optimizer, sampler)
    plan.samples = 3 * distcompat.get_world_size()
    objects: dict[str, Stateful] = {
        "model": model,
        "optimizer": optimizer,
        "loader": sampler,
        "plan": plan,
    }
    save_checkpoint(
        root, 3, training_state(model=model, optimizer=optimizer, loader=sampler, plan=plan)
    )
    return {name: obj.state_dict() for name, obj in objects.items()}


def _rank_resume_replicated(root: str) -> dict[str, Any]:
    model = _mlp(1)  # other weights and no moments: all of it must be replaced
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    plan = Plan(1)
    objects: dict[str, Stateful] = {"model": model, "optimizer": optimizer, "plan": plan}
    sampler = ShardedSampler(range(ROWS), seed=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = resume(root, model=model, optimizer=optimizer, loader=sampler, plan=plan)
    state = {name: obj.state_dict() for name, obj in objects.items()}
    return {
        **state,
        "consumed": sampler.state_dict()["consumed"],
        "resumed": (resumed.step, resumed.world_size, resumed.resized),
        "warnings": [w.category.__name__ for w in caught],
    }


def _equal(got: Any, want: Any) -> bool:
    """Bit for bit: tensors of the same dtype, shape and bytes; plain values equal."""
    if isinstance(want, torch.Tensor):
        return (
            isinstance(got, torch.Tensor)
            and got.dtype == want.dtype
            and torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
        )
    if isinstance(want, dict):
        return (
            isinstance(got, dict)
            and got.keys() == want.keys()
            and all(_equal(got[k], want[k]) for k in want)
        )
    if isinstance(want, list | tuple):
        return len(got) == len(want) and all(_equal(a, b) for a, b in zip(got, want, strict=True))
    return bool(got == want)


@pytest.mark.parametrize(
    ("saved", "now"),
    [
        (2, 3),
        (3, 2),
        pytest.param(1, 4, marks=pytest.mark.anysize),
        pytest.param(4, 1, marks=pytest.mark.anysize),
    ],
)
def test_replicated_state_follows_another_world_size(
    tmp_path: Path, run_on_ranks: Runner, saved: int, now: int
) -> None:
    """Model, AdamW, sampler and plan saved by ``saved`` DDP ranks come back bit for bit on
    ``now`` ranks: every saving rank's copy is checked equal, rank 0's is loaded, the loader
    continues at the global position, and every rank is told its RNG states were not restored."""
    states = run_on_ranks(_rank_save_replicated, saved, args=(str(tmp_path),))
    assert all(_equal(s, states[0]) for s in states[1:])  # replicated, so the check passes
    results = run_on_ranks(_rank_resume_replicated, now, args=(str(tmp_path),))
    for rank, result in enumerate(results):
        for name in ("model", "optimizer", "plan"):
            assert _equal(result[name], states[0][name]), (rank, name)
        assert result["optimizer"]["state"][0]["step"] == 3
        assert result["consumed"] == states[0]["loader"]["consumed"] == 3 * saved
        assert result["resumed"] == (3, saved, True)
        assert result["warnings"] == ["RngStateWarning"]


def _rank_save_sharded(root: str) -> None:
    model = _mlp(0)
    whole = torch.arange(10, dtype=torch.float64) * 1.5 - 2.0
    save_checkpoint(root, 7, training_state(model=model, optimizer=Slices(whole), rng=False))


def _rank_resume_sharded(root: str) -> tuple[list[float], int, bool]:
    model, slices = _mlp(1), Slices(torch.zeros(10, dtype=torch.float64))
    resume(root, model=model, optimizer=slices)
    return (
        slices.part.tolist(),
        slices.states_given,
        _equal(model.state_dict(), _mlp(0).state_dict()),
    )


@pytest.mark.parametrize(("saved", "now"), [(2, 3), (3, 2)])
def test_a_reshardable_object_gets_every_saving_ranks_state(
    tmp_path: Path, run_on_ranks: Runner, saved: int, now: int
) -> None:
    """A Reshardable object's ``load_resharded`` receives the state of each of the ``saved``
    ranks, in rank order, and takes exactly this rank's share at ``now`` ranks; the replicated
    model beside it is checked and loaded as usual."""
    run_on_ranks(_rank_save_sharded, saved, args=(str(tmp_path),))
    results = run_on_ranks(_rank_resume_sharded, now, args=(str(tmp_path),))
    whole = torch.arange(10, dtype=torch.float64) * 1.5 - 2.0
    for rank, (part, given, model_restored) in enumerate(results):
        assert part == torch.tensor_split(whole, now)[rank].tolist()
        assert given == saved
        assert model_restored


def _rank_save_zero(root: str) -> dict[str, torch.Tensor]:
    """ZeRO-1 by hand: rank r's AdamW steps the parameters i with i % world == r, then each
    parameter is broadcast from its owner. The model stays replicated; the moments are per rank."""
    rank, world = distcompat.get_rank(), distcompat.get_world_size()
    model = _mlp(0)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW([p for i, p in enumerate(params) if i % world == rank], lr=0.05)
    for step in range(2):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()  # the same input everywhere: the same gradients
        optimizer.step()
        optimizer.zero_grad()
        for i, p in enumerate(params):
            distcompat.broadcast(p.data, src=i % world)
    save_checkpoint(root, 2, training_state(model=model, optimizer=optimizer, rng=False))
    return model.state_dict()


def _rank_resume_zero(root: str, world_change: str) -> tuple[str, dict[str, torch.Tensor]]:
    """Resume the ZeRO-1 run: its optimizer split for this world size ("follow"), or as saving
    rank 0's ("rank0", which loads rank 0's file on every rank)."""
    model = _mlp(1)
    params = list(model.parameters())
    rank, world = distcompat.get_rank(), distcompat.get_world_size()
    owner, owners = (rank, world) if world_change == "follow" else (0, 2)
    optimizer = torch.optim.AdamW([p for i, p in enumerate(params) if i % owners == owner], lr=0.05)
    try:
        resume(root, model=model, optimizer=optimizer, world_change=world_change)  # type: ignore[arg-type]
    except PerRankStateError as exc:
        return str(exc), model.state_dict()
    return "", model.state_dict()


def test_per_rank_state_that_is_not_reshardable_is_refused_on_every_rank(
    tmp_path: Path, run_on_ranks: Runner
) -> None:
    """A hand-made ZeRO-1 AdamW (not Reshardable) saved by 2 ranks, resumed on 3: every rank
    raises PerRankStateError naming the optimizer and its first keys that differ, with how
    many, before anything is restored; ``world_change="rank0"`` loads rank 0's file unchecked."""
    saved = run_on_ranks(_rank_save_zero, 2, args=(str(tmp_path),))
    assert _equal(saved[1], saved[0])
    results = run_on_ranks(_rank_resume_zero, 3, args=(str(tmp_path), "follow"))
    messages = {message for message, _ in results}
    assert len(messages) == 1, messages  # the same verdict on every rank
    message = messages.pop()
    assert "optimizer: 6 of " in message  # 3 parameters per rank, exp_avg and exp_avg_sq each
    assert "state.0.exp_avg, state.0.exp_avg_sq, state.1.exp_avg, state.1.exp_avg_sq, " in message
    assert "..." in message
    assert "saving rank(s) 1 differ from rank 0" in message
    assert "model:" not in message  # the replicated model passed its check
    assert "saved by 2 rank(s) and this run has 3" in message
    fresh = _mlp(1).state_dict()
    assert all(_equal(model, fresh) for _, model in results)  # raised before anything restored
    unchecked = run_on_ranks(_rank_resume_zero, 3, args=(str(tmp_path), "rank0"))
    assert [message for message, _ in unchecked] == [""] * 3
    assert all(_equal(model, saved[0]) for _, model in unchecked)


def _rank_save_two_steps(root: str) -> None:
    for step in (1, 2):
        save_checkpoint(root, step, training_state(model=_mlp(step), rng=False))


def _rank_resume_model(root: str) -> tuple[int, tuple[str, ...], bool]:
    model = _mlp(0)
    resumed = resume(root, model=model)
    return resumed.step, resumed.skipped, _equal(model.state_dict(), _mlp(1).state_dict())


def test_a_damaged_file_of_another_saving_rank_drops_the_step_on_every_rank(
    tmp_path: Path, run_on_ranks: Runner
) -> None:
    """Saving rank 1's file of step 2 is damaged after its commit (same size): on 3 ranks the
    rank that reads it for the check fails its SHA-256, the outcome is gathered, and every rank
    resumes from step 1 instead, naming why step 2 was skipped."""
    run_on_ranks(_rank_save_two_steps, 2, args=(str(tmp_path),))
    path = tmp_path / "step-2" / "rank-00001.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    results = run_on_ranks(_rank_resume_model, 3, args=(str(tmp_path),))
    for step, skipped, restored in results:
        assert step == 1
        assert restored
        assert any(
            note.startswith("step-2: rank 1: CheckpointCorruptError") and "rank-00001.pt" in note
            for note in skipped
        ), skipped


class _Records(logging.Handler):
    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _rank_resume_rng(
    root: str, rng_change: str, world_change: str = "follow"
) -> tuple[list[str], list[str], str]:
    """Resume, recording warnings, this rank's WARNING log lines and the error raised."""
    handler = _Records(logging.WARNING)
    records = handler.records
    logger = logging.getLogger("distcompat.checkpoint")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            resume(root, model=_mlp(1), rng_change=rng_change, world_change=world_change)  # type: ignore[arg-type]
        error = ""
    except PerRankStateError as exc:
        error = str(exc)
    finally:
        logger.removeHandler(handler)
    said = [f"{w.category.__name__}: {w.message} [{Path(w.filename).name}]" for w in caught]
    return said, [r.getMessage() for r in records if r.levelno >= logging.WARNING], error


def _rank_save_rng(root: str, rng: bool) -> None:
    torch.manual_seed(distcompat.get_rank())  # per-rank streams
    save_checkpoint(root, 1, training_state(model=_mlp(0), rng=rng))


def test_per_rank_rng_states_warn_or_raise_on_another_world_size(
    tmp_path: Path, run_on_ranks: Runner
) -> None:
    """RNG states saved by 2 ranks, resumed on 3: a RngStateWarning on every rank and a WARNING
    on rank 0's log by default; PerRankStateError naming the key with ``rng_change="error"``
    (with ``world_change="rank0"`` too: never silence); nothing at all for a checkpoint saved
    with ``rng=False``."""
    with_rng, without = str(tmp_path / "rng"), str(tmp_path / "none")
    run_on_ranks(_rank_save_rng, 2, args=(with_rng, True))
    run_on_ranks(_rank_save_rng, 2, args=(without, False))

    warned = run_on_ranks(_rank_resume_rng, 3, args=(with_rng, "warn"))
    for rank, (said, logged, error) in enumerate(warned):
        assert error == ""
        assert len(said) == 1, said
        assert said[0].startswith("RngStateWarning: resume("), said
        assert "saved per rank by 2 rank(s) and are not restored on 3 rank(s)" in said[0]
        assert "Counter-based RNG" in said[0]
        assert said[0].endswith("[test_checkpoint_resume.py]")  # it points at resume's caller
        assert len(logged) == (1 if rank == 0 else 0), logged
    assert "saved per rank by 2 rank(s)" in warned[0][1][0]

    refused = run_on_ranks(_rank_resume_rng, 3, args=(with_rng, "error"))
    assert all(said == [] and 'RNG states (key "rng")' in error for said, _, error in refused)
    assert len({error for _, _, error in refused}) == 1

    unchecked = run_on_ranks(_rank_resume_rng, 3, args=(with_rng, "error", "rank0"))
    assert all('RNG states (key "rng")' in error for _, _, error in unchecked)  # rank0 too

    quiet = run_on_ranks(_rank_resume_rng, 3, args=(without, "error"))
    assert quiet == [([], [], "")] * 3


def test_resume_arguments_and_the_plan_in_one_process(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="rng_change='loud'"):
        resume(tmp_path, rng_change="loud")  # type: ignore[arg-type]
    plan = Plan(8)
    plan.samples = 40
    save_checkpoint(tmp_path, 5, training_state(plan=plan))
    restored = Plan(1)
    resumed = resume(tmp_path, plan=restored)
    assert (restored.global_batch, restored.samples) == (8, 40)
    assert (resumed.resized, resumed.world_size) == (False, 1)


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
