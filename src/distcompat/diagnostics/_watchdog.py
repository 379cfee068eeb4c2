"""The hang watchdog: a stuck collective becomes a cross-rank report and a HangError, in seconds.

The two lines a training script writes::

    with distcompat.watchdog(timeout=60):          # or init_distributed(..., watchdog=60)
        train()                                    # a hang raises HangError naming the late rank

How it works. Every distcompat collective records itself (op, shape, dtype, sequence number per
group) in an in-memory ring buffer, and a synchronous one is issued async and waited on with the
watchdog timeout instead of blocking in C++. When a wait runs out, the rank raises an alarm in
the rendezvous store; a background thread on every rank (``_incidents``) polls that alarm (one
store request per ``poll`` seconds, the only traffic when nothing hangs), dumps its Python stacks
(faulthandler, all threads) and publishes its account. The ranks compare sequence numbers and
name who is behind, who is gone (no answer within ``grace``), and who is in a different
collective at the same number; each writes ``<job>/incident-<N>/rank<R>.json`` under
``dump_dir`` (the job's name is agreed through the store at start, so jobs never share a folder)
and logs the report. The stuck rank then raises :class:`HangError` (``action="raise"``), or
keeps waiting (``action="report"``, what ``init_distributed`` starts by default).

Limits (said plainly): a raw ``torch.distributed`` call is not recorded and cannot be
interrupted: it blocks in C++ until the group timeout, although this rank still answers alarms
(its stacks show the call). On NCCL a collective returns before the GPU finishes, so the host sees
no hang there; torch's Flight Recorder (set by init) dumps it. With no group, or an adopted group
whose store distcompat does not know, the report covers this rank only (``why()`` says which).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from distcompat.collectives import _wait as waits
from distcompat.collectives._errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    PeerLostError,
    translate,
)
from distcompat.collectives.agree import answerer, answering
from distcompat.diagnostics import _hooks
from distcompat.diagnostics._config import Action, WatchdogConfig
from distcompat.diagnostics._errors import HangError
from distcompat.diagnostics._exit import declared_failure, note_failure
from distcompat.diagnostics._incidents import IncidentDesk
from distcompat.diagnostics._records import Raw, Recorder, thread_call_site, to_record
from distcompat.diagnostics._report import HangReport

__all__ = ["Watchdog", "watchdog"]


class Watchdog:
    """Bounds every distcompat collective's wait and turns a hang into a cross-rank report.

    Use :func:`watchdog` (a context manager) or ``init_distributed(watchdog=...)``; ``start()`` and
    ``stop()`` exist for code that manages the lifetime itself. ``last_report`` is the latest
    :class:`~distcompat.diagnostics.HangReport` this rank assembled; ``why()`` says what the
    watchdog can and cannot do here.

    Example:
        >>> with Watchdog(WatchdogConfig(timeout=5)) as w:   # no group: nothing to watch
        ...     w.why()
        'inactive: no process group (one process cannot hang in a collective)'
    """

    def __init__(self, config: WatchdogConfig) -> None:
        self.config = config
        # the call (its record) whose wait was last declared a hang, or a wait outside any call
        self._reported: Raw | waits.Wait | None = None
        self._opened: set[int] = set()  # waits (by id) that watch() marked in flight
        self._recorder = Recorder(config.history)
        self._desk = IncidentDesk(config, self._recorder)  # the thread, the reports, the dumps
        self._active = False
        #: A fast-path synchronous call's first wait: one answering slice, at most the timeout.
        self.first_wait = timedelta(seconds=min(waits.POLL_S, config.timeout))
        #: The fast paths' record (``collectives.direct``): ``Recorder.note`` itself, no layer
        #: between (a call costs microseconds right after a wait). A synchronous call then waits
        #: :attr:`first_wait` itself and calls :meth:`wait_late` only if that did not end it.
        #: After a declared hang (``poisoned``) the fast paths step aside
        #: (``_checked.step_aside``) and :meth:`before` refuses the call.
        self.note = self._recorder.note
        #: The recorder's queue and drain: the fast paths append their records in place.
        self.queue = self._recorder.queue
        self.drain = self._recorder.drain

    @property
    def poisoned(self) -> bool:
        """A raising watchdog declared a hang: every later collective raises HangError."""
        return self._desk.poisoned

    @property
    def last_report(self) -> HangReport | None:
        """The latest hang report this rank assembled (None before any)."""
        return self._desk.last_report

    # --- lifetime ---------------------------------------------------------------------------

    def why(self) -> str:
        """Say what this watchdog covers here, and why not more."""
        if not self._active:
            return "inactive: no process group (one process cannot hang in a collective)"
        return self._desk.channel_reason

    def start(self) -> Watchdog:
        """Start watching (a no-op without a process group of more than one rank)."""
        if self._active or not (dist.is_available() and dist.is_initialized()):
            return self
        rank, world = dist.get_rank(), dist.get_world_size()
        if world < 2:
            return self
        self._desk.connect(rank=rank, world=world)
        with _hooks.state.lock:
            outer = _hooks.state.watchdogs[-1] if _hooks.state.watchdogs else None
            if outer is not None:  # nested: share the sequence numbers, pause the outer thread
                self._recorder = self._desk.recorder = outer._recorder
                self.note = self._recorder.note
                self.queue, self.drain = self._recorder.queue, self._recorder.drain
                outer._desk.halt()
            _hooks.state.watchdogs.append(self)
            _hooks.refresh()
        self._active = True
        self._desk.launch()
        return self

    def dump_now(self, who: str) -> None:
        """Have every rank write its stacks and collective history now; nothing stops.

        ``who`` says who asked; the dumps go where a hang's would (``diagnostics._on_demand``).
        """
        self._desk.request_dump(who)

    def stop(self) -> None:
        """Stop watching; an outer watchdog (if nested) takes over again."""
        if not self._active:
            return
        self._active = False
        self._desk.halt()
        with _hooks.state.lock:
            if self in _hooks.state.watchdogs:
                _hooks.state.watchdogs.remove(self)
            outer = _hooks.state.watchdogs[-1] if _hooks.state.watchdogs else None
            _hooks.refresh()
        if outer is not None:
            outer._desk.catch_up(self._desk)
            outer._desk.launch()

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # --- the collective hooks (called from distcompat.collectives) --------------------------

    def before(
        self, op: str, tensor: torch.Tensor | None, group: Any, reduce_op: Any, root: int | None
    ) -> None:
        """Pre-call: refuse to run after a declared hang, else record the call."""
        if self._desk.poisoned:
            self._refuse(op)
        self._recorder.begin(op, tensor, group, reduce_op, root)

    def _refuse(self, op: str) -> None:
        if self.last_report is not None:
            note_failure(f"{op}: HangError")
            raise self._hang_error(op, "a hang was already declared; the group cannot be trusted")

    def wait_sync(self, work: Any, op: str, group: Any) -> None:
        """Wait for a synchronous collective's ``work`` with the watchdog timeout.

        While the default mismatch check listens (``collectives.agree``), the wait runs in
        ``POLL_S`` slices and answers peers' questions between them, so a peer that called a
        different collective gets its ``CollectiveMismatchError`` here too, not a timeout.
        """
        key = id(work)
        raw = self._recorder.issued(key)
        if work is None:
            return
        if raw is None:  # a later step of one call (an object collective's second message)
            wait = waits.Wait(op=op, phase="backend wait", group=group)
            waits.until(waits.work_ready(work), wait)
            return
        self._bounded(waits.work_ready(work), key, raw, op, group, answer_first=False)

    def wait_late(self, work: Any, raw: Raw, op: str, group: Any) -> None:
        """Go on waiting for a fast-path call whose first wait (:attr:`first_wait`) raised.

        Either the op failed (it is complete: waiting again raises its error at once) or the
        slice ran out: the op is then marked in flight from the call's start and the bounded
        wait goes on, answering peers first.
        """
        key = id(work)
        if work.is_completed():
            try:
                work.wait()
            except RuntimeError as exc:
                self._peer_failed(exc, op, group)
                raise
            return
        raw = self._recorder.late(key, raw)
        self._bounded(waits.work_ready(work), key, raw, op, group, answer_first=True)

    def _bounded(
        self,
        ready: Callable[[float], bool],
        key: int,
        raw: Raw,
        op: str,
        group: Any,
        answer_first: bool,
    ) -> None:
        """Wait until ``ready`` as :func:`~distcompat.collectives._wait.until` does every wait.

        The wait answers peers between slices while the mismatch check listens; :meth:`watch`
        declares the hang once the call is ``timeout`` old; the backend's timeout ends it.
        """
        between = answerer(group, listening=answering())
        wait = waits.Wait(op=op, phase="backend wait", group=group, started=raw[8], record=raw)
        try:
            if answer_first:
                between()
            waits.until(ready, wait, between=between)
        except CollectiveMismatchError:
            self._recorder.abandon(key)
            raise
        except RuntimeError as exc:
            self._recorder.abandon(key)
            if not isinstance(exc, HangError):
                typed = self._peer_failed(exc, op, group)  # a peer died, or the group timeout
                if self._reported is raw:  # the backend timed out what this watchdog reported
                    self._name_the_late(typed, exc, op)
            raise
        self._recorder.finished(key)

    def _name_the_late(self, typed: BaseException, exc: RuntimeError, op: str) -> None:
        """Raise the group timeout of a reported call naming the ranks the report blamed.

        gloo's timeout names no rank, and past two ranks ``collectives`` can name only a
        stopped one; the report of this very call knows who was late, and what it was doing.
        """
        report = self.last_report
        if not isinstance(typed, CollectiveTimeoutError) or typed.peers or report is None:
            return
        late = tuple(r for r in report.verdict.blamed if r != self._desk.rank)
        if not late:
            return
        ranks = ", ".join(map(str, late))
        raise CollectiveTimeoutError(
            f"{typed} Late: rank{'s' if len(late) > 1 else ''} {ranks}.\n{self.explain(late)}",
            op=op,
            peer=late[0] if len(late) == 1 else None,
            peers=late,
        ) from exc

    # --- the wait primitive's observer (collectives._wait.until calls these) ---------------

    def watch(self, wait: waits.Wait) -> None:
        """Show a wait that outlasted a slice in flight; past the timeout, declare a hang.

        The call's age counts from when it entered distcompat (its record's start), whatever
        phase it is in now. One report per call; a raising watchdog raises HangError here.
        """
        raw = wait.record
        if raw is None and not wait.call:  # a wait before the backend call: this thread's call
            raw = self._recorder.in_call()
            if raw is not None:
                wait.started = min(wait.started, raw[8])  # the call began before this wait
            else:  # no record yet (a fast path's set-up): the newest call, aged from this wait
                raw = self._recorder.current()
                if raw is None:
                    return
            wait.record = self._recorder.late(id(wait), raw, started=wait.started)
            self._opened.add(id(wait))
        # a wait outside any collective (p2p, a save's arrival) is its own call: no record
        call = wait if wait.call else raw
        if time.monotonic() - wait.started < self.config.timeout or self._reported is call:
            return
        self._reported = call
        what = (
            f"{wait.call} at {thread_call_site(waits.thread_of(wait))}"
            if wait.call
            else to_record(raw).describe()
        )
        self._hung(what, wait.started, wait.op)  # HangError unless report-only

    def release(self, wait: waits.Wait) -> None:
        """Stop showing a watched wait's call in flight: the wait ended."""
        if id(wait) in self._opened:
            self._opened.discard(id(wait))
            self._recorder.finished(id(wait))

    def explain(self, absent: tuple[int, ...]) -> str:
        """Return what the last report saw of the ``absent`` ranks, for a timeout error."""
        report = self.last_report
        if report is None:
            return ""
        lines = []
        for rank in absent:
            state = report.states.get(rank)
            if state is not None:
                lines.append(f"rank {rank} was {state.doing()}")
        if not lines:
            return ""
        where = self.config.directory
        return "\n".join(lines) + f" (hang report, incident {report.incident}: dumps in {where})"

    def track_async(self, handle: Any, raw: Raw | None = None) -> None:
        """Follow an async collective's handle until it completes (``raw``: its :meth:`note`)."""
        key = id(handle)
        if raw is not None:
            self._recorder.late(key, raw, started=time.monotonic())
        elif self._recorder.issued(key) is None:
            return
        handle.get_future().add_done_callback(lambda _: self._recorder.finished(key))

    def wait_event(self, done: threading.Event, handle: Any) -> None:
        """``CompatWork.wait()`` without a timeout: the bounded wait of a synchronous call.

        A watched handle's wait goes in slices like every other (:meth:`wait_late`): a peer
        of the handle's ``group`` that ended (the peer watch saw it, or ``/proc`` says so) raises
        :class:`PeerLostError` within a slice, even while the backend's op still waits on it
        (gloo waits for its sockets to close, which a child the peer forked keeps open: a
        DataLoader worker, for seconds); the call's age past the timeout is a hang. The op
        keeps running in the backend.
        """
        entry = self._recorder.open.get(id(handle))
        if entry is None:
            done.wait()
            return
        raw = entry[0]
        op = to_record(raw).op
        self._bounded(done.wait, id(handle), raw, op, handle.group, answer_first=False)
        error = declared_failure(handle.exception())
        if error is not None:
            note_failure(f"{op}: {type(error).__name__}")

    def _hung(self, what: str, started: float, op: str) -> None:
        """Handle a call (``what``: its words) not done in time: report, raise unless reporting."""
        timeout = self.config.timeout
        reason = f"rank {self._desk.rank}: {what} not complete after {timeout:g}s"
        self._desk.declare(reason, started)
        if self.config.action == "raise":
            note_failure(f"{op}: HangError")
            raise self._hang_error(op, reason)

    def _peer_failed(self, exc: RuntimeError, op: str, group: Any) -> BaseException:
        """Handle a backend error in a watched wait: for a lost peer, report, then raise it.

        Only a raising watchdog reports a lost peer: the report waits ``grace`` seconds for the
        gone rank, and the default (report-only) watchdog must not delay the error by that.
        Otherwise return the typed form of ``exc`` (``exc`` itself if it has none).
        """
        typed = translate(exc, op, group)
        if declared_failure(typed) is not None:
            note_failure(f"{op}: {type(typed).__name__}")
        if isinstance(typed, PeerLostError) and self.config.action == "raise":
            report = self._desk.declare(f"rank {self._desk.rank}: {typed}", time.monotonic())
            if hasattr(typed, "add_note"):  # Python 3.11+: the report travels with the error
                typed.add_note(self._desk.pointer(report) or report.describe())
            raise typed from exc
        return typed

    def _hang_error(self, op: str, reason: str) -> HangError:
        report = self.last_report
        assert report is not None  # _declare always leaves one
        late = report.verdict.blamed
        told = self._desk.pointer(report)  # another rank printed it: one line, not a copy
        return HangError(
            f"{op}: {reason}; hang declared (incident {report.incident}); report written to "
            f"{self.config.directory}\n"
            + (told or report.describe(stacks=tuple(r for r in late if r != self._desk.rank))),
            op=op,
            peer=late[0] if len(late) == 1 else None,
            report=report,
        )


def watchdog(
    timeout: float,
    *,
    action: Action = "raise",
    dump_dir: str | os.PathLike[str] | None = None,
    grace: float | None = None,
    poll: float | None = None,
) -> Watchdog:
    """Watch every distcompat collective in the block; a hang becomes a report and HangError.

    Every rank must enter it (at the same point of its collective sequence). See the module
    docstring for what is covered; the report names the ranks that are behind, gone, or in a
    different collective, and each rank writes ``<job>/incident-<N>/rank<R>.json`` under
    ``dump_dir`` (read them with ``distcompat diagnose DIR``).

    Example:
        >>> with watchdog(timeout=30) as w:   # doctest: +SKIP
        ...     train()
    """
    config = WatchdogConfig(
        timeout=float(timeout),
        action=action,
        dump_dir=Path(dump_dir) if dump_dir is not None else None,
        grace=grace,
        poll=poll,
    )
    return Watchdog(config)
