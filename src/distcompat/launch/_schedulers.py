"""Read schedulers and MPI, which spell a task's place their own way: Slurm, MPI, LSF, SageMaker.

``_env`` detects the launcher and calls one parser here. None of these launchers
sets ``MASTER_ADDR``, so each parser derives the master from what the job exports (its host
list, Azure ML's master variable, loopback on a single node) and the port from the job ID or the
platform's convention, unless ``MASTER_ADDR`` / ``MASTER_PORT`` are set.
MPI and jsrun export no node index, so their node rank is derived, assuming a uniform layout.

Example:
    >>> draft = parse_slurm({"SLURM_JOB_ID": "1234567", "SLURM_PROCID": "1",
    ...     "SLURM_LOCALID": "1", "SLURM_NODEID": "0", "SLURM_STEP_NUM_TASKS": "2",
    ...     "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_STEP_NODELIST": "gpu7"}, lambda path: None)
    >>> draft.rank.value, draft.master.addr, draft.master.port
    (1, 'gpu7', 19567)
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import NamedTuple, TypeVar

from distcompat.launch import _slurm
from distcompat.launch._rules import (
    INTEGER,
    Draft,
    LaunchEnvError,
    Master,
    NamedInt,
    ReadText,
    check_port,
    default_port,
    explicit_master,
    first_set,
    get_int,
    need_int,
    node_layout,
)

__all__ = ["LSF", "VarNames", "parse_lsf", "parse_mpi", "parse_sagemaker", "parse_slurm"]

T = TypeVar("T")

SAGEMAKER_MASTER_PORT = 7777  # sagemaker-training-toolkit's torch_distributed.MASTER_PORT
SLURM_PORT_BASE = 15000  # Lightning: 15000 + last 4 digits of SLURM_JOB_ID
LSF_PORT_BASE = 10000  # Lightning: 10000 + LSB_JOBID % 1000
#: Open MPI on one host: 20000 + the job family % 10000, below Linux's ephemeral ports (32768+),
#: so two mpirun jobs on one host do not both default to 29500 (measured: the second one failed).
OPENMPI_PORT_BASE = 20000
OPENMPI_JOBID = "OMPI_MCA_ess_base_jobid"


class VarNames(NamedTuple):
    """How an MPI-style launcher spells rank, world size, local rank and local world size."""

    rank: str
    size: str
    local_rank: str
    local_size: str


LSF = VarNames(
    "JSM_NAMESPACE_RANK",
    "JSM_NAMESPACE_SIZE",
    "JSM_NAMESPACE_LOCAL_RANK",
    "JSM_NAMESPACE_LOCAL_SIZE",
)
_MPI_HINT = (
    "start the same number of processes on every node with ranks placed node by node "
    "(e.g. mpirun --map-by ppr:N:node), or launch with torchrun or srun"
)


# --- Slurm (srun) ---------------------------------------------------------------------------------


def parse_slurm(env: Mapping[str, str], _read: ReadText) -> Draft:
    """Read an srun task: counts from the tasks-per-node list, the master from the node list."""
    why = "srun sets it for every task"
    rank = need_int(env, "SLURM_PROCID", why)
    local_rank = need_int(env, "SLURM_LOCALID", why)
    node = need_int(env, "SLURM_NODEID", why)
    world_var = first_set(env, ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"))
    world = need_int(env, world_var or "SLURM_STEP_NUM_TASKS", why)
    counts_var = first_set(env, ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"))
    if counts_var is not None:
        text = env[counts_var]
        counts = _expand(counts_var, text, _slurm.expand_tasks_per_node, "tasks-per-node list")
        if node.value >= len(counts):
            raise LaunchEnvError(
                f"SLURM_NODEID={node.value} is out of range for {counts_var}={text!r}, which "
                f"lists {len(counts)} node(s)",
                variable="SLURM_NODEID",
            )
        if sum(counts) != world.value:
            raise LaunchEnvError(
                f"{counts_var}={text!r} adds up to {sum(counts)} tasks, not "
                f"{world.label}={world.value}",
                variable=counts_var,
            )
        local_world = NamedInt(
            counts[node.value],
            f"{counts_var}[node {node.value}]",
            f"{counts_var}={text!r}, entry SLURM_NODEID={node.value}",
        )
        nodes = NamedInt(
            len(counts), f"len({counts_var})", f"{counts_var}={text!r}: {len(counts)} nodes"
        )
    else:
        local_world = need_int(env, "SLURM_NTASKS_PER_NODE", "no SLURM_STEP_TASKS_PER_NODE either")
        nodes_var = first_set(env, ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"))
        count = None if nodes_var is None else get_int(env, nodes_var)
        hint = "set SLURM_STEP_TASKS_PER_NODE"
        node, nodes = node_layout(rank, local_rank, world, local_world, node, count, hint)
    master = explicit_master(env, _slurm_master(env, counts_var))
    return Draft(rank, local_rank, world, local_world, node, nodes, master)


def _expand(variable: str, text: str, expand: Callable[[str], list[T]], what: str) -> list[T]:
    """Expand a compressed Slurm string, naming the variable when it is malformed."""
    try:
        return expand(text)
    except _slurm.SlurmFormatError as err:
        raise LaunchEnvError(
            f"{variable}={text!r} is not a Slurm {what}: {err.problem} at position {err.position}",
            variable=variable,
        ) from err


def _slurm_master(env: Mapping[str, str], counts_var: str | None) -> Master:
    addr, addr_source = None, "not set (no SLURM_*NODELIST; set MASTER_ADDR)"
    list_var = first_set(env, ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"))
    if list_var is not None:
        text = env[list_var]
        hosts = _expand(list_var, text, _slurm.expand_hostlist, "host list")
        counts_text = env.get("SLURM_STEP_TASKS_PER_NODE")
        if list_var == "SLURM_STEP_NODELIST" and counts_var == "SLURM_STEP_TASKS_PER_NODE":
            count = len(_slurm.expand_tasks_per_node(counts_text or ""))
            if count != len(hosts):
                raise LaunchEnvError(
                    f"SLURM_STEP_NODELIST={text!r} names {len(hosts)} host(s) but "
                    f"SLURM_STEP_TASKS_PER_NODE={counts_text!r} lists {count} node(s)",
                    variable="SLURM_STEP_NODELIST",
                )
        addr, addr_source = hosts[0], f"first host of {list_var}={text!r}"
    port: int | None = None
    port_source = "not set (no SLURM_JOB_ID to derive it from; set MASTER_PORT)"
    job_var = first_set(env, ("SLURM_JOB_ID", "SLURM_JOBID"))
    if job_var is not None:
        job = need_int(env, job_var, "")
        port = check_port(SLURM_PORT_BASE + int(str(job.value)[-4:]), f"derived from {job_var}")
        port_source = (
            f"derived from {job_var}={job.value}: {SLURM_PORT_BASE} + last 4 digits "
            "(Lightning's convention)"
        )
    return Master(addr, addr_source, port, port_source)


# --- MPI: Open MPI, MVAPICH2, MPICH / Intel MPI (Hydra) -------------------------------------------


def parse_mpi(env: Mapping[str, str], launcher: str, names: VarNames, azure: str | None) -> Draft:
    """Read an MPI rank spelled by ``names``; ``azure`` is Azure ML's master variable, if set."""
    why = f"{launcher} sets it for every rank"
    rank, world = need_int(env, names.rank, why), need_int(env, names.size, why)
    local_rank = need_int(env, names.local_rank, why)
    local_world = need_int(env, names.local_size, why)
    node, nodes = node_layout(rank, local_rank, world, local_world, None, None, _MPI_HINT)
    if azure is not None:
        master = _azure_mpi_master(env, azure)
    elif world.value == local_world.value:
        master = Master("127.0.0.1", "127.0.0.1: single node, every rank is on this host", None, "")
        if launcher == "openmpi":
            master = _openmpi_port(env, master)
    else:
        unset = "not set: MPI does not export a master {0}; set MASTER_{1}"
        master = Master(None, unset.format("address", "ADDR"), None, unset.format("port", "PORT"))
    master = explicit_master(env, master)
    return Draft(
        rank,
        local_rank,
        world,
        local_world,
        node,
        nodes,
        default_port(master, "MASTER_PORT not set"),
    )


def _openmpi_port(env: Mapping[str, str], master: Master) -> Master:
    """Derive a per-job port from Open MPI's job id (its upper 16 bits name the mpirun)."""
    text = env.get(OPENMPI_JOBID, "")
    if not re.fullmatch(r"[0-9]+", text):
        return master  # not exported, or not a number: torch's default port, as before
    family = int(text) >> 16
    port = OPENMPI_PORT_BASE + family % 10000
    source = (
        f"derived from {OPENMPI_JOBID}={text}: {OPENMPI_PORT_BASE} + job family "
        f"({family}) % 10000, so concurrent mpirun jobs on one host differ"
    )
    return master._replace(port=port, port_source=source)


def _azure_mpi_master(env: Mapping[str, str], var: str) -> Master:
    text = env[var]
    if var == "AZ_BATCHAI_MPI_MASTER_NODE":
        if not text:
            raise LaunchEnvError(f"{var}='' is empty (it must name a host)", variable=var)
        return Master(text, var, None, "")
    host, _, port = text.rpartition(":")
    if not host or not re.fullmatch(r"[0-9]+", port):
        raise LaunchEnvError(f"{var}={text!r} is not HOST:PORT", variable=var)
    if not 1 <= int(port) <= 65535:
        raise LaunchEnvError(f"{var}={text!r} has port {int(port)} outside 1..65535", variable=var)
    return Master(host, f"{var}={text!r}", int(port), f"{var}={text!r}")


# --- LSF (jsrun) ----------------------------------------------------------------------------------


def parse_lsf(env: Mapping[str, str], read: ReadText) -> Draft:
    """Read a jsrun task; hosts come from ``LSB_DJOB_RANKFILE`` or ``LSB_MCPU_HOSTS``."""
    why = "jsrun sets it for every task"
    rank, world = need_int(env, LSF.rank, why), need_int(env, LSF.size, why)
    local_rank = need_int(env, LSF.local_rank, why)
    local_world = get_int(env, LSF.local_size)
    hosts, hosts_from = _lsf_hosts(env, read)
    nodes = None
    if local_world is None:
        if not hosts:
            raise LaunchEnvError(
                f"{LSF.local_size} is not set and neither LSB_DJOB_RANKFILE nor LSB_MCPU_HOSTS "
                "lists the hosts, so the local world size cannot be derived",
                variable=LSF.local_size,
            )
        distinct = len(dict.fromkeys(hosts))
        if world.value % distinct:
            raise LaunchEnvError(
                f"{LSF.size}={world.value} is not a multiple of the {distinct} compute hosts in "
                f"{hosts_from}, so the local world size cannot be derived; set {LSF.local_size}",
                variable=LSF.size,
            )
        nodes = NamedInt(
            distinct, f"hosts in {hosts_from}", f"{hosts_from}: {distinct} compute hosts"
        )
        local_world = NamedInt(
            world.value // distinct,
            f"local_world_size ({LSF.size} // hosts)",
            f"derived: {LSF.size} // {distinct} hosts, assuming as many tasks on every host",
        )
    hint = "start the same number of tasks on every host, or set MASTER_ADDR and use torchrun"
    node, nodes = node_layout(rank, local_rank, world, local_world, None, nodes, hint)
    addr, addr_source = None, "not set (no LSB_DJOB_RANKFILE or LSB_MCPU_HOSTS; set MASTER_ADDR)"
    if hosts:
        addr, addr_source = hosts[0], f"first compute host in {hosts_from} (launch node skipped)"
    port, port_source = None, "not set (no LSB_JOBID to derive it from; set MASTER_PORT)"
    job = get_int(env, "LSB_JOBID")
    if job is not None:
        port = check_port(LSF_PORT_BASE + job.value % 1000, "derived from LSB_JOBID")
        port_source = (
            f"derived from LSB_JOBID={job.value}: {LSF_PORT_BASE} + LSB_JOBID % 1000 "
            "(Lightning's convention)"
        )
    master = explicit_master(env, Master(addr, addr_source, port, port_source))
    return Draft(rank, local_rank, world, local_world, node, nodes, master)


def _lsf_hosts(env: Mapping[str, str], read: ReadText) -> tuple[list[str], str]:
    """Return the compute hosts (the launch node, listed first, is dropped) and where from."""
    path = env.get("LSB_DJOB_RANKFILE")
    text = None
    if path:
        try:
            text = read(path)
        except OSError as err:
            raise LaunchEnvError(
                f"LSB_DJOB_RANKFILE={path!r} cannot be read ({err})", variable="LSB_DJOB_RANKFILE"
            ) from err
    if path and text is not None:
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if len(lines) < 2:
            raise LaunchEnvError(
                f"LSB_DJOB_RANKFILE={path!r} lists {len(lines)} host line(s); it must list the "
                "launch node and then the compute hosts",
                variable="LSB_DJOB_RANKFILE",
            )
        return lines[1:], f"LSB_DJOB_RANKFILE={path!r}"
    mcpu = env.get("LSB_MCPU_HOSTS")
    if mcpu is None:
        return [], ""
    tokens = mcpu.split()
    if len(tokens) < 4 or len(tokens) % 2 or not all(INTEGER.fullmatch(t) for t in tokens[1::2]):
        raise LaunchEnvError(
            f"LSB_MCPU_HOSTS={mcpu!r} is not 'launchnode n host1 n1 host2 n2 ...'",
            variable="LSB_MCPU_HOSTS",
        )
    return tokens[2::2], f"LSB_MCPU_HOSTS={mcpu!r}"


# --- SageMaker ------------------------------------------------------------------------------------


def parse_sagemaker(env: Mapping[str, str], _read: ReadText) -> Draft:
    """Read a SageMaker host: one process per host, ranked by its place in ``SM_HOSTS``."""
    text = env.get("SM_HOSTS")
    current = env.get("SM_CURRENT_HOST")
    if text is None or current is None:
        have, lack = (
            ("SM_HOSTS", "SM_CURRENT_HOST") if current is None else ("SM_CURRENT_HOST", "SM_HOSTS")
        )
        raise LaunchEnvError(f"{have}={env[have]!r} is set but {lack} is not set", variable=lack)
    try:
        hosts = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        hosts = None
    if not (isinstance(hosts, list) and hosts and all(isinstance(h, str) and h for h in hosts)):
        raise LaunchEnvError(
            f"SM_HOSTS={text!r} is not a JSON list of host names", variable="SM_HOSTS"
        )
    if len(set(hosts)) != len(hosts) or current not in hosts:
        problem = (
            "repeats a host"
            if current in hosts
            else f"does not contain SM_CURRENT_HOST={current!r}"
        )
        raise LaunchEnvError(f"SM_HOSTS={text!r} {problem}", variable="SM_HOSTS")
    index = hosts.index(current)
    host = f"index of SM_CURRENT_HOST={current!r} in SM_HOSTS"
    one = "SageMaker runs the script once per host"
    fallback = Master(
        hosts[0],
        "SM_HOSTS[0] (SageMaker's master host)",
        SAGEMAKER_MASTER_PORT,
        f"default {SAGEMAKER_MASTER_PORT} (sagemaker-training-toolkit's torch_distributed port)",
    )
    return Draft(
        NamedInt(index, "rank", f"{host} ({one})"),
        NamedInt(0, "local_rank", f"0 ({one})"),
        NamedInt(len(hosts), "world_size", f"len(SM_HOSTS) ({one})"),
        NamedInt(1, "local_world_size", f"1 ({one})"),
        NamedInt(index, "node_rank", host),
        NamedInt(len(hosts), "num_nodes", "len(SM_HOSTS)"),
        explicit_master(env, fallback),
    )
