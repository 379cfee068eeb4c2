"""run_on_ranks tells what went wrong when rank processes cannot start or cannot load the task.

Each case is a real script run with this interpreter (the main-guard problem only exists for a
script that is the main module), in a temporary directory.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from distcompat.testing import run_on_ranks
from distcompat.testing._startup import _guarded, startup_hint


def _run_script(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "user_script.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_script_without_main_guard_is_told_to_add_one(tmp_path: Path) -> None:
    done = _run_script(
        tmp_path,
        """
        import distcompat
        from distcompat.testing import run_on_ranks

        print(run_on_ranks(distcompat.get_rank, 2))
        """,
    )
    assert done.returncode != 0
    assert "MainGuardError" in done.stderr
    assert 'without an `if __name__ == "__main__":` guard' in done.stderr
    assert "user_script.py (line 5)" in done.stderr


@pytest.mark.slow
def test_script_with_main_guard_runs(tmp_path: Path) -> None:
    done = _run_script(
        tmp_path,
        """
        import distcompat
        from distcompat.testing import run_on_ranks

        if __name__ == "__main__":
            print(run_on_ranks(distcompat.get_rank, 2))
        """,
    )
    assert done.returncode == 0, done.stderr
    assert "[0, 1]" in done.stdout


@pytest.mark.parametrize(
    "source",
    [
        'if __name__ == "__main__":\n    call()\n',
        'if "__main__" == __name__:\n    call()\n',
        'if __name__ == "__main__" and len(sys.argv) > 1:\n    call()\n',
        'if x:\n    pass\nelif __name__ == "__main__":\n    call()\n',
        'if __name__ != "__main__":\n    pass\nelse:\n    call()\n',
    ],
)
def test_guards_written_any_way_are_accepted(source: str) -> None:
    """A script whose call sits under any ``if`` that tests ``__name__`` is not refused."""
    tree = ast.parse(source)
    line = next(
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "call"
    )
    assert _guarded(tree, line)


def test_a_call_outside_every_guard_is_found() -> None:
    tree = ast.parse('if __name__ == "__main__":\n    pass\ncall()\nif flag:\n    call()\n')
    assert not _guarded(tree, 3)
    assert not _guarded(tree, 5)


@pytest.mark.slow
def test_function_defined_under_the_guard_is_explained(tmp_path: Path) -> None:
    done = _run_script(
        tmp_path,
        """
        from distcompat.testing import run_on_ranks

        if __name__ == "__main__":
            def work():
                return 1

            run_on_ranks(work, 2)
        """,
    )
    assert done.returncode != 0
    assert "could not load the function" in done.stderr
    assert "Can't get attribute 'work'" in done.stderr
    assert "define it at module level" in done.stderr


@pytest.mark.slow
def test_import_error_in_the_rank_is_relayed(tmp_path: Path) -> None:
    done = _run_script(
        tmp_path,
        """
        import distcompat
        from distcompat.testing import run_on_ranks

        if __name__ == "__mp_main__":  # only the rank processes fail to import
            import a_module_only_the_parent_has

        if __name__ == "__main__":
            run_on_ranks(distcompat.get_rank, 2)
        """,
    )
    assert done.returncode != 0
    message = done.stderr[done.stderr.index("RankFailedError") :]
    assert "died while starting (exit code 1)" in message
    assert "could not import a module" in message
    assert "No module named 'a_module_only_the_parent_has'" in message  # the rank's own stderr


def _nested_function_task() -> None:
    def inner() -> int:
        return 1

    run_on_ranks(inner, 2)


def test_unpicklable_function_says_which_part() -> None:
    with pytest.raises(TypeError, match=r"the function .*inner.* is not") as info:
        _nested_function_task()
    assert "defined at module level" in str(info.value)
    with pytest.raises(TypeError, match="its arguments are not"):
        run_on_ranks(print, 2, args=(lambda: None,))


def test_startup_hints() -> None:
    assert "if __name__" in startup_hint(
        "... before the current process has finished its bootstrapping phase ..."
    )
    assert "printed nothing" in startup_hint("")
