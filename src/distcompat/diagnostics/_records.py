"""The in-memory collective history a watchdog keeps: a ring buffer and per-group counters.

Cheap by design (under a microsecond per collective warm, no I/O): each distcompat collective
appends one raw entry (a tuple, made into a :class:`CollectiveRecord` only when read) and bumps
its group's sequence number; a record is *open* while the op is known to be in flight. Nothing
here talks to other ranks::

    recorder = Recorder(capacity=64)
    recorder.begin("all_reduce", tensor, None, reduce_op=None, root=None)

The per-call cost matters more than its few hundred nanoseconds suggest: a tiny collective right
after a wait runs this code with cold caches, and on the measured 2-core machine each microsecond
of warm Python showed as several of end-to-end latency (benchmarks/README.md). So a call records
only what a report needs later: where the user called from is kept as (file, line) and formatted
when read, one monotonic clock reading serves as the start time (the wall time is derived), and
``completed`` is derived from ``started`` and the open ops instead of being counted per call.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "TORCH_DIR",
    "CollectiveRecord",
    "Raw",
    "Recorder",
    "call_site",
    "group_label",
    "thread_call_site",
    "to_record",
]

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Where torch is installed (its frames are never the user's).
TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
#: Frames skipped when looking for the user's call: distcompat, torch, and context managers.
_SKIP = (_PACKAGE_DIR, TORCH_DIR, "<frozen", contextlib.__file__)


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveRecord:
    """One collective as this rank issued it.

    ``seq`` counts collectives on ``group`` from 0 (the same number on every rank that calls the
    same sequence); ``site`` is ``file:line`` of the user's call; ``started`` is wall-clock time.

    Example:
        >>> r = CollectiveRecord(seq=3, op="all_reduce", group="0", shape=(4,), dtype="float32",
        ...     reduce_op="SUM", root=None, site="train.py:42", started=0.0)
        >>> r.describe()
        '#3 all_reduce(float32[4], op=SUM) on group 0 at train.py:42'
    """

    seq: int
    op: str
    group: str
    shape: tuple[int, ...] | None
    dtype: str | None
    reduce_op: str | None
    root: int | None
    site: str
    started: float

    def describe(self) -> str:
        """``#seq op(dtype[shape], op=..., root=...) on group G at file:line``."""
        args = []
        if self.dtype is not None:
            args.append(f"{self.dtype}[{','.join(map(str, self.shape or ()))}]")
        if self.reduce_op is not None:
            args.append(f"op={self.reduce_op}")
        if self.root is not None:
            args.append(f"root={self.root}")
        return f"#{self.seq} {self.op}({', '.join(args)}) on group {self.group} at {self.site}"

    def to_json(self) -> dict[str, Any]:
        """Return a JSON-ready dict (``from_json`` reads it back)."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CollectiveRecord:
        """Rebuild a record written by :meth:`to_json`."""
        shape = data.get("shape")
        return cls(
            seq=int(data["seq"]),
            op=str(data["op"]),
            group=str(data["group"]),
            shape=None if shape is None else tuple(int(n) for n in shape),
            dtype=data.get("dtype"),
            reduce_op=data.get("reduce_op"),
            root=data.get("root"),
            site=str(data.get("site", "?")),
            started=float(data.get("started", 0.0)),
        )


def _site(depth: int) -> tuple[str, int]:
    """Return (file, line) of the innermost frame outside distcompat, torch and contextlib."""
    return _site_from(sys._getframe(depth + 1))


def thread_call_site(thread: int | None) -> str:
    """Return ``file:line`` where ``thread`` (an ident) is in user code now ("?" if unknown).

    For a call watched from another thread (``collectives._blocking.beside``).

    Example:
        >>> import threading
        >>> thread_call_site(threading.get_ident()).startswith("<doctest")
        True
    """
    frame = sys._current_frames().get(thread) if thread is not None else None
    return _site_text(_site_from(frame)) if frame is not None else "?"


def _site_from(frame: FrameType | None) -> tuple[str, int]:
    while frame is not None and frame.f_code.co_filename.startswith(_SKIP):
        frame = frame.f_back
    if frame is None:
        return ("?", 0)
    return (frame.f_code.co_filename, frame.f_lineno)


def _site_text(site: tuple[str, int] | None) -> str:
    return "?" if site is None or site[1] == 0 else f"{site[0]}:{site[1]}"


def call_site(depth: int = 1) -> str:
    """Return ``file:line`` of the innermost frame outside distcompat, torch and contextlib.

    Example:
        >>> call_site().startswith("<doctest")
        True
    """
    return _site_text(_site(depth))


_labels: dict[Any, str] = {}


def group_label(group: Any) -> str:
    """Return a name for ``group`` that is the same on every rank (torch's group name)."""
    label = _labels.get(group)
    if label is None:
        pg = group if group is not None else dist.group.WORLD
        name = getattr(pg, "group_name", None)  # torch assigns names consistently across ranks
        if not name:  # fallback: older or foreign groups without a name; the member ranks
            name = "ranks" + str(dist.get_process_group_ranks(pg)).replace(" ", "")
        label = _labels[group] = str(name)
    return label


def _reduce_name(reduce_op: Any) -> str | None:
    if reduce_op is None:
        return None
    kind = getattr(reduce_op, "op", reduce_op)  # a PREMUL_SUM wrapper carries .op
    return str(kind).rsplit(".", 1)[-1]


#: What a call's record keeps, converted to a CollectiveRecord only when read (cheap hot path):
#: [seq, op, group label, shape, dtype, reduce_op, root, (file, line), monotonic start]. Made
#: with seq None and the group object in the label's place; :meth:`Recorder.drain` fills both.
#: The site is None in the fast paths' records until :meth:`Recorder.late` finds it.
Raw = list[Any]
#: Wall-clock time minus monotonic time: turns a raw entry's monotonic start into wall time.
_WALL_OFFSET = time.time() - time.monotonic()
#: :meth:`Recorder.note` drains its queue once it holds this many records.
_DRAIN_AT = 256


def to_record(raw: Raw) -> CollectiveRecord:
    """Return the :class:`CollectiveRecord` for a raw history entry (a drained one)."""
    seq, op, group, shape, dtype, reduce_op, root, site, started = raw
    return CollectiveRecord(
        seq=seq,
        op=op,
        group=group,
        shape=None if shape is None else tuple(shape),
        dtype=None if dtype is None else str(dtype).removeprefix("torch."),
        reduce_op=_reduce_name(reduce_op),
        root=root,
        site=_site_text(site),
        started=started + _WALL_OFFSET,
    )


class Recorder:
    """Ring buffer of the last ``capacity`` collectives, per-group counters and the open ops.

    A call's record first goes to a queue, in call order; :meth:`drain` numbers the queued
    records per group (``started`` counts calls per group label) and moves them to ``history``.
    Everything that reads records drains first, so the hot path pays only for the append. An
    op is in ``open`` (key -> (raw, monotonic start)) while it is known to be in flight: an
    async op from issue to completion, a synchronous one once its wait has outlasted the first
    slice (the common short wait is never entered: see :meth:`note`).
    """

    def __init__(self, capacity: int = 64) -> None:
        self.history: deque[Raw] = deque(maxlen=capacity)
        self.started: dict[str, int] = {}
        self.open: dict[int, tuple[Raw, float]] = {}  # key -> (raw record, monotonic start)
        #: Raw records in call order, not yet numbered: callers append (:meth:`note`,
        #: :meth:`begin`); only drain() removes.
        self.queue: list[Raw] = []
        self._drain_lock = threading.Lock()
        self._local = threading.local()

    def note(
        self, op: str, shape: Any, dtype: Any, group: Any, reduce_op: Any, root: int | None
    ) -> Raw:
        """Record a collective about to be issued and return its raw entry: the fast paths' record.

        Leaner than :meth:`begin` (``collectives.direct`` calls it for every common call while
        a watchdog is active): one list appended to the queue, no call site (found from the
        live frames only if the op is still in flight after its first wait, :meth:`late`;
        history shows ``?``), and no pending record (:meth:`current` finds it).
        """
        raw = [None, op, group, shape, dtype, reduce_op, root, None, time.monotonic()]
        queue = self.queue
        queue.append(raw)
        if len(queue) >= _DRAIN_AT:
            self.drain()
        return raw

    def begin(
        self, op: str, tensor: torch.Tensor | None, group: Any, reduce_op: Any, root: int | None
    ) -> None:
        """Record a collective about to be issued; it becomes this thread's pending record."""
        shape, dtype = (None, None) if tensor is None else (tensor.shape, tensor.dtype)
        raw = [None, op, group, shape, dtype, reduce_op, root, _site(1), time.monotonic()]
        self.queue.append(raw)
        self._local.pending = raw

    def drain(self) -> None:
        """Give the queued records their numbers per group, in call order; move them to history.

        Safe from any thread: callers only append to the queue, and this removes what it read.
        """
        with self._drain_lock:
            queue = self.queue
            count = len(queue)
            if not count:
                return
            taken = queue[:count]
            del queue[:count]  # appends made meanwhile sit after these: they stay
            for raw in taken:
                group = raw[2]
                label = _labels.get(group) or group_label(group)
                seq = self.started.get(label, 0)
                self.started[label] = seq + 1
                raw[0], raw[2] = seq, label
                self.history.append(raw)

    def issued(self, key: int) -> Raw | None:
        """Mark this thread's pending record as in flight under ``key``; None if there is none."""
        raw: Raw | None = getattr(self._local, "pending", None)
        if raw is None:
            return None
        self._local.pending = None
        self.drain()  # the record is read from the watchdog's thread: numbered first
        self.open[key] = (raw, time.monotonic())  # one dict store: atomic under the GIL
        return raw

    def late(self, key: int, raw: Raw, *, started: float | None = None) -> Raw:
        """Mark a :meth:`note` record in flight under ``key``, with its call site, and return it.

        Called while the op's frames are live (its first wait ran out, or it is async), so the
        user's frame is found then; the open entry starts at ``started`` (default: the call's).
        """
        self.drain()
        if raw[7] is None:
            raw[7] = _site(1)
        self.open[key] = (raw, raw[8] if started is None else started)
        return raw

    def current(self) -> Raw | None:
        """Return the record of the call this thread is making: pending, else the newest.

        :meth:`note` leaves no pending record; a pending one that is not the newest entry is
        left over from a call that failed before it was issued. (With collectives made from
        several threads at once, the newest entry may be another thread's.)
        """
        self.drain()
        pending: Raw | None = getattr(self._local, "pending", None)
        newest = self.history[-1] if self.history else None
        return pending if pending is not None and pending is newest else newest

    def in_call(self) -> Raw | None:
        """Return the record of the call this thread is making, if it made one (else None).

        Unlike :meth:`current`, never an earlier call's: the fast paths record a call only
        after issuing it, so a wait of theirs before that (a set-up) has no record yet.
        """
        self.drain()
        pending: Raw | None = getattr(self._local, "pending", None)
        newest = self.history[-1] if self.history else None
        return pending if pending is not None and pending is newest else None

    def finished(self, key: int) -> None:
        """Mark the op issued under ``key`` as completed (or failed): no longer in flight."""
        self.open.pop(key, None)

    abandon = finished  # a failed op: no longer in flight either

    def completed(self) -> dict[str, int]:
        """Return calls per group label that returned or failed: started, less those in flight."""
        self.drain()
        done = dict(self.started)
        for raw, _ in list(self.open.values()):  # a C-level copy: safe against updates
            done[raw[2]] = done.get(raw[2], 0) - 1
        return done

    def oldest_open(self) -> tuple[CollectiveRecord, float] | None:
        """Return the open op issued first, with its monotonic start time, or None."""
        self.drain()
        entries = list(self.open.values())  # a C-level copy: safe against concurrent updates
        if not entries:
            return None
        raw, started = min(entries, key=lambda e: e[1])
        return to_record(raw), started

    def snapshot(self) -> dict[str, Any]:
        """Return counters, open ops and history as JSON-ready data (what a dump stores)."""
        self.drain()
        open_records = [to_record(raw).to_json() for raw, _ in list(self.open.values())]
        return {
            "started": dict(self.started),
            "completed": self.completed(),
            "in_flight": sorted(open_records, key=lambda r: r["started"]),
            "history": [to_record(raw).to_json() for raw in list(self.history)],
        }
