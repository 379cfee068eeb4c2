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
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from distcompat._store import QuickStore, StoreUnreachable, asked_until
from distcompat.collectives._errors import (
    CollectiveError,
    CollectiveTimeoutError,
    raise_typed,
    translate,
)
from distcompat.collectives._group import global_rank
from distcompat.collectives._native import all_gather_flat
from distcompat.collectives._profiled import internal
from distcompat.collectives._wait import POLL_S, Wait, polled, until, work_ready
from distcompat.collectives.agree import _state
from distcompat.collectives.agree._posts import (
    ROWS_VARY,
    late_error,
    mismatch_error,
    rebuild_call,
    signature_text,
)
from distcompat.collectives.agree._state import (
    _MAX_AGREED,
    _RED_OP_TYPE,
    HISTORY,
    _State,
    count,
    state_for,
)

__all__ = [
    "StoreUnreachable",
    "agree",
    "answer",
    "answerer",
    "check",
    "record",
    "wait_answering",
]


def agree(
    op: str,
    tensor: torch.Tensor | None,
    group: Any,
    reduce_op: Any,
    root: int | None,
    rows: Sequence[int] | None = None,
) -> None:
    """Count this call on ``group``; check it with every rank if its signature is new there.

    ``rows``: an uneven all_gather's row count per rank, which every rank's list must agree on.
    """
    if _state.paused:
        return
    state = state_for(group)
    if state.store is None:
        return
    if type(reduce_op) is _RED_OP_TYPE:
        reduce_op = reduce_op.name  # "SUM": what the fast paths (direct) put in the signature
    elif reduce_op is not None:
        reduce_op = str(getattr(reduce_op, "op", reduce_op))  # a PREMUL_SUM ReduceOp object
    if tensor is None:
        sig: tuple[Any, ...] = (op, None, None, reduce_op, root)
    else:
        shape = tensor.shape[1:] if op in ROWS_VARY else tensor.shape
        sig = (op, tensor.dtype, shape, reduce_op, root)
        if rows is not None:
            sig = (op, tensor.dtype, tensor.shape[1:], reduce_op, root, tuple(rows))
    record(state, sig, group)


def record(state: _State, sig: tuple[Any, ...], group: Any) -> None:
    """Count a call with signature ``sig`` (op, dtype, shape, ReduceOp, root); check it if new."""
    counted = count(state, sig)
    if counted is not None:
        check(state, counted, sig, group)


def check(
    state: _State, counted: tuple[int, tuple[int, int]], sig: tuple[Any, ...], group: Any
) -> None:
    """Check a call :func:`count` returned with the peers; remember its step as agreed."""
    seq, step = counted
    _check(state, seq, sig, group)
    if len(state.agreed) >= _MAX_AGREED:
        state.agreed.clear()
    state.agreed.add(step)  # reached only when every rank agreed


def _check(state: _State, seq: int, sig: tuple[Any, ...], group: Any) -> None:
    """Post ``sig`` for call ``seq``, wait for every rank's post, compare.

    The group's first call is checked by every rank (nothing is agreed yet), so it first
    compares a code of the signature with one tiny all-gather on the group itself, which notices
    a dead or stopped peer as any collective does; the texts are posted only on a disagreement.
    Both waits are the group's :func:`~distcompat.collectives._wait.until` ("in the mismatch
    check"): watched by the watchdog, and ended by the group's timeout with
    :class:`CollectiveTimeoutError` naming the ranks whose post is missing. A store that does not
    answer is asked again until then.
    """
    store = state.store
    assert store is not None  # only checked groups get here
    started = time.monotonic()
    deadline = started + state.wait_s
    if seq == 0:  # set before any peer can read it (after this call)
        _retry(lambda: store.set(f"ask/{state.rank}", "0"), sig, seq, state, deadline)
        if _codes_agree(state, sig, group, started):
            state.posted.add(seq)
            return
    post = "arrived|" + signature_text(sig)
    _retry(lambda: store.set(f"ask/{state.rank}", str(seq)), sig, seq, state, deadline)
    _retry(lambda: store.set(f"s/{seq}/{state.rank}", post), sig, seq, state, deadline)
    state.posted.add(seq)
    keys = [f"s/{seq}/{r}" for r in range(state.world)]
    reached = [True]  # did the store answer the last look (else: no one to name, no answers)

    def posted() -> bool:
        try:
            reached[0] = True
            return store.check(keys)
        except StoreUnreachable:
            reached[0] = False
            return False

    def between() -> None:  # meanwhile, peers may be asking about an earlier call
        if reached[0]:
            with contextlib.suppress(StoreUnreachable):
                answer(group)

    wait = Wait(
        op=sig[0],
        phase="mismatch check",
        group=group,
        started=started,
        deadline=deadline,
        awaited=lambda: _absent(store, keys, group) if reached[0] else None,
    )
    until(polled(posted), wait, between=between)
    values: list[bytes] = _retry(lambda: store.multi_get(keys), sig, seq, state, deadline)
    posts = [value.decode() for value in values]
    if all(post.split("|", 1)[1] == posts[0].split("|", 1)[1] for post in posts):
        return
    _join_pending(posts, group)
    raise mismatch_error(sig[0], seq, posts)


def _retry(
    request: Callable[[], Any], sig: tuple[Any, ...], seq: int, state: _State, deadline: float
) -> Any:
    """Return ``request()``, asked again while the store does not answer, until ``deadline``."""
    return asked_until(
        request, deadline, POLL_S, lambda: late_error(sig[0], seq, state.wait_s, None)
    )


def _absent(store: QuickStore, keys: list[str], group: Any) -> tuple[int, ...] | None:
    """Return the global ranks whose post for this call is missing (None: no store answer)."""
    try:
        return tuple(global_rank(group, r) for r, key in enumerate(keys) if not store.check([key]))
    except StoreUnreachable:
        return None


def _codes_agree(state: _State, sig: tuple[Any, ...], group: Any, started: float) -> bool:
    """Return whether every rank's signature code equals this rank's (one all-gather).

    Waited on as the mismatch check: a rank whose ``ask`` key is missing never reached the call.
    """
    store = state.store
    assert store is not None
    mine = torch.tensor([zlib.crc32(signature_text(sig).encode())], dtype=torch.int64)
    codes = torch.empty(state.world, dtype=torch.int64)
    asked = [f"ask/{r}" for r in range(state.world)]
    wait = Wait(
        op=sig[0],
        phase="mismatch check",
        group=group,
        started=started,
        deadline=started + state.wait_s,
        awaited=lambda: _absent(store, asked, group),
    )
    try:
        with internal("mismatch check"):  # not one of the caller's collectives
            until(work_ready(all_gather_flat(codes, mine, group=group, async_op=True)), wait)
    except CollectiveError:
        raise
    except RuntimeError as exc:
        error = translate(exc, sig[0], group)
        if isinstance(error, CollectiveTimeoutError) and not error.peers:
            # gloo's own timeout came before the wait's deadline (a loaded machine): the ranks
            # whose ask key is missing never reached the call, as the wait would have named
            absent = _absent(store, asked, group)
            if absent:
                raise late_error(sig[0], 0, state.wait_s, absent) from exc
        raise_typed(exc, sig[0], group)
    return bool((codes == mine).all())


def answer(group: Any) -> None:
    """Post what this rank did at every call a peer is asking about; raise on a disagreement.

    Called while this rank waits (in a collective, or for its own check). Never blocks for long:
    one store round trip to read the questions, and one per question, each given up after
    ``_store.TIMEOUT_S`` with :class:`StoreUnreachable`.
    """
    state = state_for(group)
    store = state.store
    if store is None:
        return
    peers = [r for r in range(state.world) if r != state.rank]
    asked = {int(value) for value in store.multi_get([f"ask/{r}" for r in peers])}
    for seq in sorted(asked - state.posted):
        if seq < state.seq:  # a call this rank already made (a later one is not ours to answer)
            sig = state.history[seq % HISTORY] if seq > state.seq - HISTORY else None
            store.set(f"s/{seq}/{state.rank}", "in|" + signature_text(sig))
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
            raise mismatch_error(mine.split(",", 1)[0], seq, posts)


def answerer(group: Any, *, listening: bool = True) -> Callable[[], None]:
    """Return the step a backend wait takes between slices: answer peers' questions.

    Once the store stops answering (a network partition) it asks no more, and the op's own
    timeout gives the typed error; a short outage passes unseen. ``listening=False``: never ask.
    """
    asking = [listening]

    def between() -> None:
        if asking[0]:
            try:
                answer(group)  # a peer may be asking what this rank called
            except StoreUnreachable:
                asking[0] = False

    return between


def wait_answering(work: Any, group: Any, op: str = "collective") -> None:
    """Wait for a backend ``work``, answering peers' questions every ``POLL_S`` seconds.

    The wait is :func:`~distcompat.collectives._wait.until`'s ("in the backend wait"), so the
    watchdog sees it; the backend's own timeout ends it (:func:`answerer` between slices).
    """
    wait = Wait(op=op, phase="backend wait", group=group)
    until(work_ready(work), wait, between=answerer(group))


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
    call = rebuild_call(text, group)
    if call is None:
        return
    _state._pause(True, _state._suspended)
    try:
        call()
    except RuntimeError:
        pass  # the peers' call failed anyway; they raise on their own
    finally:
        _state._pause(False, _state._suspended)
