"""FSDP2 model and optimizer saved with DCP on one world size load on another, bit for bit.

Real gloo ranks through ``run_on_ranks``, whose ranks join with :func:`distcompat.init_distributed`
(every default on: the protected group, shared memory auto, the mismatch check, the watchdog).
Each side builds the same 3-layer MLP under FSDP2 (``fully_shard`` per Linear and on the root),
with AdamW. The saving side trains a few steps, gathers the full model and optimizer state dicts
(``get_state_dict`` with ``full_state_dict=True``) and saves the sharded ones with
``torch.distributed.checkpoint``; the loading side, on another world size (a shard of 16 rows is
uneven at 3 ranks), loads them with DCP, sets them, gathers the full state dicts again and
compares them with the saved ones, every tensor's bytes.

All marked ``anysize`` (``nox -s anysize``; ``pytest tests/test_checkpoint_fsdp_reshard.py -m
anysize``): they start pools of 2, 3 and 4 ranks, too slow for the ``tests`` session.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import distcompat

pytestmark = pytest.mark.anysize


def _mlp(seed: int) -> torch.nn.Module:
    """The MLP, each Linear and the root under FSDP2 over the default (distcompat) group."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 12), torch.nn.Linear(12, 4)
    )
    for layer in model.children():
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """One step on this rank's micro-batch (its rank and the step pick the inputs)."""
    generator = torch.Generator().manual_seed(100 * step + distcompat.get_rank())
    model(torch.randn(4, 8, generator=generator)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _full(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The full (unsharded) model and optimizer state dicts, gathered on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True)  # cpu_offload would keep it on rank 0 only
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    return {"model": model_state, "optimizer": optim_state}


def _rank_train_and_save(directory: str) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    # FSDP2 and DCP run on the group distcompat made, every default on
    assert type(dist.group.WORLD).__name__ == "ProtectedGroup"
    model = _mlp(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(3):
        _step(model, optimizer, step)
    model_state, optim_state = get_state_dict(model, optimizer)  # sharded: DTensors
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=directory)  # type: ignore[attr-defined]
    return _full(model, optimizer)


def _rank_load(directory: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = _mlp(1)  # other weights, and no moments yet: all of it must come from the files
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model_state, optim_state = get_state_dict(model, optimizer)  # the layout to load into
    dcp.load({"model": model_state, "optimizer": optim_state}, checkpoint_id=directory)  # type: ignore[attr-defined]
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    return _full(model, optimizer)


def _flat(value: Any, key: str = "") -> dict[str, Any]:
    """Nested dicts and lists as ``{dotted key: leaf}``."""
    if isinstance(value, dict):
        return {
            k: v for name, item in value.items() for k, v in _flat(item, f"{key}.{name}").items()
        }
    if isinstance(value, list | tuple):
        return {k: v for i, item in enumerate(value) for k, v in _flat(item, f"{key}.{i}").items()}
    return {key: value}


def _differences(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """The keys whose values are not equal bit for bit (tensors: dtype, shape and bytes)."""
    got_flat, want_flat = _flat(got), _flat(want)
    keys = sorted(got_flat.keys() | want_flat.keys())
    wrong = []
    for key in keys:
        a, b = got_flat.get(key), want_flat.get(key)
        if isinstance(b, torch.Tensor):
            same = (
                isinstance(a, torch.Tensor)
                and a.dtype == b.dtype
                and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
            )
        else:
            same = a == b
        if not same:
            wrong.append(key)
    return wrong


@pytest.mark.parametrize(("saved", "loaded"), [(2, 3), (4, 2)])
def test_fsdp2_model_and_optimizer_reshard_through_dcp(
    tmp_path: Path, run_on_ranks: Any, saved: int, loaded: int
) -> None:
    """Saved by ``saved`` FSDP2 ranks with DCP, loaded by ``loaded``: the full model and AdamW
    state dicts (step, exp_avg, exp_avg_sq of every parameter, the param groups) are the saved
    ones bit for bit on every loading rank."""
    directory = str(tmp_path / "dcp")
    before = run_on_ranks(_rank_train_and_save, saved, args=(directory,))
    assert all(_differences(full, before[0]) == [] for full in before[1:])  # gathered the same
    optim_state = before[0]["optimizer"]["state"]
    assert len(optim_state) == 6  # 3 Linear layers, weight and bias each
    assert all(float(s["step"]) == 3.0 for s in optim_state.values())
    after = run_on_ranks(_rank_load, loaded, args=(directory,))
    for rank, full in enumerate(after):
        assert _differences(full, before[0]) == [], rank
