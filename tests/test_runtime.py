"""nanochat-shaped runtime helpers on real gloo groups of 1 and 2 ranks, and in a plain process.

Hardware we do not have is mocked, and only that: a host that "has CUDA" is
``torch.cuda.is_available() -> True`` (what nanochat's code asks) plus ``override_host`` with one
CUDA device (what distcompat's placement asks); the CUDA dtype rules mock the device capability.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import replace
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import distcompat
from distcompat.launch._host import override_host, probe_host
from distcompat.runtime import (
    ComputeInit,
    DistInfoTuple,
    autodetect_device_type,
    compute_cleanup,
    compute_dtype,
    compute_init,
    get_dist_info,
    print0,
)
from distcompat.testing import run_on_ranks


def _moved_by() -> str:
    """The backend the default group moves bytes with: the protected group names the one it holds
    (``dist.get_backend()`` says ``"distcompat"`` for it)."""
    return getattr(dist.group.WORLD, "protects", None) or str(dist.get_backend())


def _compute_init_round_trip() -> dict[str, Any]:
    distcompat.destroy_distributed()  # drop the harness's group: compute_init makes its own
    ddp, rank, local_rank, world_size, device = compute_init("cpu", seed=None)
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        print0("hello from print0")
    result = {
        "unpacked": (ddp, rank, local_rank, world_size, str(device)),
        "dist_info": tuple(get_dist_info()),
        "backend": _moved_by(),
        "total": total.item(),
        "printed": printed.getvalue(),
    }
    compute_cleanup()
    result["after_cleanup"] = dist.is_initialized()
    compute_cleanup()  # a second cleanup is a no-op
    return result


@pytest.mark.parametrize("world_size", [1, 2])
def test_compute_init_creates_a_gloo_group_for_cpu(world_size: int) -> None:
    results = run_on_ranks(_compute_init_round_trip, world_size)
    for rank, got in enumerate(results):
        assert got["unpacked"] == (True, rank, rank, world_size, "cpu")
        assert got["dist_info"] == (True, rank, rank, world_size)
        assert got["backend"] == "gloo"
        assert got["total"] == sum(range(1, world_size + 1))
        assert got["printed"] == ("hello from print0\n" if rank == 0 else "")
        assert got["after_cleanup"] is False


def _cpu_run_on_claimed_cuda_host() -> tuple[str, str, str, str, str]:
    distcompat.destroy_distributed()
    host = replace(probe_host(), cuda_device_count=1, backends=probe_host().backends | {"nccl"})
    with mock.patch("torch.cuda.is_available", return_value=True), override_host(host):
        detected = autodetect_device_type()
        init = compute_init("cpu", seed=None)
        backend = _moved_by()
        choice = compute_dtype(init.device)
    compute_cleanup()
    return detected, backend, str(init.device), str(choice.dtype), choice.reason


def test_cpu_run_on_host_that_claims_cuda_gets_gloo_and_fp32() -> None:
    """Mocked: torch.cuda.is_available() -> True and a one-GPU host (we have no GPU)."""
    for detected, backend, device, dtype, reason in run_on_ranks(_cpu_run_on_claimed_cuda_host, 2):
        assert detected == "cuda"  # the host claims CUDA ...
        assert (backend, device, dtype) == ("gloo", "cpu", "torch.float32")  # ... the run is CPU
        assert reason.startswith("float32: run device cpu")


def _run_on_this_gpu_host(device_type: str) -> dict[str, Any]:
    from distcompat.attention import explain_attention

    distcompat.destroy_distributed()  # drop the harness's group: compute_init makes its own
    init = compute_init(device_type, seed=None)
    choice = compute_dtype(init.device)
    q = torch.randn(1, 2, 16, 16, device=init.device, dtype=choice.dtype)
    got = {
        "detected": autodetect_device_type(),
        "backend": _moved_by(),
        "device": str(init.device),
        "dtype": str(choice.dtype),
        "kernel": explain_attention(q, q, q, causal=True).impl,
        "bf16_capable": torch.cuda.get_device_capability(0) >= (8, 0),
    }
    compute_cleanup()
    return got


@pytest.mark.cuda
def test_cpu_run_on_a_gpu_host_gets_gloo_fp32_and_a_cpu_kernel() -> None:
    """Real GPU: the nanochat case. The host has CUDA, the run asks for the CPU."""
    for got in run_on_ranks(_run_on_this_gpu_host, 2, args=("cpu",)):
        assert got["detected"] == "cuda"
        assert (got["backend"], got["device"], got["dtype"]) == ("gloo", "cpu", "torch.float32")
        assert got["kernel"] in ("sdpa", "math")


@pytest.mark.cuda
def test_cuda_run_gets_nccl_the_local_rank_device_and_its_dtype() -> None:
    """Real GPU, NCCL at world size 1 (one GPU): cuda:LOCAL_RANK and bf16 from sm80 on."""
    got = run_on_ranks(_run_on_this_gpu_host, 1, backend="nccl", args=("cuda",))[0]
    assert (got["backend"], got["device"]) == ("nccl", "cuda:0")
    assert got["dtype"] == ("torch.bfloat16" if got["bf16_capable"] else "torch.float32")
    assert got["kernel"] not in ("math",)  # a fused kernel on the GPU


def test_single_process_has_no_group() -> None:
    result = compute_init("cpu", seed=None)
    try:
        assert isinstance(result, ComputeInit)
        assert tuple(result) == (False, 0, 0, 1, torch.device("cpu"))
        assert result.world_size == 1
        assert get_dist_info() == DistInfoTuple(False, 0, 0, 1)
        assert not dist.is_initialized()
    finally:
        compute_cleanup()
    compute_cleanup()


def test_compute_init_seeds_like_nanochat() -> None:
    compute_init("cpu", seed=7)
    first = torch.rand(3)
    compute_init("cpu", seed=7)
    assert torch.equal(torch.rand(3), first)
    compute_cleanup()


@pytest.mark.parametrize("bad", ["gpu", "xla", "cuda:0", ""])
def test_compute_init_rejects_unknown_device_types(bad: str) -> None:
    with pytest.raises(ValueError, match="is not one of 'cuda', 'mps', 'cpu'"):
        compute_init(bad)


@pytest.mark.parametrize(
    ("capability", "dtype", "words"),
    [
        ((9, 0), torch.bfloat16, "has bf16 tensor cores"),
        ((8, 0), torch.bfloat16, "has bf16 tensor cores"),
        ((7, 5), torch.float32, "predates bf16 tensor cores"),
    ],
)
def test_compute_dtype_on_cuda_follows_the_device(
    capability: tuple[int, int], dtype: torch.dtype, words: str
) -> None:
    """Mocked: the capability and name of a CUDA device (we have none)."""
    with (
        mock.patch("torch.cuda.get_device_capability", return_value=capability),
        mock.patch("torch.cuda.get_device_name", return_value="Fake GPU"),
    ):
        choice = compute_dtype("cuda:0")
    assert choice.dtype == dtype
    assert words in choice.reason
    assert "Fake GPU" in choice.reason


@pytest.mark.parametrize("device", ["cpu", "mps", torch.device("cpu")])
def test_compute_dtype_is_fp32_off_cuda(device: str | torch.device) -> None:
    choice = compute_dtype(device)
    assert choice.dtype == torch.float32
    assert choice.reason.startswith("float32: run device")


@pytest.mark.parametrize(
    ("cuda", "mps", "expected"),
    [(True, True, "cuda"), (False, True, "mps"), (False, False, "cpu")],
)
def test_autodetect_device_type_order(cuda: bool, mps: bool, expected: str) -> None:
    """Mocked: which accelerators torch reports."""
    with (
        mock.patch("torch.cuda.is_available", return_value=cuda),
        mock.patch("torch.backends.mps.is_available", return_value=mps),
    ):
        assert autodetect_device_type() == expected


def _init_says_what_it_made() -> dict[str, Any]:
    import logging

    from distcompat.collectives import _checked

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("distcompat.process_group")
    handler, level = Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        distcompat.destroy_distributed()  # drop the harness's group: compute_init makes its own
        compute_init("cpu", seed=None)
        compute_init("cpu", seed=None)  # idempotent: says nothing the second time
        info = distcompat.init_distributed(device="cpu")
        watch = _checked.watch
        result = {
            "records": records,
            "summary": info.summary,
            "launcher": info.launcher,
            "watchdog_reason": info.watchdog_reason,
            "mismatch_reason": info.mismatch_reason,
            "action": None if watch is None else watch.config.action,
        }
        compute_cleanup()
        return result
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_compute_init_says_once_on_rank_zero_which_group_it_made() -> None:
    for rank, got in enumerate(run_on_ranks(_init_says_what_it_made, 2)):
        # the harness's ranks look like "env" or, once init exported torchrun's contract, torchrun
        made = f"gloo group of 2 ranks on cpu (launcher {got['launcher']})"
        assert got["summary"] == made
        expected = [f"distcompat: {made}; watchdog report-only after 120s"]
        assert got["records"] == (expected if rank == 0 else [])
        # the default watchdog watches the group, report-only, and the reason says so
        assert got["action"] == "report"
        assert got["watchdog_reason"].startswith("report-only after 120s: distcompat's default")
        assert got["watchdog_reason"].endswith("covers all ranks, through the rendezvous store")
        assert got["mismatch_reason"].startswith("on: distcompat's default")


def test_a_single_process_reads_well() -> None:
    distcompat.destroy_distributed()
    info = distcompat.init_distributed(device="cpu")
    try:
        assert info.summary == "one process on cpu, no process group (no launcher)"
        lines = info.reason.splitlines()
        assert lines[-2] == "watchdog: none: one process, no collective to watch"
        assert lines[-1] == "mismatch check: none: one process, no collective to compare"
    finally:
        distcompat.destroy_distributed()
