"""The in-memory collective history a watchdog keeps: a ring buffer and per-group counters.

Cheap by design (a few microseconds per collective, no I/O): each distcompat collective appends
one :class:`CollectiveRecord` and bumps its group's sequence number; a record is *open* from the
moment the op is issued until it completes. Nothing here talks to other ranks::

    recorder = Recorder(capacity=64)
    recorder.begin("all_reduce", tensor, None, reduce_op=None, root=None)
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


def call_site(depth: int = 1) -> str:
    """Return ``file:line`` of the innermost frame outside distcompat, torch and contextlib."""
    frame: FrameType | None = sys._getframe(depth)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIP):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


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


#: What begin() keeps per call, converted to a CollectiveRecord only when read (cheap hot path):
#: (seq, op, group label, shape, dtype, reduce_op, root, site, wall time).
Raw = tuple[int, str, str, Any, Any, Any, "int | None", str, float]


def to_record(raw: Raw) -> CollectiveRecord:
    """Return the :class:`CollectiveRecord` for a raw history entry."""
    seq, op, group, shape, dtype, reduce_op, root, site, started = raw
    return CollectiveRecord(
        seq=seq,
        op=op,
        group=group,
        shape=None if shape is None else tuple(shape),
        dtype=None if dtype is None else str(dtype).removeprefix("torch."),
        reduce_op=_reduce_name(reduce_op),
        root=root,
        site=site,
        started=started,
    )


class Recorder:
    """Ring buffer of the last ``capacity`` collectives, per-group counters and the open ops."""

    def __init__(self, capacity: int = 64) -> None:
        self.history: deque[Raw] = deque(maxlen=capacity)
        self.started: dict[str, int] = {}
        self.completed: dict[str, int] = {}
        self.open: dict[int, tuple[Raw, float]] = {}  # key -> (raw record, monotonic start)
        self._local = threading.local()

    def begin(
        self, op: str, tensor: torch.Tensor | None, group: Any, reduce_op: Any, root: int | None
    ) -> None:
        """Record a collective about to be issued; it becomes this thread's pending record."""
        label = _labels.get(group) or group_label(group)
        seq = self.started.get(label, 0)
        self.started[label] = seq + 1
        if tensor is None:
            raw: Raw = (seq, op, label, None, None, reduce_op, root, call_site(), time.time())
        else:
            raw = (seq, op, label, tensor.shape, tensor.dtype, reduce_op, root, call_site(),
                   time.time())  # fmt: skip
        self.history.append(raw)
        self._local.pending = raw

    def issued(self, key: int) -> Raw | None:
        """Mark this thread's pending record as in flight under ``key``; None if there is none."""
        raw: Raw | None = getattr(self._local, "pending", None)
        if raw is None:
            return None
        self._local.pending = None
        self.open[key] = (raw, time.monotonic())  # one dict store: atomic under the GIL
        return raw

    def restore(self, key: int, raw: Raw) -> None:
        """Undo :meth:`issued`: ``raw`` is this thread's pending record again, not in flight."""
        self.open.pop(key, None)
        self._local.pending = raw

    def finished(self, key: int) -> None:
        """Mark the op issued under ``key`` as completed."""
        entry = self.open.pop(key, None)
        if entry is not None:
            label = entry[0][2]
            self.completed[label] = self.completed.get(label, 0) + 1

    def abandon(self, key: int) -> None:
        """Drop the failed op issued under ``key``: no longer in flight, and not completed."""
        self.open.pop(key, None)

    def oldest_open(self) -> tuple[CollectiveRecord, float] | None:
        """Return the open op issued first, with its monotonic start time, or None."""
        entries = list(self.open.values())  # a C-level copy: safe against concurrent updates
        if not entries:
            return None
        raw, started = min(entries, key=lambda e: e[1])
        return to_record(raw), started

    def snapshot(self) -> dict[str, Any]:
        """Return counters, open ops and history as JSON-ready data (what a dump stores)."""
        open_records = [to_record(raw).to_json() for raw, _ in list(self.open.values())]
        return {
            "started": dict(self.started),
            "completed": dict(self.completed),
            "in_flight": sorted(open_records, key=lambda r: r["started"]),
            "history": [to_record(raw).to_json() for raw in list(self.history)],
        }
