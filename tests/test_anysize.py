"""distcompat.anysize in one process: the plan's split and errors, counter seeds, fixed point, and
exact mode's bookkeeping (bounds, redo, non-finite gradients, refusals). The multi-rank bit
equality is in ``test_anysize_exact.py`` (``nox -s anysize``)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from distcompat.anysize import (
    BatchSplitError,
    ExactGradients,
    ExactModeError,
    NonFiniteGradientError,
    PlanMismatchError,
    TrainPlan,
    counter_rng,
    counter_seed,
    sample_generator,
)
from distcompat.anysize._fixed import dequantize, exponent, quantize
from distcompat.data import TokenLoader, write_tokens


@given(micro=st.integers(1, 8), count=st.integers(1, 24), world=st.integers(1, 12))
def test_the_shares_cover_every_micro_batch_once_or_the_split_is_refused(
    micro: int, count: int, world: int
) -> None:
    plan = TrainPlan(global_batch=micro * count, micro_batch=micro)
    if count % world:
        with pytest.raises(BatchSplitError, match=f"do not split over {world} ranks"):
            plan.share(world_size=world, rank=0)
        assert world not in plan.valid_world_sizes()
        return
    shares = [plan.share(world_size=world, rank=r) for r in range(world)]
    covered = [m for s in shares for m in s.micro_batches]
    assert covered == list(range(count))
    assert {s.samples for s in shares} == {micro * count // world}
    assert [s.first_sample for s in shares] == [r * micro * count // world for r in range(world)]


def test_a_global_batch_that_does_not_split_names_what_would() -> None:
    with pytest.raises(BatchSplitError, match=r"not a multiple of micro_batch=4; .* 8 or 12"):
        TrainPlan(global_batch=10, micro_batch=4)
    plan = TrainPlan(global_batch=20, micro_batch=4)  # 5 micro-batches
    with pytest.raises(BatchSplitError, match=r"world sizes that work: 1, 5 .* 16 or 24 for 2"):
        plan.share(world_size=2, rank=1)
    with pytest.raises(BatchSplitError, match="positive integer"):
        TrainPlan(global_batch=0, micro_batch=1)


def test_a_plan_resumes_only_as_the_same_run() -> None:
    saved = TrainPlan(global_batch=8, micro_batch=2, seed=1, step=5).state_dict()
    assert saved["samples_consumed"] == 40
    plan = TrainPlan(global_batch=8, micro_batch=2, seed=1)
    plan.load_state_dict(saved)
    assert plan.step == 5
    with pytest.raises(PlanMismatchError, match="global_batch: saved 8, now 16"):
        TrainPlan(global_batch=16, micro_batch=2, seed=1).load_state_dict(saved)


def test_counter_seeds_depend_on_every_counter_and_not_on_a_rank() -> None:
    seeds = {counter_seed(0, step, micro) for step in range(20) for micro in range(20)}
    assert len(seeds) == 400
    assert all(0 <= s < 2**63 for s in seeds)
    with pytest.raises(ValueError, match="non-negative"):
        counter_seed(0, -1)
    draws = torch.rand(4, generator=sample_generator(9, 123))
    assert torch.equal(draws, torch.rand(4, generator=sample_generator(9, 123)))
    assert not torch.equal(draws, torch.rand(4, generator=sample_generator(9, 124)))


def test_counter_rng_restores_the_default_generator() -> None:
    torch.manual_seed(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    with counter_rng(0, 0, 0):
        torch.rand(100)
    assert torch.equal(torch.rand(3), expected)


@settings(max_examples=50, deadline=None)
@given(
    values=st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=2, max_size=12),
    split=st.integers(1, 11),
)
@example(values=[0.0, 1.401298464324817e-45], split=1)  # a subnormal: 2**-e beyond float32
def test_fixed_point_sums_have_the_same_bits_in_any_order_and_split(
    values: list[float], split: int
) -> None:
    terms = len(values)
    bound = max(abs(v) for v in values) or 1.0
    e = exponent(bound, terms)
    ints = [quantize(torch.tensor([v]), e) for v in values]
    forward = sum(ints, torch.zeros(1, dtype=torch.int64))
    cut = min(split, terms - 1)
    halves = sum(ints[cut:], torch.zeros(1, dtype=torch.int64)) + sum(
        reversed(ints[:cut]), torch.zeros(1, dtype=torch.int64)
    )
    assert torch.equal(forward, halves)
    mean = dequantize(forward, e, divisor=terms, dtype=torch.float64).item()
    exact = math.fsum(values) / terms
    assert abs(mean - exact) <= terms * math.ldexp(1.0, e - 1) / terms + 1e-300


def test_exact_gradients_sum_micro_batches_without_a_float_sum() -> None:
    model = torch.nn.Linear(2, 1, bias=False)
    exact = ExactGradients(model, micro_batches=3)
    for scale in (1.0, 2.0, 4.0):
        loss = model(torch.full((1, 2), scale)).sum()
        exact.add_loss(loss)
        loss.backward()
        assert model.weight.grad is not None
        assert not model.weight.grad.any(), "the hook leaves no float gradient to accumulate"
    step = exact.reduce()
    assert step.ok
    assert model.weight.grad is not None
    assert torch.equal(model.weight.grad, torch.full((1, 2), 7 / 3, dtype=torch.float32))
    exact.close()


def test_a_gradient_past_its_bound_asks_for_the_step_again_and_then_fits() -> None:
    model = torch.nn.Linear(1, 1, bias=False)
    exact = ExactGradients(model, micro_batches=1, headroom_bits=0)
    for expected_ok in (False, True):
        (model(torch.tensor([[1000.0]])).sum()).backward()
        step = exact.reduce()
        assert step.ok is expected_ok
        assert step.overflowed == (() if expected_ok else ("weight",))
    assert model.weight.grad is not None
    assert model.weight.grad.item() == 1000.0
    saved = exact.state_dict()
    other = ExactGradients(torch.nn.Linear(1, 1, bias=False), micro_batches=1, headroom_bits=0)
    other.load_state_dict(saved)
    assert other.state_dict()["bounds"] == saved["bounds"]


def test_a_non_finite_gradient_raises_naming_the_tensor() -> None:
    model = torch.nn.Linear(1, 1)
    exact = ExactGradients(model, micro_batches=1)
    model(torch.tensor([[math.inf]])).sum().backward()
    with pytest.raises(NonFiniteGradientError, match="weight"):
        exact.reduce()


def test_sharded_or_complex_parameters_are_refused() -> None:
    """A DTensor is simulated by a Parameter subclass of that name (FSDP2 needs a group)."""

    class DTensor(torch.nn.Parameter):
        pass

    with pytest.raises(ExactModeError, match="param0 is a DTensor"):
        ExactGradients([DTensor(torch.zeros(2))], micro_batches=1)
    with pytest.raises(ExactModeError, match="complex"):
        ExactGradients([torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))], micro_batches=1)
    with pytest.raises(ValueError, match="micro_batches=0"):
        ExactGradients(torch.nn.Linear(1, 1), micro_batches=0)


def _global_batches(
    path: str, plan: TrainPlan, sizes: list[tuple[int, int]], seq_len: int
) -> list[list[int]]:
    """Each step's global batch (window indices, in global micro-batch order) when the run goes
    through ``sizes``: (world size, steps) in turn, every new size loading rank 0's state.

    The ranks are TokenLoaders built with ``rank=``/``world_size=`` in one process (a loader has
    no collective), which is what a resized run's ranks hold."""
    state = None
    steps: list[list[int]] = []
    for world, count in sizes:
        shares = [plan.share(world_size=world, rank=r) for r in range(world)]
        loaders = [
            TokenLoader(
                path,
                batch_size=s.samples,
                seq_len=seq_len,
                seed=3,
                world_size=world,
                rank=s.rank,
                dtype=torch.uint32,
            )
            for s in shares
        ]
        if state is not None:
            for loader in loaders:
                loader.load_state_dict(state)
        streams = [iter(loader) for loader in loaders]
        for _ in range(count):
            batch: list[int] = []
            for stream in streams:  # rank order = global micro-batch order
                inputs, _ = next(stream)
                batch += (inputs[:, 0] // seq_len).tolist()
            steps.append(batch)
        state = loaders[0].state_dict()
    return steps


def test_a_resized_run_sees_the_same_global_batches_each_window_once(tmp_path: Path) -> None:
    seq_len, windows = 4, 72
    path = str(
        write_tokens(tmp_path / "t.bin", torch.arange(windows * seq_len + 1), dtype=torch.uint32)
    )
    plan = TrainPlan(global_batch=12, micro_batch=2)
    steps = windows // plan.global_batch
    one = _global_batches(path, plan, [(1, steps)], seq_len)
    assert sorted(w for batch in one for w in batch) == list(range(windows))
    for sizes in ([(2, 2), (3, steps - 2)], [(3, 3), (2, steps - 3)], [(6, 1), (1, steps - 1)]):
        assert _global_batches(path, plan, sizes, seq_len) == one, sizes
