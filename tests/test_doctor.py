"""``distcompat doctor``: the report, the CLI exit codes, and a real 2-process torchrun launch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from distcompat.cli import main
from distcompat.cli._doctor import collect_report

TORCHRUN_ENV = {
    "RANK": "1",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "0",
    "GROUP_WORLD_SIZE": "1",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "abc",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
}


def test_single_process_report() -> None:
    report = collect_report(device="cpu", environ={})
    assert report.ok
    assert (report.device, report.backend) == ("cpu", "gloo")
    assert "single process" in report.backend_reason
    assert "[rank 0] launcher none" in report.to_text()


def test_torchrun_report_is_tagged_with_rank() -> None:
    report = collect_report(device="cpu", environ=TORCHRUN_ENV)
    text = report.to_text()
    assert all(line.startswith("[rank 1] ") for line in text.splitlines())
    assert "launcher torchrun: rank 1 of 2" in text
    assert report.backend_reason == "gloo: the default for run device cpu"


def test_bad_environment_is_a_problem_not_a_crash() -> None:
    report = collect_report(environ={"RANK": "5", "WORLD_SIZE": "2"})
    assert not report.ok
    assert "RANK" in report.problems[0]
    assert "5" in report.problems[0]
    assert "PROBLEM:" in report.to_text()


def test_device_the_host_lacks_is_a_problem() -> None:
    report = collect_report(device="xpu", environ=TORCHRUN_ENV)
    assert not report.ok
    assert "no xpu device" in report.problems[0]


def test_cli_json_and_exit_codes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    assert main(["doctor", "--device", "cpu", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert (payload["ok"], payload["backend"], payload["world_size"]) == (True, "gloo", 1)
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["doctor"]) == 1
    assert "PROBLEM" in capsys.readouterr().out
    assert main([]) == 2
    assert "usage: distcompat" in capsys.readouterr().out
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("distcompat ")


def _scripts_env() -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "TORCHELASTIC_"))}
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    return env


@pytest.mark.slow
def test_torchrun_two_processes_doctor_exits_zero() -> None:
    env = _scripts_env()
    torchrun = shutil.which("torchrun", path=env["PATH"])
    assert torchrun is not None
    done = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node=2", "--no-python", "distcompat", "doctor"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] launcher torchrun: rank {rank} of 2" in done.stdout
        assert f"[rank {rank}] ok: init_distributed() would succeed" in done.stdout


@pytest.mark.slow
def test_python_dash_m_entry_point() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "distcompat", "doctor", "--json", "--device", "cpu"],
        env=_scripts_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["backend"] == "gloo"


def test_pitfalls_are_listed_and_do_not_fail_the_report() -> None:
    """Environment and torchrun command line are mocks (no launcher runs)."""
    environ = TORCHRUN_ENV | {"GROUP_WORLD_SIZE": "2", "WORLD_SIZE": "4", "GROUP_RANK": "0"}
    report = collect_report(device="cpu", environ=environ, launcher_argv=["t.py", "--run"])
    assert report.ok
    assert any("GLOO_SOCKET_IFNAME" in p for p in report.pitfalls)
    assert any("--run-path" in p for p in report.pitfalls)
    assert json.loads(report.to_json())["pitfalls"] == list(report.pitfalls)
    assert "PITFALL:" in report.to_text()


def test_the_group_line_says_whether_the_group_is_protected() -> None:
    """Env parsing only (a dict, no launcher): protected on gloo by default, torch's own with
    DISTCOMPAT_PROTECT_GROUP=off, and a malformed value is a PROBLEM naming the variable."""
    assert collect_report(device="cpu", environ=TORCHRUN_ENV).group_reason.startswith("protected")
    off = collect_report(device="cpu", environ=TORCHRUN_ENV | {"DISTCOMPAT_PROTECT_GROUP": "off"})
    assert off.group_reason.startswith("torch's own gloo group")
    bad = collect_report(device="cpu", environ=TORCHRUN_ENV | {"DISTCOMPAT_PROTECT_GROUP": "x"})
    assert not bad.ok
    assert any("DISTCOMPAT_PROTECT_GROUP='x'" in problem for problem in bad.problems)
