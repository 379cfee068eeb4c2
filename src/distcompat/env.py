"""``distcompat.env``: the launcher environment, under the import path the docs first gave.

The code lives in :mod:`distcompat.launch`; this module re-exports its launcher-environment names
so that ``from distcompat.env import LaunchEnv`` keeps working::

    from distcompat.env import LaunchEnv
    env = LaunchEnv.from_environ()
"""

from distcompat.launch import (
    DETECTION_ORDER,
    LaunchEnv,
    LaunchEnvError,
    Launcher,
    detect_launcher,
)

__all__ = ["DETECTION_ORDER", "LaunchEnv", "LaunchEnvError", "Launcher", "detect_launcher"]
