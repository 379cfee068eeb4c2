"""Launch pitfalls from fabricated environments and command lines (mocks: no launcher runs here).

The torchrun command lines are parsed with torchrun's own argument parser, as the agent would.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from distcompat.cli._doctor import collect_report
from distcompat.diagnostics import launch_pitfalls, log_launch_pitfalls, torchrun_prefix_pitfalls
from distcompat.env import LaunchEnv
from distcompat.launch import launcher_argv

# torchrun --nnodes=2 --nproc-per-node=2, rank 2 on the second node
TWO_NODES = {
    "RANK": "2",
    "LOCAL_RANK": "0",
    "WORLD_SIZE": "4",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1",
    "GROUP_WORLD_SIZE": "2",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "job",
}


@pytest.mark.parametrize(
    ("argv", "flagged"),
    [
        (["--nproc-per-node=2", "train.py", "--run", "fast"], ["--run"]),
        (["--nproc-per-node", "2", "train.py", "--max", "3", "--lr", "1"], ["--max"]),
        (["--standalone", "train.py", "--lr", "1"], []),  # not a prefix of any torchrun option
        (["train.py", "--", "--run", "fast"], []),  # the fix
        (["--nnodes", "1", "--", "train.py", "--run"], []),
        (["train.py", "--nnodes", "3"], []),  # an exact torchrun name after the script is passed
    ],
)
def test_script_options_torchrun_takes_by_prefix(argv: list[str], flagged: list[str]) -> None:
    found = torchrun_prefix_pitfalls(argv)
    assert [p.problem.split()[3] for p in found] == flagged
    for pitfall in found:
        assert "train.py -- " in pitfall.fix
        assert "--run-path" in pitfall.problem or "--max-restarts" in pitfall.problem


def test_launcher_argv_reads_the_parent_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent's /proc/<pid>/cmdline, mocked with a file."""
    real = Path

    def fake(path: str) -> Path:
        return real(tmp_path / "cmdline") if path.startswith("/proc/") else real(path)

    (tmp_path / "cmdline").write_bytes(
        b"/usr/bin/python3\0/usr/bin/torchrun\0--nproc-per-node=2\0train.py\0--run\0"
    )
    monkeypatch.setattr("distcompat.launch._pitfalls.Path", fake)
    assert launcher_argv(1234) == ["--nproc-per-node=2", "train.py", "--run"]
    (tmp_path / "cmdline").write_bytes(b"python\0-m\0torch.distributed.run\0x.py\0")
    assert launcher_argv(1234) == ["x.py"]
    (tmp_path / "cmdline").write_bytes(b"python\0train.py\0")
    assert launcher_argv(1234) is None


@pytest.mark.parametrize(
    ("ifname", "expected"),
    [
        (None, "without GLOO_SOCKET_IFNAME"),
        ("lo", "binds gloo to loopback"),
        ("nosuchnic0", "names no interface"),
    ],
)
def test_multi_node_gloo_needs_a_routable_interface(ifname: str | None, expected: str) -> None:
    environ = TWO_NODES | ({"GLOO_SOCKET_IFNAME": ifname} if ifname else {})
    found = launch_pitfalls(LaunchEnv.from_environ(environ), backend="gloo", argv=[])
    assert [p.name for p in found] == ["gloo-interface"]
    assert expected in found[0].problem
    assert "GLOO_SOCKET_IFNAME=" in found[0].fix


def test_no_gloo_pitfall_when_it_does_not_apply() -> None:
    env = LaunchEnv.from_environ(TWO_NODES | {"GLOO_SOCKET_IFNAME": "lo"})
    assert launch_pitfalls(env, backend="nccl", argv=[]) == []
    one_node = TWO_NODES | {
        "WORLD_SIZE": "2",
        "RANK": "0",
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
    }
    assert launch_pitfalls(LaunchEnv.from_environ(one_node), backend="gloo", argv=[]) == []


def test_no_rendezvous_host_is_a_doctor_problem() -> None:
    environ = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4",
               "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}  # fmt: skip
    env = LaunchEnv.from_environ(environ)
    assert env.master_addr is None  # multi-node MPI names no host
    names = [p.name for p in launch_pitfalls(env, backend="gloo", argv=[])]
    assert names == ["no-rendezvous-host", "gloo-interface"]
    report = collect_report(device="cpu", environ=environ, launcher_argv=[])
    assert not report.ok
    assert any("MASTER_ADDR" in p for p in report.problems)
    assert any("GLOO_SOCKET_IFNAME" in p for p in report.pitfalls)
    assert "PITFALL: gloo in a 2-node job" in report.to_text()


def test_doctor_reports_a_prefix_option_but_stays_ok() -> None:
    environ = TWO_NODES | {"GLOO_SOCKET_IFNAME": "lo"}
    report = collect_report(device="cpu", environ=environ, launcher_argv=["x.py", "--run"])
    assert report.ok  # pitfalls warn; they do not stop init
    assert "binds gloo to loopback" in report.pitfalls[0]
    assert "--run-path" in report.pitfalls[1]


def test_init_logs_each_pitfall_once(caplog: pytest.LogCaptureFixture) -> None:
    env = LaunchEnv.from_environ(TWO_NODES | {"LOCAL_RANK": "0"})
    with caplog.at_level(logging.WARNING, logger="distcompat"):
        first = log_launch_pitfalls(env, backend="gloo", argv=["t.py", "--run"])
        log_launch_pitfalls(env, backend="gloo", argv=["t.py", "--run"])
    assert len(first) == 2
    assert len([r for r in caplog.records if "launch pitfall" in r.getMessage()]) == 2
    other = LaunchEnv.from_environ(TWO_NODES | {"RANK": "3", "LOCAL_RANK": "1"})
    assert log_launch_pitfalls(other, backend="gloo", argv=[]) == []  # one rank per node logs
