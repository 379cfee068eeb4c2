"""Log the launch pitfalls (:mod:`distcompat.launch`) once, on each node's local rank 0.

``init_distributed`` calls :func:`log_launch_pitfalls` before it creates the group; ``distcompat
doctor`` prints the same findings without logging them::

    log_launch_pitfalls(LaunchEnv.from_environ(), backend="gloo")
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from distcompat.launch import LaunchEnv, Pitfall, launch_pitfalls

__all__ = ["log_launch_pitfalls"]

_logged: set[str] = set()


def log_launch_pitfalls(
    env: LaunchEnv, *, backend: str | None = None, argv: Sequence[str] | None = None
) -> list[Pitfall]:
    """Log each launch pitfall once per process, on each node's local rank 0; return them.

    Records go to the ``distcompat`` logger at WARNING, stamped like
    :func:`distcompat.get_logger`'s: ``rank`` and ``world_size`` attributes, and a
    ``[rank R/W]`` prefix when the launch has more than one rank (the group does not exist yet,
    so both come from ``env``).

    Example:
        >>> log_launch_pitfalls(LaunchEnv.from_environ({}), argv=[])
        []
    """
    if env.local_rank != 0:
        return []
    found = launch_pitfalls(env, backend=backend, argv=argv)
    log = logging.getLogger("distcompat")
    prefix = f"[rank {env.rank}/{env.world_size}] " if env.world_size > 1 else ""
    for pitfall in found:
        text = pitfall.describe()
        if text not in _logged:
            _logged.add(text)
            log.warning(
                "%slaunch pitfall: %s",
                prefix,
                text,
                extra={"rank": env.rank, "world_size": env.world_size},
            )
    return found
