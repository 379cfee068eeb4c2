"""``distcompat run``'s bootstrap: first on ``PYTHONPATH``, so every Python process runs it.

    distcompat run torchrun --standalone --nproc-per-node=2 train.py   # this folder first, exec

Python imports ``sitecustomize`` at start-up (``site``), from the first folder on ``sys.path``
that has one: this file, in every process the command starts (torchrun's workers, ``spawn``
children, a script that re-launches ``sys.argv``, Slurm and MPI ranks), as they inherit
``PYTHONPATH``. At start-up it does two things, with the standard library only (no torch, no
distcompat: a process that never imports ``torch.distributed`` pays for a list append):

* puts :class:`_Finder` first on ``sys.meta_path``. It waits for
  ``torch.distributed.distributed_c10d``; right after torch has executed that module, and
  before ``torch.distributed`` and ``torch.distributed.device_mesh`` import its names,
  ``distcompat.run._patch`` replaces its ``init_process_group``, ``destroy_process_group`` and
  ``monitored_barrier`` (so every holder of those names, torch's own included, gets them);
* runs the ``sitecustomize`` this file shadows (the next one on ``sys.path``), as its own
  ``sitecustomize`` module.

``DISTCOMPAT_RUN=off`` (read here and nowhere else) leaves the finder out: the process runs
torch's own init, and the shadowed ``sitecustomize`` still runs. Nothing here raises into the
program: a process that cannot import distcompat, or one where patching fails, says so in one
line on stderr and keeps torch's own functions.
"""

import os
import sys

# No `from __future__ import annotations` and no typing at run time: each costs every start; the
# annotations are strings the checker reads.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from types import ModuleType
    from typing import Any

__all__ = [
    "HERE", "RUN_OFF", "RUN_ON", "RUN_VARIABLE", "TARGET", "install", "run_enabled", "switch_error",
]  # fmt: skip

#: The switch, read here and nowhere else (``distcompat.launch._settings`` lists it too).
RUN_VARIABLE = "DISTCOMPAT_RUN"
#: The module whose functions are replaced, as soon as torch has executed it.
TARGET = "torch.distributed.distributed_c10d"
#: The values that turn it off, and those that leave it on (the other switches' spellings).
RUN_OFF = ("off", "0", "false", "no", "none")
RUN_ON = ("", "on", "1", "true", "yes")
#: This folder, the one ``distcompat run`` puts first on ``PYTHONPATH``.
HERE = os.path.dirname(os.path.abspath(__file__))


def run_enabled(environ: "Mapping[str, str] | None" = None) -> bool:
    """Whether :data:`RUN_VARIABLE` leaves ``distcompat run`` on (``distcompat run`` validated it).

    Example:
        >>> run_enabled({"DISTCOMPAT_RUN": "off"}), run_enabled({})
        (False, True)
    """
    text = (os.environ if environ is None else environ).get(RUN_VARIABLE, "")
    return text.strip().lower() not in RUN_OFF


def switch_error(environ: "Mapping[str, str]") -> "str | None":
    """Return the error for a :data:`RUN_VARIABLE` value neither on nor off; None when valid.

    Example:
        >>> switch_error({"DISTCOMPAT_RUN": "maybe"})
        "DISTCOMPAT_RUN='maybe': expected 'on' or 'off' (or 1 / 0)"
    """
    text = environ.get(RUN_VARIABLE, "").strip()
    if text.lower() in RUN_OFF + RUN_ON:
        return None
    return f"{RUN_VARIABLE}={text!r}: expected 'on' or 'off' (or 1 / 0)"


def _say(text: str) -> None:
    sys.stderr.write(f"distcompat run: {text}\n")


def _patch(module: "ModuleType") -> None:
    """Replace ``module``'s init functions by distcompat's routing (``distcompat.run._patch``)."""
    try:
        # Imported when torch.distributed is, never at start-up: the bootstrap stays stdlib-only
        from distcompat.run import _patch as patch
    except ImportError as exc:  # another environment, or a distcompat without `run`
        _say(f"cannot import distcompat.run here ({exc}): this process runs torch's own init")
        return
    try:
        patch.patch_module(module)
    except Exception as exc:  # never break `import torch`: name it and keep torch's functions
        _say(f"could not patch {module.__name__} ({type(exc).__name__}: {exc}): torch's own init")


class _PatchingLoader:
    """The loader torch's module comes with, patching the module once it has executed."""

    def __init__(self, loader: "Any") -> None:
        self._loader = loader

    def create_module(self, spec: "Any") -> "ModuleType | None":
        made: ModuleType | None = self._loader.create_module(spec)
        return made

    def exec_module(self, module: "ModuleType") -> None:
        self._loader.exec_module(module)
        module.__loader__ = self._loader  # transparent afterwards (tracebacks, inspect)
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        _patch(module)

    def __getattr__(self, name: str) -> "Any":
        return getattr(self._loader, name)


class _Finder:
    """A ``sys.meta_path`` finder that finds nothing itself: it wraps :data:`TARGET`'s loader."""

    distcompat_run = True  # how install() recognises one already there

    def find_spec(self, name: str, path: "Sequence[str] | None", target: "Any" = None) -> "Any":
        if name != TARGET:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


def install() -> bool:
    """Put the finder first on ``sys.meta_path`` (once); patch now if torch is already imported.

    Returns whether the finder was added by this call.

    Example:
        >>> install()   # in a process not started by distcompat run  # doctest: +SKIP
        True
    """
    if any(getattr(finder, "distcompat_run", False) for finder in sys.meta_path):
        return False
    sys.meta_path.insert(0, _Finder())
    loaded = sys.modules.get(TARGET)
    if loaded is not None:  # torch came first (a shadowed sitecustomize, or a late install)
        _patch(loaded)
    return True


def _chain() -> None:
    """Run the ``sitecustomize`` this one shadows, as ``sitecustomize`` (ddtrace's way).

    This folder leaves ``sys.path`` while Python's own import finds the next one (no
    ``importlib.util``: it costs 3 ms at every start); the path is restored in any case.
    """
    ours = sys.modules.pop("sitecustomize", None)
    kept = sys.path[:]
    sys.path[:] = [entry for entry in kept if os.path.abspath(entry or os.curdir) != HERE]
    try:
        __import__("sitecustomize")  # the shadowed one, or ModuleNotFoundError
    except ModuleNotFoundError as exc:
        if exc.name != "sitecustomize":
            raise  # theirs failed importing something: as without distcompat, site reports it
        if ours is not None:
            sys.modules["sitecustomize"] = ours
    except BaseException:  # as without distcompat: site reports it ("Error in sitecustomize")
        if ours is not None:
            sys.modules["sitecustomize"] = ours
        raise
    finally:
        sys.path[:] = kept


def _bootstrap() -> None:
    if run_enabled():
        install()
    _chain()


if __name__ == "sitecustomize":  # run by site at start-up; imported under its package name, inert
    _bootstrap()
