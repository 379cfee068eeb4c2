"""Process-group lifecycle on real gloo groups of 2 and 3 ranks, plus the single-process path.

The tests that pretend a host has CUDA describe it with ``override_host`` (we have no GPU here).
"""

from __future__ import annotations

import os
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import distcompat
from _rank_processes import run_ranks
from distcompat import DeviceBindingError, DistInitError, LaunchEnv
from distcompat.collectives import CollectiveMismatchError
from distcompat.launch._host import override_host, probe_host
from distcompat.testing import run_on_ranks


def _all_reduce_sum() -> float:
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    return value.item()


def _harness_info() -> dict[str, Any]:
    info = distcompat.init_distributed(device="cpu", backend="gloo", timeout=120.0)
    again = distcompat.init_distributed(device="cpu", backend="gloo", timeout=120.0)
    return {
        "same": info is again,
        "rank": info.rank,
        "world_size": info.world_size,
        "backend": info.backend,
        "device": str(info.device),
        "has_group": info.has_group,
        "helpers": (
            distcompat.get_rank(),
            distcompat.get_world_size(),
            distcompat.get_local_rank(),
            distcompat.is_main_process(),
        ),
        "reason": info.reason,
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_info_and_helpers_on_real_group(world_size: int) -> None:
    for rank, got in enumerate(run_on_ranks(_harness_info, world_size)):
        assert got["same"]
        assert (got["rank"], got["world_size"]) == (rank, world_size)
        assert (got["backend"], got["device"], got["has_group"]) == ("gloo", "cpu", True)
        assert got["helpers"] == (rank, world_size, rank, rank == 0)
        assert got["reason"].splitlines()[0].startswith("device: cpu")


def _init_destroy_twice() -> list[float]:
    distcompat.destroy_distributed()
    sums = []
    for _ in range(2):
        info = distcompat.init_distributed(device="cpu", timeout=60)
        assert info.has_group
        assert not info.adopted
        sums.append(_all_reduce_sum())
        distcompat.barrier()
        distcompat.destroy_distributed()
        assert not dist.is_initialized()
        distcompat.destroy_distributed()  # a second destroy is a no-op
    return sums


@pytest.mark.parametrize("world_size", [2, 3])
def test_init_and_destroy_twice(world_size: int) -> None:
    expected = float(sum(range(1, world_size + 1)))
    assert run_on_ranks(_init_destroy_twice, world_size) == [[expected, expected]] * world_size


def _second_call_warns() -> str:
    distcompat.init_distributed(device="cpu", backend="gloo", timeout=120.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        distcompat.init_distributed(device="cpu", timeout=5)
    assert len(caught) == 1
    return str(caught[0].message)


def test_second_call_with_other_arguments_warns() -> None:
    for message in run_on_ranks(_second_call_warns, 2):
        assert "already ran with (device='cpu', backend='gloo', timeout=0:02:00)" in message
        assert "ignoring the new arguments (device='cpu', backend=None, timeout=0:00:05)" in message


def _adopt(token: str) -> dict[str, Any]:
    distcompat.destroy_distributed()
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False
    )
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"user-group-{token}", store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )
    info = distcompat.init_distributed()
    total = _all_reduce_sum()
    distcompat.destroy_distributed()
    still_there = dist.is_initialized()
    dist.destroy_process_group()
    return {
        "adopted": info.adopted,
        "backend": info.backend,
        "device": str(info.device),
        "timeout": info.timeout,
        "reason": info.backend_reason,
        "total": total,
        "still_there": still_there,
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_existing_group_is_adopted_not_recreated(world_size: int) -> None:
    for got in run_on_ranks(_adopt, world_size, args=(uuid.uuid4().hex,)):
        assert got["adopted"]
        assert (got["backend"], got["device"], got["timeout"]) == ("gloo", "cpu", None)
        assert "adopted" in got["reason"]
        assert got["total"] == sum(range(1, world_size + 1))
        assert got["still_there"]  # destroy_distributed leaves someone else's group alone


def _cpu_on_cuda_host() -> tuple[str, str, str, float]:
    distcompat.destroy_distributed()
    host = replace(probe_host(), cuda_device_count=2, backends=probe_host().backends | {"nccl"})
    with override_host(host):
        info = distcompat.init_distributed(device="cpu")
    total = _all_reduce_sum()
    distcompat.destroy_distributed()
    return str(info.device), str(info.backend), info.reason, total


@pytest.mark.parametrize("world_size", [2, 3])
def test_cpu_on_host_that_claims_cuda_uses_gloo(world_size: int) -> None:
    for device, backend, reason, total in run_on_ranks(_cpu_on_cuda_host, world_size):
        assert (device, backend, total) == ("cpu", "gloo", sum(range(1, world_size + 1)))
        assert "cuda (2) present but unused" in reason
        assert "backend: gloo: the default for run device cpu" in reason


def _bad_local_rank() -> str | None:
    distcompat.destroy_distributed()
    if dist.is_initialized():
        dist.destroy_process_group()
    if distcompat.get_local_rank() == 0:
        return None  # rank 0 could bind cuda:0; the check under test happens before any collective
    one_gpu = replace(probe_host(), cuda_device_count=1, backends=probe_host().backends | {"nccl"})
    with override_host(one_gpu), pytest.raises(DeviceBindingError) as info:
        distcompat.init_distributed(device="cuda")
    assert not dist.is_initialized()
    return str(info.value)


@pytest.mark.parametrize("world_size", [2, 3])
def test_bad_local_rank_on_one_device_host(world_size: int) -> None:
    first, *others = run_on_ranks(_bad_local_rank, world_size)
    assert first is None
    for local_rank, message in enumerate(others, start=1):
        assert message is not None
        assert f"LOCAL_RANK={local_rank} has no cuda device to bind" in message
        assert "1 cuda device(s)" in message
        assert "CUDA_VISIBLE_DEVICES=" in message


def _session() -> tuple[int, bool]:
    distcompat.destroy_distributed()
    with distcompat.distributed_session(device="cpu", timeout=30) as info:
        assert info.timeout == timedelta(seconds=30)
        total = int(_all_reduce_sum())
    return total, dist.is_initialized()


def test_context_manager_destroys_what_it_created() -> None:
    assert run_on_ranks(_session, 2) == [(3, False), (3, False)]


def _reinit_after_foreign_destroy() -> float:
    distcompat.init_distributed(device="cpu", backend="gloo", timeout=120.0)
    dist.destroy_process_group()  # behind distcompat's back
    distcompat.init_distributed(device="cpu")
    return _all_reduce_sum()


def test_reinit_after_group_destroyed_elsewhere() -> None:
    assert run_on_ranks(_reinit_after_foreign_destroy, 2) == [3.0, 3.0]


@pytest.fixture
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Clear launcher variables so this test process is a plain single process."""
    for name in list(os.environ):
        if name in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"} or name.startswith(
            ("TORCHELASTIC_", "SLURM_", "OMPI_", "PMI_", "MV2_", "JSM_", "SM_")
        ):
            monkeypatch.delenv(name)
    yield
    distcompat.destroy_distributed()


@pytest.mark.usefixtures("no_launcher")
def test_single_process_needs_no_group() -> None:
    info = distcompat.init_distributed(device="cpu")
    assert not info.has_group
    assert not dist.is_initialized()
    assert (info.rank, info.world_size, info.backend, info.launcher) == (0, 1, None, "none")
    assert "no launcher environment" in info.backend_reason
    distcompat.barrier()
    assert (distcompat.get_rank(), distcompat.get_world_size(), distcompat.get_local_rank()) == (
        0,
        1,
        0,
    )
    assert distcompat.is_main_process()
    distcompat.destroy_distributed()
    distcompat.destroy_distributed()


@pytest.mark.usefixtures("no_launcher")
def test_helpers_before_init_read_the_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert (distcompat.get_rank(), distcompat.get_world_size()) == (0, 1)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert (distcompat.get_rank(), distcompat.get_world_size(), distcompat.get_local_rank()) == (
        3,
        4,
        1,
    )
    assert not distcompat.is_main_process()


def test_missing_rendezvous_address_is_named() -> None:
    env = replace(
        LaunchEnv.from_environ({}),
        launcher="openmpi",
        rank=1,
        world_size=2,
        local_world_size=1,
        node_rank=1,
        num_nodes=2,
    )
    with pytest.raises(DistInitError, match="set MASTER_ADDR and MASTER_PORT"):
        distcompat.init_distributed(device="cpu", env=env)
    assert not dist.is_initialized()


def _nccl_world_of_one() -> tuple[str, str | None, float]:
    info = distcompat.init_distributed()
    value = torch.ones(2, device=info.device)
    dist.all_reduce(value)
    return str(info.device), info.backend, value.sum().item()


@pytest.mark.cuda
def test_nccl_group_of_one_binds_cuda() -> None:
    """One GPU means NCCL world size 1 only (NCCL refuses two ranks on one device)."""
    assert run_on_ranks(_nccl_world_of_one, 1, backend="nccl") == [("cuda:0", "nccl", 2.0)]


def _cuda_tensors_through_gloo() -> tuple[str, str | None, float]:
    distcompat.destroy_distributed()
    info = distcompat.init_distributed(device="cuda:0", backend="gloo")
    value = torch.ones(2, device=info.device)
    dist.all_reduce(value)
    distcompat.destroy_distributed()
    return str(value.device), info.backend, value.sum().item()


@pytest.mark.cuda
def test_cuda_tensors_through_gloo() -> None:
    assert run_on_ranks(_cuda_tensors_through_gloo, 2) == [("cuda:0", "gloo", 4.0)] * 2


def _barrier_against_all_reduce() -> tuple[str, float]:
    try:
        if distcompat.get_rank() == 0:
            distcompat.barrier()
        else:
            distcompat.all_reduce(torch.ones(3))
        message = "no error"
    except CollectiveMismatchError as exc:
        message = str(exc)
    after = torch.ones(2)
    distcompat.all_reduce(after)  # the group still works
    distcompat.barrier()
    return message, after.sum().item()


def test_a_barrier_meets_the_mismatch_check() -> None:
    """``distcompat.barrier()`` on one rank, an ``all_reduce`` on the other: an error on both.

    The barrier used to be torch's own, beside the checks: the two calls met in gloo.
    """
    for message, after in run_on_ranks(_barrier_against_all_reduce, 2, timeout=60):
        assert "barrier" in message, message
        assert "all_reduce" in message, message
        assert after == 4.0


EXIT_SCRIPT = Path(__file__).with_name("_exit_script.py")


@pytest.mark.slow
def test_destroy_frees_the_group_an_optimizer_made_after_init_would_keep() -> None:
    """``torch.optim`` imported after init once kept the destroyed group (and its gloo threads).

    Real rank processes (``run_ranks``): the group object must be gone after destroy, so its
    threads are joined before the interpreter's teardown (where one ended a job in SIGABRT).
    """
    for r in run_ranks(EXIT_SCRIPT, 2, args=("--freed",), timeout=60):
        assert r.returncode == 0, r.stderr[-2000:]
        assert f"FREED {r.rank} True" in r.stdout, r.stdout + r.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("shm", ["off", "auto"])
def test_a_script_that_succeeded_exits_0_without_destroying_its_group(shm: str) -> None:
    """Two-rank runs of a script that waits on async futures and returns: all exit 0, and
    every run's group was destroyed by distcompat's at-exit teardown before the interpreter's.

    Real processes started as a launcher does (``run_ranks``), since only a real interpreter
    exit shows the failure: before the at-exit teardown, with the shared-memory path off, 3-5
    runs in 10 ended in SIGABRT ("terminate called without an active exception"). The teardown
    itself is checked in every run (``AT_EXIT``), so that part does not depend on the luck of
    the draw. The exit codes: 8 runs with shared memory off, where the failure showed, would
    miss a 30 % failure 6 times in 100; 3 with it on (``auto``) add a check of that path (8
    there too were 28 s more on torch 2.15, 2 cores).
    """

    # One job at a time: with three at once the failure did not show even without the fix.
    runs = {"off": 8, "auto": 3}[shm]
    jobs = [run_ranks(EXIT_SCRIPT, 2, env={"DISTCOMPAT_SHM": shm}, timeout=60) for _ in range(runs)]
    for ranks in jobs:
        for r in ranks:
            assert f"DONE {r.rank} 6.0" in r.stdout, r.stderr[-2000:]
            assert f"AT_EXIT {r.rank} group gone" in r.stdout, r.stdout + r.stderr[-2000:]
    assert [tuple(r.returncode for r in ranks) for ranks in jobs] == [(0, 0)] * runs
