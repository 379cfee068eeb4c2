"""The default group, in the same process and the same object, made of the agreed survivors.

After :func:`~distcompat.inplace._members.agree_survivors`, every survivor calls::

    done = regroup(group, new_members, me=launch_rank, uuid=agreed_uuid, base=generation)

* **the backend**: where the installed torch's gloo can be reconfigured (2.14+), the group's
  own gloo backend takes the new members (handles exchanged under the epoch's store keys;
  about 1-3 ms at 2-3 ranks here), and C++ callers see the new rank and size with Python;
  elsewhere a new gloo backend is made under the epoch's fresh store prefix and only Python
  sees the new numbers (:meth:`ProtectedGroup.regrouped`);
* **the meeting**: each rank writes its handle (``compare_set``) and waits for the others';
  a member seen to end meanwhile, or a newcomer of a grow that does not come within
  :data:`JOIN_S` (at once when its process is seen to end), makes the members agree again
  without it (:class:`MemberLostError`); a newcomer left out that comes later is fenced;
* **torch's record**: the group's ranks and its store (``_torch.set_world_view``), so
  ``get_process_group_ranks`` and every key distcompat writes (identities, the mismatch check,
  shared memory) belong to the new epoch;
* **distcompat's per-group state**: the mismatch check's record, the shared-memory engines, the
  peers' identities and their watch, the failure noted for the lost op, and the rank record
  (``get_rank``, ``init_distributed``'s :class:`DistInfo`).

Groups and device meshes made before (subgroups, a mesh's) hold the old members: they are
fenced, and their collectives, numbers and slices raise
:class:`~distcompat.collectives.StaleGroupError`.

Example:
    >>> Regrouped(rank=0, world_size=2, how="gloo reconfigured in place", seconds=0.002).world_size
    2
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from distcompat import _torch, peers
from distcompat._ranks import keep_rendezvous, recorded, rendezvous
from distcompat._store import StoreUnreachable
from distcompat.collectives._group import StaleGroupError
from distcompat.collectives.agree._state import forget as forget_agreement
from distcompat.collectives.shm._path import close_all
from distcompat.diagnostics._exit import forget_failures
from distcompat.inplace._errors import FencedError, InPlaceUnsupportedError, ShrinkRefusedError
from distcompat.inplace._members import POLL_S, Members, StoreSilence
from distcompat.process_group._joining import init_prefix
from distcompat.process_group._lifecycle import note_regroup

__all__ = ["JOIN_S", "Joiners", "MemberLostError", "Regrouped", "regroup", "wait_for"]

#: The group timeout when init recorded none (an adopted group: not regrouped anyway).
_FALLBACK_TIMEOUT = timedelta(minutes=10)


#: How long the members wait at a regroup for an admitted newcomer that has not come (seconds)
#: before they leave it out: it holds no state yet, so it is left out on time alone (at once
#: when its process is seen to end); if it comes later it is fenced.
JOIN_S = 5.0
#: What a member writes in the place of a newcomer's handle when it leaves it out.
LEFT_OUT = "left out"


class MemberLostError(ConnectionError):
    """A member the survivors agreed on ended during the regroup: they agree again.

    ``ids``: the members that ended, or the newcomers left out (either way, not in the next
    epoch).
    """

    def __init__(self, message: str, ids: frozenset[int] = frozenset()) -> None:
        super().__init__(message)
        self.ids = ids


@dataclass(frozen=True, slots=True)
class Joiners:
    """The newcomers of a grow, as the members see them at its regroup.

    ``ids``: admitted, not yet members; ``ended(ids)``: those among ``ids`` whose process was
    seen to end. A shrink, and a newcomer's own regroup, pass none (:func:`regroup`).
    """

    ids: frozenset[int]
    ended: Callable[[set[int]], set[int]]


@dataclass(frozen=True, slots=True)
class Regrouped:
    """What a regroup made: this rank's new rank and the world size, how, and how long."""

    rank: int
    world_size: int
    how: str
    seconds: float
    reconfigured: bool = True  # False: a new backend; torch's C++ sees the old rank and size


def regroup(
    group: Any,
    new: Members,
    *,
    me: int,
    uuid: int,
    base: str,
    links: bool,
    lost: Callable[[], set[int]],
    deadline: float,
    joining: str | None = None,
    joiners: Joiners | None = None,
) -> Regrouped:
    """Make ``group`` (the default one) the group of ``new``'s members; this process is ``me``.

    ``uuid``: agreed by the members, new to the group; ``base``: the init generation the
    epochs count from (``"3"``); ``links``: whether the peer watch links to other machines;
    ``lost()``: the members seen to end since they agreed (one that does raises
    :class:`MemberLostError`, and the survivors agree again); ``deadline``: ``time.monotonic()``
    past which a member that never came raises :class:`ShrinkRefusedError`; ``joining``: in a
    newcomer (a group of one until now), the members' group name: its reconfigurable backend
    is made where theirs meet; ``joiners``: in a member, the newcomers of a grow (one that does
    not come within :data:`JOIN_S`, or ends, is left out: :class:`MemberLostError`, and the
    members agree again; one that comes after raises :class:`FencedError`).
    """
    started = time.perf_counter()
    found, info = rendezvous(), recorded()
    if found is None or info is None or not hasattr(group, "regrouped"):
        raise InPlaceUnsupportedError(
            "only a group distcompat made (init_distributed, or distcompat run) goes on in "
            "place: an adopted group's store and backend are its owner's"
        )
    store, _ = found
    rank, size = new.rank_of(me), new.size
    epoch = dist.PrefixStore(f"distcompat/inplace/generation{base}/epoch{new.epoch}", store)
    timeout = info.timeout or _FALLBACK_TIMEOUT
    backend = group.backend
    if _torch.can_reconfigure(backend):
        if joining is not None:  # its own backend's handle would be rank 0's, a member's too
            members_store = dist.PrefixStore(init_prefix(base), store)
            backend = _torch.joining_gloo(members_store, joining, me, timeout)
        handles = _meet(epoch, new, me, _torch.reconfigure_handle(backend), lost, deadline, joiners)
        _torch.reconfigure(backend, uuid, handles, timeout)
        how, reconfigured = "gloo reconfigured in place", joining is None
    else:
        _meet(epoch, new, me, "came", lost, deadline, joiners)
        backend = dist.ProcessGroupGloo(dist.PrefixStore("gloo", epoch), rank, size, timeout)
        how, reconfigured = "a new gloo backend (this torch's gloo has no reconfigure)", False
    group.regrouped(backend)
    _fence_others(group, new)
    _forget(group)
    _torch.set_world_view(group, size, dist.PrefixStore("group", epoch))
    keep_rendezvous(store, f"{base}.{new.epoch}")
    peers.start(rank, size, links=links)
    forget_failures()
    note_regroup(rank, size)
    return Regrouped(rank, size, how, time.perf_counter() - started, reconfigured)


def _meet(
    epoch: Any,
    new: Members,
    me: int,
    mine: str,
    lost: Callable[[], set[int]],
    deadline: float,
    joiners: Joiners | None,
) -> list[str]:
    """Write this rank's handle (``mine``) and wait for every rank's; return them in rank order.

    Each handle is written with ``compare_set``: a member that leaves a late newcomer out takes
    its place with :data:`LEFT_OUT` the same way, so the newcomer's own write and the members'
    leaving out cannot both win.
    """
    key = f"handle/{new.rank_of(me)}"
    if bytes(epoch.compare_set(key, "", mine)).decode() != mine:
        raise FencedError(
            f"newcomer {me} came to the regroup of epoch {new.epoch} after the members left it "
            f"out (it did not come within {JOIN_S:g}s of its admission): it must not join "
            "silently; start it again to join at a later step"
        )
    keys = [f"handle/{r}" for r in range(new.size)]
    join_by = time.monotonic() + JOIN_S

    def gone() -> set[int]:
        ended = lost()
        if ended or joiners is None:
            return ended
        late = {m for m in joiners.ids if not epoch.check([f"handle/{new.rank_of(m)}"])}
        late = late if time.monotonic() > join_by else joiners.ended(late)
        return {m for m in late if _leave_out(epoch, new.rank_of(m))}

    wait_for(
        epoch, keys, gone, deadline, during="during the regroup",
        missing="a member agreed on never came to the regroup's handles",
    )  # fmt: skip
    handles = [value.decode() for value in epoch.multi_get(keys)]
    left = frozenset(new.id_of(r) for r, handle in enumerate(handles) if handle == LEFT_OUT)
    if left:  # another member left them out first
        raise MemberLostError(f"newcomer(s) {sorted(left)} left out of the regroup", left)
    return handles


def _leave_out(epoch: Any, rank: int) -> bool:
    """Take a newcomer's place in the handles; False: it came first."""
    return bytes(epoch.compare_set(f"handle/{rank}", "", LEFT_OUT)).decode() == LEFT_OUT


def wait_for(
    store: Any,
    keys: list[str],
    lost: Callable[[], set[int]],
    deadline: float,
    *,
    during: str,
    missing: str,
) -> None:
    """Wait until ``keys`` exist in ``store``; the members' waits of a regroup and a grow.

    A member ``lost()`` names meanwhile raises :class:`MemberLostError` ("... ended
    ``during``"); past ``deadline``, :class:`ShrinkRefusedError` with ``missing``. A store
    request that times out is asked again (a process stopped and resumed finds its request
    timed out) for up to :data:`STORE_SILENCE_S`.
    """
    silence = StoreSilence(during)
    while True:
        try:
            if store.check(keys):
                return
            silence.answered()
        except StoreUnreachable as exc:
            silence.missed(exc)
        gone = lost()
        if gone:
            raise MemberLostError(f"launch rank(s) {sorted(gone)} ended {during}", frozenset(gone))
        if time.monotonic() > deadline:
            raise ShrinkRefusedError(missing)
        time.sleep(POLL_S)


def _fence_others(group: Any, new: Members) -> None:
    """Make every group and device mesh made before this regroup refuse (a typed error).

    Their members are ranks of the epoch before: a collective on one would wait for a lost
    rank, or pair ranks the regroup renumbered. Their rank and size refuse too, and torch's
    record of their ranks is emptied, so its world views (``get_world_size(sub)``,
    ``get_rank(sub)``) raise rather than answer the old numbers. A device mesh, even one over
    the whole world (whose group is the default one, regrouped), answers the old shape: every
    use of it raises :class:`StaleGroupError`.
    """
    reason = (
        f"this group was made before the default group changed members in place (epoch "
        f"{new.epoch}: launch ranks {list(new.ids)}); its members are the old ones: make it "
        "again after the regroup (new_group, a new device mesh)"
    )
    for other in _torch.other_groups(group):
        fence = getattr(other, "fence", None)
        if callable(fence):
            fence(reason)
    _torch.forget_group_ranks(_torch.other_groups(group))
    for mesh in _torch.device_meshes():  # a mesh over the whole world holds the default group
        _torch.fence_mesh(mesh, lambda: StaleGroupError(reason))


def _forget(group: Any) -> None:
    """Drop what distcompat keeps per group, made for the members before."""
    forget_agreement(group)
    close_all()  # the engines: their segments and slots are sized for the old world
    peers.forget_group(group)
