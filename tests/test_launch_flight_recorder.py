"""torch's Flight Recorder variables init sets on NCCL, decided on CPU (no GPU, no process).

The NCCL group itself is not made here: the host is replaced by one with two CUDA devices and
NCCL built in (``override_host``), and the decision is read, as init reads it before the group.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from distcompat.launch import LaunchEnv, LaunchEnvError
from distcompat.launch._flight_recorder import (
    FLIGHT_RECORDER_VARIABLES,
    choose_flight_recorder,
    flight_recorder_folder,
    plan_flight_recorder,
)
from distcompat.launch._host import override_host, probe_host

FOLDER = Path("/dumps/flight-recorder/node1-29500")
LAUNCH = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
          "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}  # fmt: skip


def test_on_nccl_every_unset_variable_is_set() -> None:
    choice = choose_flight_recorder("nccl", folder=FOLDER, environ={})
    assert choice.values == {
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": f"{FOLDER}/comm_lib_trace_rank_",
    }
    assert choice.folder == FOLDER
    assert choice.reason.startswith(
        f"set TORCH_FR_BUFFER_SIZE=2000 TORCH_NCCL_DUMP_ON_TIMEOUT=1 "
        f"TORCH_FR_DUMP_TEMP_FILE={FOLDER}/comm_lib_trace_rank_ for this process, before the "
        "NCCL group was made"
    )
    assert "kept" not in choice.reason
    mixed = choose_flight_recorder("cpu:gloo,cuda:nccl", folder=FOLDER, environ={})
    assert mixed.values == choice.values  # a per-device map that names NCCL


@pytest.mark.parametrize("backend", ["gloo", "mpi", "xccl"])
def test_off_nccl_nothing_is_set_or_said(backend: str) -> None:
    choice = choose_flight_recorder(backend, folder=FOLDER, environ={})
    assert (choice.values, choice.folder, choice.reason) == ({}, None, "")


@pytest.mark.parametrize(("name", "alias"), list(FLIGHT_RECORDER_VARIABLES.items()))
def test_a_variable_the_user_set_under_either_name_is_kept_and_said(name: str, alias: str) -> None:
    for given in (name, alias):
        choice = choose_flight_recorder("nccl", folder=FOLDER, environ={given: "7"})
        assert name not in choice.values
        assert len(choice.values) == len(FLIGHT_RECORDER_VARIABLES) - 1
        assert f"kept the user's {given}=7" in choice.reason


def test_all_set_by_the_user_nothing_is_written_and_the_reason_says_so() -> None:
    user = {"TORCH_FR_BUFFER_SIZE": "500", "TORCH_FR_DUMP_ON_TIMEOUT": "1",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/scratch/fr_"}  # fmt: skip
    choice = choose_flight_recorder("nccl", folder=FOLDER, environ=user)
    assert choice.values == {}
    assert choice.folder is None  # the user's prefix: init makes no folder
    assert choice.reason == (
        "kept the user's TORCH_FR_BUFFER_SIZE=500 TORCH_FR_DUMP_ON_TIMEOUT=1 "
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE=/scratch/fr_"
    )


def test_a_buffer_of_zero_is_said_to_leave_no_dump() -> None:
    choice = choose_flight_recorder("nccl", folder=FOLDER, environ={"TORCH_FR_BUFFER_SIZE": "0"})
    assert (
        "the Flight Recorder is off (buffer size 0): an NCCL hang leaves no dump" in choice.reason
    )


@pytest.mark.parametrize("text", ["lots", "-1", ""])
def test_a_bad_buffer_size_names_variable_value_and_rule(text: str) -> None:
    with pytest.raises(LaunchEnvError) as caught:
        choose_flight_recorder(
            "nccl", folder=FOLDER, environ={"TORCH_NCCL_TRACE_BUFFER_SIZE": text}
        )
    assert caught.value.variable == "TORCH_NCCL_TRACE_BUFFER_SIZE"
    assert f"TORCH_NCCL_TRACE_BUFFER_SIZE={text!r} is not a number of entries" in str(caught.value)


def test_the_process_environment_is_read_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, alias in FLIGHT_RECORDER_VARIABLES.items():
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(alias, raising=False)
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")
    choice = choose_flight_recorder("nccl", folder=FOLDER)
    assert sorted(choice.values) == ["TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE"]
    assert "kept the user's TORCH_NCCL_DUMP_ON_TIMEOUT=0" in choice.reason


def test_init_plans_from_the_device_it_will_bind(tmp_path: Path) -> None:
    """Simulated host: two CUDA devices and NCCL (none here); the folder is made on request."""
    launch = LaunchEnv.from_environ(LAUNCH)
    gpu = replace(probe_host(), backends=frozenset({"gloo", "nccl"}), cuda_device_count=2)
    with override_host(gpu):
        on_gpu = plan_flight_recorder("cuda", None, launch, dump_dir=tmp_path, environ={})
        auto = plan_flight_recorder("auto", None, launch, dump_dir=tmp_path, environ={})
        on_cpu = plan_flight_recorder("cpu", None, launch, dump_dir=tmp_path, environ={})
    folder = tmp_path / "flight-recorder" / "127.0.0.1-29500"
    assert folder == flight_recorder_folder(tmp_path, launch)
    assert on_gpu.values["TORCH_FR_DUMP_TEMP_FILE"] == f"{folder}/comm_lib_trace_rank_"
    assert auto.values == on_gpu.values
    assert on_cpu.values == {}  # gloo: nothing to set
    assert not folder.exists()
    on_gpu.make_folder()
    assert folder.is_dir()
