"""A training loop whose lost rank costs a regroup, not a restart: :class:`InPlace`.

The lines a loop writes (every rank; DDP or a hand-written all-reduce alike)::

    inplace = InPlace(model, optimizer, state={"plan": plan})
    for attempt in inplace.steps(total_steps):
        with attempt:                                # a lost peer inside: regroup, then again
            loss = model(batch_for(attempt.step)).sum()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

Each attempt is one optimizer step. When a peer is lost inside one (the collective raises, and
the peer watch has seen the process end), every survivor leaves its attempt, they agree on who
goes on (``_members``), the default group takes the survivors in place (``_regroup``), and the
furthest whole state is sent to all (``_state``); the attempt's error is swallowed and the loop
gives the step again, now at the new size. ``attempt.step`` is the step to run: the optimizer
steps the group has applied. What cannot go on in place raises an :class:`InPlaceError` (the job
ends as before, and a restart resumes it); an error with no lost peer behind it is raised as is.

A process started after the group (a replaced rank) is a group of one from its init until its
``InPlace`` is admitted: the members agree on a step boundary (``_grow``), regroup with it there
and send it the state, as after a loss. After the last step the ranks confirm with one small
collective that none was lost in it: the loop ends on every rank together. Per step the loop
takes one lock (the boundary); a thread polls the store for newcomers every 50 ms.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from distcompat import _torch, peers
from distcompat._ranks import recorded, rendezvous
from distcompat._store import QuickStore
from distcompat.collectives import all_reduce
from distcompat.collectives._handover import forget, refuse_step
from distcompat.inplace._ddp import regroup_ddp
from distcompat.inplace._errors import InPlaceError, InPlaceUnsupportedError, ShrinkRefusedError
from distcompat.inplace._grow import Admissions, Proposal, announce_members, wait_admitted, went_on
from distcompat.inplace._members import Members, agree_survivors
from distcompat.inplace._recovery import Recovery, deadline, is_collective, report
from distcompat.inplace._regroup import Joiners, MemberLostError, Regrouped, regroup
from distcompat.inplace._shards import Shards, sharded
from distcompat.inplace._state import (
    Position,
    choose_source,
    positions,
    refuse_sharded,
    sync,
    zero_grads,
)
from distcompat.process_group import _joining

__all__ = ["Attempt", "InPlace"]

#: Where a newcomer stands: it holds no state (never a source).
NEWCOMER = Position(-1, True)

#: How many regroups one recovery may take (a rank lost during one starts the next).
ATTEMPTS = 4
#: How long a survivor waits for the peer watch to see the end of a peer whose collective
#: failed, before it takes the error for what it is (seconds): a pidfd fires at once, a link
#: a round trip later.
EVIDENCE_S = 1.0


class Attempt:
    """One try at one optimizer step: a context manager that :meth:`InPlace.steps` yields."""

    def __init__(self, inplace: InPlace, step: int) -> None:
        self.step = step
        self._inplace = inplace

    def __enter__(self) -> Attempt:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if error is None:
            return False
        try:
            swallowed = self._inplace._recover(error)
        except BaseException:
            self._inplace._end_admissions()  # the loop ends here, not when it is collected
            raise
        if not swallowed:
            self._inplace._end_admissions()
        return swallowed


@dataclass(slots=True)
class _Progress:
    applied: int = 0  # optimizer steps applied whole on this rank
    stepping: bool = False  # inside optimizer.step() now
    history: list[Recovery] = field(default_factory=list)


class InPlace:
    """Go on in place when a rank is lost: the same processes, the same group, the same state.

    Args:
        model: the module trained (a ``DistributedDataParallel`` or a plain one); its parameters
            and buffers are what the survivors copy from the furthest one.
        optimizer: its optimizer (``torch.optim`` or any object with ``step()``,
            ``state_dict()`` and ``load_state_dict()``); each attempt calls ``step()`` once.
        state: other Statefuls to keep the same on every rank (a ``TrainPlan``, a loader). Their
            ``state_dict()`` is taken at the start of each attempt (keep it cheap): a rank that
            sends its state for a step it did not apply sends that one, since a loader that
            fetched the step's batch is a batch ahead by then.
        shard_copies: keep sharded state in place: the optimizer or a Stateful that is
            ``Reshardable`` (a ZeRO optimizer whose ``load_resharded`` re-cuts its share and
            sets the parameters it owns, as the demo's ``ZeroAdamW`` does). After each step
            every rank sends its share to a rank on another machine (a cost per step: measure
            it); a regroup goes back to the last step whose every share a survivor holds and
            re-cuts them for the new size. Without it such state raises here.

    Needs the default group distcompat made (``init_distributed``) and state that is the same
    on every rank or ``Reshardable`` (with ``shard_copies``): DTensor parameters (FSDP2) and
    torch's ``ZeroRedundancyOptimizer`` raise :class:`InPlaceUnsupportedError` here.
    :attr:`recoveries` lists each regroup with its times.

    Example:
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> inplace = InPlace(model, opt)        # no group here: the loop just runs
        >>> for attempt in inplace.steps(2):
        ...     with attempt:
        ...         model(torch.ones(1, 2)).sum().backward(); opt.step(); opt.zero_grad()
        >>> inplace.step
        2
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        *,
        state: Mapping[str, Any] | None = None,
        shard_copies: bool = False,
    ) -> None:
        self._model, self._optimizer, self._state = model, optimizer, dict(state or {})
        refuse_sharded(model, optimizer, self._state, copies=shard_copies)
        info = recorded()  # a copy of each share goes to another machine: its node rank
        node = 0 if info is None else info.node_rank
        self._shards = Shards(sharded(optimizer, self._state), node)  # kept twice (_shards)
        _torch.device_meshes()  # the pass a regroup would pay, paid here (none: none later)
        self._progress = _Progress()
        self._grouped = dist.is_available() and dist.is_initialized()
        self._members = Members(0, (0,))  # the members of the epoch agreed last
        self._watched = self._members  # the members the group and its peer watch have now
        self._me, self._first = 0, 1
        self._gone: set[int] = set()  # ids ended or left out, as a regroup's wait found them
        self._store: QuickStore | None = None
        self._admissions: Admissions | None = None
        self._base, self._links = "", True
        self._syncing = False  # inside a state sync that writes this rank's state
        self._started: tuple[int, dict[str, Any]] = (-1, {})  # the Statefuls at an attempt's start
        self._synced: Position | None = None  # where a regroup that broke off left this rank
        self._ended = False  # the loop ended: no newcomer admitted any more
        self._regrouped_as: Regrouped | None = None
        self._announced: _joining.Announcement | None = None  # what the leader tells newcomers
        if self._grouped:
            self._join_group()
        self._wrap_step()
        if _joining.pending() is not None:
            self._be_admitted()

    @property
    def step(self) -> int:
        """The optimizer steps applied (the next attempt's step)."""
        return self._progress.applied

    @property
    def recoveries(self) -> list[Recovery]:
        """Each regroup of this run, in order."""
        return list(self._progress.history)

    def steps(self, total: int) -> Iterator[Attempt]:
        """Yield an :class:`Attempt` until ``total`` optimizer steps are applied on every rank.

        At each step boundary a newcomer the members agreed to admit joins (see ``_grow``).
        """
        self._ended = False
        if self._store is not None:
            self._admissions = Admissions(
                self._store, self._members, self._me, self._first, total, self._announce
            )
        try:
            self._keep_first()
            while True:
                while self._progress.applied < total:
                    before, recoveries = self._progress.applied, len(self._progress.history)
                    if self._admissions is not None:
                        grow = self._admissions.boundary(before)
                        if grow is not None:
                            self._grow(grow)
                            continue
                    self._started = (before, {n: v.state_dict() for n, v in self._state.items()})
                    yield Attempt(self, before)
                    recovered = len(self._progress.history) > recoveries
                    if self._progress.applied == before and not recovered:
                        raise InPlaceError(
                            f"attempt {before} ended without an optimizer step: each attempt "
                            "makes exactly one (optimizer.step() inside the with block)"
                        )
                if self._confirmed_end():
                    return
        finally:
            self._end_admissions()

    # -- the parts of a recovery ------------------------------------------------------------

    def _join_group(self) -> None:
        info, found = recorded(), rendezvous()
        group = _torch.default_group()
        if info is None or found is None or not hasattr(group, "regrouped"):
            raise InPlaceUnsupportedError(
                "InPlace needs the default group distcompat made (init_distributed or "
                "distcompat run, with the protected group on): an adopted group, or torch's "
                "own, cannot take new members in place"
            )
        store, generation = found
        newcomer = _joining.pending()
        if newcomer is not None:  # a group of one until admitted (process_group._joining)
            self._announced = newcomer.group
            self._me, self._first = newcomer.id, newcomer.group.first
            self._base, self._links = newcomer.group.base, newcomer.group.links
        else:
            self._me = dist.get_rank()
            self._first = dist.get_world_size()
            self._members = self._watched = Members(0, tuple(range(self._first)))
            self._base = str(generation)
            self._links = info.local_world_size != info.world_size
            name = str(group.group_name)
            self._announced = _joining.Announcement(self._base, self._first, self._links, name)
            if self._me == 0:  # newcomers (a replaced rank) find the group through it
                _joining.announce(store, self._announced)
        self._store = QuickStore(store, _joining.prefix(self._base))

    def _announce(self, members: Members) -> bool:
        """Name ``members``' processes in the group's notice (the leader's watch asks)."""
        return self._announced is None or announce_members(self._announced, members)

    def _be_admitted(self) -> None:
        """Wait until the members admit this newcomer, then take their state."""
        assert self._store is not None
        started = time.perf_counter()
        new = wait_admitted(self._store, self._me, deadline())
        self._members = new
        self._syncing = True  # it holds no state: never a source
        before = Members(new.epoch - 1, ())
        try:
            recovery = self._rebuild(before, new, NEWCOMER, started)
        except MemberLostError as error:  # another newcomer left out, a member lost: agree again
            self._gone |= error.ids
            recovery = self._recover_from(before, NEWCOMER)
        self._report(recovery)
        _joining.forget()

    def _grow(self, proposal: Proposal) -> None:
        """At the agreed boundary: admit the newcomers, or go on as before if it fell through."""
        assert self._admissions is not None
        started = time.perf_counter()
        first = self._members
        try:
            admissions = self._admissions
            new = admissions.decide(proposal, self._ended_ids, deadline())
            if new is None:
                return
            self._members = new
            joiners = Joiners(frozenset(proposal.ids), admissions.ended_newcomers)
            mine = Position(self._progress.applied, False)
            recovery = self._rebuild(first, new, mine, started, joiners)
        except InPlaceError:
            raise
        except Exception as error:  # a member lost while the group grew: recover from it
            if not self._recover(error):
                raise
            return
        self._report(recovery)

    def _end_admissions(self) -> None:
        """Admit no newcomer any more: the loop ended (the leader takes the notice back).

        Once: when an attempt raises, and again when the loop is collected (maybe at the
        interpreter's exit, when no store request can start).
        """
        if self._ended:
            return
        self._ended = True
        if self._admissions is not None:
            self._admissions.stop()
            self._admissions = None
        found = rendezvous()
        if found is not None and self._grouped and dist.get_rank() == 0:
            with contextlib.suppress(Exception):  # best effort: a newcomer times out anyway
                _joining.withdraw_announcement(found[0], self._base)

    def _wrap_step(self) -> None:
        """Count each whole optimizer step; know when an error came from inside one."""
        step = self._optimizer.step
        progress = self._progress

        def counted(*args: Any, **kwargs: Any) -> Any:
            refuse_step()  # a backward whose reduction failed: not applied, so not torn
            progress.stepping = True
            result = step(*args, **kwargs)
            if self._shards and self._grouped:  # the step's shares in two places: then it counts
                self._shards.keep(progress.applied + 1, self._watched.epoch)
            progress.stepping = False
            progress.applied += 1
            return result

        self._optimizer.step = counted

    def _keep_first(self) -> None:
        """Keep the sharded state's first copies (a newcomer's regroup kept them already)."""
        key = (self._progress.applied, self._watched.epoch)
        if not self._shards or not self._grouped or key in self._shards:
            return
        try:
            self._shards.keep(*key)
        except Exception as error:
            if not self._recover(error):
                raise

    def _ended_ids(self) -> set[int]:
        """Return the ids of the members seen to end.

        By the peer watch (its ranks: the group's), or by a regroup's wait (a newcomer left
        out counts with them).
        """
        group = _torch.default_group()
        return {self._watched.id_of(rank) for rank in peers.gone_peers(group)} | self._gone

    def _lost_behind(self, error: BaseException) -> bool:
        """Whether ``error`` came with a peer's end seen (waiting for the evidence briefly)."""
        if not self._grouped:
            return False
        deadline = time.monotonic() + (EVIDENCE_S if is_collective(error) else 0.0)
        while True:
            if self._ended_ids():
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)

    def _recover(self, error: BaseException) -> bool:
        """Regroup after ``error`` if a peer was lost behind it; True: swallowed, go on.

        A member lost during the recovery itself (its collectives fail, or it never comes to
        the regroup's handles) starts it again at the next epoch, up to :data:`ATTEMPTS` times.
        """
        if isinstance(error, MemberLostError):
            self._gone |= error.ids
        if isinstance(error, InPlaceError) or not self._lost_behind(error):
            return False
        progress = self._progress
        mine = Position(progress.applied, progress.stepping or self._syncing)
        progress.stepping = False
        self._report(self._recover_from(self._watched, mine))
        return True

    def _recover_from(self, first: Members, mine: Position) -> Recovery:
        """Agree on the next members from ``first`` (the group's last), regroup, take the state.

        ``mine``: where this rank stands. Starts again at the next epoch when a member is lost
        meanwhile, up to :data:`ATTEMPTS` times.
        """
        for _ in range(ATTEMPTS):
            try:
                recovery = self._regroup_once(first, mine)
                break
            except InPlaceError:
                raise
            except Exception as again:  # a member lost during it: a collective failed, or
                if isinstance(again, MemberLostError):
                    self._gone |= again.ids
                lost = is_collective(again) and self._lost_behind(again)  # not any error
                if not isinstance(again, MemberLostError) and not lost:
                    raise
                mine = self._synced or Position(mine.applied, mine.torn or self._syncing)
        else:
            raise ShrinkRefusedError(f"ranks kept being lost during {ATTEMPTS} regroups in a row")
        forget()  # the failures handed over from the old group's ops: past them now
        return recovery

    def _regroup_once(self, first: Members, mine: Position) -> Recovery:
        """Agree, regroup, copy the furthest state: one try (see :meth:`_recover`)."""
        started = time.perf_counter()
        assert self._store is not None
        tried = self._members  # the members agreed last (a grow or a regroup that broke off)
        new = agree_survivors(
            self._store, tried, me=self._me, ended=self._ended_ids, deadline=deadline()
        )
        self._members = new  # a member lost from here on: the next agreement starts from it
        return self._rebuild(first, new, mine, started, tried=tried.ids)

    def _rebuild(
        self,
        first: Members,
        new: Members,
        mine: Position,
        started: float,
        joiners: Joiners | None = None,
        tried: tuple[int, ...] = (),
    ) -> Recovery:
        """Make the group ``new``'s (agreed from ``first``) and copy the furthest state.

        ``joiners``: in a member, the newcomers of a grow (left out if they do not come);
        ``tried``: the members of an epoch agreed since ``first`` that never came together (a
        newcomer admitted there and not in ``new`` counts as lost).
        """
        progress = self._progress
        agreed = time.perf_counter()
        newcomer = _joining.pending()
        done: Regrouped = regroup(
            _torch.default_group(),
            new,
            me=self._me,
            uuid=new.epoch,
            base=self._base,
            links=self._links,
            lost=self._lost_in(new),
            deadline=deadline(),
            joining=None if newcomer is None else newcomer.group.group_name,
            joiners=joiners,
        )
        self._watched = new
        if self._admissions is not None:
            self._admissions.reset(new)
        regrouped = time.perf_counter()
        found = positions(mine)
        source = self._take_state(found, done.rank)
        zero_grads(self._model)
        if isinstance(self._model, DistributedDataParallel):
            regroup_ddp(self._model, done)
        recovery = Recovery(
            epoch=new.epoch,
            lost=tuple(sorted((set(first.ids) | set(tried)) - set(new.ids))),
            joined=tuple(sorted(set(new.ids) - set(first.ids))) if first.ids else (),
            members=new.ids,
            step=progress.applied,
            source=source,
            how=done.how,
            agree_s=agreed - started,
            regroup_s=regrouped - agreed,
            sync_s=time.perf_counter() - regrouped,
        )
        self._regrouped_as = done
        self._synced = None
        return recovery

    def _take_state(self, found: list[Position], rank: int) -> int:
        """Make this rank's state the group's (``found``: every rank's); return the source.

        Replicated state comes from the source (:func:`sync`); sharded state from the copies,
        at the latest step whose every share a survivor holds: its ``load_resharded`` after
        the sync (a ZeRO optimizer's restores the parameters it owns), then copies anew.
        """
        progress, shards = self._progress, self._shards
        shard_optimizer = shards.holds(self._optimizer)
        usable = {p.applied for p in found if p.applied >= 0 and (shard_optimizer or not p.torn)}
        key = shards.choose(usable) if shards else None
        source = choose_source(found, at=None if key is None else key[0], torn=shard_optimizer)
        self._syncing = rank != source  # a sync broken midway leaves this rank torn
        started, at_start = self._started
        unapplied = at_start if rank == source and progress.applied == started else None
        replicated = {n: v for n, v in self._state.items() if not shards.holds(v)}
        optimizer = None if shard_optimizer else self._optimizer
        sync(source, rank, self._model, optimizer, replicated, unapplied)
        # the replicated state is the source's now: a retry counts this rank there (its sharded
        # state comes from the copies whatever the step)
        self._synced = Position(found[source].applied, False)
        if key is not None:
            shards.load(key)
        self._syncing = False
        progress.applied = found[source].applied
        if shards:
            shards.keep(progress.applied, self._watched.epoch)
        return source

    def _lost_in(self, new: Members) -> Callable[[], set[int]]:
        """Return what a regroup's waits ask: the members of ``new`` seen to end.

        In a member, the peer watch's (still the group's before) and the regroup's own finds;
        in a newcomer, which watches no member yet, :func:`~._grow.went_on`.
        """
        if _joining.pending() is None:
            return lambda: self._ended_ids() & set(new.ids)
        assert self._store is not None
        return went_on(self._store, new, self._me, lambda: self._gone)

    def _report(self, recovery: Recovery) -> None:
        """Keep ``recovery``; rank 0 says it in one line."""
        assert self._regrouped_as is not None
        self._progress.history.append(recovery)
        report(recovery, self._regrouped_as)

    def _confirmed_end(self) -> bool:
        """One small collective after the last step: True when no rank was lost in it."""
        if not self._grouped:
            return True
        mark = torch.tensor([self._progress.applied], dtype=torch.int64)
        try:
            all_reduce(mark, dist.ReduceOp.MIN)
        except Exception as error:
            if not self._recover(error):
                raise
            return False
        return int(mark) == self._progress.applied
