"""Single-rank regions on real gloo groups: collectives inside raise at once, naming the call."""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

import distcompat
from distcompat.collectives import all_reduce
from distcompat.diagnostics import (
    SingleRankCollectiveError,
    in_single_rank_region,
    single_rank_region,
)


def _line_of(marker: str) -> int:
    """The line number of ``marker`` in this file (call sites are asserted by line)."""
    with open(__file__) as source:
        return next(i for i, line in enumerate(source, 1) if marker in line)


def _refused() -> dict[str, str]:
    seen = {}
    original = dist.all_reduce
    with single_rank_region("saving on rank 0"):
        try:
            all_reduce(torch.ones(2))  # MARK-distcompat
        except SingleRankCollectiveError as exc:
            seen["distcompat"] = str(exc)
        try:
            dist.all_reduce(torch.ones(2))  # MARK-torch
        except SingleRankCollectiveError as exc:
            seen["torch"] = str(exc)
        try:
            dist.broadcast_object_list([1], src=0)  # any torch.distributed collective
        except SingleRankCollectiveError as exc:
            seen["object"] = str(exc)
        try:
            distcompat.all_gather_object([None, None], {"loss": 1.0})  # MARK-object
        except SingleRankCollectiveError as exc:
            seen["distcompat_object"] = str(exc)
    seen["restored"] = str(dist.all_reduce is original)
    t = torch.ones(2)
    all_reduce(t)  # outside the region: runs
    seen["after"] = str(t.tolist())
    return seen


def test_region_refuses_distcompat_and_torch_collectives() -> None:
    from distcompat.testing import run_on_ranks

    for seen in run_on_ranks(_refused, 2):
        assert f"test_diagnostics_regions.py:{_line_of('MARK-distcompat')}" in seen["distcompat"]
        assert "inside single-rank code (saving on rank 0)" in seen["distcompat"]
        assert f"test_diagnostics_regions.py:{_line_of('MARK-torch')}" in seen["torch"]
        assert seen["torch"].startswith("torch.distributed.all_reduce called at")
        assert seen["object"].startswith("torch.distributed.broadcast_object_list called at")
        assert f"test_diagnostics_regions.py:{_line_of('MARK-object')}" in seen["distcompat_object"]
        assert seen["restored"] == "True"
        assert seen["after"] == "[2.0, 2.0]"


@distcompat.rank_zero_only
def _log_metric(t: torch.Tensor) -> float:
    all_reduce(t)  # MARK-rank-zero: the bug rank_zero_only now catches
    return float(t.sum())


def _rank_zero_only_body() -> str:
    try:
        value = _log_metric(torch.ones(1))
    except SingleRankCollectiveError as exc:
        return str(exc)
    return f"returned {value}"


def test_rank_zero_only_body_is_a_single_rank_region() -> None:
    from distcompat.testing import run_on_ranks

    rank0, rank1 = run_on_ranks(_rank_zero_only_body, 2)
    assert "@rank_zero_only _log_metric" in rank0
    assert f"test_diagnostics_regions.py:{_line_of('MARK-rank-zero')}" in rank0
    assert rank1 == "returned None"  # rank 1 skips the body, as before


def _other_thread_unaffected() -> list[float]:
    result: list[float] = []
    inside = threading.Event()
    leave = threading.Event()

    def hold_region() -> None:
        with single_rank_region("a helper thread"):
            inside.set()
            leave.wait(30)

    holder = threading.Thread(target=hold_region)
    holder.start()
    inside.wait(30)
    t = torch.ones(3)
    dist.all_reduce(t)  # swapped for a wrapper, but this thread is in no region: runs
    result.append(float(t.sum()))
    leave.set()
    holder.join()
    return result


def test_regions_are_per_thread() -> None:
    from distcompat.testing import run_on_ranks

    assert run_on_ranks(_other_thread_unaffected, 2) == [[6.0], [6.0]]


def test_region_nests_and_restores_without_a_group() -> None:
    """Single process, no group: nothing can hang, so nothing is refused."""
    original = dist.all_reduce
    with single_rank_region("outer"):
        assert dist.all_reduce is not original
        with single_rank_region("inner"):
            assert in_single_rank_region()
            t = torch.ones(2)
            all_reduce(t)  # world size 1: the identity
        assert in_single_rank_region()
    assert not in_single_rank_region()
    assert dist.all_reduce is original
