"""Whether this thread is inside a distcompat collective: the one flag the protected group reads.

Every public collective is an :func:`entry`. While one runs, the backend calls it makes on a
:class:`~distcompat.collectives.ProtectedGroup` (its transport, the mismatch check's posts, an
object collective's broadcasts) go straight to the backend the group holds: the checks, the
watch and the routing ran once, in the entry. A call that reaches the group from anywhere else
(DDP's reducer, FSDP2, ``torch.distributed.*`` in library code) is not inside one, so the group
sends it through the same collectives::

    @entry
    def all_reduce(tensor, op=SUM, group=None, async_op=False): ...

    if inside():            # in ProtectedGroup.allreduce
        return backend.allreduce(tensors, opts)

The flag is per thread: DDP's reducer may call the group from an autograd thread while the main
thread is inside a collective of its own. An entry also runs with autograd off, as torch's own
collectives do: DDP with ``create_graph=True`` hands over gradients that require grad, and a
reduction's ``out=`` arithmetic on them would raise. And an entry first raises the error a
failed op owes this thread (``_handover.raise_owed``: DDP's bucket that failed inside
``loss.backward()``), so no collective starts with it still on its way.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from distcompat import _torch
from distcompat.collectives._handover import OWED, raise_owed

__all__ = ["entry", "inside"]

P = ParamSpec("P")
R = TypeVar("R")


class _Depth(threading.local):
    depth = 0


_local = _Depth()


def inside() -> bool:
    """Return whether this thread is inside a distcompat collective.

    Example:
        >>> inside()
        False
    """
    return _local.depth > 0


def entry(function: Callable[P, R]) -> Callable[P, R]:
    """Mark ``function`` as a collective's entry: while it runs, this thread is :func:`inside`.

    Example:
        >>> entry(inside)()
        True
    """

    @functools.wraps(function)
    def entered(*args: P.args, **kwargs: P.kwargs) -> R:
        local = _local
        depth = local.depth
        if OWED and not depth:  # an error owed to this thread (rare): one dict's truth test
            raise_owed()
        local.depth = depth + 1
        grad = _torch.is_grad_enabled()
        if grad:  # a collective moves bytes: autograd records none of it, as in torch's
            _torch.set_grad_enabled(False)
        try:
            return function(*args, **kwargs)
        finally:
            local.depth = depth
            if grad:
                _torch.set_grad_enabled(True)

    return entered
