"""``distcompat run CMD``: the environment it prepares, the flags it names, the command it execs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from distcompat.cli._run import prepare_environ, python_flag_warnings, run_command
from distcompat.run import BOOTSTRAP_DIR, RUN_VARIABLE


def test_the_bootstrap_goes_first_once() -> None:
    joined = os.pathsep.join([BOOTSTRAP_DIR, "/src"])
    assert prepare_environ({"PYTHONPATH": "/src"})["PYTHONPATH"] == joined
    assert prepare_environ({"PYTHONPATH": joined})["PYTHONPATH"] == joined  # nested runs
    assert prepare_environ({})["PYTHONPATH"] == BOOTSTRAP_DIR
    assert prepare_environ({RUN_VARIABLE: "off", "PYTHONPATH": "/src"})["PYTHONPATH"] == "/src"


@pytest.mark.parametrize(
    ("command", "named"),
    [
        (["python3", "-I", "x.py"], ["-I"]),
        (["/usr/bin/python3.11", "-IS", "x.py"], ["-IS", "-IS"]),
        (["python", "-u", "-E", "-m", "torch.distributed.run"], ["-E"]),
        (["python", "-W", "ignore", "-S", "x.py"], ["-S"]),  # -W's value is skipped
        (["python", "-Wignore", "-X", "dev", "-E", "x.py"], ["-E"]),
        (["python", "-m", "x", "-I"], []),  # the module's own option
        (["torchrun", "-S", "x.py"], []),
    ],
)
def test_flags_that_skip_the_bootstrap_are_named(command: list[str], named: list[str]) -> None:
    found = python_flag_warnings(command)
    assert [text.split(":")[0].split(" ")[1] for text in found] == named
    assert all("torch's own init" in text for text in found)


def test_bad_input_exits_2_or_127_and_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_command([], environ={}) == 2
    assert run_command(["true"], environ={RUN_VARIABLE: "maybe"}) == 2
    assert run_command(["no-such-command-for-distcompat"], environ={"PATH": "/nonexistent"}) == 127
    said = capsys.readouterr().err
    assert "give the command to run" in said
    assert f"{RUN_VARIABLE}='maybe': expected 'on' or 'off'" in said
    assert "command not found: no-such-command-for-distcompat" in said


def test_the_command_runs_with_the_bootstrap_and_keeps_its_exit_code(tmp_path: Path) -> None:
    """The console script execs the command: its PYTHONPATH starts with the bootstrap, its
    sitecustomize is the bootstrap's, and its exit code is the command's."""
    script = shutil.which("distcompat", path=os.path.dirname(sys.executable))
    assert script is not None
    probe = (
        "import os, sys; print(os.environ['PYTHONPATH'].split(os.pathsep)[0]); "
        "print(sys.modules['sitecustomize'].__file__); sys.exit(3)"
    )
    environ = {k: v for k, v in os.environ.items() if k != RUN_VARIABLE}
    done = subprocess.run(
        [script, "run", sys.executable, "-c", probe], capture_output=True, text=True,
        env=environ, cwd=tmp_path, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    first, custom = done.stdout.split()
    assert first == BOOTSTRAP_DIR
    assert custom == os.path.join(BOOTSTRAP_DIR, "sitecustomize.py")
