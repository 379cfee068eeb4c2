"""InPlace takes replicated state and Reshardable sharded state; what it cannot re-cut in
place (torch's ZeroRedundancyOptimizer, DTensor parameters) is refused by name, before any step.

One process; the ZeroRedundancyOptimizer and DTensor cases make a one-rank gloo group through a
file store (they need one to exist).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from distcompat.inplace import InPlace, InPlaceUnsupportedError


class _Shard:
    """A Stateful that holds a per-rank share (the checkpoint's Reshardable protocol)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state

    def load_resharded(self, states: list[dict[str, Any]], /) -> None:
        del states

    def step(self) -> None:
        pass


def test_a_replicated_optimizer_and_state_are_taken() -> None:
    model = torch.nn.Linear(2, 1)
    InPlace(model, torch.optim.AdamW(model.parameters()), state={"plan": object()})


def test_a_reshardable_optimizer_or_state_is_refused_without_shard_copies() -> None:
    model = torch.nn.Linear(2, 1)
    with pytest.raises(InPlaceUnsupportedError, match=r"the optimizer \(_Shard\) holds a share"):
        InPlace(model, _Shard())
    with pytest.raises(InPlaceUnsupportedError, match=r"state\['zero'\] .*shard_copies=True"):
        InPlace(model, torch.optim.SGD(model.parameters()), state={"zero": _Shard()})


def test_a_reshardable_optimizer_or_state_is_taken_with_shard_copies() -> None:
    """Kept in two places at each step (``_shards``) instead of sent from one rank."""
    model = torch.nn.Linear(2, 1)
    InPlace(model, _Shard(), shard_copies=True)
    InPlace(model, torch.optim.SGD(model.parameters()), state={"zero": _Shard()}, shard_copies=True)


@pytest.mark.usefixtures("one_rank")
def test_torchs_zero_optimizer_is_refused() -> None:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = torch.nn.Linear(2, 1)
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    with pytest.raises(InPlaceUnsupportedError, match="ZeroRedundancyOptimizer"):
        InPlace(model, zero)


@pytest.mark.usefixtures("one_rank")
def test_dtensor_parameters_are_refused() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_module

    model = distribute_module(torch.nn.Linear(2, 1), init_device_mesh("cpu", (1,)))
    with pytest.raises(InPlaceUnsupportedError, match="parameter weight is a DTensor"):
        InPlace(model, torch.optim.SGD(model.parameters()))
