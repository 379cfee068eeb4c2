"""Point-to-point ops, batched point-to-point ops, and barrier.

gloo gives ``isend``/``irecv`` Works no future and a second ``wait()`` on an any-source ``irecv``
hangs; here they return :class:`CompatWork` (completed by the group's worker thread) like every
other async op. Tensors are staged contiguous (gloo refuses non-contiguous ones). On gloo, CUDA
tensors go through a host copy: gloo's send and recv hand the tensor's memory to the socket as
host memory, and a CUDA pointer kills the process (``writev: Bad address``, measured on an H100
with torch 2.11, docs/capabilities_gloo_cuda.md).

A blocking ``send``/``recv`` on gloo waits on its peer (a send until the peer posts the receive)
and is watched as a collective's wait is: it runs on the calling thread, registered with
:func:`~distcompat.collectives._blocking.beside`, whose thread shows a call that outlasts a slice
to the watchdog ("in the backend wait of recv"). gloo ends it: a lost peer with
:class:`PeerLostError` at once, the group's timeout with :class:`CollectiveTimeoutError` naming
the peer. (gloo's point-to-point wait cannot be sliced: a timed wait that runs out closes the
group's pairs; and handing the call to a helper thread cost a small round trip 1.5-2x.)

``P2POp`` accepts distcompat's ``isend``/``irecv`` as well as torch's (torch's own ``P2POp``
rejects any function but its own, so ``dist.P2POp(dist.isend, ...)`` failed under the drop-in
``distcompat.distributed``), and ``batch_isend_irecv`` returns :class:`CompatWork` handles.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Literal, TypeVar, cast, overload

import torch
import torch.distributed as dist

from distcompat import _torch
from distcompat.collectives._blocking import beside
from distcompat.collectives._checked import verify
from distcompat.collectives._entry import entry
from distcompat.collectives._errors import CollectiveTimeoutError, translate, typed_errors
from distcompat.collectives._group import (
    backend_for,
    global_rank,
    group_size,
    group_timeout_s,
    root_kwargs,
)
from distcompat.collectives._issue import issue
from distcompat.collectives._wait import Wait, timeout_error
from distcompat.collectives._wire import Finish, chain, stage_input, stage_output
from distcompat.collectives._work import CompatWork, done_if_async, finish_now

__all__ = [
    "NoPeerError",
    "P2POp",
    "barrier",
    "batch_isend_irecv",
    "irecv",
    "isend",
    "recv",
    "send",
]


T = TypeVar("T")


class NoPeerError(ValueError):
    """A point-to-point op was called where there is no other rank to talk to."""


def _needs_peer(group: Any, op: str) -> None:
    if group_size(group) == 1:
        raise NoPeerError(f"{op} needs another rank, but the world size is 1 (or no group exists)")


def _through_host(tensor: torch.Tensor, group: Any) -> bool:
    """Whether ``tensor`` must cross as a host copy: CUDA (or other device) memory on gloo."""
    return tensor.device.type != "cpu" and backend_for(group, tensor.device) == "gloo"


def _send_wire(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """Return what a send hands the backend: contiguous, in host memory where gloo needs it."""
    return stage_input(tensor.cpu() if _through_host(tensor, group) else tensor)


def _recv_wire(tensor: torch.Tensor, group: Any) -> tuple[torch.Tensor, Finish]:
    """``(wire, finish)`` for a receive into ``tensor``, through host memory where gloo needs it."""
    if not _through_host(tensor, group):
        return stage_output(tensor)
    host = torch.empty(tensor.shape, dtype=tensor.dtype)
    wire, copy_back = stage_output(host)

    def finish() -> None:
        copy_back()
        tensor.copy_(host)

    return wire, finish


def _blocking(
    op: str, call: Callable[[], T], group: Any, wire: torch.Tensor, peer: int | None
) -> T:
    """Return ``call()``, a blocking send or recv with global rank ``peer`` (None: any source).

    On gloo it is a wait on the peer, watched like a collective's (module docstring); NCCL only
    queues the op on the GPU stream. Every step here runs per call, so it stays cheap: the
    :class:`Wait` is made only if the call outlasts a slice.
    """

    def wait(started: float) -> Wait:
        toward = "any rank" if peer is None else f"rank {peer}"
        return Wait(
            op=op,
            phase="backend wait",
            group=group,
            started=started,
            deadline=started + _timeout_s(group),
            awaited=None if peer is None else lambda: (peer,),
            call=f"{op} {'from' if op == 'recv' else 'to'} {toward}",
        )

    started = time.monotonic()
    try:
        return beside(call, wait) if backend_for(group, wire.device) == "gloo" else call()
    except RuntimeError as exc:
        error = translate(exc, op, group)
        if isinstance(error, CollectiveTimeoutError) and peer is not None:
            # gloo's own timeout, the group's: name the peer, with what the watchdog saw of it
            error = timeout_error(wait(started), _timeout_s(group))
        if error is exc:
            raise
        raise error from exc


def _timeout_s(group: Any) -> float:
    return group_timeout_s(group if group is not None else dist.group.WORLD)


def _peer(group: Any, rank: int | None, group_rank: int | None) -> int | None:
    """Return the global rank of a peer named by global ``rank`` or ``group_rank`` (None: any)."""
    return global_rank(group, group_rank) if group_rank is not None else rank


@entry
def send(
    tensor: torch.Tensor,
    dst: int | None = None,
    group: Any = None,
    tag: int = 0,
    group_dst: int | None = None,
) -> None:
    """Send ``tensor`` to ``dst`` (any layout: staged contiguous first).

    On gloo it returns once ``dst`` has posted the matching receive; past the group's timeout it
    raises :class:`CollectiveTimeoutError` naming ``dst``.
    """
    _needs_peer(group, "send")
    wire = _send_wire(tensor, group)
    peer = root_kwargs("dst", dst, group_dst)
    _blocking(
        "send",
        lambda: dist.send(wire, group=group, tag=tag, **peer),
        group,
        wire,
        _peer(group, dst, group_dst),
    )


@entry
def recv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: Any = None,
    tag: int = 0,
    group_src: int | None = None,
) -> int:
    """Receive into ``tensor`` from ``src`` (any rank if None); return the sender's rank.

    Past the group's timeout it raises :class:`CollectiveTimeoutError` naming ``src``.
    """
    _needs_peer(group, "recv")
    wire, copy_back = _recv_wire(tensor, group)
    peer = root_kwargs("src", src, group_src)
    sender = _blocking(
        "recv",
        lambda: dist.recv(wire, group=group, tag=tag, **peer),
        group,
        wire,
        _peer(group, src, group_src),
    )
    finish_now(copy_back, tensor)
    return int(sender)


@entry
def isend(
    tensor: torch.Tensor,
    dst: int | None = None,
    group: Any = None,
    tag: int = 0,
    group_dst: int | None = None,
) -> CompatWork:
    """Start sending ``tensor`` to ``dst``; the handle's future works on every backend."""
    _needs_peer(group, "isend")
    wire = _send_wire(tensor, group)
    with typed_errors("isend", group):
        work = dist.isend(wire, group=group, tag=tag, **root_kwargs("dst", dst, group_dst))
    return CompatWork.from_work(work, group, [tensor], None, op="isend")


@entry
def irecv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: Any = None,
    tag: int = 0,
    group_src: int | None = None,
) -> CompatWork:
    """Start receiving into ``tensor``; ``wait()`` on the handle is safe to repeat."""
    _needs_peer(group, "irecv")
    wire, copy_back = _recv_wire(tensor, group)
    with typed_errors("irecv", group):
        work = dist.irecv(wire, group=group, tag=tag, **root_kwargs("src", src, group_src))
    return CompatWork.from_work(work, group, [tensor], copy_back, op="irecv")


def _native_op(op: Callable[..., Any]) -> Callable[..., Any]:
    """Map distcompat's ``isend``/``irecv`` to torch's; leave anything else for torch to check."""
    return {isend: dist.isend, irecv: dist.irecv}.get(op, op)


class P2POp(dist.P2POp):
    """torch's ``P2POp`` that also takes distcompat's ``isend``/``irecv`` (stored as torch's).

    Example:
        >>> import distcompat.distributed as dist
        >>> op = dist.P2POp(dist.isend, torch.zeros(2), 1)  # doctest: +SKIP
        >>> op.op is torch.distributed.isend  # doctest: +SKIP
        True
    """

    def __new__(
        cls, op: Callable[..., Any], tensor: torch.Tensor, *args: Any, **kwargs: Any
    ) -> P2POp:
        made: Any = super().__new__(cls, _native_op(op), tensor, *args, **kwargs)
        return cast(P2POp, made)  # torch's stubs type __new__ differently per release

    def __init__(self, op: Callable[..., Any], tensor: torch.Tensor, *args: Any, **kwargs: Any):
        super().__init__(_native_op(op), tensor, *args, **kwargs)


def _staged(op: Any) -> tuple[Any, Finish | None]:
    """Return a torch ``P2POp`` on a contiguous wire tensor, and the copy back into the caller's."""
    native = _native_op(op.op)
    if native is dist.isend:
        wire, copy_back = _send_wire(op.tensor, op.group), None
    elif native is dist.irecv:
        wire, copy_back = _recv_wire(op.tensor, op.group)
    else:
        raise ValueError(f"batch_isend_irecv: op.op is {native!r}; it must be isend or irecv")
    if wire is op.tensor and native is op.op:
        return op, copy_back
    staged = object.__new__(
        dist.P2POp
    )  # every field copied from a P2POp that passed torch's checks
    staged.__dict__.update(vars(op))
    staged.op, staged.tensor = native, wire
    return staged, copy_back


@entry
def batch_isend_irecv(p2p_op_list: Sequence[Any]) -> list[CompatWork]:
    """Start a batch of sends and receives; each handle's future works on every backend.

    Takes ``P2POp`` objects built with torch's or distcompat's ``isend``/``irecv``; tensors of any
    layout are staged contiguous, and received data is copied back into the caller's tensor when
    its handle completes. On NCCL torch coalesces the batch into one Work: then one handle is
    returned, completing when the whole batch has.

    Example:
        >>> import distcompat.distributed as dist
        >>> rank, world = dist.get_rank(), dist.get_world_size()  # doctest: +SKIP
        >>> out, inp = torch.ones(2), torch.empty(2)  # doctest: +SKIP
        >>> works = dist.batch_isend_irecv([
        ...     dist.P2POp(dist.isend, out, (rank + 1) % world),
        ...     dist.P2POp(dist.irecv, inp, (rank - 1) % world),
        ... ])  # doctest: +SKIP
        >>> torch.futures.wait_all([w.get_future() for w in works])  # doctest: +SKIP
    """
    ops = list(p2p_op_list)
    if not ops:
        raise ValueError("batch_isend_irecv needs at least one P2POp")
    bad = [type(op).__name__ for op in ops if not isinstance(op, dist.P2POp)]
    if bad:
        raise TypeError(f"batch_isend_irecv takes P2POp objects, got {', '.join(bad)}")
    group = ops[0].group
    _needs_peer(group, "batch_isend_irecv")
    staged = [_staged(op) for op in ops]
    with typed_errors("batch_isend_irecv", group):
        works = dist.batch_isend_irecv([native for native, _ in staged])
    if len(works) == len(ops):  # one Work per op (gloo, and every backend without coalescing)
        return [
            CompatWork.from_work(work, group, [op.tensor], copy_back, op=_native_op(op.op).__name__)
            for work, op, (_, copy_back) in zip(works, ops, staged, strict=True)
        ]
    # Coalesced (NCCL): the copies back wait for the last Work of the batch.
    copy_all = chain(*(copy_back for _, copy_back in staged))
    last = len(works) - 1
    return [
        CompatWork.from_work(work, group, None, copy_all if i == last else None, op="p2p batch")
        for i, work in enumerate(works)
    ]


@overload
def barrier(
    group: Any = ...,
    *,
    async_op: Literal[True],
    device_ids: list[int] | None = ...,
    timeout: timedelta | None = ...,
) -> CompatWork: ...


@overload
def barrier(
    group: Any = ...,
    async_op: bool = ...,
    device_ids: list[int] | None = ...,
    timeout: timedelta | None = ...,
) -> CompatWork | None: ...


@entry
def barrier(
    group: Any = None,
    async_op: bool = False,
    device_ids: list[int] | None = None,
    timeout: timedelta | None = None,
) -> CompatWork | None:
    """Wait for every rank of ``group``; the identity at world size 1.

    ``timeout``: this barrier's own, as torch's (torch 2.9 has no such parameter: there it
    raises :class:`~distcompat._torch.TorchReleaseError`).

    Example:
        >>> barrier()
    """
    own = {} if timeout is None else {"timeout": timeout}
    if own:
        _torch.require_takes("barrier", "timeout", timeout)
    if group_size(group) == 1:
        return done_if_async(None, async_op)
    verify("barrier", None, group)
    transport = lambda a: dist.barrier(group=group, async_op=a, device_ids=device_ids, **own)  # noqa: E731
    return issue("barrier", transport, group, None, None, async_op)
