"""The rules every launcher's values obey, and the values that carry their variable's name.

``_env`` detects the launcher, and ``_contract`` or
``_schedulers`` reads its variables; all three speak the small vocabulary defined
here, so that every error can name the variable, its value and the rule it breaks. A value keeps
its name from the moment it is read::

    rank = need_int(env, "SLURM_PROCID", "srun sets it for every task")
    check_processes(rank, local_rank, world, local_world)   # raises LaunchEnvError, naming them

Nothing here reads ``os.environ``: every function takes the mapping it is given.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

__all__ = [
    "DEFAULT_MASTER_PORT",
    "INTEGER",
    "Draft",
    "LaunchEnvError",
    "Master",
    "NamedInt",
    "ReadText",
    "check_layout",
    "check_port",
    "check_processes",
    "default_port",
    "explicit_master",
    "first_set",
    "get_int",
    "need_int",
    "node_layout",
    "unset_master",
]

DEFAULT_MASTER_PORT = 29500  # torch's own default for MASTER_PORT
INTEGER = re.compile(r"-?[0-9]+")
_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"

ReadText = Callable[[str], "str | None"]
"""Return a file's text, or ``None`` when it does not exist (LSF's ``LSB_DJOB_RANKFILE``)."""


class LaunchEnvError(ValueError):
    """The launcher's environment breaks a rule; the message names variable, value and rule.

    ``variable`` is the first variable named, when there is one.

    Example:
        >>> from distcompat import LaunchEnv, LaunchEnvError
        >>> try:
        ...     LaunchEnv.from_environ({"RANK": "abc", "WORLD_SIZE": "2"})
        ... except LaunchEnvError as err:
        ...     print(err, "/", err.variable)
        RANK='abc' is not an integer / RANK
    """

    def __init__(self, message: str, *, variable: str | None = None) -> None:
        super().__init__(message)
        self.variable = variable


class NamedInt(NamedTuple):
    """An integer with how errors name it and what ``LaunchEnv.sources`` records for it."""

    value: int
    label: str  # how errors name it: "SLURM_PROCID", "SLURM_STEP_TASKS_PER_NODE[node 2]"
    source: str  # what LaunchEnv.sources records


class Master(NamedTuple):
    """The rendezvous: the store's address and port, and whether an agent already hosts it.

    A launcher's parser builds the first four fields; :func:`explicit_master` fills in the last
    two for every launcher with a master, and the single-process launcher sets them itself.
    """

    addr: str | None
    addr_source: str
    port: int | None
    port_source: str
    agent_store: bool = False
    agent_store_source: str = ""


@dataclass(slots=True)
class Draft:
    """What a launcher's parser found, before the final checks turn it into a ``LaunchEnv``."""

    rank: NamedInt
    local_rank: NamedInt
    world_size: NamedInt
    local_world_size: NamedInt
    node_rank: NamedInt
    num_nodes: NamedInt
    master: Master


# --- reading single variables ----------------------------------------------------------------


def get_int(env: Mapping[str, str], name: str) -> NamedInt | None:
    """Parse a non-negative integer variable; ``None`` when it is not set."""
    text = env.get(name)
    if text is None:
        return None
    if not INTEGER.fullmatch(text):
        raise LaunchEnvError(f"{name}={text!r} is not an integer", variable=name)
    if int(text) < 0:
        raise LaunchEnvError(f"{name}={int(text)} is negative (must be >= 0)", variable=name)
    return NamedInt(int(text), name, name)


def need_int(env: Mapping[str, str], name: str, why: str) -> NamedInt:
    """Parse a non-negative integer variable that must be set; ``why`` says who sets it."""
    value = get_int(env, name)
    if value is None:
        raise LaunchEnvError(f"{name} is not set ({why})", variable=name)
    return value


def first_set(env: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    """Return the first of ``names`` that is set, or ``None``."""
    return next((name for name in names if name in env), None)


def check_port(value: int, label: str) -> int:
    """Return ``value`` if it is a usable TCP port for a master, else raise naming ``label``."""
    if not 1 <= value <= 65535:
        raise LaunchEnvError(
            f"{label}={value} is outside 1..65535 (a master port must be a usable TCP port; "
            "0 means 'any free port', which the other ranks cannot know)",
            variable=label,
        )
    return value


# --- layout rules ----------------------------------------------------------------------------


def check_processes(
    rank: NamedInt, local_rank: NamedInt, world: NamedInt, local_world: NamedInt
) -> None:
    """Check that the rank fits the world and the local rank fits the node."""
    if world.value < 1:
        raise LaunchEnvError(
            f"{world.label}={world.value} is below 1 (a world has at least one process)",
            variable=world.label,
        )
    if rank.value >= world.value:
        raise LaunchEnvError(
            f"{rank.label}={rank.value} is not below {world.label}={world.value} "
            f"(rank must be in [0, {world.label}))",
            variable=rank.label,
        )
    if not 1 <= local_world.value <= world.value:
        raise LaunchEnvError(
            f"{local_world.label}={local_world.value} is not in [1, {world.label}={world.value}] "
            "(a node runs at least one process and at most all of them)",
            variable=local_world.label,
        )
    if local_rank.value >= local_world.value:
        raise LaunchEnvError(
            f"{local_rank.label}={local_rank.value} is not below "
            f"{local_world.label}={local_world.value} "
            "(local rank must be in [0, local world size))",
            variable=local_rank.label,
        )


def check_layout(
    rank: NamedInt,
    local_rank: NamedInt,
    world: NamedInt,
    local_world: NamedInt,
    node: NamedInt,
    nodes: NamedInt,
) -> None:
    """Check the processes, then that the node count and node rank fit them."""
    check_processes(rank, local_rank, world, local_world)
    most = world.value - local_world.value + 1  # every other node runs at least one process
    if not 1 <= nodes.value <= most:
        raise LaunchEnvError(
            f"{nodes.label}={nodes.value} is not in [1, {most}] ({world.label}={world.value} "
            f"processes, {local_world.label}={local_world.value} of them on this node and at "
            "least one on every other node)",
            variable=nodes.label,
        )
    if node.value >= nodes.value:
        raise LaunchEnvError(
            f"{node.label}={node.value} is not below {nodes.label}={nodes.value} "
            "(node rank must be in [0, number of nodes))",
            variable=node.label,
        )


def node_layout(
    rank: NamedInt,
    local_rank: NamedInt,
    world: NamedInt,
    local_world: NamedInt,
    node: NamedInt | None,
    nodes: NamedInt | None,
    hint: str,
) -> tuple[NamedInt, NamedInt]:
    """Fill in the node rank and count a launcher did not give, assuming a uniform layout."""
    check_processes(rank, local_rank, world, local_world)
    if nodes is None:
        if world.value == local_world.value:
            nodes = NamedInt(1, "num_nodes", f"1: {local_world.label} == {world.label}")
        elif world.value % local_world.value:
            raise LaunchEnvError(
                f"{world.label}={world.value} is not a multiple of "
                f"{local_world.label}={local_world.value}, so the node count cannot be derived "
                f"(nodes run different numbers of processes); {hint}",
                variable=world.label,
            )
        else:
            nodes = NamedInt(
                world.value // local_world.value,
                f"num_nodes ({world.label} // {local_world.label})",
                f"derived: {world.label} // {local_world.label}, assuming every node runs "
                f"{local_world.label} processes",
            )
    if node is not None:
        return node, nodes
    if nodes.value == 1:
        return NamedInt(0, "node_rank", "0: single node"), nodes
    if nodes.value * local_world.value != world.value:
        raise LaunchEnvError(
            f"{nodes.label}={nodes.value} nodes of {local_world.label}={local_world.value} "
            f"processes do not make {world.label}={world.value}, so the node rank cannot be "
            f"derived; {hint}",
            variable=nodes.label,
        )
    if local_rank.value != rank.value % local_world.value:
        raise LaunchEnvError(
            f"{local_rank.label}={local_rank.value} is not {rank.label}={rank.value} modulo "
            f"{local_world.label}={local_world.value} (ranks are not placed node by node), so "
            f"the node rank cannot be derived; {hint}",
            variable=local_rank.label,
        )
    derived = NamedInt(
        rank.value // local_world.value,
        f"node_rank ({rank.label} // {local_world.label})",
        f"derived: {rank.label} // {local_world.label}, assuming ranks are placed node by node "
        "with the same count on every node",
    )
    return derived, nodes


# --- the rendezvous: master address, port and who hosts the store ----------------------------


def explicit_master(env: Mapping[str, str], fallback: Master) -> Master:
    """Apply the variables torch's env:// rendezvous reads over what the launcher implies.

    ``MASTER_ADDR`` and ``MASTER_PORT``, when set, replace the launcher's master, and
    ``TORCHELASTIC_USE_AGENT_STORE`` says whether an agent already hosts the store there. torch
    honours that last one whatever started the process, so every launcher with a master reads
    it here, once.
    """
    agent_store, agent_store_source = _agent_store(env)
    addr, addr_source, port, port_source = fallback[:4]
    if "MASTER_ADDR" in env:
        addr, addr_source = env["MASTER_ADDR"], "MASTER_ADDR"
        if not addr:
            raise LaunchEnvError(
                "MASTER_ADDR='' is empty (it must name a host)", variable="MASTER_ADDR"
            )
    given = get_int(env, "MASTER_PORT")
    if given is not None:
        port, port_source = check_port(given.value, "MASTER_PORT"), "MASTER_PORT"
    return Master(addr, addr_source, port, port_source, agent_store, agent_store_source)


def _agent_store(env: Mapping[str, str]) -> tuple[bool, str]:
    """Read ``TORCHELASTIC_USE_AGENT_STORE``; torch's ``_create_c10d_store`` tests ``== "True"``.

    Any spelling but ``'True'`` and ``'False'`` raises, since torch would silently read it as False.
    """
    store = env.get(_AGENT_STORE)
    if store not in (None, "True", "False"):
        raise LaunchEnvError(
            f"{_AGENT_STORE}={store!r} is neither 'True' nor 'False' (torch compares it with "
            "the exact string 'True')",
            variable=_AGENT_STORE,
        )
    if store == "True":
        return True, f"{_AGENT_STORE}='True': the agent hosts the TCPStore, every rank connects"
    return False, f"False: {_AGENT_STORE} is not 'True', rank 0 hosts the TCPStore"


def unset_master(env: Mapping[str, str], why: str) -> Master:
    """Return the master a launcher does not name, which only the rendezvous variables set."""
    return explicit_master(env, Master(None, f"not set ({why})", None, f"not set ({why})"))


def default_port(master: Master, why: str) -> Master:
    """Give a known master address torch's default port when nothing chose one."""
    if master.addr is None or master.port is not None:
        return master
    return master._replace(
        port=DEFAULT_MASTER_PORT, port_source=f"default {DEFAULT_MASTER_PORT} ({why})"
    )
