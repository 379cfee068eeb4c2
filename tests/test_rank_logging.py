"""Rank-safe logging: print0, rank_zero_only, get_logger, warn_once, progress.

Rank gating is checked two ways: on real gloo ranks through run_on_ranks (the ``_rank_*``
bodies), and in this process with ``get_rank`` patched, which is fast and covers every branch.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from distcompat import rank_logging
from distcompat.rank_logging import (
    ProgressBackend,
    get_logger,
    print0,
    progress,
    progress_backend,
    rank_zero_only,
    warn_once,
)

Runner = Callable[..., list[Any]]


@pytest.fixture(autouse=True)
def _fresh_warn_once_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rank_logging, "_warned", set())


@pytest.fixture
def as_rank(monkeypatch: pytest.MonkeyPatch) -> Callable[[int, int], None]:
    def set_rank(rank: int, world_size: int = 4) -> None:
        monkeypatch.setattr(rank_logging, "get_rank", lambda: rank)
        monkeypatch.setattr(rank_logging, "get_world_size", lambda: world_size)

    return set_rank


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def _capture(name: str) -> Iterator[_Records]:
    handler = _Records()
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)


# --- on real ranks --------------------------------------------------------------------------------


def _rank_print0() -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print0("hello from", "rank zero")
    return out.getvalue()


def _rank_log(ranks: str) -> list[tuple[str, int]]:
    with _capture(f"distcompat.test.{ranks}") as captured:
        get_logger(f"distcompat.test.{ranks}", ranks=ranks).info("step %d done", 3)  # type: ignore[arg-type]
    return [(r.getMessage(), r.rank) for r in captured.records]  # type: ignore[attr-defined]


def _rank_progress() -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        total = sum(progress(range(5), desc="eval"))
    return total, err.getvalue()


def test_only_rank_zero_prints(run_on_ranks: Runner) -> None:
    assert run_on_ranks(_rank_print0, 3) == ["hello from rank zero\n", "", ""]


def test_logger_records_carry_the_rank_and_a_prefix(run_on_ranks: Runner) -> None:
    assert run_on_ranks(_rank_log, 2, args=("all",)) == [
        [("[rank 0/2] step 3 done", 0)],
        [("[rank 1/2] step 3 done", 1)],
    ]
    assert run_on_ranks(_rank_log, 2, args=("zero",)) == [[("[rank 0/2] step 3 done", 0)], []]


def test_progress_is_silent_off_rank_zero(run_on_ranks: Runner) -> None:
    (total0, out0), (total1, out1) = run_on_ranks(_rank_progress, 2)
    assert total0 == total1 == 10  # every rank still gets every item
    assert "eval" in out0
    assert "5/5" in out0
    assert out1 == ""


# --- in this process, rank patched ----------------------------------------------------------------


def test_print0_and_rank_zero_only_off_rank_zero(
    as_rank: Callable[[int, int], None], capsys: pytest.CaptureFixture[str]
) -> None:
    @rank_zero_only
    def double(x: int, *, times: int = 2) -> int:
        """Double it."""
        return x * times

    assert double.__name__ == "double"
    assert double.__doc__ == "Double it."
    assert double(4, times=3) == 12
    as_rank(2, 4)
    print0("quiet")
    assert double(4) is None
    assert capsys.readouterr().out == ""


def test_logger_reads_the_rank_at_call_time(as_rank: Callable[[int, int], None]) -> None:
    log = get_logger("distcompat.test.late")  # made "at import", before any rank is known
    with _capture("distcompat.test.late") as captured:
        as_rank(1, 2)
        log.warning("muted")
        as_rank(0, 2)
        log.warning("shown")
        as_rank(0, 1)
        log.warning("single process: no prefix")
    assert [r.getMessage() for r in captured.records] == [
        "[rank 0/2] shown",
        "single process: no prefix",
    ]
    assert get_logger("distcompat.test.late", prefix=False).ranks == "zero"
    with pytest.raises(ValueError, match="'zero' or 'all'"):
        get_logger("x", ranks="some")  # type: ignore[arg-type]


def test_the_root_logger_is_never_configured() -> None:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    with _capture("distcompat.test.root"):
        get_logger("distcompat.test.root").info("x")
    assert root.handlers == handlers
    assert root.level == level


def test_warn_once_fires_once_and_blames_the_caller() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            warn_once("gloo has no AVG; using SUM then divide", RuntimeWarning)
        warn_once("another message")
    assert [(type(w.message), str(w.message)) for w in caught] == [
        (RuntimeWarning, "gloo has no AVG; using SUM then divide"),
        (UserWarning, "another message"),
    ]
    assert caught[0].filename == __file__  # stacklevel points at this test, not the helper


def _library_helper() -> bool:
    return warn_once("deprecated knob", DeprecationWarning, stacklevel=2)


def test_warn_once_stacklevel_can_blame_the_callers_caller() -> None:
    with pytest.warns(DeprecationWarning, match="deprecated knob") as caught:
        assert _library_helper() is True
    assert caught[0].filename == __file__
    assert caught[0].lineno != _library_helper.__code__.co_firstlineno + 1
    assert _library_helper() is False


def test_warn_once_is_rank_zero_unless_asked(as_rank: Callable[[int, int], None]) -> None:
    as_rank(1, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert warn_once("only rank 0") is False
        assert warn_once("every rank", all_ranks=True) is True
    assert [str(w.message) for w in caught] == ["every rank"]


def test_progress_off_rank_zero_passes_items_through(as_rank: Callable[[int, int], None]) -> None:
    as_rank(3, 4)
    out = io.StringIO()
    assert list(progress(iter("abc"), desc="x", file=out)) == ["a", "b", "c"]
    assert out.getvalue() == ""


def test_plain_progress_shows_rate_and_eta(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = ProgressBackend(name="plain", reason="forced by the test")
    monkeypatch.setattr(rank_logging, "progress_backend", lambda: plain)
    monkeypatch.setattr(rank_logging, "_PLAIN_INTERVAL_S", 0.0)
    out = io.StringIO()
    assert list(progress(range(3), desc="train", file=out)) == [0, 1, 2]
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("train: 1/3 [")
    assert "it/s, ETA" in lines[0]
    assert lines[-1].startswith("train: 3/3 [")
    assert len(lines) == 3  # the closing line is not repeated
    out = io.StringIO()
    list(progress(iter(range(2)), file=out))  # no len(): count only, no ETA
    assert out.getvalue().splitlines()[-1].startswith("2 [")
    assert "ETA" not in out.getvalue()


def test_progress_backend_names_itself() -> None:
    backend = progress_backend()
    expected = "tqdm" if importlib.util.find_spec("tqdm") else "plain"
    assert backend.name == expected
    assert backend.reason


def test_tqdm_progress_when_installed() -> None:
    pytest.importorskip("tqdm")
    out = io.StringIO()
    assert sum(progress(range(4), desc="tq", file=out, mininterval=0)) == 6
    assert "tq" in out.getvalue()
    assert "4/4" in out.getvalue()
