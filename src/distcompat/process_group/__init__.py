"""Process-group lifecycle: init once from the launcher env, adopt a group that exists, tear down.

The two lines a training script writes::

    info = distcompat.init_distributed(device="cpu")   # gloo, even on a host with a GPU
    print(info.reason)                                  # why this device, backend and timeout

``_lifecycle`` holds init/destroy (and wires in identity publishing, launch pitfalls and the
watchdog), ``_create`` makes or adopts the group, ``_torch_api`` is torch's
``init_process_group`` / ``destroy_process_group`` doing the same, ``_barrier`` is the barrier
a script writes (a distcompat collective); the rank queries re-exported here live in
``distcompat._ranks``, below the collectives, so that every layer can ask for a rank.
"""

from distcompat._ranks import (
    DistInfo,
    get_local_rank,
    get_rank,
    get_world_size,
    is_main_process,
)
from distcompat.process_group._barrier import barrier
from distcompat.process_group._create import DistInitError
from distcompat.process_group._lifecycle import (
    destroy_distributed,
    distributed_session,
    init_distributed,
)
from distcompat.process_group._torch_api import (
    destroy_process_group,
    init_process_group,
    monitored_barrier,
    set_timeout,
)

__all__ = [
    "DistInfo",
    "DistInitError",
    "barrier",
    "destroy_distributed",
    "destroy_process_group",
    "distributed_session",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "init_process_group",
    "is_main_process",
    "monitored_barrier",
    "set_timeout",
]
