"""Which copies of sharded state a regroup goes back to, and what a ZeRO optimizer does with
them. The ring's exchange over real ranks: tests/test_inplace.py (``--zero``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from distcompat.demo._optim import OptimizerStateError, ZeroAdamW
from distcompat.inplace import StateLostError
from distcompat.inplace._shards import (
    KEPT,
    Generation,
    Shards,
    _pack,
    _unpack,
    holders,
    latest,
    sharded,
)


def test_the_latest_generation_whose_every_share_is_held_is_taken() -> None:
    held = {(4, 1): {0, 1, 2}, (5, 1): {0, 2}, (5, 2): {0, 1}}
    world = {(4, 1): 3, (5, 1): 3, (5, 2): 2}
    assert latest(held, world=world, steps={4, 5}) == (5, 2)
    assert latest(held, world=world, steps={4}) == (4, 1)  # no other state stands at step 5


def test_a_share_held_nowhere_raises_state_lost() -> None:
    with pytest.raises(StateLostError, match="gone with both ranks that held it"):
        latest({(5, 1): {0, 2}}, world={(5, 1): 3}, steps={5})


@given(st.lists(st.integers(0, 50), min_size=1, max_size=8))
def test_a_rank_keeps_the_last_two_generations(steps: list[int]) -> None:
    shards = Shards({"the optimizer": object()})
    for step in steps:
        shards._add((step, 0), Generation(1, {0: _pack({})}))
    assert sorted(shards.held()) == sorted({(s, 0) for s in steps})[-KEPT:]


@given(st.lists(st.integers(0, 3), min_size=2, max_size=12))
def test_every_share_is_held_on_another_machine(nodes: list[int]) -> None:
    """Whatever the machines' rank counts; on one machine, by another rank (a ring)."""
    held = holders(nodes)
    if len(set(nodes)) > 1:
        assert all(nodes[holder] != nodes[rank] for rank, holder in enumerate(held))
    else:
        assert sorted(held) == list(range(len(nodes)))
        assert all(holder != rank for rank, holder in enumerate(held))


def test_even_machines_hold_one_share_each() -> None:
    """Ranks laid out evenly (torchrun's nodes): each rank holds exactly one other's share."""
    held = holders([0, 0, 1, 1, 2, 2])
    assert held == [2, 3, 4, 5, 0, 1]


def test_a_packed_state_comes_back_the_same() -> None:
    """Tensors of any dtype, shape (empty, 0-d) and nesting; everything else as pickled."""
    state: dict[str, Any] = {
        "shards": [{"master": torch.randn(5), "count": torch.tensor(3)}, (torch.zeros(0, 2),)],
        "steps": 7,
        "mask": torch.tensor([True, False]),
        "half": torch.randn(2, 3).half(),
    }
    back = _unpack(_pack(state))
    assert back["steps"] == 7
    for got, want in (
        (back["shards"][0]["master"], state["shards"][0]["master"]),
        (back["shards"][0]["count"], state["shards"][0]["count"]),
        (back["shards"][1][0], state["shards"][1][0]),
        (back["mask"], state["mask"]),
        (back["half"], state["half"]),
    ):
        assert got.dtype == want.dtype
        assert torch.equal(got, want)
    assert isinstance(back["shards"][1], tuple)


def test_a_share_is_a_copy() -> None:
    """What a rank keeps is the state at the step, whatever the optimizer writes after."""
    live = {"master": torch.zeros(3)}
    share = _pack(live)
    live["master"].add_(1.0)
    assert torch.equal(_unpack(share)["master"], torch.zeros(3))


def test_the_sharded_objects_are_those_that_can_be_re_cut() -> None:
    model = torch.nn.Linear(2, 1)
    zero = ZeroAdamW(model.parameters(), lr=0.1)
    assert sharded(zero, {"plan": object()}) == {"the optimizer": zero}
    assert sharded(torch.optim.SGD(model.parameters()), {"zero": zero}) == {"state['zero']": zero}
    plain = torch.optim.SGD(model.parameters())  # a Stateful that the user named "optimizer"
    assert sharded(plain, {"optimizer": zero}) == {"state['optimizer']": zero}


def _halves(state: dict[str, Any]) -> list[dict[str, Any]]:
    """Split a one-rank ZeroAdamW state as 2 ranks would have saved it."""
    out = []
    for rank in range(2):
        shards = []
        for shard in state["shards"]:
            size = (shard["master"].numel() + 1) // 2
            part = {k: v[rank * size : (rank + 1) * size].clone() for k, v in shard.items()}
            shards.append(
                {k: torch.cat([v, v.new_zeros(size - v.numel())]) for k, v in part.items()}
            )
        out.append({**state, "rank": rank, "world_size": 2, "shards": shards})
    return out


def test_zero_adamw_re_cut_sets_its_parameters_from_the_master_weights() -> None:
    """A step broken off midway (parameters half updated, a gradient launched) is undone."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = ZeroAdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    states = _halves(opt.state_dict())
    with torch.no_grad():
        model.weight.add_(1.0)  # a gather that wrote part of the parameters
    model(torch.ones(1, 3)).sum().backward()  # the next step's reduce-scatter launched
    opt.load_resharded(states)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    assert opt.steps_done == 1
    assert opt._launched == 0


def test_zero_adamw_refuses_states_of_another_parameter_count() -> None:
    opt = ZeroAdamW(torch.nn.Linear(3, 1).parameters(), lr=0.1)
    states = _halves(opt.state_dict())
    for state in states:
        state["shards"] = state["shards"][:1]
    with pytest.raises(OptimizerStateError, match=r"hold \[1\] parameters, this optimizer 2"):
        opt.load_resharded(states)


@pytest.mark.usefixtures("one_rank")
def test_going_back_drops_the_copies_of_the_steps_undone() -> None:
    """One rank (a 1-rank gloo group): copies kept at steps 5 and 6; the group goes back to 5
    (no survivor's other state stands at 6). The step-6 copies are of the run undone: gone,
    and the optimizer is step 5's."""
    model = torch.nn.Linear(3, 1)
    opt = ZeroAdamW(model.parameters(), lr=0.1)
    shards = Shards({"the optimizer": opt})
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    shards.keep(5, 0)
    at_five = {k: v.clone() for k, v in model.state_dict().items()}
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    shards.keep(6, 0)
    assert shards.choose({5}) == (5, 0)
    shards.load((5, 0))
    assert sorted(shards.held()) == [(5, 0)]
    assert opt.steps_done == 1
    assert all(torch.equal(model.state_dict()[k], v) for k, v in at_five.items())


def test_a_share_unpacks_without_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch installs without numpy (a bare ``pip install torch``): simulated by making
    ``Tensor.numpy`` raise as torch does there."""

    def no_numpy(self: torch.Tensor) -> Any:
        raise RuntimeError("Numpy is not available")

    monkeypatch.setattr(torch.Tensor, "numpy", no_numpy)
    back = _unpack(_pack({"master": torch.arange(3.0), "steps": 2}))
    assert back["steps"] == 2
    assert torch.equal(back["master"], torch.arange(3.0))
