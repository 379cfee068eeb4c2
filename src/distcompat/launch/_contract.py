"""Read the launchers that speak torch's env:// contract: torchrun, Ray Train, Azure ML, Kubeflow.

``_env`` detects the launcher and calls one parser here; it reads ``RANK``,
``WORLD_SIZE`` and their companions from the mapping it is given (never ``os.environ``) into a
:class:`~distcompat.launch._rules.Draft`, whose values carry their variable's name. The process no
launcher started is described here too, as the contract's absence.

Example:
    >>> draft = parse_torchrun({"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2",
    ...     "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"}, lambda path: None)
    >>> draft.rank, draft.num_nodes.source
    (NamedInt(value=1, label='RANK', source='RANK'), '1: LOCAL_WORLD_SIZE == WORLD_SIZE')
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping

from distcompat.launch._rules import (
    INTEGER,
    Draft,
    LaunchEnvError,
    Master,
    NamedInt,
    ReadText,
    check_processes,
    get_int,
    need_int,
    node_layout,
    unset_master,
)

__all__ = ["parse_env", "parse_kubeflow", "parse_none", "parse_torchrun"]


def parse_torchrun(env: Mapping[str, str], _read: ReadText) -> Draft:
    """Read a torchrun worker; under an elastic agent the node rank and master must be set."""
    run_id = env.get("TORCHELASTIC_RUN_ID")
    why = "torchrun sets it for every worker"
    rank, local_rank = need_int(env, "RANK", why), need_int(env, "LOCAL_RANK", why)
    world = need_int(env, "WORLD_SIZE", why)
    local_world = need_int(env, "LOCAL_WORLD_SIZE", why)
    node = get_int(env, "GROUP_RANK")
    if run_id is not None:
        node = need_int(env, "GROUP_RANK", why)
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if name not in env:
                raise LaunchEnvError(f"{name} is not set ({why})", variable=name)
    hint = "torchrun sets GROUP_WORLD_SIZE; set it to the number of nodes"
    node, nodes = node_layout(
        rank, local_rank, world, local_world, node, get_int(env, "GROUP_WORLD_SIZE"), hint
    )
    master = unset_master(env, "torchrun did not set it")
    return Draft(rank, local_rank, world, local_world, node, nodes, master)


def _need_rank_and_world(env: Mapping[str, str]) -> tuple[NamedInt, NamedInt]:
    for have, lack in (("RANK", "WORLD_SIZE"), ("WORLD_SIZE", "RANK")):
        if have in env and lack not in env:
            raise LaunchEnvError(
                f"{have}={env[have]!r} is set but {lack} is not set "
                "(the env:// contract needs both)",
                variable=lack,
            )
    return need_int(env, "RANK", "env://"), need_int(env, "WORLD_SIZE", "env://")


def parse_env(env: Mapping[str, str], who: str, node_count_var: str | None) -> Draft:
    """Read the env:// contract set by ``who``, whose node count (if any) is ``node_count_var``."""
    rank, world = _need_rank_and_world(env)
    local_rank, local_world = get_int(env, "LOCAL_RANK"), get_int(env, "LOCAL_WORLD_SIZE")
    node, other = get_int(env, "NODE_RANK"), get_int(env, "GROUP_RANK")
    if node is not None and other is not None and node.value != other.value:
        raise LaunchEnvError(
            f"NODE_RANK={node.value} and GROUP_RANK={other.value} disagree (both name this "
            "node's rank)",
            variable="NODE_RANK",
        )
    node = node or other
    nodes = get_int(env, "GROUP_WORLD_SIZE")
    if nodes is None and node_count_var is not None:
        nodes = get_int(env, node_count_var)
    if local_world is not None and local_rank is None:
        raise LaunchEnvError(
            f"LOCAL_WORLD_SIZE={local_world.value} is set but LOCAL_RANK is not set",
            variable="LOCAL_RANK",
        )
    if local_world is None and nodes is not None:
        if nodes.value < 1 or world.value % nodes.value:
            raise LaunchEnvError(
                f"{nodes.label}={nodes.value} does not divide WORLD_SIZE={world.value}, so "
                "LOCAL_WORLD_SIZE cannot be derived; set LOCAL_WORLD_SIZE",
                variable=nodes.label,
            )
        local_world = NamedInt(
            world.value // nodes.value,
            f"local_world_size (WORLD_SIZE // {nodes.label})",
            f"derived: WORLD_SIZE // {nodes.label}, assuming every node runs as many processes",
        )
        if local_rank is None and nodes.value == 1:
            local_rank = NamedInt(rank.value, "RANK", f"RANK: {nodes.label}=1, a single node")
        elif local_rank is None:
            raise LaunchEnvError(
                f"LOCAL_RANK is not set and {nodes.label}={nodes.value} nodes",
                variable="LOCAL_RANK",
            )
    if local_world is None:
        return _single_node(env, rank, world, local_rank, node, who)
    assert local_rank is not None  # both set, or derived above
    hint = "set NODE_RANK and GROUP_WORLD_SIZE"
    node, nodes = node_layout(rank, local_rank, world, local_world, node, nodes, hint)
    master = unset_master(env, f"{who} did not set it")
    return Draft(rank, local_rank, world, local_world, node, nodes, master)


def _single_node(
    env: Mapping[str, str],
    rank: NamedInt,
    world: NamedInt,
    local_rank: NamedInt | None,
    node: NamedInt | None,
    who: str,
) -> Draft:
    """Accept a missing LOCAL_WORLD_SIZE only where one node is the only consistent reading."""
    doubts = []
    if node is not None and node.value != 0:
        doubts.append(f"{node.label}={node.value}")
    if local_rank is not None and local_rank.value != rank.value:
        doubts.append(f"LOCAL_RANK={local_rank.value} differs from RANK={rank.value}")
    addr = env.get("MASTER_ADDR")
    if world.value > 1 and addr is not None and not _is_loopback(addr):
        doubts.append(f"MASTER_ADDR={addr!r} is not a loopback address")
    if doubts:
        raise LaunchEnvError(
            f"LOCAL_WORLD_SIZE is not set and the job may span nodes ({'; '.join(doubts)}); "
            "set LOCAL_RANK and LOCAL_WORLD_SIZE",
            variable="LOCAL_WORLD_SIZE",
        )
    why = (
        "assumed single node: LOCAL_WORLD_SIZE not set, no node rank above 0, MASTER_ADDR "
        "unset or loopback"
    )
    local_world = NamedInt(world.value, "WORLD_SIZE", f"WORLD_SIZE ({why})")
    local_rank = local_rank or NamedInt(rank.value, "RANK", f"RANK ({why})")
    node = node or NamedInt(0, "node_rank", f"0 ({why})")
    nodes = NamedInt(1, "num_nodes", f"1 ({why})")
    check_processes(rank, local_rank, world, local_world)
    master = unset_master(env, f"{who} did not set it")
    return Draft(rank, local_rank, world, local_world, node, nodes, master)


def _is_loopback(addr: str) -> bool:
    if addr.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def parse_kubeflow(env: Mapping[str, str], _read: ReadText) -> Draft:
    """Read a Kubeflow PyTorchJob pod without torchrun: one process per pod."""
    rank, world = _need_rank_and_world(env)
    per_pod = env.get("PET_NPROC_PER_NODE", "1")
    if INTEGER.fullmatch(per_pod) and int(per_pod) > 1:
        raise LaunchEnvError(
            f"PET_NPROC_PER_NODE={per_pod} but torchrun did not start this process (no "
            f"TORCHELASTIC_RUN_ID): the Kubeflow PyTorchJob expects `torchrun` in each pod to "
            f"start {per_pod} processes, while RANK={rank.value} is the pod index; run torchrun "
            "inside the pod",
            variable="PET_NPROC_PER_NODE",
        )
    pod = "Kubeflow PyTorchJob runs one process per pod; RANK and WORLD_SIZE count pods"
    return Draft(
        rank,
        NamedInt(0, "local_rank", f"0 ({pod})"),
        world,
        NamedInt(1, "local_world_size", f"1 ({pod})"),
        NamedInt(rank.value, "RANK", f"RANK ({pod})"),
        NamedInt(world.value, "WORLD_SIZE", f"WORLD_SIZE ({pod})"),
        unset_master(env, "the PyTorchJob operator did not set it"),
    )


# --- no launcher -----------------------------------------------------------------------------


def parse_none(env: Mapping[str, str], _read: ReadText) -> Draft:
    """Describe a process no launcher started: one process, no master, no store to share."""
    single = "single process"
    return Draft(
        NamedInt(0, "rank", f"0 ({single})"),
        NamedInt(0, "local_rank", f"0 ({single})"),
        NamedInt(1, "world_size", f"1 ({single})"),
        NamedInt(1, "local_world_size", f"1 ({single})"),
        NamedInt(0, "node_rank", f"0 ({single})"),
        NamedInt(1, "num_nodes", f"1 ({single})"),
        Master(
            None,
            f"None ({single}: no master)",
            None,
            f"None ({single}: no master)",
            False,
            f"False ({single}: no store to share)",
        ),
    )
