"""ShardedSampler: a DistributedSampler drop-in that reshuffles itself, resumes on any world size.

W ranks are simulated in one process (one sampler per rank, stepped together like a training loop);
one test runs real gloo ranks to check the defaults come from the group.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from distcompat.data import (
    EmptyShardError,
    EpochRepeatWarning,
    LoaderStateError,
    ShardedSampler,
    ShardMode,
)
from distcompat.testing import run_on_ranks

EVEN: list[ShardMode] = ["pad", "drop"]
SAMPLER_MODES: list[ShardMode] = ["strided", "pad", "drop"]


def _ranks(n: int, world: int, **kwargs: object) -> list[ShardedSampler]:
    return [ShardedSampler(range(n), world, r, **kwargs) for r in range(world)]  # type: ignore[arg-type]


def _min_items(n: int, world: int, mode: ShardMode) -> bool:
    return n >= (1 if mode == "pad" else world)


# --- drop-in -----------------------------------------------------------------------------------


@given(st.integers(1, 60), st.integers(1, 8), st.booleans())
def test_same_shards_as_distributed_sampler_without_shuffle(
    n: int, world: int, drop_last: bool
) -> None:
    if drop_last and n < world:
        return
    for rank in range(world):
        ours = ShardedSampler(range(n), world, rank, shuffle=False, drop_last=drop_last)
        theirs: DistributedSampler[int] = DistributedSampler(
            range(n),  # type: ignore[arg-type]
            world,
            rank,
            shuffle=False,
            drop_last=drop_last,
        )
        assert list(ours) == list(theirs)
        assert len(ours) == len(theirs) == ours.num_samples == theirs.num_samples
        assert ours.total_size == theirs.total_size


def test_works_in_a_dataloader() -> None:
    data = TensorDataset(torch.arange(20))
    samplers = _ranks(20, 3, seed=5)  # pad: 7 each
    batches = [[b[0] for b in DataLoader(data, batch_size=4, sampler=s)] for s in samplers]
    assert [sum(len(b) for b in rank) for rank in batches] == [7, 7, 7]
    seen = torch.cat([b for rank in batches for b in rank]).tolist()
    assert set(seen) == set(range(20))
    assert all(s.epoch == 1 for s in samplers)


def test_refusals_name_the_problem() -> None:
    with pytest.raises(ValueError, match="does not take mode='contiguous'"):
        ShardedSampler(range(4), 2, 0, mode="contiguous")
    with pytest.raises(ValueError, match="drop_last=True contradicts mode='pad'"):
        ShardedSampler(range(4), 2, 0, drop_last=True, mode="pad")
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size=2\), got 2"):
        ShardedSampler(range(4), 2, 2)
    with pytest.raises(EmptyShardError, match="3 sample"):
        ShardedSampler(range(3), 4, 0, drop_last=True)
    with pytest.raises(EmptyShardError):
        ShardedSampler(range(0), 1, 0)


# --- properties over an epoch --------------------------------------------------------------


@given(st.integers(0, 120), st.integers(1, 8), st.sampled_from(SAMPLER_MODES), st.integers(0, 99))
def test_one_epoch_covers_the_data_as_the_mode_promises(
    n: int, world: int, mode: ShardMode, seed: int
) -> None:
    if not _min_items(n, world, mode):
        with pytest.raises(EmptyShardError):
            ShardedSampler(range(n), world, 0, seed=seed, mode=mode)
        return
    shards = [list(s) for s in _ranks(n, world, seed=seed, mode=mode)]
    seen = Counter(i for shard in shards for i in shard)
    counts = {len(shard) for shard in shards}
    if mode == "strided":
        assert seen == Counter(range(n))
        assert max(counts) - min(counts) <= 1
    elif mode == "pad":
        assert set(seen) == set(range(n))
        assert counts == {-(-n // world)}
    else:
        assert max(seen.values()) == 1
        assert counts == {n // world}
    assert shards == [list(s) for s in _ranks(n, world, seed=seed, mode=mode)]  # deterministic


@given(st.integers(10, 200), st.integers(1, 8), st.integers(0, 2**32))
def test_order_differs_across_epochs_even_without_set_epoch(n: int, world: int, seed: int) -> None:
    samplers = _ranks(n, world, seed=seed, mode="strided")
    first = [list(s) for s in samplers]
    second = [list(s) for s in samplers]  # no set_epoch: the next pass is the next epoch
    assert first != second
    flat = [sorted(itertools.chain(*passes)) for passes in (first, second)]
    assert flat[0] == flat[1] == list(range(n))
    explicit = _ranks(n, world, seed=seed, mode="strided")
    for s in explicit:
        s.set_epoch(1)  # the DistributedSampler habit gives the same epoch-1 order
    assert [list(s) for s in explicit] == second


def test_repeating_a_completed_epoch_warns_loudly() -> None:
    sampler = ShardedSampler(range(10), 2, 0, seed=1)
    sampler.set_epoch(0)
    first = list(sampler)
    with pytest.warns(EpochRepeatWarning, match=r"set_epoch\(0\): epoch 0 was already completed"):
        sampler.set_epoch(0)  # the classic bug: a constant passed every epoch
    assert list(sampler) == first


def test_breaking_out_and_iterating_again_continues_the_epoch() -> None:
    sampler = ShardedSampler(range(10), 1, 0, seed=2)
    it = iter(sampler)
    head = [next(it) for _ in range(4)]
    tail = list(sampler)
    full = list(ShardedSampler(range(10), 1, 0, seed=2))
    assert head + tail == full


# --- resume --------------------------------------------------------------------------------


@settings(max_examples=150)
@given(
    n=st.integers(0, 150),
    old_world=st.integers(1, 8),
    new_world=st.integers(1, 8),
    mode=st.sampled_from(SAMPLER_MODES),
    shuffle=st.booleans(),
    stop=st.floats(0, 1, allow_subnormal=False),  # torch 2.4 inductor kernels set FTZ
    seed=st.integers(0, 2**16),
)
def test_resume_on_any_world_size_covers_the_epoch_once(
    n: int,
    old_world: int,
    new_world: int,
    mode: ShardMode,
    shuffle: bool,
    stop: float,
    seed: int,
) -> None:
    if not (_min_items(n, old_world, mode) and _min_items(n, new_world, mode)):
        return
    before = _ranks(n, old_world, seed=seed, shuffle=shuffle, mode=mode)
    iters = [iter(s) for s in before]
    steps = int(stop * min(len(s) for s in before))  # every rank takes a sample per step
    seen = [next(it) for _ in range(steps) for it in iters]
    states = [s.state_dict() for s in before]
    assert all(state == states[0] for state in states)
    assert states[0]["consumed"] == min(steps * old_world, n)
    after = _ranks(n, new_world, seed=seed + 1, shuffle=shuffle, mode=mode)  # seed comes from state
    for s in after:
        s.load_state_dict(states[0])
    rest = [list(s) for s in after]
    consumed = min(steps * old_world, n)  # pad rounds may run past the end
    left = n - consumed
    if left == 0 or (mode == "drop" and left < new_world):  # nothing left: the next epoch begins
        following = _ranks(n, new_world, seed=seed, shuffle=shuffle, mode=mode)
        for s in following:
            s.set_epoch(1)
        assert rest == [list(s) for s in following]
        return
    counts = Counter(seen + [i for shard in rest for i in shard])
    if mode == "strided":
        assert counts == Counter(range(n))  # exactly one full pass
    elif mode == "pad":
        assert set(counts) == set(range(n))
        assert {len(shard) for shard in rest} == {-(-left // new_world)}
    else:
        assert max(counts.values()) == 1
        assert sum(counts.values()) == consumed + left // new_world * new_world
        assert {len(shard) for shard in rest} == {left // new_world}
    if new_world == old_world:  # the very indices an uninterrupted run gives
        fresh = _ranks(n, old_world, seed=seed, shuffle=shuffle, mode=mode)
        for rank, (s, shard) in enumerate(zip(fresh, rest, strict=True)):
            assert list(s) == seen[rank::old_world] + shard
    assert all(s.epoch == 1 for s in after)


def test_local_consumed_accounts_for_prefetching() -> None:
    samplers = _ranks(40, 2, seed=3)
    iters = [iter(s) for s in samplers]
    for it in iters:
        for _ in range(8):  # the loader fetched 8 per rank, the loop trained on 5
            next(it)
    state = samplers[0].state_dict(local_consumed=5)
    assert state["consumed"] == 10
    resumed = _ranks(40, 2)
    for s in resumed:
        s.load_state_dict(state)
    fresh = [list(s) for s in _ranks(40, 2, seed=3)]
    assert [list(s) for s in resumed] == [shard[5:] for shard in fresh]
    with pytest.raises(ValueError, match=r"local_consumed must be an int in \[0, 8\] .*got 9"):
        samplers[0].state_dict(local_consumed=9)


def test_state_of_other_data_is_refused() -> None:
    state = ShardedSampler(range(10), 1, 0).state_dict()
    with pytest.raises(LoaderStateError, match="num_samples=10 but this ShardedSampler has"):
        ShardedSampler(range(11), 1, 0).load_state_dict(state)
    with pytest.raises(LoaderStateError, match="consumed must be an int"):
        ShardedSampler(range(10), 1, 0).load_state_dict({**state, "consumed": "3"})
    with pytest.raises(LoaderStateError, match="outside"):
        ShardedSampler(range(10), 1, 0).load_state_dict({**state, "consumed": 11})


# --- a real group ----------------------------------------------------------------------------


def _rank_epoch(n: int) -> tuple[list[int], int]:
    sampler = ShardedSampler(range(n), seed=4)  # rank and world from the group
    return list(sampler), sampler.num_replicas


def test_on_real_gloo_ranks_defaults_come_from_the_group() -> None:
    (a, world_a), (b, world_b) = run_on_ranks(_rank_epoch, 2, args=(11,))
    assert world_a == world_b == 2
    assert len(a) == len(b) == 6  # padded to 12
    assert set(a) | set(b) == set(range(11))
