"""What init writes into its process's environment (``process_group._environ``), for real.

* The deciding functions, with dict environments and fake interface picks (unit tests).
* A real 2-rank gloo group whose processes carry Open MPI's variables only (set by this test, no
  mpiexec): after init the script sees torchrun's ``RANK`` / ``WORLD_SIZE`` ..., a variable set
  beforehand keeps its value, and destroy unsets what init set.
* The same script under the real ``mpiexec`` of Open MPI and MPICH (skipped when not installed).
* Two torchrun "nodes" in network namespaces joined by a veth pair, started WITHOUT
  ``GLOO_SOCKET_IFNAME`` (gloo alone binds 127.0.0.1 there and fails after 82 s): init picks the
  veth on each node and the all_reduce completes. Needs root and ``ip``; skipped otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from distcompat import DistInfo
from distcompat.launch import InterfacePick, LaunchEnv, torchrun_exports
from distcompat.launch._exports import TorchrunValues
from distcompat.launch._local_ranks import is_launcher_variable
from distcompat.process_group._environ import (
    EnvironWrites,
    bind_gloo_interface,
    export_torchrun_contract,
)

# A nanochat-style script: its own helper reads the environment, as most training code does.
SCRIPT = """
import json, os, sys
import torch
import distcompat
import distcompat.distributed as dist

def get_dist_info():  # nanochat's shape
    if all(v in os.environ for v in ("RANK", "LOCAL_RANK", "WORLD_SIZE")):
        return True, int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    return False, 0, 0, 1

before = get_dist_info()
info = distcompat.init_distributed(device="cpu", timeout=60)
after = get_dist_info()
total = torch.tensor([float(info.rank + 1)])
dist.all_reduce(total)
names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
         "MASTER_PORT", "GLOO_SOCKET_IFNAME")
seen = {name: os.environ.get(name) for name in names}
distcompat.destroy_distributed()
report = {"rank": info.rank, "launcher": info.launcher, "before": before, "after": after,
          "sum": total.item(), "environ": seen, "exported": list(info.exported),
          "reason": info.reason,
          "after_destroy": {name: os.environ.get(name) for name in names}}
with open(os.path.join(sys.argv[1], f"rank{info.rank}.json"), "w") as handle:
    json.dump(report, handle)
"""  # noqa: E501


OPEN_MPI_RANK1 = {
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
}


def _values(**change: Any) -> TorchrunValues:
    base: dict[str, Any] = {
        "rank": 3, "local_rank": 1, "world_size": 4, "local_world_size": 2, "node_rank": 1,
        "master_addr": "node0", "master_port": 29500,
    }  # fmt: skip
    return TorchrunValues(**(base | change))


def test_exports_only_what_is_missing() -> None:
    environ = {"SLURM_PROCID": "3", "MASTER_ADDR": "mine", "LOCAL_RANK": "7"}
    assert torchrun_exports(_values(), environ) == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "MASTER_PORT": "29500",
    }
    assert torchrun_exports(_values(master_addr=None, master_port=None), {}).keys() == {
        "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
    }  # fmt: skip


def _info(**change: Any) -> DistInfo:
    base: dict[str, Any] = {
        "rank": 1, "local_rank": 1, "world_size": 2, "local_world_size": 2, "node_rank": 0,
        "device": torch.device("cpu"), "backend": "gloo", "timeout": None,
        "launcher": "openmpi", "has_group": True, "adopted": False, "device_reason": "d",
        "backend_reason": "b", "timeout_reason": "t",
    }  # fmt: skip
    return DistInfo(**(base | change))


def test_export_records_names_and_reason_and_withdraw_keeps_foreign_values() -> None:
    """Dict environment; the real-process version is below."""
    launch = LaunchEnv.from_environ(OPEN_MPI_RANK1 | {"MASTER_PORT": "1234"})
    environ = {"MASTER_PORT": "1234"}
    writes = EnvironWrites(environ)
    info = export_torchrun_contract(_info(), launch, writes)
    assert info.exported == (
        "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
    )  # fmt: skip
    assert environ["RANK"] == "1"
    assert environ["MASTER_ADDR"] == "127.0.0.1"
    assert "exported RANK=1 LOCAL_RANK=1 WORLD_SIZE=2" in info.reason
    assert "left unset by the openmpi launch" in info.environ_reason
    environ["RANK"] = "changed by the user"
    writes.withdraw()
    assert environ == {"MASTER_PORT": "1234", "RANK": "changed by the user"}


def test_no_export_without_a_group() -> None:
    environ: dict[str, str] = {}
    info = _info(has_group=False, launcher="none", rank=0, world_size=1)
    out = export_torchrun_contract(info, LaunchEnv.from_environ({}), EnvironWrites(environ))
    assert out is info
    assert environ == {}


def test_adopted_group_without_launcher_exports_ranks_but_no_master() -> None:
    environ: dict[str, str] = {}
    out = export_torchrun_contract(
        _info(launcher="none", adopted=True), LaunchEnv.from_environ({}), EnvironWrites(environ)
    )
    assert "MASTER_ADDR" not in environ
    assert environ["WORLD_SIZE"] == "2"
    assert "whoever made the group" in out.environ_reason


def test_gloo_interface_is_set_only_when_unset_and_found() -> None:
    launch = LaunchEnv.from_environ({})  # the pick is faked, so the launch does not matter
    found = InterfacePick(name="veth1", reason="veth1: the interface whose route reaches ...")
    environ: dict[str, str] = {}
    writes = bind_gloo_interface(launch, "gloo", environ=environ, pick=lambda e, b: found)
    assert environ == {"GLOO_SOCKET_IFNAME": "veth1"}
    assert "GLOO_SOCKET_IFNAME=veth1 for this process" in writes.reasons[0]
    mine = {"GLOO_SOCKET_IFNAME": "eth7"}
    assert not bind_gloo_interface(launch, "gloo", environ=mine, pick=lambda e, b: found).values
    assert mine == {"GLOO_SOCKET_IFNAME": "eth7"}
    nothing = InterfacePick(name=None, reason="no route")
    empty: dict[str, str] = {}
    assert not bind_gloo_interface(launch, "gloo", environ=empty, pick=lambda e, b: nothing).values
    assert empty == {}


# --- real processes ----------------------------------------------------------------------------


def _clean_environ() -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if not is_launcher_variable(k)}
    for name in ("MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME"):
        environ.pop(name, None)
    environ["OMP_NUM_THREADS"] = "1"
    environ["PATH"] = str(Path(sys.executable).parent) + os.pathsep + environ.get("PATH", "")
    return environ


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _reports(folder: Path, ranks: int) -> list[dict[str, Any]]:
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(ranks)]


def _check_mpi_reports(reports: list[dict[str, Any]], launcher: str) -> None:
    for rank, got in enumerate(reports):
        assert got["launcher"] == launcher
        assert got["before"] == [False, 0, 0, 1]  # what the script saw without distcompat
        assert got["after"] == [True, rank, rank, 2]
        assert got["sum"] == 3.0
        assert got["environ"]["LOCAL_WORLD_SIZE"] == "2"
        assert got["environ"]["GROUP_RANK"] == "0"
        assert got["environ"]["MASTER_ADDR"] == "127.0.0.1"
        assert "exported RANK=" in got["reason"]
        assert all(got["after_destroy"][name] is None for name in got["exported"])


@pytest.mark.slow
def test_real_group_with_mpi_variables_gets_torchrun_contract(tmp_path: Path) -> None:
    """Two processes with Open MPI's variables (set here; no mpiexec) make a real gloo group."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    port = _free_port()
    procs = []
    for rank in range(2):
        environ = _clean_environ() | {
            "OMPI_COMM_WORLD_RANK": str(rank),
            "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_LOCAL_RANK": str(rank),
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            "MASTER_PORT": str(port),
        }
        if rank == 1:
            environ["GROUP_RANK"] = "0"  # set before init: must be kept, not exported
        procs.append(subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=environ))
    for proc in procs:
        assert proc.wait(timeout=120) == 0
    reports = _reports(tmp_path, 2)
    _check_mpi_reports(reports, "openmpi")
    assert "GROUP_RANK" in reports[0]["exported"]
    assert "GROUP_RANK" not in reports[1]["exported"]
    assert reports[1]["after_destroy"]["GROUP_RANK"] == "0"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mpiexec", "flags", "launcher"),
    [
        ("mpiexec.openmpi", ["--allow-run-as-root", "--oversubscribe", "-np", "2"], "openmpi"),
        ("mpiexec.mpich", ["-n", "2"], "mpich"),
    ],
)
def test_under_real_mpiexec(tmp_path: Path, mpiexec: str, flags: list[str], launcher: str) -> None:
    """The real launcher: its ranks see RANK / WORLD_SIZE after init, as under torchrun."""
    found = shutil.which(mpiexec)
    if found is None:
        pytest.skip(f"{mpiexec} is not installed (apt-get install openmpi-bin / mpich)")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    environ = _clean_environ() | {"MASTER_PORT": str(_free_port())}
    done = subprocess.run(
        [found, *flags, sys.executable, str(script), str(tmp_path)],
        env=environ,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    _check_mpi_reports(_reports(tmp_path, 2), launcher)


# --- two nodes in network namespaces -----------------------------------------------------------


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


@pytest.mark.slow
def test_two_netns_nodes_need_no_gloo_socket_ifname(tmp_path: Path) -> None:
    """torchrun on 2 "nodes" (namespaces + veth, c10d rendezvous), GLOO_SOCKET_IFNAME unset."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("`ip` (iproute2) is not installed")
    tag = f"dcb{os.getpid() % 100000}"
    spaces, links = (f"{tag}-n0", f"{tag}-n1"), (f"{tag}v0", f"{tag}v1")
    addresses = ("10.77.0.1", "10.77.0.2")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for space in spaces:
            _run("ip", "netns", "add", space)
        _run("ip", "link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for space, link, address in zip(spaces, links, addresses, strict=True):
            _run("ip", "link", "set", link, "netns", space)
            _run("ip", "-n", space, "addr", "add", f"{address}/24", "dev", link)
            _run("ip", "-n", space, "link", "set", link, "up")
            _run("ip", "-n", space, "link", "set", "lo", "up")
        started = time.monotonic()
        for node, (space, address) in enumerate(zip(spaces, addresses, strict=True)):
            command = [
                "ip", "netns", "exec", space, sys.executable, "-m", "torch.distributed.run",
                "--nnodes=2", "--nproc-per-node=1", f"--node-rank={node}",
                "--rdzv-backend=c10d", f"--rdzv-endpoint={addresses[0]}:29400",
                f"--rdzv-id={tag}", f"--rdzv-conf=is_host={int(node == 0)}",
                f"--local-addr={address}", str(script), str(tmp_path),
            ]  # fmt: skip
            procs.append(subprocess.Popen(command, env=_clean_environ()))
        codes = [proc.wait(timeout=90) for proc in procs]
        elapsed = time.monotonic() - started
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for space in spaces:
            subprocess.run(["ip", "netns", "delete", space], capture_output=True, check=False)
        subprocess.run(["ip", "link", "delete", links[0]], capture_output=True, check=False)
    assert codes == [0, 0]
    for node, got in enumerate(_reports(tmp_path, 2)):
        assert got["sum"] == 3.0
        assert got["environ"]["GLOO_SOCKET_IFNAME"] == links[node]
        assert f"GLOO_SOCKET_IFNAME={links[node]} for this process" in got["reason"]
        assert got["after_destroy"]["GLOO_SOCKET_IFNAME"] is None
    assert elapsed < 60, f"two-node run took {elapsed:.1f} s"
