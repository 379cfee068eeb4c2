"""Backend-neutral collectives: torch.distributed's signatures, correct on every backend.

The two lines a training script writes::

    from distcompat.collectives import reduce_scatter_tensor
    reduce_scatter_tensor(shard, grads, op=dist.ReduceOp.AVG, async_op=True).get_future()

What every function here guarantees, on gloo as on NCCL:

* with ``async_op=True`` it returns a :class:`CompatWork` whose ``wait()``, ``is_completed()`` and
  ``get_future()`` work (gloo has no future for reduce_scatter and p2p ops);
* any memory layout: non-contiguous tensors are staged and copied back (gloo corrupts them);
* bool reductions mean what they say (gloo's bool SUM wraps at 256); AVG and PREMUL_SUM work
  where the backend lacks them; complex moves and sums everywhere; dtypes a backend cannot carry
  move as bytes and reduce through an upcast; anything with no correct emulation raises
  :class:`UnsupportedCollectiveError` instead of returning garbage;
* at world size 1, or with no process group, each op is the identity and needs no group;
* ranks that disagree about a call (shape, dtype, op, ReduceOp, root) get
  :class:`CollectiveMismatchError` on every rank instead of a SIGABRT or a hang, by default on
  groups distcompat created (``DISTCOMPAT_MISMATCH_CHECK=off`` or :func:`unchecked` turn it off;
  :func:`checked` compares every call).

On one machine (every rank of the group here), CPU tensors of ``all_reduce``, ``broadcast``,
``all_gather_into_tensor`` and the reduce-scatters go through shared memory instead of gloo
(``DISTCOMPAT_SHM=auto|on|off``; :func:`shm_status` and :func:`explain_collective` say which
path and why). On gloo the default group ``init_distributed`` makes is a :class:`ProtectedGroup`:
DDP's, FSDP2's and every library's collectives on it go through these functions too (and so
through shared memory); :func:`allreduce_hook` does that for DDP on a group distcompat did not
make.

``all_gather_single`` and ``reduce_scatter_single`` are the same functions as
``all_gather_into_tensor`` and ``reduce_scatter_tensor`` (torch 2.13's newer names).
``all_gather``'s tensors may differ in their first dimension (each rank's rows);
:func:`all_gather_uneven` concatenates rows whose counts are not known up front.
"""

from distcompat.collectives._all_to_all import all_to_all, all_to_all_single
from distcompat.collectives._checked import CollectiveMismatchError, checked, is_checked, unchecked
from distcompat.collectives._coalesced import all_reduce_coalesced, reduce_scatter_coalesced
from distcompat.collectives._ddp_hook import allreduce_hook
from distcompat.collectives._errors import CollectiveError, CollectiveTimeoutError, PeerLostError
from distcompat.collectives._explain import CollectivePlan, explain_collective
from distcompat.collectives._group import NotInGroupError, StaleGroupError
from distcompat.collectives._movement import all_gather, all_gather_into_tensor, broadcast
from distcompat.collectives._objects import (
    all_gather_object,
    broadcast_object_list,
    gather_object,
    scatter_object_list,
)
from distcompat.collectives._p2p import (
    NoPeerError,
    P2POp,
    barrier,
    batch_isend_irecv,
    irecv,
    isend,
    recv,
    send,
)
from distcompat.collectives._protected import GroupWork, ProtectedGroup
from distcompat.collectives._reduce_scatter import reduce_scatter, reduce_scatter_tensor
from distcompat.collectives._reductions import all_reduce, reduce
from distcompat.collectives._rooted import gather, gather_single, scatter
from distcompat.collectives._uneven import all_gather_uneven
from distcompat.collectives._wire import UnsupportedCollectiveError
from distcompat.collectives._work import CompatWork
from distcompat.collectives.shm import SharedMemoryFallbackWarning, ShmStatus
from distcompat.collectives.shm import status as shm_status

all_gather_single = all_gather_into_tensor
reduce_scatter_single = reduce_scatter_tensor

__all__ = [
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectivePlan",
    "CollectiveTimeoutError",
    "CompatWork",
    "GroupWork",
    "NoPeerError",
    "NotInGroupError",
    "P2POp",
    "PeerLostError",
    "ProtectedGroup",
    "SharedMemoryFallbackWarning",
    "ShmStatus",
    "StaleGroupError",
    "UnsupportedCollectiveError",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_gather_single",
    "all_gather_uneven",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "allreduce_hook",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "checked",
    "explain_collective",
    "gather",
    "gather_object",
    "gather_single",
    "irecv",
    "is_checked",
    "isend",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_coalesced",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
    "shm_status",
    "unchecked",
]
