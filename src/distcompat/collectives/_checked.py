"""Checked mode: every rank compares what it is about to do before it does it.

Measured on gloo: ranks that disagree on shape or dtype abort the receiving process (SIGABRT),
disagree on the op and both hang until the timeout, disagree on the ReduceOp or the dtype's
meaning and get garbage with no error. In checked mode each distcompat collective first
all-gathers a small int64 fingerprint (sequence number, op, ReduceOp, root, dtype, shape, splits),
so a disagreement raises :class:`CollectiveMismatchError` on every rank, describing each side::

    with distcompat.collectives.checked():
        train_step()          # a mismatched collective raises instead of hanging

A rank that never arrives (a collective inside ``if rank == 0:``) is caught by a bounded wait on
the fingerprint exchange. The cost is one extra tiny all_gather per collective (about 0.3-0.6 ms
on gloo here); use it while debugging, not in production runs. Outside it, the default check
(``_agree``) compares only the calls whose signature is new on the group.

:func:`verify` is also the single pre-call hook of every distcompat collective: while
:mod:`distcompat.diagnostics` has a watchdog or a single-rank region active it installs
``pre_call`` (history record, single-rank check) and ``watch`` (bounded waits in ``issue()`` and
``CompatWork.wait()``). With nothing installed the hook costs one module-global lookup plus the
default check's bookkeeping; the common calls skip it and do that bookkeeping in ``direct``, the
watchdog's record included. Only checked mode and single-rank regions (``_general``) send every
call through here.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from distcompat.collectives import _wait
from distcompat.collectives._errors import CollectiveMismatchError
from distcompat.collectives._native import all_gather_flat
from distcompat.collectives._profiled import internal
from distcompat.collectives.agree import agree, unchecked

__all__ = [
    "CollectiveMismatchError",
    "PreCall",
    "checked",
    "is_checked",
    "set_hooks",
    "step_aside",
    "unchecked",
    "verify",
]

_FIELDS = ("seq", "op", "reduce_op", "root", "dtype", "numel", "shape")
_OPS = (
    "all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor", "broadcast", "all_gather",
    "all_gather_into_tensor", "gather", "scatter", "all_to_all", "all_to_all_single", "barrier",
)  # fmt: skip
_enabled = False
_wait_s = 60.0
_sequence: dict[Any, int] = {}

#: ``pre_call(op, tensor, group, reduce_op, root)``: installed by distcompat.diagnostics.
PreCall = Callable[[str, "torch.Tensor | None", Any, Any, "int | None"], None]
_pre_call: PreCall | None = None
#: The active watchdog (``distcompat.diagnostics``), read by ``issue()`` and ``CompatWork.wait()``.
watch: Any = None
#: ``_enabled or _pre_call or watch``: the one flag verify() reads when nothing is enabled.
_active = False
#: Diagnostics want every call's pre-call hook: a single-rank region is open in some thread, or
#: a declared hang poisons the group (``distcompat.diagnostics``).
_hooked = False
#: ``_enabled or _hooked``: every call must run :func:`verify` (``direct`` steps aside).
_general = False


def set_hooks(pre_call: PreCall | None, watcher: Any, *, general: bool = False) -> None:
    """Install (or, with None, remove) the diagnostics pre-call hook and watchdog.

    ``general``: every call must go through verify() (a single-rank region is open somewhere,
    or a hang was declared); otherwise the fast paths record the call with ``watcher.note``.
    """
    global _pre_call, watch, _active, _hooked, _general
    _pre_call, watch, _hooked = pre_call, watcher, general
    _active = _enabled or pre_call is not None or watcher is not None
    _general = _enabled or general
    _wait.observer = watcher
    _wait.explain = None if watcher is None else watcher.explain


def step_aside() -> None:
    """Send every call through :func:`verify` until :func:`set_hooks` says otherwise.

    For a declared hang, from the watchdog's thread: two module flags, no lock (the next
    ``set_hooks`` reads the same state from the watchdog and keeps them).
    """
    global _hooked, _general
    _hooked = _general = True


@contextlib.contextmanager
def checked(enabled: bool = True, *, timeout: float = 60.0) -> Iterator[None]:
    """Turn checked mode on (or off) inside the block; ``timeout`` bounds the wait for peers.

    Every rank must use the same mode, or the fingerprint exchanges themselves mismatch.

    Example:
        >>> with checked():
        ...     is_checked()
        True
    """
    global _enabled, _wait_s, _active, _general
    previous = (_enabled, _wait_s)
    _enabled, _wait_s = enabled, timeout
    _active = _enabled or _pre_call is not None or watch is not None
    _general = _enabled or _hooked
    try:
        yield
    finally:
        _enabled, _wait_s = previous
        _active = _enabled or _pre_call is not None or watch is not None
        _general = _enabled or _hooked


def is_checked() -> bool:
    """Return whether checked mode is on."""
    return _enabled


def _code(value: object) -> int:
    """Return a stable non-negative 31-bit code for ``value`` (the same in every process)."""
    return zlib.crc32(repr(value).encode()) & 0x7FFFFFFF


def _reduce_code(reduce_op: Any) -> int:
    if reduce_op is None:
        return -1
    kind = getattr(reduce_op, "op", reduce_op)
    factor = getattr(reduce_op, "factor", None)
    return _code((str(kind), None if factor is None else float(factor)))


def _describe(
    row: list[int], op_names: dict[int, str], dtypes: dict[int, str], splits: list[int]
) -> str:
    """Return one rank's fingerprint as readable ``field=value`` text."""
    named = {"op": op_names.get(row[1], str(row[1])), "dtype": dtypes.get(row[4], str(row[4]))}
    parts = [f"{name}={named.get(name, row[i])}" for i, name in enumerate(_FIELDS)]
    return ", ".join(parts) + (f", splits={splits}" if splits else "")


def verify(
    op: str,
    tensor: torch.Tensor | None,
    group: Any,
    *,
    reduce_op: Any = None,
    root: int | None = None,
    in_splits: Sequence[int] | None = None,
    out_splits: Sequence[int] | None = None,
    row_counts: Sequence[int] | None = None,
) -> None:
    """Run the pre-call hooks: diagnostics (if installed), then a mismatch check.

    The check is checked mode's fingerprint exchange inside :func:`checked`, else the default
    one (``_agree``: only calls whose signature is new on the group are compared). ``row_counts``:
    an uneven all_gather's row count per rank (``tensor``: this rank's, rows first).
    """
    if not _active:
        agree(op, tensor, group, reduce_op, root, row_counts)
        return
    if _pre_call is not None:
        _pre_call(op, tensor, group, reduce_op, root)
    if not _enabled:
        agree(op, tensor, group, reduce_op, root, row_counts)
        return
    world = dist.get_world_size(group)
    if row_counts is not None and tensor is not None:  # as all_to_all's splits; the rest agree
        in_splits, out_splits = [tensor.shape[0]] * world, row_counts
        tensor = tensor.new_empty(tensor.shape[1:])  # one row's shape: compared as usual
    key = group if group is not None else dist.group.WORLD
    seq = _sequence.get(key, 0)
    _sequence[key] = seq + 1
    shape = tuple(tensor.shape) if tensor is not None else ()
    head = [
        seq,
        _code(op),
        _reduce_code(reduce_op),
        -1 if root is None else root,
        _code(tensor.dtype) if tensor is not None else -1,
        tensor.numel() if tensor is not None and (in_splits is None or row_counts) else -1,
        _code(shape) if in_splits is None or row_counts else -1,
    ]
    splits = [*(in_splits or [-1] * world), *(out_splits or [-1] * world)]
    mine = torch.tensor(head + splits, dtype=torch.int64)
    rows = torch.empty(world * mine.numel(), dtype=torch.int64)
    try:
        with internal("strict check"):  # not one of the caller's collectives
            work = all_gather_flat(rows, mine, group=group, async_op=True)
            assert work is not None
            work.wait(timeout=timedelta(seconds=_wait_s))
    except RuntimeError as exc:
        raise CollectiveMismatchError(
            f"{op} (call #{seq} on this group): not every rank reached it within {_wait_s:g}s. "
            "A collective inside `if rank == 0:` or a rank stuck elsewhere does this"
        ) from exc
    table = rows.view(world, -1).tolist()
    width = len(head)
    problems = []
    if any(row[:width] != table[0][:width] for row in table):
        problems.append("ranks disagree")
    if in_splits is not None:
        for r, row in enumerate(table):
            for s in range(world):
                sent = table[s][width + r]  # what rank s sends to rank r
                expected = row[width + world + s]  # what rank r expects from rank s
                if sent != expected:
                    problems.append(
                        f"rank {s} sends {sent} rows to rank {r}, which expects {expected}"
                    )
    if problems:
        names = {_code(name): name for name in _OPS}
        dtypes = {_code(value): str(value) for value in vars(torch).values()
                  if isinstance(value, torch.dtype)}  # fmt: skip
        lines = [
            f"  rank {r}: {_describe(row[:width], names, dtypes, row[width:] if in_splits else [])}"
            for r, row in enumerate(table)
        ]
        raise CollectiveMismatchError(
            f"{op} (call #{seq} on this group): {'; '.join(problems)}:\n" + "\n".join(lines)
        )
