"""The backend's own call for plain CPU tensors, without torch's Python wrapper around it.

``torch.distributed.all_reduce`` is Python around ``ProcessGroup.allreduce``: torch-function
dispatch, argument checks, an options object. On 2 gloo ranks sharing 2 cores, a tiny call made
right after a barrier spends about 10 us there (benchmarks/README.md), twice distcompat's budget
for its own per-call cost. For the common case, ``all_reduce``, ``broadcast``,
``all_to_all_single``, ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` first try the
functions here, which do the mismatch check's bookkeeping and call the ProcessGroup method the
wrapper would call, with the same options (``reduce_scatter_tensor``: the all-to-all and the row
reduction its general path does)::

    done = allreduce(tensor, op, group, async_op)
    if done is not SKIP:
        return done          # else: the general path (staging, plans, shims)

The common case: a plain ``torch.Tensor`` (no subclass, no torch-function mode: those go
through torch's dispatch) on the CPU, dense, of a dtype the backend handles natively, on a group
of more than one rank that an earlier call already looked up; no checked mode, single-rank region
or capability-probe results that would change the call. The options keep ``asyncOp`` at its
default (True): the work is waited on here, as torch waits on it for a synchronous call.

Where the group's ranks share a machine (``shm``) and the tensor is at or above the
path's floor, the same functions send the call through shared memory instead of the
ProcessGroup, with the same checks and records: an async call becomes the engine's work, and a
synchronous one runs in place (``Engine.all_reduce_now`` / ``Engine.run_now``), handing back a
work only if its wait outlasted the first slice or it failed. A group whose path is unusable
goes to the general path, which then takes the backend.

The protections are the general path's, shared through one function each, never a second copy
(a microsecond is not worth one): :func:`~._common._admit` counts the call for the mismatch
check (``agree.count``) and checks a new step with the peers first, recorded for the watchdog
before that wait (``Watchdog.note``); :func:`~._common._complete` records any other call once
issued, tracks an async handle as ``issue()`` does, and waits for a synchronous one for one
slice (``Watchdog.first_wait``): only a call that outlasts it becomes the watchdog's bounded
wait (``Watchdog.wait_late``). A group's shared memory is set up by the general path only, after
its call's check, so every rank meets the set-up at the same point whichever path its call took.
After a declared hang the fast paths step aside (``_checked._general``) and the general path's
pre-call refuses the call.

Each Python call or object made here costs a tiny collective several times its warm cost, since
it runs right after a wait with cold caches (benchmarks/README.md): hence options objects made
once, the ReduceOp compared by identity, the common-case test written out in ``allreduce``,
``broadcast``, ``alltoall`` and ``reducescatter`` (through ``_ready`` a tiny broadcast or
all-to-all read about 4 us more), and ``reducescatter``'s receive buffers kept for reuse
(``_spare_rows``).
"""

from distcompat.collectives.direct._common import SKIP, Outcome
from distcompat.collectives.direct._move import allgather, alltoall, broadcast
from distcompat.collectives.direct._reduce import allreduce, reducescatter

__all__ = ["SKIP", "Outcome", "allgather", "allreduce", "alltoall", "broadcast", "reducescatter"]
