"""Launch pitfalls that end in a hang or a confusing failure, found before the first collective.

Reported by ``distcompat doctor``, and logged once at ``init_distributed`` (node-local rank 0) by
:func:`distcompat.diagnostics.log_launch_pitfalls`::

    for pitfall in launch_pitfalls(LaunchEnv.from_environ(), backend="gloo"):
        print(pitfall.problem, pitfall.fix)

* a script option that torchrun takes as its own by prefix (argparse accepts abbreviations: the
  script's ``--run`` is read as torchrun's ``--run-path``, or refused as ambiguous);
* multi-node gloo without ``GLOO_SOCKET_IFNAME`` (gloo binds the address the host name resolves
  to, often 127.0.0.1, and the peers dial their own loopback; measured to fail after 82 s): the
  finding says which interface ``init_distributed`` will pick instead (``_interface``), or that
  it found none;
* a multi-process launch with no rendezvous host (``MASTER_ADDR``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from distcompat.launch._env import LaunchEnv
from distcompat.launch._interface import InterfacePick, is_multi_node, pick_gloo_interface

__all__ = [
    "Pitfall",
    "launch_pitfalls",
    "launcher_argv",
    "torchrun_prefix_pitfalls",
]

_TORCHRUN_MODULES = ("torch.distributed.run", "torch.distributed.launch")


@dataclass(frozen=True, slots=True, kw_only=True)
class Pitfall:
    """One launch problem: what is wrong, and the fix.

    Example:
        >>> Pitfall(name="x", problem="p", fix="f").describe()
        'p. Fix: f'
    """

    name: str
    problem: str
    fix: str

    def describe(self) -> str:
        """``problem. Fix: fix``."""
        return f"{self.problem}. Fix: {self.fix}"


def launcher_argv(pid: int | None = None) -> list[str] | None:
    """Torchrun's arguments (after ``torchrun``) when process ``pid`` (default: our parent) is it.

    Reads ``/proc/<pid>/cmdline`` (Linux); None when that is unreadable or not torchrun.
    """
    path = Path(f"/proc/{os.getppid() if pid is None else pid}/cmdline")
    try:
        words = path.read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    for index, word in enumerate(words):
        if os.path.basename(word) == "torchrun":
            return [w for w in words[index + 1 :] if w]
        if word == "-m" and index + 1 < len(words) and words[index + 1] in _TORCHRUN_MODULES:
            return [w for w in words[index + 2 :] if w]
    return None


def _torchrun_parser() -> argparse.ArgumentParser | None:
    """Torchrun's own parser (``torch.distributed.run.get_args_parser``), if this torch has it."""
    try:
        # Heavy: torch.distributed.run imports the elastic agent; only torchrun launches need it.
        from torch.distributed import run
    except ImportError:  # a torch without torch.distributed.run: nothing to compare against
        return None
    make = getattr(run, "get_args_parser", None)
    return make() if callable(make) else None


def _options(parser: argparse.ArgumentParser) -> dict[str, bool]:
    """Torchrun's long options, each mapped to whether it takes a value."""
    return {
        option: action.nargs != 0
        for action in parser._actions  # argparse has no public list of its actions
        for option in action.option_strings
        if option.startswith("--")
    }


def torchrun_prefix_pitfalls(
    argv: Sequence[str], parser: argparse.ArgumentParser | None = None
) -> list[Pitfall]:
    """Script options on a torchrun command line that are prefixes of torchrun's own options.

    ``argv`` is what follows ``torchrun``. Options after the script that abbreviate a torchrun
    option are taken by torchrun (or refused as ambiguous), depending on the Python version;
    options after a ``--`` are safe.

    Example:
        >>> found = torchrun_prefix_pitfalls(["--nproc-per-node=2", "train.py", "--run"])
        >>> found[0].name
        'torchrun-prefix'
        >>> torchrun_prefix_pitfalls(["train.py", "--", "--run"])
        []
    """
    parser = parser or _torchrun_parser()
    if parser is None:
        return []
    options = _options(parser)
    index = 0
    while index < len(argv):  # skip torchrun's own options to find the script
        word = argv[index]
        if word == "--":
            return []  # everything after it goes to the script untouched
        if not word.startswith("-"):
            break
        name = word.split("=", 1)[0]
        takes_value = options.get(name, False)
        index += 2 if takes_value and "=" not in word else 1
    script, rest = argv[index : index + 1], list(argv[index + 1 :])
    found = []
    for word in rest:
        if word == "--":
            break
        name = word.split("=", 1)[0]
        if not name.startswith("--") or name in options:
            continue
        matches = sorted(option for option in options if option.startswith(name))
        if matches:
            found.append(
                Pitfall(
                    name="torchrun-prefix",
                    problem=(
                        f"the script option {name} is a prefix of torchrun's own "
                        f"{' / '.join(matches)}: argparse accepts abbreviations, so torchrun takes "
                        f"{name} as its own (or refuses it as ambiguous) and "
                        f"{script[0] if script else 'the script'} may never see it"
                    ),
                    fix=(
                        "put `--` between the script and its options: torchrun [options] "
                        f"{script[0] if script else 'train.py'} -- {name} ..."
                    ),
                )
            )
    return found


#: ``(env, backend) -> InterfacePick | None``: how init picks gloo's interface (tests replace it).
PickInterface = Callable[[LaunchEnv, "str | None"], "InterfacePick | None"]


def _gloo_pitfall(env: LaunchEnv, backend: str | None, pick: PickInterface) -> Pitfall | None:
    if not is_multi_node(env) or (backend is not None and "gloo" not in backend):
        return None
    names = [n.strip() for n in (env.gloo_socket_ifname or "").split(",") if n.strip()]
    fix = "export GLOO_SOCKET_IFNAME=<the interface that routes to the other nodes, e.g. eth0>"
    if names and all(n != "lo" for n in names):
        missing = [n for n in names if not Path("/sys/class/net", n).exists()]
        if not missing or not Path("/sys/class/net").exists():
            return None
        problem = f"GLOO_SOCKET_IFNAME={env.gloo_socket_ifname} names no interface of this host"
    elif names:
        problem = (
            f"GLOO_SOCKET_IFNAME={env.gloo_socket_ifname} binds gloo to loopback in a "
            f"{env.num_nodes}-node job: the other nodes cannot reach it"
        )
    else:
        problem = (
            f"gloo in a {env.num_nodes}-node job without GLOO_SOCKET_IFNAME: gloo binds the "
            "address the host name resolves to (often 127.0.0.1), and peers then dial their "
            "own loopback (measured: connectFullMesh fails after 82 s)"
        )
        chosen = pick(env, backend)
        if chosen is not None and chosen.name is not None:
            problem += (
                f"; init_distributed sets GLOO_SOCKET_IFNAME={chosen.name} for its own process "
                f"({chosen.reason})"
            )
            fix = f"none needed; to choose another interface, {fix}"
        elif chosen is not None:
            problem += f"; init_distributed found no interface to pick: {chosen.reason}"
    return Pitfall(name="gloo-interface", problem=problem, fix=fix)


def launch_pitfalls(
    env: LaunchEnv,
    *,
    backend: str | None = None,
    argv: Sequence[str] | None = None,
    pick: PickInterface = pick_gloo_interface,
) -> list[Pitfall]:
    """Every launch pitfall this process's launch shows.

    ``argv`` is torchrun's command line after ``torchrun`` (default: read from the parent
    process when it is torchrun); ``backend`` the collective backend (None: assume gloo may be
    used); ``pick`` how init chooses gloo's interface when ``GLOO_SOCKET_IFNAME`` is unset (the
    gloo finding names its choice; tests pass a fake to avoid asking the host's routing table).

    Example:
        >>> launch_pitfalls(LaunchEnv.from_environ({}), argv=[])
        []
    """
    found: list[Pitfall] = []
    if env.is_distributed and env.world_size > 1 and not env.master_addr:
        found.append(
            Pitfall(
                name="no-rendezvous-host",
                problem=(
                    f"the {env.launcher} launch of {env.world_size} processes gives no "
                    "rendezvous host (MASTER_ADDR is not set)"
                ),
                fix="set MASTER_ADDR to rank 0's host and MASTER_PORT to a free port",
            )
        )
    gloo = _gloo_pitfall(env, backend, pick)
    if gloo is not None:
        found.append(gloo)
    if argv is None and env.launcher == "torchrun" and sys.platform.startswith("linux"):
        argv = launcher_argv()
    if argv:
        found += torchrun_prefix_pitfalls(argv)
    return found
