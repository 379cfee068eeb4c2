"""What ranks post for the default mismatch check, and what is made of it.

Each rank posts ``kind|text`` per checked call (``signature_text``: op, dtype, shape, ReduceOp,
root); ``mismatch_error`` turns disagreeing posts into the error every rank raises. When the
ranks that answered are already inside a backend call, the checking rank joins that call with
zeros (``rebuild_call``), so it completes for them and the group stays usable. Only the plain
cases are rebuilt: dtypes the backend moves natively, a ReduceOp that is sent as it is, a root::

    call = rebuild_call("all_reduce, dtype=torch.float32, shape=[4], reduce_op=SUM", group)
    if call is not None:
        call()
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from distcompat.collectives._errors import CollectiveMismatchError, CollectiveTimeoutError
from distcompat.collectives._native import all_gather_flat
from distcompat.collectives._probed import probed_for
from distcompat.collectives._reduce_ops import plan_fast
from distcompat.collectives._wire import MOVE_NATIVE
from distcompat.collectives.shm import _path as shm

__all__ = ["ROWS_VARY", "late_error", "mismatch_error", "rebuild_call", "signature_text"]

#: Ops whose row count may legitimately differ between ranks (uneven splits).
ROWS_VARY = frozenset({"all_to_all_single", "all_to_all"})


def signature_text(sig: tuple[Any, ...] | None) -> str:
    """Return a signature as readable text (what ranks post, and the error shows for each).

    Example:
        >>> signature_text(("all_reduce", torch.float32, torch.Size([4]), None, None))
        'all_reduce, dtype=torch.float32, shape=[4]'
    """
    if sig is None:
        return "(unknown: too long ago)"
    op, dtype, shape, reduce_op, root, *rows = sig  # rows: an uneven all_gather's, per rank
    parts = [op]
    if dtype is not None:
        vary = "rows x " if op in ROWS_VARY or rows else ""
        parts += [f"dtype={dtype}", f"shape={vary}{list(shape)}"]
    if reduce_op is not None:
        parts.append(f"reduce_op={str(reduce_op).rsplit('.', 1)[-1]}")
    if root is not None:
        parts.append(f"root={root}")
    if rows:
        parts.append("rows=" + "/".join(map(str, rows[0])))
    return ", ".join(parts)


def mismatch_error(op: str, seq: int, posts: list[str]) -> CollectiveMismatchError:
    """Return the error that names each rank's post for call ``seq`` (``kind|text`` each).

    Example:
        >>> print(mismatch_error("all_gather", 0, ["arrived|all_gather, dtype=torch.int8, "
        ...     "shape=rows x [], rows=1/2", "arrived|all_gather, dtype=torch.int8, shape=[1]"]))
        all_gather (call #0 on this group): ranks disagree: rank 1 sends 1 rows, rank 0 expects 2:
          rank 0: all_gather, dtype=torch.int8, shape=rows x [], rows=1/2
          rank 1: all_gather, dtype=torch.int8, shape=[1]
    """
    lines = []
    for rank, post in enumerate(posts):
        kind, text = post.split("|", 1)
        lines.append(f"  rank {rank}: {text}" + ("  (already inside it)" if kind == "in" else ""))
    rows = [_rows_of(post.split("|", 1)[1], len(posts)) for post in posts]
    named = [
        f"rank {sender} sends {own[sender]} rows, rank {r} expects {seen[sender]}"
        for sender, own in enumerate(rows)
        for r, seen in enumerate(rows)
        if own is not None and seen is not None and seen[sender] != own[sender]
    ]  # an all_gather's row counts: each rank's own is what it sends
    detail = "".join(f"; {n}" for n in named).replace(";", ":", 1)
    return CollectiveMismatchError(
        f"{op} (call #{seq} on this group): ranks disagree{detail}:\n" + "\n".join(lines)
    )


def _rows_of(text: str, world: int) -> list[int] | None:
    """Return the row count per rank an all_gather's post expects, or None (another call)."""
    found = re.match(r"all_gather, .*rows=([\d/]+)", text)
    if found:
        return [int(n) for n in found.group(1).split("/")]
    found = re.match(r"all_gather, dtype=[^,]+, shape=\[(\d+)", text)  # an even one: n each
    return [int(found.group(1))] * world if found else None


def late_error(
    op: str, seq: int, wait_s: float, absent: tuple[int, ...] | None
) -> CollectiveTimeoutError:
    """Return the error of a check whose posts did not all come within the group's timeout.

    ``absent``: the ranks whose post is missing, or None when the store did not answer.

    Example:
        >>> late_error("all_reduce", 3, 2.0, (1,)).peers
        (1,)
    """
    if absent is None:
        why, named = "; the rendezvous store did not answer", ""
    else:
        ranks = ", ".join(map(str, absent))
        why, named = (f"; not arrived: rank {ranks}", f" (rank {ranks})") if absent else ("", "")
    return CollectiveTimeoutError(
        f"{op} (call #{seq} on this group): not every rank reached it within {wait_s:g}s, the "
        f"group's timeout (a collective only some ranks call, or a rank stuck elsewhere{why})"
        + named,
        op=op,
        peer=absent[0] if absent is not None and len(absent) == 1 else None,
        peers=absent or (),
    )


_DTYPES = {str(v): v for v in vars(torch).values() if isinstance(v, torch.dtype)}


def rebuild_call(text: str, group: Any) -> Callable[[], Any] | None:
    """Return a raw call matching the signature ``text``, or None where none is safe to make.

    Example:
        >>> rebuild_call("all_reduce, dtype=torch.complex64, shape=[2], reduce_op=SUM", None)
    """
    fields = dict(re.findall(r"(\w+)=(\[[^\]]*\]|[^,]*)", text))  # a shape keeps its commas
    op = text.split(", ", 1)[0]
    if op == "barrier":
        return lambda: dist.barrier(group=group)
    dtype = _DTYPES.get(fields.get("dtype", ""))
    shape = fields.get("shape", "")
    if dtype not in MOVE_NATIVE or not shape.startswith("["):
        return None
    zeros = torch.zeros([int(n) for n in shape.strip("[]").split(",") if n.strip()], dtype=dtype)
    root = int(fields["root"]) if "root" in fields else None
    engine = shm.engine_for(group, op, zeros) if op in shm.WIRED else None  # the peers' path
    if op == "broadcast" and root is not None:
        if engine is not None:
            return lambda: engine.run(op, engine.broadcast(zeros.view(-1), root), False)
        return lambda: dist.broadcast(zeros, src=root, group=group)
    if op == "all_gather_into_tensor":
        out = torch.empty(zeros.numel() * dist.get_world_size(group), dtype=dtype)
        if engine is not None:
            return lambda: engine.run(op, engine.all_gather(out, zeros.view(-1)), False)
        return lambda: all_gather_flat(out, zeros.reshape(-1), group=group)
    if op in ("all_reduce", "reduce") and probed_for(group) is None:
        plan = plan_fast(getattr(dist.ReduceOp, fields.get("reduce_op", "")), dtype)
        if plan is None or plan.gather or plan.factor is not None:
            return None
        if op == "all_reduce" and engine is not None and shm.reduces(plan.op, dtype):
            return lambda: engine.run(op, engine.all_reduce(zeros.view(-1), plan.op), False)
        if op == "all_reduce":
            return lambda: dist.all_reduce(zeros, op=plan.op, group=group)
        if root is not None:
            return lambda: dist.reduce(zeros, dst=root, op=plan.op, group=group)
    return None
