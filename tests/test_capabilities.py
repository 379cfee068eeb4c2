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
    for got in results:
        assert got["cached"]
        assert got["backend"] == "gloo"
        assert got["float_sum"] == "ok"
        assert got["bool_sum"] == "WRONG"  # bytes add and wrap at 256
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
