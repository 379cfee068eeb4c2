"""No line changed: ``distcompat run CMD`` gives every Python process beneath it distcompat's init.

    distcompat run torchrun --standalone --nproc-per-node=2 train.py   # train.py unchanged

``bootstrap/`` is the folder put first on ``PYTHONPATH`` (its ``sitecustomize`` installs a lazy
import hook), ``_patch`` holds the replacements of torch's init functions and decides which
calls they take; the command itself is ``distcompat.cli._run`` (it prepares the environment and
execs the command). Importing this package imports neither torch nor the rest of distcompat.
docs/no-line-changed.md says what is patched, where it stops, the switch and the pitfalls.
"""

from distcompat.run._patch import Route, patch_module, route_init
from distcompat.run.bootstrap.sitecustomize import HERE as BOOTSTRAP_DIR
from distcompat.run.bootstrap.sitecustomize import RUN_VARIABLE, install, run_enabled

__all__ = [
    "BOOTSTRAP_DIR",
    "RUN_VARIABLE",
    "Route",
    "install",
    "patch_module",
    "route_init",
    "run_enabled",
]
