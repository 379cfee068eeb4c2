"""The process group every caller goes through: DDP, FSDP2, checkpoints, ``torch.distributed``.

Most collectives of a training job are not the user's own calls: DDP's reducer all-reduces the
gradient buckets, FSDP2 gathers and reduce-scatters its shards, ``torch.distributed.checkpoint``
gathers its plans, and library code calls ``torch.distributed.*``. They all call the process
group's methods. :class:`ProtectedGroup` is a ``torch.distributed.ProcessGroup`` written in
Python that holds the real backend (gloo) and sends each such call through distcompat's
collectives: the mismatch check, the watchdog's record and bounded wait, typed errors, the
shims, and shared memory where every rank is on this machine. torch runs Python process groups
natively (a C++ trampoline calls these methods; ``torch.distributed.Backend.register_backend``
names the factory), so DDP and FSDP2 use it unchanged::

    info = distcompat.init_distributed(device="cpu")     # the default group is a ProtectedGroup
    model = DistributedDataParallel(model)                # its gradient buckets: checked, watched,
                                                          # through shared memory on one machine

A distcompat collective called on the group does its work once: it is an ``entry``
(``_entry``), and the backend calls it makes on the group go straight to the backend. The group
defines every method torch's trampoline offers to Python (functional collectives reach
``all_gather_single_coalesced`` and ``reduce_scatter_single_coalesced``): one left undefined
would be issued by torch's fallback with the GIL held, which deadlocks with gloo's worker. The
methods C++ calls without a trampoline go to the backend, registered as the group's CPU backend:
they work, unprotected.
"""

from __future__ import annotations

import functools
import sys
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from distcompat import _torch
from distcompat.collectives import _entry
from distcompat.collectives._all_to_all import all_to_all, all_to_all_single
from distcompat.collectives._coalesced import all_reduce_coalesced
from distcompat.collectives._group import StaleGroupError
from distcompat.collectives._handover import Caller, shielded
from distcompat.collectives._movement import all_gather, all_gather_into_tensor, broadcast
from distcompat.collectives._p2p import barrier, irecv, isend
from distcompat.collectives._reduce_scatter import reduce_scatter, reduce_scatter_tensor
from distcompat.collectives._reductions import all_reduce, reduce
from distcompat.collectives._rooted import gather, gather_single, scatter
from distcompat.collectives._work import CompatWork, joined

__all__ = ["BACKEND", "GroupWork", "ProtectedGroup", "make_group", "register"]

#: The name :func:`register` gives the protected gloo group in ``torch.distributed``'s backends.
BACKEND = "distcompat"

_R = dist.ReduceOp
#: torch's ReduceOps by kind: an options object hands back a fresh ``ReduceOp`` on each read,
#: and distcompat's fast paths know the ops by identity.
_KINDS = {
    kind: kind for kind in (_R.SUM, _R.AVG, _R.PRODUCT, _R.MIN, _R.MAX, _R.BAND, _R.BOR, _R.BXOR)
}
_NO_TIMEOUT = timedelta(0)


def _op(opts: Any) -> Any:
    """Return the ReduceOp of ``opts`` as distcompat's collectives take it (none given: SUM).

    torch's callers may pass no options: ``ProcessGroup.allreduce(tensors)`` (DDP comm hooks).
    """
    if opts is None:
        return _R.SUM
    chosen = opts.reduceOp
    return _KINDS.get(chosen.op, chosen)  # PREMUL_SUM keeps its factor


class GroupWork(dist.Work):
    """The ``torch.distributed.Work`` a :class:`ProtectedGroup` hands its callers.

    It holds distcompat's :class:`CompatWork`: ``wait()`` is the watchdog's bounded wait and
    raises the typed error, and ``get_future()`` works for every op (gloo has none for
    reduce_scatter and point-to-point ops), which DDP's reducer and torch's callers use.

    A caller in C++ (``caller``; DDP's reducer) gets a future that never fails, and a failed
    op's typed error is raised in its thread once its C++ call is back in Python
    (after ``loss.backward()`` returns, the :class:`PeerLostError`): see ``_handover``.

    Example:
        >>> work = GroupWork(CompatWork.completed([torch.ones(1)]), [torch.ones(1)])
        >>> work.wait(), work.get_future().value()
        (True, [tensor([1.])])
    """

    def __init__(self, handle: CompatWork, outputs: Any, caller: Caller | None = None) -> None:
        super().__init__()
        self.handle = handle
        self.outputs = outputs
        self.caller = caller

    def wait(self, timeout: timedelta = _NO_TIMEOUT) -> bool:
        """Wait for the op (bounded by the watchdog); a zero timeout means none, as in torch."""
        return self.handle.wait(timeout if timeout else None)

    def get_future(self) -> torch.futures.Future[Any]:
        """Return the op's future: its value is the op's output tensors."""
        future = self.handle.get_future()
        if self.caller is None:
            return future
        handle = self.handle
        return shielded(future, self.outputs, self.caller, group=handle.group, op=handle.op)

    def is_completed(self) -> bool:
        """Return whether the op finished (successfully or not); never blocks."""
        return self.handle.is_completed()

    def is_success(self) -> bool:
        """Return whether the op finished without an error."""
        return self.handle.is_completed() and self.handle.exception() is None

    def exception(self) -> BaseException | None:
        """Return the op's error once it finished with one, else None."""
        return self.handle.exception()

    def result(self) -> Any:
        """Return the op's output tensors (after :meth:`wait`)."""
        return self.outputs


#: The files of the functions that call the group from Python (``torch.distributed.all_reduce``...),
#: of their logging wrapper, and of torch's Join, which hands an all_reduce's Work on to DDP's
#: reducer (C++): the reducer reads its ``result()``, which a Python Work cannot give, after the
#: Python object may be gone.
_PYTHON_CALLER, _LOGGER, _JOIN = _torch.caller_files()
_HANDS_TO_CPP = (_JOIN,)


def _handed(handle: CompatWork | None, outputs: Any) -> Any:
    """Wrap what an async distcompat collective returned (always a handle) for the group's caller.

    The caller is in C++ (DDP's reducer, a functional collective) unless the method was called
    from ``torch.distributed``'s Python functions; a Work that goes on to C++ from there is a
    native one over a future that never fails (see :class:`GroupWork`).
    """
    assert handle is not None, "an async distcompat collective returns a handle"
    try:
        caller = sys._getframe(2)
    except ValueError:  # a thread with no Python frame to raise in: the error stays in the future
        return GroupWork(handle, outputs)
    if caller.f_code.co_filename != _PYTHON_CALLER:
        return GroupWork(handle, outputs, Caller(threading.get_ident(), caller))
    outer = caller.f_back
    while outer is not None and outer.f_code.co_filename == _LOGGER:  # torch's logging wrapper
        outer = outer.f_back
    if outer is not None and outer.f_code.co_filename in _HANDS_TO_CPP:
        caller_here = Caller(threading.get_ident(), caller)
        future = shielded(
            handle.get_future(), outputs, caller_here, group=handle.group, op=handle.op
        )
        return _torch.create_work_from_future(future)
    return GroupWork(handle, outputs)


def _one(handles: list[CompatWork | None], outputs: Any) -> CompatWork:
    """One handle over a coalesced call's async collectives (each returns a handle)."""
    present = [h for h in handles if h is not None]
    assert len(present) == len(handles), "an async distcompat collective returns a handle"
    return present[0] if len(present) == 1 else joined(present, None, outputs)


def _backend_work(issued: list[tuple[Any, torch.Tensor]], group: Any, outputs: Any) -> GroupWork:
    """One Work over backend ops issued inside an entry (a coalesced call's parts)."""
    parts = [CompatWork.from_work(work, group, [out], None) for work, out in issued]
    return GroupWork(_one(list(parts), outputs), outputs)


class ProtectedGroup(dist.ProcessGroup):
    """A process group whose every collective goes through distcompat; ``backend`` moves the bytes.

    Made by :func:`make_group` (the factory :func:`register` gives torch); its ``backend`` is
    the real one (a ``ProcessGroupGloo``), also registered as the group's CPU backend for what
    C++ calls on it directly. ``protects`` names the backend for distcompat's plans.

    Example:
        >>> ProtectedGroup.__mro__[1] is torch.distributed.ProcessGroup
        True
    """

    def __init__(self, backend: Any, rank: int, size: int, name: str = "gloo") -> None:
        base: Any = super().__init__  # (rank, size): a form some releases' stubs lack
        base(rank, size)
        self.backend = backend
        self.protects = name
        self._group_name = ""
        self.retired: list[Any] = []  # backends of earlier members (see regrouped)
        self.fenced = ""  # why its collectives refuse: made before an in-place regroup
        _torch.register_cpu_backend(self, backend)

    def fence(self, reason: str) -> None:
        """Refuse every collective, and the rank and size, from now on (``StaleGroupError``).

        The default group changed members in place, and this group holds the old ones.
        """
        self.fenced = reason

        def refuse() -> int:
            raise StaleGroupError(reason)

        vars(self)["rank"] = vars(self)["size"] = refuse  # for Python callers (torch's too)

    def regrouped(self, backend: Any) -> None:
        """Go on with ``backend``, a gloo group of new members (``distcompat.inplace``).

        The same backend reconfigured (torch 2.14+) already answers the new rank and size, to
        Python and C++ alike. A new one becomes this group's: Python's ``rank()`` and ``size()``
        follow it, while torch's C++ keeps the numbers the group was made with. The backend
        before is kept, not freed: an op of the lost members may still hold it.
        """
        if backend is self.backend:
            return
        self.retired.append(self.backend)
        self.backend = backend
        vars(self)["rank"] = backend.rank  # for Python callers, ahead of the C++ methods
        vars(self)["size"] = backend.size

    # FSDP2's DeviceMesh names the group and reads the name back.
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:  # type: ignore[override]
        """The name torch registered the group under."""
        return self._group_name

    # Each method: straight to the backend inside a distcompat collective; else through one.
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        # sparse tensors: gloo's own sparse all-reduce (distcompat's paths move dense bytes)
        if _entry.inside() or len(tensors) != 1 or tensors[0].layout != torch.strided:
            return self.backend.allreduce(tensors, opts or dist.AllreduceOptions())
        return _handed(all_reduce(tensors[0], _op(opts), self, True), tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        if _entry.inside():
            return self.backend.allreduce_coalesced(
                tensors, opts or dist.AllreduceCoalescedOptions()
            )
        return _handed(all_reduce_coalesced(tensors, _op(opts), self, True), tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        if _entry.inside() or len(tensors) != 1:
            return self.backend.broadcast(tensors, opts or dist.BroadcastOptions())
        root = opts.rootRank
        return _handed(broadcast(tensors[0], group=self, async_op=True, group_src=root), tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:  # type: ignore[override]
        if _entry.inside() or len(tensors) != 1:
            return self.backend.reduce(tensors, opts)
        root = opts.rootRank
        return _handed(reduce(tensors[0], None, _op(opts), self, True, group_dst=root), tensors)

    def allgather(  # type: ignore[override]
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        if _entry.inside() or len(inputs) != 1:
            return self.backend.allgather(outputs, inputs, opts or _torch.AllgatherOptions())
        return _handed(all_gather(outputs[0], inputs[0], self, True), outputs)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        if _entry.inside():
            return self.backend._allgather_base(output, input, opts or _torch.AllgatherOptions())
        return _handed(all_gather_into_tensor(output, input, self, True), [output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        """All-gather into tensors: what functional collectives call (DTensor, FSDP2's state dict).

        Defined here so that torch's C++ sends it to Python: left to torch's fallback, it is
        issued with the GIL held, and gloo's worker, which may need the GIL to free the last
        reference to a finished op while it holds its queue's lock, deadlocks with it.
        """
        pairs = list(zip(outputs, inputs, strict=True))
        if _entry.inside():
            options = opts or _torch.AllgatherOptions()
            issued = [(self.backend._allgather_base(o, i, options), o) for o, i in pairs]
            return _backend_work(issued, self, outputs)
        handles = [all_gather_into_tensor(o, i, self, True) for o, i in pairs]
        return _handed(_one(handles, outputs), outputs)

    # its older name: torch's trampoline asks for either
    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]

    def gather(  # type: ignore[override]
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any
    ) -> Any:
        if _entry.inside() or len(inputs) != 1:
            return self.backend.gather(outputs, inputs, opts)
        listed = outputs[0] if outputs else None
        return _handed(
            gather(inputs[0], listed, None, self, True, group_dst=opts.rootRank), outputs
        )

    def gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        # torch 2.14+'s dist.gather_single calls it (its C++ has no trampoline for it)
        if _entry.inside():
            return self.backend.gather_single(output, input, opts)
        dst = opts.rootRank if opts is not None else 0
        root = dst == self.rank()
        work = gather_single(input, output if root else None, None, self, True, group_dst=dst)
        return _handed(work, [output])

    def scatter(  # type: ignore[override]
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any
    ) -> Any:
        if _entry.inside() or len(outputs) != 1:
            return self.backend.scatter(outputs, inputs, opts)
        listed = inputs[0] if inputs else None
        return _handed(
            scatter(outputs[0], listed, None, self, True, group_src=opts.rootRank), outputs
        )

    def reduce_scatter(  # type: ignore[override]
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> Any:
        if _entry.inside() or len(outputs) != 1:
            return self.backend.reduce_scatter(outputs, inputs, opts or dist.ReduceScatterOptions())
        return _handed(reduce_scatter(outputs[0], inputs[0], _op(opts), self, True), outputs)

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> Any:
        if _entry.inside():
            options = opts or dist.ReduceScatterOptions()
            return self.backend._reduce_scatter_base(output, input, options)
        return _handed(reduce_scatter_tensor(output, input, _op(opts), self, True), [output])

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        """Reduce-scatter tensors: what functional ``reduce_scatter_tensor`` calls (see above)."""
        pairs = list(zip(outputs, inputs, strict=True))
        options = opts or dist.ReduceScatterOptions()
        if _entry.inside():
            issued = [(self.backend._reduce_scatter_base(o, i, options), o) for o, i in pairs]
            return _backend_work(issued, self, outputs)
        op = _op(options)
        handles = [reduce_scatter_tensor(o, i, op, self, True) for o, i in pairs]
        return _handed(_one(handles, outputs), outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        opts: Any = None,
    ) -> Any:
        if _entry.inside():
            options = opts or dist.AllToAllOptions()
            return self.backend.alltoall_base(output, input, output_splits, input_splits, options)
        outs, ins = output_splits or None, input_splits or None
        return _handed(all_to_all_single(output, input, outs, ins, self, True), [output])

    alltoall_base = all_to_all_single  # type: ignore[assignment]

    def alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        if _entry.inside():
            return self.backend.alltoall(outputs, inputs, opts or dist.AllToAllOptions())
        return _handed(all_to_all(outputs, inputs, self, True), outputs)

    def barrier(self, opts: Any = None) -> Any:
        if _entry.inside():
            return self.backend.barrier(opts or dist.BarrierOptions())
        return _handed(barrier(self, True), [])

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> Any:
        if _entry.inside() or len(tensors) != 1 or self.size() == 1:  # to itself, as in torch
            return self.backend.send(tensors, peer, tag)
        return _handed(isend(tensors[0], None, self, tag, group_dst=peer), tensors)

    def recv(self, tensors: list[torch.Tensor], peer: int, tag: int) -> Any:
        if _entry.inside() or len(tensors) != 1 or self.size() == 1:  # to itself, as in torch
            return self.backend.recv(tensors, peer, tag)
        return _handed(irecv(tensors[0], None, self, tag, group_src=peer), tensors)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> Any:
        return self.backend.recv_anysource(tensors, tag)

    # The names torch 2.14+'s trampoline looks up besides the collectives (its C++ spelling for
    # recvAnysource). Each is what torch's own ProcessGroup does with a gloo backend: the
    # backend's call, made here rather than by C++ with the GIL held.
    recvAnysource = recv_anysource

    def start_coalescing(self, device: torch.device) -> None:
        del device  # one backend, the CPU one
        _torch.start_coalescing(self.backend)  # gloo: torch's "does not implement" error

    def end_coalescing(self, device: torch.device) -> Any:
        del device
        return _torch.end_coalescing(self.backend)

    def reconfigure(self, opts: Any) -> Any:
        return self.backend.reconfigure(opts)  # gloo made without enable_reconfigure: torch's error


def make_group(store: Any, rank: int, size: int, timeout: timedelta) -> ProtectedGroup:
    """Make a gloo backend from the rendezvous ``store`` and wrap it (torch's factory signature).

    Example:
        >>> store = torch.distributed.HashStore()
        >>> make_group(store, 0, 1, timedelta(seconds=30)).protects
        'gloo'
    """
    # No _set_sequence_number_for_group(): a no-op for gloo since torch 2.1, and from 2.14 on
    # a C++ warning on every process (torch itself stopped calling it)
    backend = dist.ProcessGroupGloo(store, rank, size, timeout)
    return ProtectedGroup(backend, rank, size)


def register() -> str:
    """Register the protected gloo group with torch (once per process); return its name.

    ``torch.distributed.init_process_group(backend=register())`` then makes one, as does
    ``new_group()`` under a default group that is one.

    Example:
        >>> register()
        'distcompat'
    """
    if not hasattr(dist.Backend, BACKEND.upper()):  # torch names each backend it registered
        dist.Backend.register_backend(BACKEND, make_group, devices=["cpu"])
        _name_it_gloo()
    return BACKEND


def _name_it_gloo() -> None:
    """Make ``torch.distributed.get_backend`` say ``"gloo"`` for a protected group.

    torch records a group under the name it was made with (``"distcompat"``), and code that asks
    for the backend's name branches on ``"gloo"``: torch's own ``monitored_barrier`` refuses
    anything else, libraries pick CPU paths by it. The protected group is gloo underneath, so
    the name torch hands back is translated (in a device map too: ``"cpu:distcompat"`` is
    ``"cpu:gloo"``); torch's record (what ``new_group()`` reads to make protected subgroups)
    keeps ``"distcompat"``. A default group asked for without a backend answers
    ``"undefined"``, it and its subgroups, as torch's does (its ``asked_as``).
    """
    c10d = dist.distributed_c10d
    asked = c10d.get_backend
    if getattr(asked, "translates", None) == BACKEND:  # already in place
        return

    @functools.wraps(asked)
    def get_backend(group: Any = None) -> Any:
        name = asked(group)
        if name == BACKEND:  # the default group or one of its subgroups made without a backend
            return getattr(_torch.default_group(), "asked_as", dist.Backend.GLOO)
        if isinstance(name, str) and name.endswith(f":{BACKEND}"):  # a map: each part ends so
            return name.replace(f":{BACKEND}", f":{dist.Backend.GLOO}")
        return name

    get_backend.translates = BACKEND  # type: ignore[attr-defined]
    c10d.get_backend = get_backend  # what torch's own functions (monitored_barrier) call
    dist.get_backend = get_backend  # torch.distributed.get_backend, imported from c10d
