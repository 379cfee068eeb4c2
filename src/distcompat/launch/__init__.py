"""The launcher environment and what follows from it: where a rank runs and which backend talks.

The bottom layer of distcompat (docs/architecture.md): it reads the environment and the host, and
decides; it creates no process group and imports nothing else of distcompat::

    env = distcompat.launch.LaunchEnv.from_environ()   # torchrun, Slurm, MPI, Ray, ...
    print(env.rank, env.world_size, env.describe())

* :class:`LaunchEnv` (``_env``, parsers in ``_contract``, ``_schedulers``, ``_slurm``, rules in
  ``_rules``): the launcher's variables, read in this one place.
* ``_host``: what this host and torch build have (one cached probe).
* ``_placement``: the run device, the backend and the timeout, each with its reason.
* :func:`launch_pitfalls` (``_pitfalls``): launch mistakes that end in hangs.
* :func:`pick_gloo_interface` (``_interface``): the interface that reaches the master, for a
  multi-node gloo launch without ``GLOO_SOCKET_IFNAME``.
* :func:`torchrun_exports` (``_exports``): the torchrun variables another launcher left unset.
* ``_local_ranks``: torchrun's worker contract for ranks distcompat starts itself.
* :func:`comeback_plan` (``_comeback``): how a rank stopped on purpose exits so that its
  launcher brings the job back.

``distcompat.env`` is the same :class:`LaunchEnv` under the import path the docs used first.
"""

from distcompat.launch._comeback import ComebackPlan, comeback_plan
from distcompat.launch._env import (
    DETECTION_ORDER,
    LaunchEnv,
    LaunchEnvError,
    Launcher,
    detect_launcher,
)
from distcompat.launch._exports import TORCHRUN_VARIABLES, TorchrunValues, torchrun_exports
from distcompat.launch._interface import InterfacePick, pick_gloo_interface
from distcompat.launch._pitfalls import (
    Pitfall,
    launch_pitfalls,
    launcher_argv,
    torchrun_prefix_pitfalls,
)
from distcompat.launch._placement import BackendUnavailableError, DeviceBindingError

__all__ = [
    "DETECTION_ORDER",
    "TORCHRUN_VARIABLES",
    "BackendUnavailableError",
    "ComebackPlan",
    "DeviceBindingError",
    "InterfacePick",
    "LaunchEnv",
    "LaunchEnvError",
    "Launcher",
    "Pitfall",
    "TorchrunValues",
    "comeback_plan",
    "detect_launcher",
    "launch_pitfalls",
    "launcher_argv",
    "pick_gloo_interface",
    "torchrun_exports",
    "torchrun_prefix_pitfalls",
]
