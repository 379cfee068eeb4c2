"""The watchdog's incident desk: its background thread, and one hang turned into one report.

A :class:`~distcompat.diagnostics.Watchdog` bounds the waits; when one runs out it asks the desk
to :meth:`~IncidentDesk.declare` an incident. The desk's thread raises the alarm in the rendezvous
store (or answers another rank's), publishes this rank's account, collects every rank's within
``grace``, fetches the stacks of the ranks the verdict blames, writes the dump (distcompat's JSON
and, beside it, the same history in Flight Recorder format for torch's analyzer) and logs the
report. One report per incident reaches the job's output: the rank that declared the incident
prints it, every other rank one line that points to it, with the first finding and its dump::

    desk = IncidentDesk(config, recorder)
    desk.connect(rank=0, world=2)           # the side channel and the job's name
    desk.launch()                           # the thread: answers alarms every ``poll`` s
    report = desk.declare("rank 0: #3 all_reduce ... not complete after 60s", since=started)

Nothing here waits for a collective; that is the watchdog's part (``_watchdog``).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from pathlib import Path

from distcompat._ranks import side_store
from distcompat.collectives import _checked
from distcompat.collectives._wait import current as current_wait
from distcompat.diagnostics._channel import ChannelError, SideChannel
from distcompat.diagnostics._config import WatchdogConfig
from distcompat.diagnostics._dump import rank_state, write_dump
from distcompat.diagnostics._flight_dump import flight_dump, write_flight_dump
from distcompat.diagnostics._records import Recorder
from distcompat.diagnostics._report import HangReport, RankState

__all__ = ["ON_DEMAND", "IncidentDesk"]

#: How the trigger of a dump asked for (a signal, ``distcompat dump``) begins: no hang.
ON_DEMAND = "on demand"

_LOG = "distcompat.diagnostics"
_BLAMED_STACKS = 8  # at most this many other ranks' stacks are fetched into a report


class IncidentDesk:
    """Handles this rank's hang incidents for one watchdog; ``last_report`` is the latest.

    Example:
        >>> from distcompat.diagnostics._records import Recorder
        >>> desk = IncidentDesk(WatchdogConfig(timeout=5), Recorder())
        >>> desk.connect(rank=0, world=1)   # no group here: no one else to ask
        >>> desk.channel_reason.split(":")[0]
        'this rank only'
    """

    def __init__(self, config: WatchdogConfig, recorder: Recorder) -> None:
        self.config = config
        self.recorder = recorder
        self.last_report: HangReport | None = None
        self.printed_by = 0  # the rank that printed last_report in full
        self.last_dump: Path | None = None  # this rank's dump of last_report
        self.channel: SideChannel | None = None
        self.channel_reason = ""
        self.rank, self.world = 0, 1
        self.job = ""  # the job's name, the same on every rank: dumps go under it
        self.poisoned = False  # a raising watchdog declared a hang: the next collective raises
        self._seen = 0  # latest incident this rank has handled
        self._handled_at = -1.0  # monotonic time it was handled
        self._cv = threading.Condition()
        self._request: tuple[str, float] | None = None  # (reason, op start) for the thread
        self._dump_request: str | None = None  # an on-demand dump asked for (its trigger)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- lifetime ---------------------------------------------------------------------------

    def connect(self, *, rank: int, world: int) -> None:
        """Find the side channel to the other ranks (the rendezvous store) and agree the job."""
        self.rank, self.world = rank, world
        found = side_store()
        self.job = _job_name()
        if found is None:
            self.channel_reason = (
                "this rank only: the group was not created by init_distributed, so its "
                "rendezvous store is unknown and other ranks cannot be asked"
            )
            return
        store, prefix = found
        self.channel = SideChannel(store, prefix, rank=rank, world_size=world)
        self.channel_reason = "all ranks, through the rendezvous store"
        try:
            self._seen = self.channel.current()
            self.job = self.channel.agree("job", self.job)  # the first rank's name wins
        except ChannelError as exc:
            self.channel, self.channel_reason = None, f"this rank only: {exc}"

    def catch_up(self, inner: IncidentDesk) -> None:
        """Count the incidents a nested watchdog's desk handled as handled here too.

        Both desks read one incident counter in the side channel; without this, an outer
        watchdog resuming after an inner one would answer the inner's incident again (a second
        report of a hang already reported, collected from ranks that have moved on).
        """
        self._seen = max(self._seen, inner._seen)

    def launch(self) -> None:
        """Start the thread that answers alarms (and raises one for a stalled async op)."""
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="distcompat-watchdog", daemon=True)
        self._thread.start()

    def halt(self) -> None:
        """Stop the thread (within ``grace`` + 5 s if it is collecting an incident)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.config.grace_s + 5)
        self._thread = None

    # --- incidents --------------------------------------------------------------------------

    def declare(self, reason: str, since: float) -> HangReport:
        """Have the thread handle an incident (or reuse one handled since ``since``)."""
        with self._cv:
            if self._handled_at < since:
                self._request = (reason, since)
                self._wake.set()
                self._cv.wait_for(
                    lambda: self._handled_at >= since, timeout=self.config.grace_s + 5
                )
            if self._handled_at < since or self.last_report is None:  # the thread did not answer
                self.last_report = self._local_report(reason, "the watchdog thread did not answer")
                self.printed_by = self.rank  # never printed: the error carries it in full
                self._handled_at = time.monotonic()
            return self.last_report

    def request_dump(self, who: str) -> None:
        """Have every rank write its stacks and collective history now; the job goes on.

        ``who`` says who asked ("SIGUSR2 to rank 1"). Safe from a signal handler: it only sets
        a field and wakes the thread, which raises the alarm with an on-demand trigger.
        """
        self._dump_request = f"{ON_DEMAND}: {who}"
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.config.poll_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            with self._cv:
                request, self._request = self._request, None
                # An incident handled after the op began already covers it (another rank's alarm
                # answered meanwhile): a second alarm would wait out the grace for ranks that
                # have moved on or exited.
                reason = request[0] if request and self._handled_at < request[1] else None
            if reason is None:
                reason = self._stalled_async()
            if reason is None and self._dump_request is not None:
                reason, self._dump_request = self._dump_request, None
            try:
                self._handle(reason)
            except Exception as exc:  # never let the thread die: the report says what failed
                logging.getLogger(_LOG).error("distcompat watchdog: %s", exc, exc_info=True)
                with self._cv:
                    self.last_report = self._local_report(reason or "alarm", f"failed: {exc}")
                    self.printed_by = self.rank  # never printed: the error carries it in full
                    self._handled_at = time.monotonic()
                    self._cv.notify_all()

    def _stalled_async(self) -> str | None:
        oldest = self.recorder.oldest_open()
        if oldest is None or time.monotonic() - oldest[1] < self.config.timeout:
            return None
        if self._handled_at >= oldest[1]:
            return None  # already reported while this op was open
        return (
            f"rank {self.rank}: {oldest[0].describe()} not complete after {self.config.timeout:g}s"
        )

    def _handle(self, reason: str | None) -> None:
        channel = self.channel
        if channel is None:
            if reason is not None:
                self._seen += 1  # incidents of this rank alone, numbered here
                self._finish(self._local_report(reason, self.channel_reason))
            return
        try:
            current = channel.current()
            if current > self._seen:
                incident = current  # another rank declared it: answer
            elif reason is not None:
                incident = channel.raise_alarm(self._seen)
                channel.set_trigger(incident, reason)
                channel.claim_report(incident)  # the declaring rank prints the report
            else:
                return
            mine = self._state(reason or f"answering incident {incident}")
            channel.publish(incident, mine)
            states = channel.collect(incident, self.config.grace_s)
            trigger = channel.trigger(incident) or reason or "?"
            writer = channel.claim_report(incident)
        except ChannelError as exc:
            self._finish(self._local_report(reason or "alarm", str(exc)))
            return
        states[self.rank] = mine
        report = HangReport(
            incident=incident,
            written_by=self.rank,
            timeout=self.config.timeout,
            world_size=self.world,
            trigger=trigger,
            states=self._with_stacks(channel, incident, states),
            job=self.job,
        )
        self._seen = incident
        self._finish(report, writer=writer)

    def _with_stacks(
        self, channel: SideChannel, incident: int, states: dict[int, RankState | None]
    ) -> dict[int, RankState | None]:
        """Fetch the stacks of the ranks the verdict blames (a few), so one dump shows them."""
        verdict = HangReport(
            incident=incident, written_by=self.rank, timeout=self.config.timeout,
            world_size=self.world, trigger="", states=states,
        ).verdict  # fmt: skip
        out = dict(states)
        for rank in [r for r in verdict.blamed if r != self.rank][:_BLAMED_STACKS]:
            state = out.get(rank)
            if state is not None:
                stacks = channel.stacks(incident, rank)
                out[rank] = RankState.from_json(state.to_json() | {"stacks": stacks})
        return out

    def _state(self, reason: str) -> RankState:
        return rank_state(self.recorder, rank=self.rank, reason=reason)

    def _local_report(self, reason: str, why: str) -> HangReport:
        states: dict[int, RankState | None] = dict.fromkeys(range(self.world))
        states[self.rank] = self._state(reason)
        return HangReport(
            incident=self._seen,
            written_by=self.rank,
            timeout=self.config.timeout,
            world_size=self.world,
            trigger=f"{reason} (other ranks not asked: {why})",
            states=states,
            job=self.job,
        )

    def _finish(self, report: HangReport, *, writer: int | None = None) -> None:
        """Write the dump, log the report (or a line that points to it), hand it to a waiter.

        ``writer`` is the rank that prints the report (None: this one, for a report of this
        rank alone); every other rank logs one line: where the report is, its first finding,
        and this rank's own dump. An on-demand dump (its trigger begins with :data:`ON_DEMAND`)
        is logged as one and changes nothing else: no hang was declared, no collective raises.
        """
        path = self._write(report)
        if report.trigger.startswith(ON_DEMAND):
            self._finish_dump(report, path, self.rank if writer is None else writer)
            return
        then = (
            "report-only: this rank keeps waiting, and the group timeout ends the wait if the "
            "late rank never comes"
            if self.config.action == "report"
            else "the waiting rank raises HangError, the others at their next collective"
        )
        printed_by = self.rank if writer is None else writer
        log = logging.getLogger(_LOG)
        if printed_by == self.rank:
            log.error(
                "[rank %d] %s\nper-rank dump: %s\ntorch's analyzer reads the same incident: "
                "python -m torch.distributed.flight_recorder.fr_trace %s\n%s",
                self.rank, report.describe(), path, path.parent, then,
            )  # fmt: skip
        else:
            log.error("[rank %d] %s", self.rank, _pointer(report, printed_by, path))
        with self._cv:
            self.last_report = report
            self.printed_by, self.last_dump = printed_by, path
            self._handled_at = time.monotonic()
            self.poisoned = self.config.action == "raise"  # the next collective raises
            self._cv.notify_all()
        if self.poisoned:  # every call now takes the general path, whose pre-call refuses it
            _checked.step_aside()  # not _hooks.refresh(): its lock is held while a desk halts

    def _finish_dump(self, report: HangReport, path: Path, printed_by: int) -> None:
        """Log an on-demand dump: the full account where it was asked for, a line elsewhere."""
        log = logging.getLogger(_LOG)
        if printed_by == self.rank:
            log.warning(
                "[rank %d] on-demand dump %d of job %s (%s): every rank's stacks and collective "
                "history are in %s (distcompat diagnose %s; torch's analyzer: python -m "
                "torch.distributed.flight_recorder.fr_trace %s); the job goes on\n%s",
                self.rank, report.incident, report.job, report.trigger, path.parent,
                path.parent, path.parent, report.describe(),
            )  # fmt: skip
        else:
            log.warning(
                "[rank %d] on-demand dump %d of job %s: this rank's dump is %s",
                self.rank, report.incident, report.job, path,
            )  # fmt: skip

    def pointer(self, report: HangReport) -> str | None:
        """Return the line that stands for ``report`` here, or None where this rank printed it.

        For an error raised on a rank that did not print the report (``HangError``, a lost
        peer's note): its first finding and where the full report is, not a second copy.
        """
        if report is not self.last_report or self.printed_by == self.rank:
            return None
        return _pointer(report, self.printed_by, self.last_dump)

    def _write(self, report: HangReport) -> Path:
        snapshot = self.recorder.snapshot()
        path = write_dump(
            self.config.directory, rank=self.rank, world_size=self.world,
            history=snapshot["history"], report=report,
        )  # fmt: skip
        try:  # the same history in torch's format, for its analyzer: never at the report's cost
            data = flight_dump(
                snapshot, rank=self.rank, world_size=self.world, wait=current_wait(),
                job=report.job, incident=report.incident,
            )  # fmt: skip
            write_flight_dump(path.parent, rank=self.rank, data=data)
        except Exception as exc:  # any failure: never at the report's cost (a KeyError was)
            logging.getLogger(_LOG).warning(
                "distcompat watchdog: the Flight Recorder-format dump was not written: %s", exc
            )
        return path


def _pointer(report: HangReport, printed_by: int, dump: Path | None) -> str:
    """One line for a report another rank printed: its first finding, who printed it, the dump."""
    finding = " ".join(report.verdict.findings[0].split())
    return (
        f"hang incident {report.incident} of job {report.job}: {finding}; the full report is in "
        f"rank {printed_by}'s output, this rank's dump is {dump}"
    )


def _job_name() -> str:
    """Propose a name for the job: start time (UTC), host and process id of this rank."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return f"{stamp}-{socket.gethostname()}-{os.getpid()}"
