"""The default mismatch check: ranks agree on each *new* collective signature before sending it.

gloo aborts a process (SIGABRT) when ranks all-reduce different shapes or dtypes, and hangs until
the timeout when one rank calls ``all_reduce`` and another ``broadcast``. With default settings
every distcompat collective on a group distcompat created is checked here, without an extra
collective in the common case::

    dist.all_reduce(torch.ones(4 if rank == 0 else 5))   # CollectiveMismatchError on every rank

How: each rank numbers its collectives per group and keeps the *steps* the ranks have already
agreed on: a call's signature (op, dtype, shape, ReduceOp, root) together with the signature of
the call before it. A call whose step is agreed goes straight to the backend (a set lookup); a
training loop repeats its steps. A new step is *checked*: the rank posts its signature to the
group's rendezvous store under its call number and waits for every rank's post for that number.
Ranks that agree remember the step; ranks that do not raise :class:`CollectiveMismatchError`
naming each rank's signature, before anything is sent. Keying by the previous call as well
catches ranks that make two different calls both already seen (two gradient buckets in a
different order); it misses them only if both followed that same call before.

A peer whose own step was already agreed does not check: it is inside the backend call. A
rank blocked in a distcompat collective looks every ``POLL_S`` seconds for a peer's question
(:func:`answer`) and posts what it is doing under the asked number, so both sides see the
mismatch and raise. The checking rank then joins the peer's pending call with zeros where it can
(the common plain cases, on the default group), so the group stays usable; elsewhere the peer's
call stays pending and the group should be recreated. ``DISTCOMPAT_MISMATCH_CHECK=off`` turns
this off; :func:`distcompat.collectives.checked` is the strict mode that checks every call.
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from distcompat._ranks import recorded, side_store
from distcompat.collectives import _shm_path as shm
from distcompat.collectives._errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    PeerLostError,
    raise_typed,
)
from distcompat.collectives._native import all_gather_flat
from distcompat.collectives._peers import gone_peers
from distcompat.collectives._probed import probed_for
from distcompat.collectives._reduce_ops import plan_fast
from distcompat.collectives._wire import MOVE_NATIVE

__all__ = [
    "ENV_VAR",
    "POLL",
    "POLL_S",
    "agree",
    "answer",
    "last",
    "listening",
    "record",
    "state_for",
    "unchecked",
    "wait_answering",
]

ENV_VAR = "DISTCOMPAT_MISMATCH_CHECK"
#: How often a rank blocked in a collective looks for a peer's question (seconds).
POLL_S = 0.5
#: The same as a timedelta, for ``Work.wait``.
POLL = timedelta(seconds=POLL_S)
#: Longest pause between two looks at the store while waiting for the other ranks' posts.
_MAX_PAUSE_S = 0.02
#: Steps remembered per group; beyond this the set starts again (every rank at the same call).
_MAX_AGREED = 4096
#: Recent signatures kept per group, to answer a question about a call already made.
_HISTORY = 256
#: The wait for every rank's post when the group's own timeout is unknown (an adopted group).
_DEFAULT_WAIT_S = 1800.0
#: Ops whose row count may legitimately differ between ranks (uneven splits).
_ROWS_VARY = frozenset({"all_to_all_single", "all_to_all"})

_RED_OP_TYPE = type(dist.ReduceOp.SUM)

#: True once some group has a store to check through: issue() then waits in POLL_S slices.
listening = False
#: Called every ``POLL_S`` while this rank waits for its peers' posts, with the op and the wait's
#: monotonic start: the watchdog's check (set by ``_checked.set_hooks``), so a rank stuck outside
#: any collective is reported while its peer waits here as it would be inside the collective.
on_wait: Callable[[str, float], None] | None = None


@dataclass(slots=True)
class _State:
    """One group's agreement record (the same on every rank while the ranks agree)."""

    store: Any  # a PrefixStore, or None: this group is not checked by default
    rank: int
    world: int
    wait_s: float = _DEFAULT_WAIT_S
    seq: int = 0
    agreed: set[Any] = field(default_factory=set)  # steps: (previous code, code), see record()
    previous: int = 0  # the last call's signature code (this process's hash of it)
    history: list[Any] = field(default_factory=lambda: [None] * _HISTORY)
    posted: set[int] = field(default_factory=set)  # call numbers this rank posted for
    open: set[int] = field(default_factory=set)  # answered, still waiting for every post


_states: weakref.WeakKeyDictionary[Any, _State] = weakref.WeakKeyDictionary()
#: A call that joins a peer's pending call after a mismatch: not numbered, not checked.
_joining = False
#: Inside :func:`unchecked`: no call is numbered or checked.
_suspended = False


def answering() -> bool:
    """Return whether a waiting rank should answer peers' questions (the default check is on)."""
    return listening and not _suspended


@contextlib.contextmanager
def unchecked() -> Iterator[None]:
    """Turn the default mismatch check off inside the block; every rank must do the same.

    Example:
        >>> with unchecked():
        ...     pass
    """
    global _suspended
    previous, _suspended = _suspended, True
    try:
        yield
    finally:
        _suspended = previous


def _enabled_by_env() -> bool:
    """Read ``DISTCOMPAT_MISMATCH_CHECK`` (on, 1: on; unset, off, 0: off).

    Off by default for now: under a network partition the check's store reads block for the
    store's timeout and the job does not end with its typed error in time (measured by the
    launchers session's partition fault); it is turned on by default once that is fixed.
    """
    value = os.environ.get(ENV_VAR, "off").strip().lower()
    if value in ("on", "1", "true", "yes"):
        return True
    if value in ("", "off", "0", "false", "no"):
        return False
    raise ValueError(f"{ENV_VAR}={value!r}: expected 'on' or 'off' (or 1 / 0)")


def _new_state(key: Any) -> _State:
    """Set up ``key``'s record: checked through the rendezvous store of a group distcompat made."""
    global listening
    rank, world = dist.get_rank(key), dist.get_world_size(key)
    found = side_store() if _enabled_by_env() else None
    if found is None:
        return _State(store=None, rank=rank, world=world)
    store, prefix = found
    name = getattr(key, "group_name", None) or ",".join(map(str, dist.get_process_group_ranks(key)))
    info = recorded()
    wait_s = info.timeout.total_seconds() if info is not None and info.timeout else _DEFAULT_WAIT_S
    listening = True
    return _State(
        store=dist.PrefixStore(f"{prefix}/agree/{name}", store),
        rank=rank,
        world=world,
        wait_s=wait_s,
    )


#: The last group looked up and its record: the fast paths (``_direct``) read it (a weakref
#: call) instead of making a weak-key lookup. A weakref: a destroyed group is not kept alive.
last: tuple[weakref.ref[Any], _State] | None = None


def state_for(group: Any) -> _State:
    """Return ``group``'s record (made on its first call; ``group`` has more than one rank)."""
    global last
    key = group if group is not None else dist.group.WORLD
    state = _states.get(key)
    if state is None:
        state = _states[key] = _new_state(key)
    last = (weakref.ref(key), state)
    return state


def agree(
    op: str, tensor: torch.Tensor | None, group: Any, reduce_op: Any, root: int | None
) -> None:
    """Count this call on ``group``; check it with every rank if its signature is new there."""
    if _joining or _suspended:
        return
    state = state_for(group)
    if state.store is None:
        return
    if reduce_op is not None and type(reduce_op) is not _RED_OP_TYPE:
        reduce_op = str(getattr(reduce_op, "op", reduce_op))  # a PREMUL_SUM ReduceOp object
    if tensor is None:
        sig: tuple[Any, ...] = (op, None, None, reduce_op, root)
    else:
        shape = tensor.shape[1:] if op in _ROWS_VARY else tensor.shape
        sig = (op, tensor.dtype, shape, reduce_op, root)
    record(state, sig, group)


def record(state: _State, sig: tuple[Any, ...], group: Any) -> None:
    """Count a call with signature ``sig`` (op, dtype, shape, ReduceOp, root); check it if new."""
    if state.store is None or _joining or _suspended:
        return
    seq = state.seq
    state.seq = seq + 1
    state.history[seq % _HISTORY] = sig
    code = hash(sig)  # a step is keyed by the two codes: hashing nested signatures costs more
    step = (state.previous, code)
    state.previous = code
    if step not in state.agreed:
        _check(state, seq, sig, group)
        if len(state.agreed) >= _MAX_AGREED:
            state.agreed.clear()
        state.agreed.add(step)  # reached only when every rank agreed


def _text(sig: tuple[Any, ...] | None) -> str:
    """Return a signature as readable text (what the error shows for each rank)."""
    if sig is None:
        return "(unknown: too long ago)"
    op, dtype, shape, reduce_op, root = sig
    parts = [op]
    if dtype is not None:
        rows = "rows x " if op in _ROWS_VARY else ""
        parts += [f"dtype={dtype}", f"shape={rows}{list(shape)}"]
    if reduce_op is not None:
        parts.append(f"reduce_op={str(reduce_op).rsplit('.', 1)[-1]}")
    if root is not None:
        parts.append(f"root={root}")
    return ", ".join(parts)


def _check(state: _State, seq: int, sig: tuple[Any, ...], group: Any) -> None:
    """Post ``sig`` for call ``seq``, wait for every rank's post, compare.

    The group's first call is checked by every rank (nothing is agreed yet), so it first
    compares a code of the signature with one tiny all-gather on the group itself, which notices
    a dead or stopped peer as any collective does; the texts are posted only on a disagreement.
    """
    store = state.store
    if seq == 0:
        store.set(f"ask/{state.rank}", "0")  # set before any peer can read it (after this call)
        if _codes_agree(state, sig, group):
            state.posted.add(seq)
            return
    store.set(f"ask/{state.rank}", str(seq))
    store.set(f"s/{seq}/{state.rank}", "arrived|" + _text(sig))
    state.posted.add(seq)
    keys = [f"s/{seq}/{r}" for r in range(state.world)]
    started = time.monotonic()
    asked_at, pause = started, 0.0005
    while not store.check(keys):  # polled: a store.wait that times out logs a C++ warning
        now = time.monotonic()
        if now - started > state.wait_s:
            raise CollectiveTimeoutError(
                f"{sig[0]} (call #{seq} on this group): not every rank reached it within "
                f"{state.wait_s:g}s, the group's timeout (a collective only some ranks call, or "
                "a rank stuck elsewhere)",
                op=sig[0],
                peer=None,
            )
        if now - asked_at > POLL_S:  # meanwhile, peers may be asking about an earlier call
            answer(group)
            _raise_if_gone(sig[0], group)
            if on_wait is not None:
                on_wait(sig[0], started)  # the watchdog: may report, or raise HangError
            asked_at = now
        time.sleep(pause)
        pause = min(pause * 2, _MAX_PAUSE_S)
    posts = [value.decode() for value in store.multi_get(keys)]
    if all(post.split("|", 1)[1] == posts[0].split("|", 1)[1] for post in posts):
        return
    _join_pending(posts, group)
    raise _mismatch(sig[0], seq, posts)


def _codes_agree(state: _State, sig: tuple[Any, ...], group: Any) -> bool:
    """Return whether every rank's signature code equals this rank's (one all-gather)."""
    mine = torch.tensor([zlib.crc32(_text(sig).encode())], dtype=torch.int64)
    codes = torch.empty(state.world, dtype=torch.int64)
    try:
        all_gather_flat(codes, mine, group=group)
    except RuntimeError as exc:
        raise_typed(exc, sig[0], group)
    return bool((codes == mine).all())


def _raise_if_gone(op: str, group: Any) -> None:
    """Raise :class:`PeerLostError` if a peer on this machine ended while this rank waits."""
    gone = gone_peers(group)
    if gone:
        raise PeerLostError(
            f"{op}: a peer process went away (rank{'s' if len(gone) > 1 else ''} "
            f"{', '.join(map(str, gone))}) while the ranks compared this call",
            op=op,
            peer=gone[0],
            peers=gone,
        )


def _mismatch(op: str, seq: int, posts: list[str]) -> CollectiveMismatchError:
    lines = []
    for rank, post in enumerate(posts):
        kind, text = post.split("|", 1)
        lines.append(f"  rank {rank}: {text}" + ("  (already inside it)" if kind == "in" else ""))
    return CollectiveMismatchError(
        f"{op} (call #{seq} on this group): ranks disagree:\n" + "\n".join(lines)
    )


def answer(group: Any) -> None:
    """Post what this rank did at every call a peer is asking about; raise on a disagreement.

    Called while this rank waits (in a collective, or for its own check). Never blocks for long:
    one store round trip to read the questions, and one per question.
    """
    state = state_for(group)
    store = state.store
    if store is None:
        return
    peers = [r for r in range(state.world) if r != state.rank]
    asked = {int(value) for value in store.multi_get([f"ask/{r}" for r in peers])}
    for seq in sorted(asked - state.posted):
        if seq < state.seq:  # a call this rank already made (a later one is not ours to answer)
            sig = state.history[seq % _HISTORY] if seq > state.seq - _HISTORY else None
            store.set(f"s/{seq}/{state.rank}", "in|" + _text(sig))
            state.posted.add(seq)
            state.open.add(seq)
    for seq in sorted(state.open):
        keys = [f"s/{seq}/{r}" for r in range(state.world)]
        if not store.check(keys):
            continue
        state.open.discard(seq)
        posts = [value.decode() for value in store.multi_get(keys)]
        if any(post.split("|", 1)[1] != posts[0].split("|", 1)[1] for post in posts):
            mine = posts[state.rank].split("|", 1)[1]
            raise _mismatch(mine.split(",", 1)[0], seq, posts)


def wait_answering(work: Any, group: Any) -> None:
    """Wait for a backend ``work``, answering peers' questions every ``POLL_S`` seconds."""
    while True:
        started = time.monotonic()
        try:
            work.wait(POLL)
            return
        except RuntimeError:
            if time.monotonic() - started < POLL_S * 0.99:
                raise  # not our slice running out: the op failed
        answer(group)


def _join_pending(posts: list[str], group: Any) -> None:
    """Join the call the ranks that answered are inside, with zeros, so it completes for them.

    Done for the plain cases only (dtypes moved natively, a ReduceOp that is sent as it is, a
    root only on the default group); elsewhere their call stays pending and the group should be
    recreated.
    """
    inside = {post.split("|", 1)[1] for post in posts if post.startswith("in|")}
    if len(inside) != 1:
        return
    text = inside.pop()
    if "root=" in text and group not in (None, dist.group.WORLD):
        return  # a root may be a global or a group rank: not told apart here
    call = _rebuild(text, group)
    if call is None:
        return
    global _joining
    _joining = True
    try:
        call()
    except RuntimeError:
        pass  # the peers' call failed anyway; they raise on their own
    finally:
        _joining = False


_DTYPES = {str(v): v for v in vars(torch).values() if isinstance(v, torch.dtype)}


def _rebuild(text: str, group: Any) -> Any:
    """Return a raw call matching the signature ``text``, or None where none is safe to make."""
    fields = dict(part.split("=", 1) for part in text.split(", ")[1:] if "=" in part)
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
