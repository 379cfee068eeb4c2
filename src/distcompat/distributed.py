"""A drop-in for ``torch.distributed`` whose collectives work the same on every backend.

Change one import and keep the code::

    import distcompat.distributed as dist        # was: import torch.distributed as dist
    dist.reduce_scatter_tensor(out, inp, op=dist.ReduceOp.AVG, async_op=True).get_future()

Everything ``torch.distributed`` offers is here (``ReduceOp``, ``new_group``, ``get_rank``,
...); the collectives are replaced by :mod:`distcompat.collectives`, which return
:class:`~distcompat.collectives.CompatWork` handles, and ``init_process_group`` /
``destroy_process_group`` do what :func:`distcompat.init_distributed` does: the default group is
distcompat's protected group, so DDP's, FSDP2's and every library's collectives on it are
checked, watched and typed too (``dist.get_backend()`` names it ``"gloo"``, which moves its
bytes; torch records it as ``"distcompat"``). Names this module does not define are looked up
in ``torch.distributed`` on access.
"""

from typing import TYPE_CHECKING, Any

import torch.distributed as _torch_dist
from torch.distributed import (
    Backend,
    ProcessGroup,
    ReduceOp,
    Work,
    get_rank,
    get_world_size,
    group,
    is_available,
    is_initialized,
    new_group,
)

if not TYPE_CHECKING:  # at run time, everything else torch.distributed has (overrides follow)
    import warnings as _warnings

    with _warnings.catch_warnings():
        # The star import touches names torch 2.13 deprecates (reduce_scatter_tensor, ...);
        # distcompat replaces those below, so the user should not see torch's FutureWarning.
        _warnings.simplefilter("ignore", FutureWarning)
        from torch.distributed import *  # noqa: F403
    # torch's deprecated alias warns whenever it is touched (even by introspection); leave it to
    # __getattr__, so using it still gets torch's warning.
    globals().pop("reduce_op", None)
    # Looked up on access: the protected group's registration translates its name (_protected).
    globals().pop("get_backend", None)
else:
    from torch.distributed import get_backend

from distcompat.collectives import (
    CompatWork,
    P2POp,
    all_gather,
    all_gather_into_tensor,
    all_gather_object,
    all_gather_single,
    all_reduce,
    all_reduce_coalesced,
    all_to_all,
    all_to_all_single,
    barrier,
    batch_isend_irecv,
    broadcast,
    broadcast_object_list,
    gather,
    gather_object,
    gather_single,
    irecv,
    isend,
    recv,
    reduce,
    reduce_scatter,
    reduce_scatter_coalesced,
    reduce_scatter_single,
    reduce_scatter_tensor,
    scatter,
    scatter_object_list,
    send,
)
from distcompat.process_group import (
    destroy_process_group,
    init_process_group,
    monitored_barrier,
    set_timeout,
)

# The rest of torch.distributed is re-exported by the star import above.
__all__ = [
    "Backend",
    "CompatWork",
    "P2POp",
    "ProcessGroup",
    "ReduceOp",
    "Work",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_gather_single",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "destroy_process_group",
    "gather",
    "gather_object",
    "gather_single",
    "get_backend",
    "get_rank",
    "get_world_size",
    "group",
    "init_process_group",
    "irecv",
    "is_available",
    "is_initialized",
    "isend",
    "monitored_barrier",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_coalesced",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
    "set_timeout",
]


def __getattr__(name: str) -> Any:
    """Fall back to ``torch.distributed`` for names not defined here (private ones included)."""
    return getattr(_torch_dist, name)
