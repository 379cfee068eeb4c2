"""``gather_for_metrics`` (``data._gather``): alone, and on real gloo groups of 2, 3 and 4 ranks.

Each rank evaluates its shard of 1001 samples under every sampler and mode, with a nested value;
every rank checks that it got each sample of the pass exactly once, in the order one process
walking the same sampler sees, and that a metric on the result equals the one-process metric
exactly. Shared memory on and off; every other default on.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler

import distcompat
import distcompat.distributed as dist
from distcompat.data import ShardedSampler, gather_for_metrics
from distcompat.testing import run_on_ranks
from shm_cases import configured

N = 1001


@dataclasses.dataclass(frozen=True)
class Eval:
    kind: str  # "pad", "strided", "drop", "resumed" (ShardedSampler), "torch", "torch-drop", "none"
    n: int = N
    seed: int = 0
    shuffle: bool = True


def _sampler(case: Eval, world: int, rank: int) -> Any:
    data = range(case.n)
    if case.kind.startswith("torch"):
        drop = case.kind == "torch-drop"
        return DistributedSampler(
            data,  # type: ignore[arg-type]  # any sized dataset: only its len() is read
            world,
            rank,
            shuffle=case.shuffle,
            seed=case.seed,
            drop_last=drop,
        )
    if case.kind == "none":
        return None
    if case.kind == "resumed":  # a third of the epoch done on one rank, the rest here, padded
        first = ShardedSampler(data, 1, 0, shuffle=case.shuffle, seed=case.seed)
        done = iter(first)
        for _ in range(case.n // 3):
            next(done)
        resumed = ShardedSampler(data, world, rank, shuffle=case.shuffle, seed=case.seed)
        resumed.load_state_dict(first.state_dict())
        return resumed
    return ShardedSampler(data, world, rank, shuffle=case.shuffle, seed=case.seed, mode=case.kind)  # type: ignore[arg-type]


def _order(case: Eval, world: int) -> list[int]:
    """What one process walking the same sampler's epoch sees (the samples of this pass)."""
    if case.kind == "none":
        return [i for r in range(world) for i in range(r, case.n, world)]  # rank order
    alone = case.kind.replace("drop", "pad").replace("resumed", "pad")
    whole = list(_sampler(dataclasses.replace(case, kind=alone), 1, 0))
    if case.kind == "resumed":
        return whole[case.n // 3 :]
    if case.kind in ("drop", "torch-drop"):
        return whole[: case.n // world * world]
    return whole


def _scores(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(n)
    return torch.randint(0, 5, (n,), generator=gen), torch.randint(0, 5, (n,), generator=gen)


def _evaluate(cases: list[Eval], asynchronous: bool) -> list[str]:
    """Each case: this rank's shard through gather_for_metrics, checked against one process."""
    rank, world = dist.get_rank(), dist.get_world_size()
    problems = []
    for mode in ("on", "off"):
        with configured(mode):
            for case in cases:
                sampler = _sampler(case, world, rank)
                mine = (
                    list(sampler)
                    if sampler is not None
                    else list(range(rank, case.n, world))  # no sampler: any split works
                )
                preds, labels = _scores(case.n)
                idx = torch.tensor(mine, dtype=torch.int64)
                value = {
                    "idx": idx,
                    "scored": (preds[idx], labels[idx]),
                    "rows": [torch.stack([idx, -idx], 1).to(torch.float64)],
                }
                if asynchronous:
                    work = gather_for_metrics(value, sampler, async_op=True)
                    got = work.get_future().wait()
                    work.wait()
                else:
                    got = gather_for_metrics(value, sampler)
                order = torch.tensor(_order(case, world), dtype=torch.int64)
                if not torch.equal(got["idx"], order):
                    problems.append(f"{mode} {case}: not each sample once in the sampler's order")
                pred, label = got["scored"]
                accuracy = (pred == label).double().mean().item()
                alone = (preds[order] == labels[order]).double().mean().item()
                if accuracy != alone or not torch.equal(label, labels[order]):
                    problems.append(f"{mode} {case}: accuracy {accuracy} differs from {alone}")
                if not torch.equal(got["rows"][0], torch.stack([order, -order], 1).double()):
                    problems.append(f"{mode} {case}: the nested list's rows differ")
    return problems


ALL_KINDS = ["pad", "strided", "drop", "resumed", "torch", "torch-drop", "none"]


def _misfits() -> list[str]:
    """Values that do not fit: every rank raises, the rank at fault says why, the group lives."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sampler = ShardedSampler(range(10), world, rank, shuffle=False, mode="strided")
    mine = torch.tensor(list(sampler))
    misfits: list[tuple[Any, Any]] = [
        (mine[:-1] if rank == 1 else mine, sampler),  # rank 1 dropped a sample
        ({"a": mine} if rank == 0 else {"b": mine}, sampler),  # other keys
        (mine if rank == 0 else mine.float(), sampler),  # another dtype
        (mine if rank == 0 else [mine, "text"], sampler),  # not a tensor
        (mine, sampler if rank == 0 else None),  # no sampler on one side
    ]
    messages = []
    for value, given_sampler in misfits:
        try:
            gather_for_metrics(value, given_sampler)
            messages.append("no error")
        except (TypeError, ValueError) as exc:
            messages.append(f"{type(exc).__name__}: {exc}")
    after = torch.ones(2)
    dist.all_reduce(after)  # the group still works
    return [*messages, str(after.sum().item())]


def test_values_that_do_not_fit_raise_on_every_rank() -> None:
    rank0, rank1 = run_on_ranks(_misfits, 2, timeout=60)
    assert "rank 1 could not take part" in rank0[0], rank0[0]
    assert "rank 1 passed 4 samples; its sampler dealt it 5" in rank1[0], rank1[0]
    for found in (rank0, rank1):
        assert "rank 1 passed a value whose keys, dtypes" in found[1], found[1]
        assert "rank 1 passed a value whose keys, dtypes" in found[2], found[2]
        assert "rank 1's sampler differs from rank 0's" in found[4], found[4]
        assert found[5] == "4.0", found
    assert "TypeError: value[1] is a str" in rank1[3], rank1[3]
    assert "ValueError: rank 1 could not take part" in rank0[3], rank0[3]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_sampler_gives_each_sample_once_in_order_on_every_rank(world_size: int) -> None:
    cases = [Eval(kind) for kind in ALL_KINDS] + [Eval("pad", shuffle=False)]
    asynchronous = world_size == 2
    found = run_on_ranks(_evaluate, world_size, args=(cases, asynchronous), timeout=120)
    assert found == [[]] * world_size


_evals = st.builds(
    Eval,
    kind=st.sampled_from(ALL_KINDS),
    n=st.integers(4, 80),
    seed=st.integers(0, 1000),
    shuffle=st.booleans(),
)


@pytest.mark.parametrize("world_size", [4])
@settings(
    max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(cases=st.lists(_evals, min_size=4, max_size=8))
def test_random_sizes_give_each_sample_once(world_size: int, cases: list[Eval]) -> None:
    found = run_on_ranks(_evaluate, world_size, args=(cases, False), timeout=120)
    assert found == [[]] * world_size


def test_alone_the_value_comes_back() -> None:
    value = {"loss": torch.arange(4.0), "pair": (torch.ones(4, 2), [torch.zeros(4)])}
    assert gather_for_metrics(value) is value
    assert gather_for_metrics(value, ShardedSampler(range(4))) is value
    assert distcompat.gather_for_metrics(value, async_op=True).get_future().value() is value
    with pytest.raises(ValueError, match="passed 4 samples; its sampler dealt it 5"):
        gather_for_metrics(value, ShardedSampler(range(5)))
    with pytest.raises(ValueError, match="num_replicas=2; the group has 1"):
        gather_for_metrics(value, ShardedSampler(range(4), num_replicas=2, rank=0))
    with pytest.raises(TypeError, match="sampler is a SequentialSampler"):
        gather_for_metrics(value, torch.utils.data.SequentialSampler(range(4)))
    with pytest.raises(ValueError, match="first dimension must be its samples"):
        gather_for_metrics({"a": torch.ones(4), "b": torch.ones(3)})
    with pytest.raises(ValueError, match="holds no tensor"):
        gather_for_metrics({})
