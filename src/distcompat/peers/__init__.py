"""Peer liveness: which rank is which process, and knowing at once when one ends.

``init_distributed`` publishes each rank's identity and starts the watch; collectives ask it who
went away when a call fails::

    start(rank, world, links=True)          # pidfds here, proven TCP links to other machines
    gone_peers(group)                       # global ranks of ``group`` seen to end: (1,)
    farewells((1,))                         # "; rank 1 exited after ValueError: ... at a.py:3"
    listeners.append(on_loss)               # called with each Lost the watch records

Modules: ``_identity`` (a process's identity, liveness from ``/proc``), ``_registry``
(identities and farewells through the rendezvous store), ``_lost`` (naming the lost or stopped
peer), ``_links`` (links to peers on other machines) and ``_talk`` (what they say: greetings
and proofs under the job's secret), ``_relay`` (losses told through the store in large worlds),
``_watch`` (the thread that watches them all), ``_term`` (a launcher's SIGTERM waits for the
watch's lines).
What the links listen on and accept: docs/network.md.
"""

from distcompat.peers._identity import (
    UNKNOWN,
    Identity,
    address_of,
    is_alive,
    is_stopped,
    machine,
    same_machine,
    seen_ended,
)
from distcompat.peers._links import Ended, Links, all_linked, linked, unproven_cap
from distcompat.peers._lost import (
    Lost,
    Watcher,
    farewells,
    gone_peers,
    listeners,
    lost_peers,
    stopped_peers,
)
from distcompat.peers._lost import forget as forget_group
from distcompat.peers._registry import (
    LEFT,
    farewell,
    identities_of,
    leave_farewell,
    own_farewell,
    publish,
    quick_store,
    rendezvous_store,
)
from distcompat.peers._talk import job_secret
from distcompat.peers._watch import clock, read_clock, start, stop, supported

__all__ = [
    "LEFT",
    "UNKNOWN",
    "Ended",
    "Identity",
    "Links",
    "Lost",
    "Watcher",
    "address_of",
    "all_linked",
    "clock",
    "farewell",
    "farewells",
    "forget_group",
    "gone_peers",
    "identities_of",
    "is_alive",
    "is_stopped",
    "job_secret",
    "leave_farewell",
    "linked",
    "listeners",
    "lost_peers",
    "machine",
    "own_farewell",
    "publish",
    "quick_store",
    "read_clock",
    "rendezvous_store",
    "same_machine",
    "seen_ended",
    "start",
    "stop",
    "stopped_peers",
    "supported",
    "unproven_cap",
]
