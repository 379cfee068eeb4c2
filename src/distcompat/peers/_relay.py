"""Losses told through the store: how a rank learns of a lost peer it holds no link to.

In a world of more than ``2 * REACH + 1`` ranks (``_links``) a rank links to its ring
neighbours only. The watch that sees a peer end posts the loss (:func:`post`); every rank's
watch reads the count of posted losses every :data:`POLL_S` seconds (:func:`read_since`, one
store request while nothing is new) and records what it had not seen::

    post(Lost(7, 4121, "node3", time.time(), ""))      # on a watch that saw rank 7 end
    count, found = read_since(0)                       # elsewhere: (1, [Lost(7, ...)])

The store sees one request per rank per :data:`POLL_S` and two per loss. Only worlds where
some pair of ranks is not linked pay it (``all_linked``). Best effort, like ``_registry``: a store
that does not answer (its host ended) relays nothing, and never raises.
"""

from __future__ import annotations

import json

from distcompat._store import StoreUnreachable
from distcompat.peers._lost import Lost
from distcompat.peers._registry import quick_store

__all__ = ["POLL_S", "post", "read_since"]

#: How often a watch asks the store for losses it did not see itself (seconds).
POLL_S = 0.5
_COUNT = "distcompat/peer/lost"
_LOSS = "distcompat/peer/lost/{}"


def post(found: Lost) -> None:
    """Tell every rank's watch that ``found`` ended (no group or store: nothing is sent).

    Example:
        >>> post(Lost(1, 4121, "node3", 0.0))   # no process group: nothing to post to
    """
    quick = quick_store()
    if quick is None:
        return
    text = json.dumps({"rank": found.rank, "pid": found.pid, "host": found.host,
                       "farewell": found.farewell})  # fmt: skip
    try:
        index = quick.add(_COUNT, 1)
        quick.set(_LOSS.format(index), text)
    except (StoreUnreachable, RuntimeError, ValueError):
        return


def read_since(count: int, seen: float = 0.0) -> tuple[int, list[Lost]]:
    """Return the count of losses read so far and those posted after the first ``count``.

    A loss counted but not written yet is read at a later call. ``seen`` is put in each
    :class:`Lost` read (when this rank learnt it).

    Example:
        >>> read_since(0)   # no process group: nothing posted
        (0, [])
    """
    quick = quick_store()
    if quick is None:
        return count, []
    found: list[Lost] = []
    try:
        posted = quick.add(_COUNT, 0)
        for index in range(count + 1, posted + 1):
            key = _LOSS.format(index)
            if not quick.check([key]):
                break
            data = json.loads(quick.get(key))
            found.append(Lost(data["rank"], data["pid"], data["host"], seen, data["farewell"]))
            count = index
    except (StoreUnreachable, RuntimeError, ValueError, KeyError, TypeError):
        pass
    return count, found
