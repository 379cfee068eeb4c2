"""Only distcompat's own command hides torch's NumPy warning; a user's program keeps it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from distcompat._command import is_own_command

needs_no_numpy = pytest.mark.skipif(
    importlib.util.find_spec("numpy") is not None,
    reason="torch warns about NumPy only when numpy is not installed",
)


@pytest.mark.parametrize(
    ("argv", "orig", "own"),
    [
        (["/venv/bin/distcompat", "doctor"], ["/venv/bin/python", "/venv/bin/distcompat"], True),
        (["-m", "demo"], ["python", "-u", "-m", "distcompat", "demo"], True),
        (["train.py"], ["python", "train.py"], False),
        (["-m"], ["python", "-m", "distcompat.testing"], False),
        (["distcompat_train.py"], ["python", "distcompat_train.py"], False),
        ([], [], False),
    ],
)
def test_own_command_is_recognised(argv: list[str], orig: list[str], own: bool) -> None:
    assert is_own_command(argv, orig) is own


def _stderr(*command: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stderr


@needs_no_numpy
def test_the_cli_is_quiet_and_a_user_program_is_not() -> None:
    assert "NumPy" not in _stderr(sys.executable, "-m", "distcompat", "doctor", "--device", "cpu")
    # The public face imports torch on first use, so the user program uses distcompat here.
    program = "import distcompat; distcompat.init_distributed"
    assert "Failed to initialize NumPy" in _stderr(sys.executable, "-c", program)
