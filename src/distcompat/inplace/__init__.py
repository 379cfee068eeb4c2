"""A lost rank costs a regroup, not a restart: the survivors go on in place, the same bits.

The lines a training loop writes (every rank)::

    from distcompat.inplace import InPlace

    inplace = InPlace(model, optimizer, state={"plan": plan})
    for attempt in inplace.steps(total_steps):
        with attempt:                      # a lost peer inside: the survivors regroup, redo
            ...                            # forward, backward, optimizer.step()

Modules: ``_members`` (who goes on: the survivors agree through the store, on proof of death
only), ``_regroup`` (the default group takes them in place: gloo reconfigure on torch 2.14+,
a new gloo backend elsewhere), ``_state`` (the furthest whole state, sent to every survivor),
``_grow`` (a replacement joins at a step boundary every member agreed to; its init is
``distcompat.process_group._joining``), ``_ddp`` (DDP after a regroup), ``_recovery`` (what a
regroup did, said in one line), ``_steps`` (the loop's :class:`InPlace`), ``_errors``.
The contract and its limits: docs/resilience.md.
"""

from distcompat.collectives._group import StaleGroupError
from distcompat.inplace._errors import (
    FencedError,
    InPlaceError,
    InPlaceUnsupportedError,
    NotAdmittedError,
    ShrinkRefusedError,
    StateLostError,
)
from distcompat.inplace._recovery import Recovery
from distcompat.inplace._steps import Attempt, InPlace

__all__ = [
    "Attempt",
    "FencedError",
    "InPlace",
    "InPlaceError",
    "InPlaceUnsupportedError",
    "NotAdmittedError",
    "Recovery",
    "ShrinkRefusedError",
    "StaleGroupError",
    "StateLostError",
]
