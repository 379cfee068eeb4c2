"""Uneven all_gather (``collectives._uneven``) on real gloo groups of 2, 3 and 4 ranks.

Every default stays on (the mismatch check, the watchdog ``init_distributed`` starts); each batch
of cases runs through shared memory and through gloo, and once more in checked mode. Every rank
rebuilds each rank's tensor from the case's seed and checks what it received, byte for byte.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import distcompat.distributed as dist
from distcompat.collectives import CollectiveMismatchError, all_gather_uneven, checked
from distcompat.testing import run_on_ranks
from shm_cases import calls_on_path, configured

SETTINGS = settings(
    max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
DTYPES = {
    "float32": torch.float32,
    "complex64": torch.complex64,  # moved as its real view
    "bool": torch.bool,
    "int16": torch.int16,  # gloo refuses it: moved as bytes
    "bfloat16": torch.bfloat16,
}


@dataclasses.dataclass(frozen=True)
class UnevenCase:
    rows: tuple[int, ...]  # per rank; drawn for 4 ranks, the first W used
    trail: tuple[int, ...]
    dtype: str
    seed: int
    strided: bool  # the input a transposed view (staged by the collective)
    async_op: bool


def _tensor(case: UnevenCase, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(case.seed * 7 + rank)
    shape = (case.rows[rank], *case.trail)
    values = torch.randint(-50, 50, shape, generator=gen).to(torch.float32) / 4
    return values.to(DTYPES[case.dtype])


def _gather_cases(cases: list[UnevenCase]) -> list[str]:
    """Run every case through shared memory and gloo, then checked; return what went wrong."""
    rank, world = dist.get_rank(), dist.get_world_size()
    problems = []
    for mode, strict in (("on", False), ("off", False), ("off", True)):
        with configured(mode), checked(strict):
            before = calls_on_path()
            for case in cases:
                mine = _tensor(case, rank)
                if case.strided and mine.dim() >= 2:
                    mine = mine.transpose(0, 1).contiguous().transpose(0, 1)  # column-major
                want = [_tensor(case, r) for r in range(world)]
                out = [torch.full_like(w, 3) for w in want]
                work = dist.all_gather(out, mine, async_op=case.async_op)
                if work is not None:
                    value = work.get_future().wait()
                    if value is not out:
                        problems.append(f"{mode}: the future's value is not the list")
                    work.wait()
                flat = all_gather_uneven(mine)
                for r, (got, expected) in enumerate(zip(out, want, strict=True)):
                    if not torch.equal(got, expected):
                        problems.append(f"{mode} {case}: rank {r}'s rows differ")
                if not torch.equal(flat, torch.cat(want)):
                    problems.append(f"{mode} {case}: all_gather_uneven differs")
            sent = any(max(case.rows[:world]) for case in cases)
            if mode == "on" and not strict and sent and calls_on_path() <= before:
                problems.append("shared memory was on, but no call went through it")
    return problems


_cases = st.builds(
    UnevenCase,
    rows=st.tuples(*[st.integers(0, 9)] * 4),
    trail=st.sampled_from([(), (3,), (2, 5)]),
    dtype=st.sampled_from(sorted(DTYPES)),
    seed=st.integers(0, 10_000),
    strided=st.booleans(),
    async_op=st.booleans(),
)


def _mismatched() -> list[str]:
    """Lists that do not match: each must raise on every rank, and the group stays usable."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(ranks=list(range(world)))
    messages = []
    sends = [3, 5] + [2] * (world - 2)  # what each rank really sends
    expects = {
        "uneven": [3, 4, *sends[2:]],  # every rank's list says rank 1 sends 4
        "mixed": [3] * world if rank == 0 else sends,  # rank 0's list is even: the even path
    }
    for name, expect in expects.items():
        for strict in (False, True):
            mine = torch.ones(sends[rank], 2)
            outs = [torch.empty(sends[rank] if r == rank else n, 2) for r, n in enumerate(expect)]
            try:
                with checked(strict):
                    dist.all_gather(outs, mine, group=group)
                messages.append(f"{name} strict={strict}: no error")
            except CollectiveMismatchError as exc:
                messages.append(str(exc))
    try:  # a problem of this rank's own list: raised here, before anything is sent
        dist.all_gather([torch.empty(2, 3), torch.empty(2, 2)], torch.ones(2, 2), group=group)
    except ValueError as exc:
        messages.append(str(exc))
    after = torch.ones(2)
    dist.all_reduce(after, group=group)  # the group still works
    dist.destroy_process_group(group)
    return [*messages, str(after.sum().item())]


def test_lists_that_do_not_match_raise_on_every_rank_naming_the_rank() -> None:
    for found in run_on_ranks(_mismatched, 2, timeout=60):
        assert "rank 1 sends 5 rows, rank 0 expects 4" in found[0], found[0]
        assert "rank 1 sends 5 rows to rank 0, which expects 4" in found[1], found[1]
        assert "rank 1 sends 5 rows, rank 0 expects 3" in found[2], found[2]
        assert "ranks disagree" in found[3], found[3]
        assert "only the first dimension" in found[4], found[4]
        assert found[5] == "4.0", found


@pytest.mark.parametrize("world_size", [2, 3, 4])
@SETTINGS
@given(cases=st.lists(_cases, min_size=3, max_size=6))
def test_uneven_all_gather_equals_every_ranks_tensor(
    world_size: int, cases: list[UnevenCase]
) -> None:
    found = run_on_ranks(_gather_cases, world_size, args=(cases,), timeout=60)
    assert found == [[]] * world_size
