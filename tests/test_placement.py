"""Device and backend decisions, on described hosts (no processes).

Hosts with GPUs are described with HostInfo values: we have no such hardware here, and the
decision functions take the host as an argument precisely so they can be tested this way.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest
import torch

from distcompat.env import LaunchEnv
from distcompat.launch._host import HostInfo, override_host, probe_host
from distcompat.launch._placement import (
    DEFAULT_TIMEOUT,
    BackendUnavailableError,
    DeviceBindingError,
    choose_backend,
    choose_timeout,
    resolve_device,
)

CPU_HOST = HostInfo(
    torch_version="2.13.0",
    distributed_available=True,
    backends=frozenset({"gloo"}),
    cuda_device_count=0,
    xpu_device_count=0,
    mps_available=False,
)
GPU_HOST = replace(CPU_HOST, backends=frozenset({"gloo", "nccl"}), cuda_device_count=2)
ENV = LaunchEnv.from_environ({})
ENV_VISIBLE = replace(ENV, cuda_visible_devices="0")


def test_cpu_on_gpu_host_stays_cpu_and_says_so() -> None:
    choice = resolve_device("cpu", local_rank=1, env=ENV, host=GPU_HOST)
    assert choice.device == torch.device("cpu")
    assert "cuda (2) present but unused" in choice.reason
    backend = choose_backend(choice.device, None, host=GPU_HOST)
    assert backend.backend == "gloo"
    assert "run device cpu" in backend.reason


def test_auto_prefers_accelerator_bound_by_local_rank() -> None:
    choice = resolve_device("auto", local_rank=1, env=ENV, host=GPU_HOST)
    assert choice.device == torch.device("cuda", 1)
    assert "LOCAL_RANK=1" in choice.reason
    assert choose_backend(choice.device, None, host=GPU_HOST).backend == "nccl"


def test_auto_on_cpu_host() -> None:
    choice = resolve_device("auto", local_rank=3, env=ENV, host=CPU_HOST)
    assert choice.device == torch.device("cpu")
    assert "no accelerator" in choice.reason


def test_local_rank_beyond_devices_names_everything() -> None:
    one_gpu = replace(GPU_HOST, cuda_device_count=1)
    with pytest.raises(DeviceBindingError) as info:
        resolve_device("cuda", local_rank=1, env=ENV_VISIBLE, host=one_gpu)
    message = str(info.value)
    assert "LOCAL_RANK=1" in message
    assert "1 cuda device(s)" in message
    assert "CUDA_VISIBLE_DEVICES='0'" in message


def test_explicit_index_checked() -> None:
    assert resolve_device("cuda:1", local_rank=0, env=ENV, host=GPU_HOST).device.index == 1
    with pytest.raises(DeviceBindingError, match="cuda:5"):
        resolve_device("cuda:5", local_rank=0, env=ENV, host=GPU_HOST)


def test_missing_accelerator_and_unknown_device() -> None:
    with pytest.raises(DeviceBindingError, match="no cuda device"):
        resolve_device("cuda", local_rank=0, env=ENV, host=CPU_HOST)
    with pytest.raises(ValueError, match="'potato' is not a device"):
        resolve_device("potato", local_rank=0, env=ENV, host=CPU_HOST)


def test_mps_maps_to_gloo() -> None:
    mac = replace(CPU_HOST, mps_available=True)
    device = resolve_device("auto", local_rank=0, env=ENV, host=mac).device
    assert device.type == "mps"
    choice = choose_backend(device, None, host=mac)
    assert choice.backend == "gloo"
    assert "host memory" in choice.reason


@pytest.mark.parametrize(
    ("device", "requested", "expected"),
    [
        ("cpu", "gloo", "gloo"),
        ("cpu", "GLOO", "gloo"),
        ("cuda", "gloo", "gloo"),
        ("cpu", "cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl"),
        ("cuda", "cpu:gloo, cuda:nccl", "cpu:gloo,cuda:nccl"),
    ],
)
def test_requested_backends(device: str, requested: str, expected: str) -> None:
    choice = choose_backend(torch.device(device), requested, host=GPU_HOST)
    assert choice.backend == expected.replace(" ", "")
    assert "requested" in choice.reason


@pytest.mark.parametrize(
    ("device", "requested", "error", "words"),
    [
        ("cpu", "nccl", BackendUnavailableError, "nccl cannot move cpu tensors"),
        ("cpu", "carrier-pigeon", ValueError, "unknown backend 'carrier-pigeon'"),
        ("cpu", "mpi", BackendUnavailableError, "mpi is not built into torch"),
        ("cuda", "cpu:gloo", BackendUnavailableError, "no backend for the run device 'cuda'"),
        ("cpu", "cpu:gloo,cuda", ValueError, "is not 'device:backend'"),
    ],
)
def test_bad_backends(device: str, requested: str, error: type[Exception], words: str) -> None:
    with pytest.raises(error, match=words):
        choose_backend(torch.device(device), requested, host=GPU_HOST)


def test_cuda_without_nccl_is_a_named_fallback() -> None:
    no_nccl = replace(GPU_HOST, backends=frozenset({"gloo"}))
    choice = choose_backend(torch.device("cuda", 0), None, host=no_nccl)
    assert choice.backend == "gloo"
    assert "cuda-without-nccl" in choice.reason


def test_xpu_without_xccl_errors() -> None:
    with pytest.raises(BackendUnavailableError, match="needs the xccl backend"):
        choose_backend(torch.device("xpu", 0), None, host=CPU_HOST)


def test_timeouts() -> None:
    assert choose_timeout(None).timeout == DEFAULT_TIMEOUT == timedelta(minutes=10)
    assert "30 min" in choose_timeout(None).reason
    assert choose_timeout(2.5).timeout == timedelta(seconds=2.5)
    assert choose_timeout(timedelta(seconds=7)).timeout == timedelta(seconds=7)
    with pytest.raises(ValueError, match="must be positive"):
        choose_timeout(0)


def test_override_host_is_scoped() -> None:
    real = probe_host()
    with override_host(GPU_HOST):
        assert probe_host() is GPU_HOST
    assert probe_host() == real
    assert "gloo" in real.backends
