"""Logging from many ranks without noise and without deadlocks.

The lines a training script writes::

    log = distcompat.get_logger(__name__)             # rank 0 only; records carry .rank
    distcompat.print0(f"epoch {epoch}: loss {loss:.3f}")
    for batch in distcompat.progress(loader, desc="train"):   # a bar on rank 0, silent elsewhere
        ...

Rules this module keeps:

* No helper here runs a collective, so none of them can hang a rank that calls it alone. Rank
  gating only decides whether *this* process writes; compute a metric's ``all_reduce`` on every rank
  first, then hand the value to these helpers.
* The rank is read at call time, not at import or at ``get_logger`` time, so a module-level logger
  created before :func:`distcompat.init_distributed` still reports the right rank.
* The root logger is never configured and no handler is added: where records go is the
  application's choice.
* The progress bar is tqdm when it is installed (small, no dependencies of its own, degrades to
  plain lines when stderr is not a terminal); otherwise a built-in line printer with the same rate
  and ETA. :func:`progress_backend` says which one and why.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, MutableMapping, Sized
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, Literal, TypeVar

from typing_extensions import ParamSpec

from distcompat._ranks import get_rank, get_world_size
from distcompat.diagnostics._regions import single_rank_region

__all__ = [
    "ProgressBackend",
    "RankLoggerAdapter",
    "get_logger",
    "print0",
    "progress",
    "progress_backend",
    "rank_zero_only",
    "warn_once",
]

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")

#: Seconds between two lines of the built-in progress printer (tqdm redraws on its own schedule).
_PLAIN_INTERVAL_S = 10.0


def print0(*values: object, sep: str | None = " ", end: str | None = "\n", **kwargs: Any) -> None:
    """Call :func:`print` on global rank 0 only (and in a plain single process).

    Accepts everything :func:`print` accepts (``file=``, ``flush=``).

    Example:
        >>> print0("loss", 0.25)
        loss 0.25
    """
    if get_rank() == 0:
        print(*values, sep=sep, end=end, **kwargs)


def rank_zero_only(fn: Callable[P, R]) -> Callable[P, R | None]:
    """Decorate ``fn`` so that it runs on global rank 0 only and returns ``None`` elsewhere.

    The signature is kept for type checkers (``ParamSpec``). The body runs inside a
    :func:`distcompat.single_rank_region`: a collective called from it (the other ranks skip it,
    so rank 0 would wait forever) raises ``SingleRankCollectiveError`` at once, naming the call.

    Example:
        >>> @rank_zero_only
        ... def report(loss: float) -> str:
        ...     return f"loss {loss:.2f}"
        >>> report(0.5)
        'loss 0.50'
    """
    label = f"@rank_zero_only {getattr(fn, '__qualname__', fn)}"

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | None:
        if get_rank() == 0:
            with single_rank_region(label):
                return fn(*args, **kwargs)
        return None

    return wrapper


if TYPE_CHECKING:
    _Adapter = logging.LoggerAdapter[logging.Logger]
else:  # LoggerAdapter is subscriptable at run time from Python 3.11 only
    _Adapter = logging.LoggerAdapter


class RankLoggerAdapter(_Adapter):
    """A logger that stamps every record with ``rank`` and ``world_size`` and may mute ranks > 0.

    Made by :func:`get_logger`. Each record gets the attributes ``rank`` and ``world_size`` (use
    ``%(rank)s`` in a formatter), and with ``prefix=True`` its message starts with
    ``[rank R/W]`` when more than one rank runs, so plain handlers show where a line came from.

    Example:
        >>> log = get_logger("distcompat.example", ranks="all")
        >>> log.ranks
        'all'
    """

    def __init__(
        self, logger: logging.Logger, *, ranks: Literal["zero", "all"], prefix: bool
    ) -> None:
        super().__init__(logger, {})
        self.ranks = ranks
        self.prefix = prefix

    def isEnabledFor(self, level: int) -> bool:
        """Return False on ranks > 0 of a rank-zero logger, else the wrapped logger's answer."""
        if self.ranks == "zero" and get_rank() != 0:
            return False
        return self.logger.isEnabledFor(level)

    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        """Add ``rank``/``world_size`` to the record's extras and the prefix to the message."""
        rank, world_size = get_rank(), get_world_size()
        extra = dict(kwargs.get("extra") or {})
        extra.setdefault("rank", rank)
        extra.setdefault("world_size", world_size)
        kwargs["extra"] = extra
        if self.prefix and world_size > 1:
            msg = f"[rank {rank}/{world_size}] {msg}"
        return msg, kwargs


def get_logger(
    name: str, *, ranks: Literal["zero", "all"] = "zero", prefix: bool = True
) -> RankLoggerAdapter:
    """Return a rank-aware adapter over ``logging.getLogger(name)``.

    Args:
        name: the logger name, usually ``__name__``.
        ranks: ``"zero"`` emits on global rank 0 only; ``"all"`` emits on every rank.
        prefix: start each message with ``[rank R/W]`` when the world has more than one rank.

    No handler or level is set: configure logging in the application as usual.

    Example:
        >>> import logging, sys
        >>> handler = logging.StreamHandler(sys.stdout)
        >>> handler.setFormatter(logging.Formatter("%(rank)s %(message)s"))
        >>> logging.getLogger("demo").addHandler(handler)
        >>> get_logger("demo").warning("checkpoint saved")
        0 checkpoint saved
        >>> logging.getLogger("demo").removeHandler(handler)
    """
    if ranks not in ("zero", "all"):
        raise ValueError(f"ranks={ranks!r} must be 'zero' or 'all'")
    return RankLoggerAdapter(logging.getLogger(name), ranks=ranks, prefix=prefix)


# Messages already shown by warn_once, keyed by (category, text). The cache is per process.
_warned: set[tuple[type[Warning], str]] = set()


def warn_once(
    message: str,
    category: type[Warning] = UserWarning,
    *,
    stacklevel: int = 1,
    all_ranks: bool = False,
) -> bool:
    """Call ``warnings.warn(message, category)`` the first time this text is seen, never again.

    ``stacklevel=1`` points the warning at the line that called :func:`warn_once` (as
    ``warnings.warn`` does for its own caller); raise it to blame that function's caller. By default
    only rank 0 warns; ``all_ranks=True`` warns once on every rank. Returns whether it warned.

    Unlike the ``warnings`` module's "default" filter, which repeats per call site and is switched
    off by ``-W error`` or ``always``, the once-ness here is by message text and always holds.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     _ = [warn_once("distcompat docs: gloo has no AVG") for _ in range(3)]
        >>> len(caught)
        1
    """
    if not all_ranks and get_rank() != 0:
        return False
    key = (category, message)
    if key in _warned:
        return False
    _warned.add(key)
    warnings.warn(message, category, stacklevel=stacklevel + 1)
    return True


@dataclass(frozen=True, slots=True, kw_only=True)
class ProgressBackend:
    """Which progress bar :func:`progress` draws on rank 0, and why."""

    name: Literal["tqdm", "plain"]
    reason: str


@functools.lru_cache(maxsize=1)
def progress_backend() -> ProgressBackend:
    """Say which progress bar :func:`progress` uses: tqdm if installed, else a plain line printer.

    Example:
        >>> progress_backend().name in ("tqdm", "plain")
        True
    """
    if importlib.util.find_spec("tqdm") is not None:
        return ProgressBackend(name="tqdm", reason="tqdm is installed")
    return ProgressBackend(
        name="plain",
        reason="tqdm is not installed (pip install 'distcompat[progress]'): a line with count, "
        f"rate and ETA every {_PLAIN_INTERVAL_S:g}s and at the end",
    )


def progress(
    iterable: Iterable[T],
    *,
    desc: str | None = None,
    total: int | None = None,
    all_ranks: bool = False,
    file: IO[str] | None = None,
    **tqdm_kwargs: Any,
) -> Iterator[T]:
    """Iterate ``iterable`` with a progress bar (rate and ETA) on rank 0; silent on other ranks.

    Off rank 0 the items pass through untouched, with no bar and no output. ``total`` defaults to
    ``len(iterable)`` when it has one. ``tqdm_kwargs`` go to ``tqdm`` when it is the backend (see
    :func:`progress_backend`) and are ignored by the plain printer. No collective runs here.

    Example:
        >>> import io
        >>> out = io.StringIO()
        >>> sum(progress(range(4), desc="demo", file=out))
        6
        >>> "4/4" in out.getvalue()
        True
    """
    if not all_ranks and get_rank() != 0:
        yield from iterable
        return
    if total is None and isinstance(iterable, Sized):
        total = len(iterable)
    stream = file if file is not None else sys.stderr
    if progress_backend().name == "tqdm":
        # Optional dependency (the progress extra), imported only when it is installed.
        from tqdm import tqdm  # type: ignore[import-untyped,unused-ignore]

        yield from tqdm(iterable, desc=desc, total=total, file=stream, **tqdm_kwargs)
        return
    yield from _plain_progress(iterable, desc=desc, total=total, file=stream)


def _format_rate_eta(count: int, total: int | None, elapsed: float) -> str:
    rate = count / elapsed if elapsed > 0 else 0.0
    shown = f"{count}/{total}" if total is not None else f"{count}"
    line = f"{shown} [{elapsed:.1f}s, {rate:.2f} it/s"
    if total is not None and rate > 0:
        line += f", ETA {max(total - count, 0) / rate:.1f}s"
    return line + "]"


def _plain_progress(
    iterable: Iterable[T], *, desc: str | None, total: int | None, file: IO[str]
) -> Iterator[T]:
    label = f"{desc}: " if desc else ""
    start = last = time.monotonic()
    count = shown = 0
    try:
        for item in iterable:
            yield item
            count += 1
            now = time.monotonic()
            if now - last >= _PLAIN_INTERVAL_S:
                last, shown = now, count
                print(label + _format_rate_eta(count, total, now - start), file=file, flush=True)
    finally:
        if shown != count or count == 0:
            elapsed = time.monotonic() - start
            print(label + _format_rate_eta(count, total, elapsed), file=file, flush=True)
