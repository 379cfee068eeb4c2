"""The runtime capability probe on real gloo groups: it must find gloo's measured gaps itself.

Only facts that hold on every torch we support (2.4 to 2.13) are asserted here.
"""

from __future__ import annotations

from typing import Any

import pytest

from distcompat import capabilities
from distcompat.testing import run_on_ranks


def _probe() -> dict[str, Any]:
    caps = capabilities()
    again = capabilities()
    return {
        "cached": again is caps,
        "backend": caps.backend,
        "float_sum": caps.cell("all_reduce", "float32", "SUM"),
        "bool_sum": caps.cell("all_reduce", "bool", "SUM"),
        "reduce_bool_sum": caps.cell("reduce", "bool", "SUM"),
        "reduce_float_max": caps.cell("reduce", "float32", "MAX"),
        "bool_max": caps.cell("all_reduce", "bool", "MAX"),
        "int16_sum": caps.cell("all_reduce", "int16", "SUM"),
        "float_band": caps.cell("all_reduce", "float32", "BAND"),
        "move_complex": caps.cell("all_gather_into_tensor", "complex64"),
        "future_all_reduce": caps.futures["all_reduce"],
        "future_reduce_scatter": caps.futures["reduce_scatter_tensor"],
        "future_isend": caps.futures["isend"],
        "strided": caps.layouts[("all_reduce", "strided view")],
        "table": caps.table(),
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_probe_finds_gloos_measured_gaps(world_size: int) -> None:
    results = run_on_ranks(_probe, world_size)
    for rank, got in enumerate(results):
        assert got["cached"]
        assert got["backend"] == "gloo"
        assert got["float_sum"] == "ok"
        assert got["bool_sum"] == "WRONG"  # bytes add and wrap at 256
        # Only the root has a reduce result to check; the others learn its verdict.
        assert got["reduce_bool_sum"] == ("WRONG" if rank == 0 else "failed on another rank")
        assert got["reduce_float_max"] == "ok"
        assert got["bool_max"] == "ok"
        assert got["int16_sum"].startswith("raises: ")
        assert got["float_band"].startswith("raises: ")
        assert got["move_complex"] == "ok"
        assert got["future_all_reduce"] == "native"
        assert got["future_reduce_scatter"].startswith("missing: ")
        assert got["future_isend"].startswith("missing: ")
        assert got["strided"] == "WRONG"
    table = results[0]["table"]
    assert f"{world_size} ranks" in table
    assert "| bool | **WRONG** |" in table
    assert len({r["table"] for r in results}) == 1  # every rank found the same


def _collectives_still_work_after_probe() -> float:
    import torch

    from distcompat.collectives import all_reduce

    capabilities(refresh=True)
    value = torch.ones(1)
    all_reduce(value)
    return value.item()


def test_probe_leaves_the_callers_group_usable() -> None:
    assert run_on_ranks(_collectives_still_work_after_probe, 2) == [2.0, 2.0]


def _agreement() -> dict[str, str]:
    import torch
    import torch.distributed as dist

    from distcompat.collectives._capabilities import Capabilities, _agree

    rank = dist.get_rank()
    caps = Capabilities(backend="gloo", torch_version="test", world_size=2)
    caps.cells[("all_reduce", "float32", "SUM")] = "ok"
    caps.cells[("all_reduce", "float32", "AVG")] = "ok" if rank == 0 else "WRONG"
    caps.cells[("all_reduce", "int16", "SUM")] = "raises: Invalid scalar type"
    caps.futures["isend"] = "native" if rank == 1 else "missing: not implemented"
    _agree(caps, None, torch.device("cpu"))
    return {
        "sum": caps.cell("all_reduce", "float32", "SUM"),
        "avg": caps.cell("all_reduce", "float32", "AVG"),
        "int16": caps.cell("all_reduce", "int16", "SUM"),
        "isend": caps.futures["isend"],
    }


def test_ranks_agree_on_every_cell() -> None:
    """A result seen right on one rank and wrong on another counts as failed on both: the
    collectives choose their path from these cells, and every rank must choose the same."""
    zero, one = run_on_ranks(_agreement, 2)
    assert zero["sum"] == one["sum"] == "ok"
    assert zero["avg"] == "failed on another rank"
    assert one["avg"] == "WRONG"
    assert zero["int16"] == one["int16"] == "raises: Invalid scalar type"
    assert zero["isend"] == "missing: not implemented"
    assert one["isend"] == "failed on another rank"


_COMBOS = [
    ("float32", "AVG"), ("float64", "SUM"), ("bfloat16", "PREMUL_SUM"), ("bool", "BXOR"),
    ("bool", "SUM"), ("int16", "BAND"), ("uint64", "MIN"), ("complex64", "AVG"),
    ("int8", "MAX"), ("float8_e4m3fn", "PRODUCT"), ("uint32", "SUM"),
]  # fmt: skip


def _every_plan(world_size: int) -> dict[str, str]:
    from collective_cases import PLANS, Case, run_case

    return {
        f"{collective} {plans} {dtype} {op} {layout}": run_case(
            Case(collective, dtype, op, layout, seed=world_size, plans=plans)
        )
        for collective in ("all_reduce", "reduce")
        for plans in PLANS
        for dtype, op in _COMBOS
        for layout in ("contiguous", "transposed")
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_reductions_are_right_under_every_plan(world_size: int) -> None:
    """The same all_reduce and reduce calls under the plans that hold everywhere, the plans
    gloo's probe picks, and the plans for a backend whose every op the probe saw fail (all
    gathered)."""
    from collective_cases import DTYPES, reduction_is_defined

    for outcomes in run_on_ranks(_every_plan, world_size, args=(world_size,)):
        for name, got in outcomes.items():
            _, _, dtype, op, _ = name.split()
            expected = "ok" if reduction_is_defined(DTYPES[dtype], op) else "unsupported"
            assert got == expected, name


def _explained() -> dict[str, Any]:
    import torch

    import distcompat.distributed as dist
    from distcompat import explain_collective
    from distcompat.collectives._probed import forget

    R = dist.ReduceOp
    ones = torch.ones(4)
    forget(None)
    seen: dict[str, Any] = {"before": explain_collective("all_reduce", ones, op=R.AVG)}
    caps = capabilities()
    seen["avg_cell"] = caps.cell("all_reduce", "float32", "AVG")
    seen["reduce_avg_cell"] = caps.cell("reduce", "float32", "AVG")
    seen["after"] = explain_collective("all_reduce", ones, op=R.AVG)
    seen["bool"] = explain_collective("all_reduce", ones.bool(), op=R.SUM)
    seen["int16"] = explain_collective("all_reduce", ones.to(torch.int16), op=R.BAND)
    seen["reduce"] = explain_collective("reduce", ones, op=R.AVG)
    seen["reduce_scatter"] = explain_collective("reduce_scatter_tensor", ones, op=R.AVG)
    seen["transposed"] = explain_collective("all_reduce", torch.ones(2, 3).t())
    seen["moved"] = explain_collective("broadcast", ones.to(torch.uint16))
    sub = dist.new_group([0, 1])
    seen["subgroup"] = explain_collective("all_reduce", ones, op=R.AVG, group=sub)
    return seen


def test_reductions_follow_the_probe_once_it_ran() -> None:
    seen = run_on_ranks(_explained, 2)[0]
    unprobed = "plan correct on every backend (group not probed: distcompat.capabilities)"
    assert seen["before"].steps == ("avg-as-sum-then-divide",)
    assert seen["before"].decided_by == unprobed
    if seen["avg_cell"] == "ok":  # gloo has a native float AVG in newer torch releases
        assert seen["after"].steps == ()
        assert seen["after"].decided_by == "probe: all_reduce float32 AVG ok"
    else:
        assert seen["after"].steps == ("avg-as-sum-then-divide",)
        assert seen["after"].decided_by == "probe: all_reduce float32 SUM ok"
    assert seen["bool"].steps == ("bool-sum-as-max",)
    assert seen["bool"].decided_by == "probe: all_reduce uint8 MAX ok"
    assert seen["int16"].steps == ("int16-reduced-as-int32",)
    assert seen["int16"].decided_by == "probe: all_reduce int32 BAND ok"
    if seen["reduce_avg_cell"] == "ok":
        assert seen["reduce"].steps == ()
        assert seen["reduce"].decided_by == "probe: reduce float32 AVG ok"
    else:
        assert seen["reduce"].steps == ("avg-as-sum-then-divide",)
        assert seen["reduce"].decided_by == "probe: reduce float32 SUM ok"
    assert seen["reduce_scatter"].decided_by == unprobed  # the probe does not run it
    assert seen["transposed"].steps[0].startswith("staging")
    assert seen["moved"].steps == ("uint16-moved-as-bytes",)
    assert seen["subgroup"].decided_by == unprobed  # another group object: not probed together
    assert "gloo" in str(seen["after"])
    assert "world size 2" in str(seen["after"])


def test_explain_refuses_an_unknown_collective() -> None:
    import torch

    from distcompat import explain_collective

    with pytest.raises(ValueError, match="all_reduce_typo"):
        explain_collective("all_reduce_typo", torch.ones(1))


@pytest.mark.parametrize(
    ("cpu_backend", "expected"), [("gloo", "cpu"), ("nccl", "cuda:3"), ("mpi", "cpu")]
)
def test_probe_runs_on_the_device_the_backend_moves(
    cpu_backend: str, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An NCCL-only group is probed with CUDA tensors on the rank's GPU; a group with a CPU
    backend (gloo, or gloo beside NCCL) with CPU tensors. The GPU is mocked: we have none here."""
    import torch

    import distcompat.collectives._capabilities as caps_module

    monkeypatch.setattr(caps_module, "backend_for", lambda group, device: cpu_backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert str(caps_module._probe_device(None)) == expected


def _probed_on(device: str | None) -> tuple[bool, str, str, str]:
    import distcompat.collectives._probed as probed

    usual = capabilities()
    other = capabilities(device=device)
    followed = probed.probed_for(None)
    assert followed is not None
    return other is usual, other.device_type, followed.device_type, other.table().splitlines()[0]


def test_probe_on_the_usual_device_is_the_cached_one() -> None:
    for same, device_type, followed, title in run_on_ranks(_probed_on, 2, args=("cpu",)):
        assert same
        assert (device_type, followed) == ("cpu", "cpu")
        assert title.startswith("Backend gloo on cpu tensors")


@pytest.mark.cuda
def test_probe_of_cuda_tensors_through_gloo_leaves_the_plans_on_cpu() -> None:
    """Real GPU: both gloo ranks probe CUDA tensors on the one device; the reductions' plans
    keep following the CPU probe, the device gloo groups move by default."""
    for same, device_type, followed, title in run_on_ranks(_probed_on, 2, args=("cuda",)):
        assert not same
        assert (device_type, followed) == ("cuda", "cpu")
        assert title.startswith("Backend gloo on cuda tensors")
