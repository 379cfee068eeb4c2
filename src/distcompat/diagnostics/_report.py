"""What each rank says when a hang is declared, and the cross-rank verdict built from it.

A :class:`RankState` is one rank's account (sequence numbers per group, the collectives it is in,
its last few calls); :func:`analyse` compares the accounts and names the ranks that are behind,
gone, or in a different collective at the same sequence number. Pure data, no I/O::

    report = HangReport(incident=1, written_by=0, timeout=30.0, world_size=2, trigger="...",
                        states={0: state0, 1: None})
    print(report.describe())          # "rank 1 did not answer ..."
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from distcompat.diagnostics._records import CollectiveRecord

__all__ = ["HangReport", "RankState", "analyse"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RankState:
    """One rank's account of itself at the time of a hang incident.

    ``started``/``completed`` count collectives per group label; ``world_group`` is the label of
    the default group (every rank is a member); ``published`` is the wall-clock time it was made;
    ``main_frames`` are the innermost frames of the main thread that are the user's code
    (``file:line in function``, innermost first), which say where a rank outside any collective is;
    ``phase`` is the wait on peers the main thread is in, if any ("in the mismatch check of
    all_reduce", "in the shared-memory set-up of all_reduce", "in the backend wait of ...").

    Example:
        >>> s = RankState(rank=1, host="h", pid=7, reason="alarm", world_group="0",
        ...     started={"0": 2}, completed={"0": 2}, in_flight=(), recent=(), published=0.0)
        >>> s.doing()
        'not in a distcompat collective'
    """

    rank: int
    host: str
    pid: int
    reason: str
    world_group: str
    started: dict[str, int]
    completed: dict[str, int]
    in_flight: tuple[CollectiveRecord, ...]
    recent: tuple[CollectiveRecord, ...]
    published: float
    stacks: str | None = field(default=None, compare=False)
    main_frames: tuple[str, ...] = ()
    phase: str = ""

    def doing(self) -> str:
        """Say what the rank was doing: the collective it waits in, or where its main thread is."""
        phase = f", {self.phase}" if self.phase else ""  # outside a collective: p2p, an arrival
        if not self.in_flight:
            where = f"; main thread at {' <- '.join(self.main_frames)}" if self.main_frames else ""
            return "not in a distcompat collective" + phase + where
        record = self.in_flight[0]
        return f"waiting in {record.describe()} for {self.published - record.started:.1f}s{phase}"

    def to_json(self, *, with_stacks: bool = True) -> dict[str, Any]:
        """Return a JSON-ready dict; ``with_stacks=False`` leaves out the (large) stacks."""
        return {
            "rank": self.rank,
            "host": self.host,
            "pid": self.pid,
            "reason": self.reason,
            "world_group": self.world_group,
            "started": self.started,
            "completed": self.completed,
            "in_flight": [r.to_json() for r in self.in_flight],
            "recent": [r.to_json() for r in self.recent],
            "published": self.published,
            "stacks": self.stacks if with_stacks else None,
            "main_frames": list(self.main_frames),
            "phase": self.phase,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RankState:
        """Rebuild a state written by :meth:`to_json`."""
        return cls(
            rank=int(data["rank"]),
            host=str(data.get("host", "?")),
            pid=int(data.get("pid", -1)),
            reason=str(data.get("reason", "")),
            world_group=str(data.get("world_group", "")),
            started={str(k): int(v) for k, v in dict(data.get("started", {})).items()},
            completed={str(k): int(v) for k, v in dict(data.get("completed", {})).items()},
            in_flight=tuple(CollectiveRecord.from_json(r) for r in data.get("in_flight", [])),
            recent=tuple(CollectiveRecord.from_json(r) for r in data.get("recent", [])),
            published=float(data.get("published", 0.0)),
            stacks=data.get("stacks"),
            main_frames=tuple(str(f) for f in data.get("main_frames", ())),
            phase=str(data.get("phase", "")),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    """What :func:`analyse` found: readable findings and the ranks they blame."""

    findings: tuple[str, ...]
    missing: tuple[int, ...]
    behind: tuple[int, ...]
    diverged: tuple[int, ...]

    @property
    def blamed(self) -> tuple[int, ...]:
        """Ranks whose stacks a reader should look at first."""
        return tuple(sorted({*self.missing, *self.behind, *self.diverged}))


def _same_call(a: CollectiveRecord, b: CollectiveRecord) -> bool:
    return (a.op, a.shape, a.dtype, a.reduce_op, a.root) == (
        b.op,
        b.shape,
        b.dtype,
        b.reduce_op,
        b.root,
    )


def analyse(states: Mapping[int, RankState | None], world_size: int) -> Verdict:
    """Compare the ranks' accounts: who is missing, who is behind, who disagrees with whom.

    Example:
        >>> a = RankState(rank=0, host="h", pid=1, reason="", world_group="0", started={"0": 3},
        ...     completed={"0": 2}, in_flight=(), recent=(), published=0.0)
        >>> analyse({0: a, 1: None}, 2).missing
        (1,)
    """
    answered = {r: s for r, s in states.items() if s is not None}
    missing = tuple(r for r in range(world_size) if answered.get(r) is None)
    findings = [
        f"rank {r} did not answer: it died, is stopped (SIGSTOP, a debugger), holds the GIL in "
        "native code, or runs without a watchdog"
        for r in missing
    ]
    world = next((s.world_group for s in answered.values() if s.world_group), "")
    behind: set[int] = set()
    diverged: set[int] = set()
    for label in sorted({g for s in answered.values() for g in s.started}):
        members = {r: s for r, s in answered.items() if label in s.started or label == world}
        counts = {r: s.started.get(label, 0) for r, s in members.items()}
        frontier = max(counts.values())
        waiting = {
            r: rec for r, s in members.items() for rec in s.in_flight[:1] if rec.group == label
        }
        ahead = sorted(r for r in waiting if waiting[r].seq == frontier - 1)
        for r in sorted(r for r, n in counts.items() if n < frontier):
            behind.add(r)
            where = (
                f"; rank(s) {', '.join(map(str, ahead))} wait in {waiting[ahead[0]].describe()}"
                if ahead
                else ""
            )
            findings.append(
                f"rank {r} is behind on group {label}: it issued {counts[r]} collective(s) "
                f"there, others {frontier}{where}; rank {r} is {members[r].doing()}"
            )
        by_seq: dict[int, dict[int, CollectiveRecord]] = {}
        for r, rec in waiting.items():
            by_seq.setdefault(rec.seq, {})[r] = rec
        for seq, calls in sorted(by_seq.items()):
            first = next(iter(calls.values()))
            if all(_same_call(first, rec) for rec in calls.values()):
                continue
            diverged.update(calls)
            sides = "".join(
                f"\n      rank {r}: {rec.describe()}" for r, rec in sorted(calls.items())
            )
            findings.append(f"ranks disagree on call #{seq} of group {label}:{sides}")
    outside = {r: s.phase for r, s in answered.items() if s.phase and not s.in_flight}
    for r, phase in sorted(outside.items()):
        findings.append(f"rank {r} waits {phase}, outside any collective")
    if not findings:
        findings.append(
            "no rank is behind and all agree: every rank is in the same collective, which is "
            "slow or stuck in the network (or a raw torch.distributed call not recorded here)"
        )
    return Verdict(
        findings=tuple(findings),
        missing=missing,
        behind=tuple(sorted(behind)),
        diverged=tuple(sorted(diverged)),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class HangReport:
    """The cross-rank account of one hang incident, as one rank assembled it.

    ``states`` maps every rank to its :class:`RankState`, or None when it did not answer within
    the grace period. ``job`` names the job (the group) that wrote it: incidents are numbered per
    job, so ``(job, incident)`` names one incident. :attr:`verdict` names who is behind, gone or
    diverged; :meth:`describe` is the text logged and raised.

    Example:
        >>> HangReport(incident=1, written_by=0, timeout=2.0, world_size=2, trigger="test",
        ...     states={0: None, 1: None}).verdict.missing
        (0, 1)
    """

    incident: int
    written_by: int
    timeout: float
    world_size: int
    trigger: str
    states: dict[int, RankState | None]
    job: str = ""

    @property
    def verdict(self) -> Verdict:
        """The findings of :func:`analyse` over :attr:`states`."""
        return analyse(self.states, self.world_size)

    def describe(self, *, stacks: bool | tuple[int, ...] = False) -> str:
        """Readable report: findings, one line per rank, then stacks (all, or of ``stacks``)."""
        verdict = self.verdict
        job = f"job {self.job}, " if self.job else ""
        lines = [
            f"distcompat hang report ({job}incident {self.incident}, written by rank "
            f"{self.written_by}, watchdog timeout {self.timeout:g}s)",
            f"trigger: {self.trigger}",
            "findings:",
            *(f"  - {finding}" for finding in verdict.findings),
            "ranks:",
        ]
        for rank in range(self.world_size):
            state = self.states.get(rank)
            if state is None:
                lines.append(f"  rank {rank}: no answer")
                continue
            last = (
                f"; last call {state.recent[-1].describe()}"
                if state.recent and state.recent[-1] not in state.in_flight
                else ""
            )
            lines.append(
                f"  rank {rank} ({state.host} pid {state.pid}): {state.doing()}; issued "
                f"{state.started}, completed {state.completed}{last}"
            )
        if stacks is not False:
            shown = range(self.world_size) if stacks is True else stacks
            for rank in shown:
                state = self.states.get(rank)
                if state is not None and state.stacks:
                    lines += [f"--- rank {rank} stacks ---", state.stacks.rstrip()]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """Return a JSON-ready dict (stacks included)."""
        return {
            "incident": self.incident,
            "written_by": self.written_by,
            "timeout": self.timeout,
            "world_size": self.world_size,
            "trigger": self.trigger,
            "job": self.job,
            "states": {str(r): None if s is None else s.to_json() for r, s in self.states.items()},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> HangReport:
        """Rebuild a report written by :meth:`to_json`."""
        states = {
            int(r): None if s is None else RankState.from_json(s)
            for r, s in dict(data["states"]).items()
        }
        return cls(
            incident=int(data["incident"]),
            written_by=int(data["written_by"]),
            timeout=float(data["timeout"]),
            world_size=int(data["world_size"]),
            trigger=str(data.get("trigger", "")),
            states=states,
            job=str(data.get("job", "")),
        )
