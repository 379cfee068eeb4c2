"""Read the launcher's environment once, into a frozen :class:`LaunchEnv`.

Every launcher tells a process its place in the job through different variables. This module is
the one place distcompat reads them. It never guesses: each value records where it came from in
``LaunchEnv.sources``, and each error names the variable, its value and the rule it breaks::

    env = LaunchEnv.from_environ()          # reads os.environ, nothing else
    print(env.rank, env.world_size, env.describe())

Detection order (``DETECTION_ORDER``; the first match wins):

1. ``torchrun``: ``TORCHELASTIC_RUN_ID`` is set, or ``RANK`` with ``GROUP_RANK`` and
   ``LOCAL_WORLD_SIZE``. Wins over scheduler variables, so torchrun inside srun is torchrun.
2. The ``env://`` contract, ``RANK`` and ``WORLD_SIZE``: ``azureml`` when ``AZUREML_RUN_ID`` is
   set; ``kubeflow`` when ``KUBERNETES_SERVICE_HOST`` is set and ``LOCAL_RANK`` and
   ``LOCAL_WORLD_SIZE`` are not (a PyTorchJob counts pods); otherwise ``env`` (Ray Train, by hand).
3. ``slurm``: an srun task step, i.e. ``SLURM_STEP_ID`` is a normal step number. The batch step of
   ``sbatch`` and an ``salloc`` shell have no such step, so they are one process (launcher
   ``none``), whatever ``SLURM_NTASKS`` says. An MPI launcher whose rank or world size disagrees
   with the step wins over it (mpirun starts its daemons with srun).
4. MPI: ``openmpi`` (``OMPI_COMM_WORLD_*``), ``mvapich2`` (``MV2_COMM_WORLD_*``), ``mpich`` (Hydra's
   ``PMI_RANK``, also Intel MPI); ``azureml`` when ``AZ_BATCH_MASTER_NODE`` or
   ``AZ_BATCHAI_MPI_MASTER_NODE`` names the master.
5. ``lsf``: jsrun's ``JSM_NAMESPACE_*``.
6. ``sagemaker``: ``SM_HOSTS`` and ``SM_CURRENT_HOST``, one process per host.
7. ``none``: a single process.

MPI and jsrun export no node index. Their node rank is derived as ``rank // local_world_size``,
which assumes the same number of processes on every node with ranks placed node by node; a layout
that provably breaks this raises, one that hides it (e.g. nodes of 3, 1, 2, 2 seen from the node
of 1) is not detectable from one process's environment.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from distcompat import _slurm

__all__ = ["DETECTION_ORDER", "LaunchEnv", "LaunchEnvError", "Launcher", "detect_launcher"]

Launcher = Literal[
    "none", "torchrun", "env", "kubeflow", "azureml", "slurm",
    "openmpi", "mpich", "mvapich2", "lsf", "sagemaker",
]  # fmt: skip

DETECTION_ORDER: tuple[Launcher, ...] = (
    "torchrun", "azureml", "kubeflow", "env", "slurm",
    "openmpi", "mvapich2", "mpich", "lsf", "sagemaker", "none",
)  # fmt: skip
"""Launchers in the order :func:`detect_launcher` tries them (``azureml`` also after MPI)."""

DEFAULT_MASTER_PORT = 29500  # torch's own default for MASTER_PORT
SAGEMAKER_MASTER_PORT = 7777  # sagemaker-training-toolkit's torch_distributed.MASTER_PORT
SLURM_PORT_BASE = 15000  # Lightning: 15000 + last 4 digits of SLURM_JOB_ID
LSF_PORT_BASE = 10000  # Lightning: 10000 + LSB_JOBID % 1000
_SLURM_MAX_NORMAL_STEP_ID = 0xFFFFFFF0  # slurm.h; above it: batch, extern, interactive steps
_INT = re.compile(r"-?[0-9]+")

ReadText = Callable[[str], "str | None"]


class LaunchEnvError(ValueError):
    """The launcher's environment breaks a rule; the message names variable, value and rule.

    ``variable`` is the first variable named, when there is one.

    Example:
        >>> try:
        ...     LaunchEnv.from_environ({"RANK": "abc", "WORLD_SIZE": "2"})
        ... except LaunchEnvError as err:
        ...     print(err, "/", err.variable)
        RANK='abc' is not an integer / RANK
    """

    def __init__(self, message: str, *, variable: str | None = None) -> None:
        super().__init__(message)
        self.variable = variable


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchEnv:
    """Where this process sits in the job, as its launcher described it.

    ``master_addr`` and ``master_port`` are ``None`` only where nothing tells us (no launcher;
    multi-node MPI or an ``env://`` launch without ``MASTER_ADDR``). ``agent_store`` is True
    when torchrun's agent hosts the TCPStore at ``master_addr:master_port`` and every rank must
    connect to it as a client. ``sources`` maps each field (and ``"launcher"``) to the variable
    or the reason it came from.

    Example:
        >>> env = LaunchEnv.from_environ({})
        >>> (env.launcher, env.rank, env.world_size, env.is_distributed)
        ('none', 0, 1, False)
    """

    launcher: Launcher
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str | None
    master_port: int | None
    agent_store: bool
    cuda_visible_devices: str | None
    sources: dict[str, str] = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        names = ("rank", "local_rank", "world_size", "local_world_size", "node_rank", "num_nodes")
        values = [_Int(getattr(self, name), name, "") for name in names]
        for value in values:
            if value.value < 0:
                raise LaunchEnvError(f"{value.label}={value.value} is negative")
        _check_layout(*values)
        if self.master_port is not None:
            _port(self.master_port, "master_port")

    @classmethod
    def from_environ(
        cls, environ: Mapping[str, str] | None = None, *, read_text: ReadText | None = None
    ) -> LaunchEnv:
        """Detect the launcher and read its variables; ``None`` reads ``os.environ``.

        ``read_text(path)`` returns a file's text or ``None`` when it does not exist; it is only
        used for LSF's ``LSB_DJOB_RANKFILE`` and exists so tests can fabricate that file.

        Example:
            >>> env = LaunchEnv.from_environ({"OMPI_COMM_WORLD_RANK": "1",
            ...     "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            ...     "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
            >>> (env.launcher, env.rank, env.master_addr, env.master_port)
            ('openmpi', 1, '127.0.0.1', 29500)
        """
        env = os.environ if environ is None else environ
        plan = _detect(env)
        draft = plan.parse(env, read_text or _read_text_if_exists)
        return _finish(plan, draft, env)

    @property
    def is_distributed(self) -> bool:
        """Whether a launcher started this process (a torchrun world of 1 still asked for one).

        Example:
            >>> LaunchEnv.from_environ({}).is_distributed
            False
        """
        return self.launcher != "none"

    def describe(self) -> str:
        """Return one line per field with its value and where it came from.

        Example:
            >>> print(LaunchEnv.from_environ({}).describe().splitlines()[0])
            launcher              none                      no launcher variables found
        """
        lines = [f"{'launcher':<21} {self.launcher:<25} {self.sources.get('launcher', '')}"]
        for name in _FIELDS:
            value = str(getattr(self, name))
            lines.append(f"{name:<21} {value:<25} {self.sources.get(name, '')}".rstrip())
        return "\n".join(lines)


def detect_launcher(environ: Mapping[str, str]) -> Launcher:
    """Return which launcher started this process, without validating its variables.

    Only a malformed marker (``SLURM_STEP_ID`` that is not a number) raises :class:`LaunchEnvError`.

    Example:
        >>> detect_launcher({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0"})
        'slurm'
        >>> detect_launcher({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "ENVIRONMENT": "BATCH"})
        'none'
    """
    return _detect(environ).launcher


# --- values carried with their names, so that every error can name its variable -------------

_FIELDS = (
    "rank", "local_rank", "world_size", "local_world_size", "node_rank", "num_nodes",
    "master_addr", "master_port", "agent_store", "cuda_visible_devices",
)  # fmt: skip


class _Int(NamedTuple):
    value: int
    label: str  # how errors name it: "SLURM_PROCID", "SLURM_STEP_TASKS_PER_NODE[node 2]"
    source: str  # what LaunchEnv.sources records


class _Master(NamedTuple):
    addr: str | None
    addr_source: str
    port: int | None
    port_source: str


@dataclass(slots=True)
class _Draft:
    rank: _Int
    local_rank: _Int
    world_size: _Int
    local_world_size: _Int
    node_rank: _Int
    num_nodes: _Int
    master: _Master
    agent_store: bool = False
    agent_store_source: str = "False: not under torchrun"


class _Plan(NamedTuple):
    launcher: Launcher
    reason: str
    parse: Callable[[Mapping[str, str], ReadText], _Draft]


class _Names(NamedTuple):
    rank: str
    size: str
    local_rank: str
    local_size: str


_MPI_FAMILIES: tuple[tuple[Launcher, _Names], ...] = (
    ("openmpi", _Names("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                       "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")),
    ("mvapich2", _Names("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE",
                        "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE")),
    # PMI_* are generic (MVAPICH2's and srun's PMI set them too), so MPICH comes last.
    ("mpich", _Names("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")),
)  # fmt: skip
_LSF = _Names(
    "JSM_NAMESPACE_RANK",
    "JSM_NAMESPACE_SIZE",
    "JSM_NAMESPACE_LOCAL_RANK",
    "JSM_NAMESPACE_LOCAL_SIZE",
)
_SLURM_STEP_KINDS = {0xFFFFFFFA: "interactive", 0xFFFFFFFB: "batch", 0xFFFFFFFC: "extern"}
_MPI_HINT = (
    "start the same number of processes on every node with ranks placed node by node "
    "(e.g. mpirun --map-by ppr:N:node), or launch with torchrun or srun"
)


def _read_text_if_exists(path: str) -> str | None:
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as handle:
        return handle.read()


def _int(env: Mapping[str, str], name: str) -> _Int | None:
    """Parse a non-negative integer variable; ``None`` when it is not set."""
    text = env.get(name)
    if text is None:
        return None
    if not _INT.fullmatch(text):
        raise LaunchEnvError(f"{name}={text!r} is not an integer", variable=name)
    if int(text) < 0:
        raise LaunchEnvError(f"{name}={int(text)} is negative (must be >= 0)", variable=name)
    return _Int(int(text), name, name)


def _need(env: Mapping[str, str], name: str, why: str) -> _Int:
    value = _int(env, name)
    if value is None:
        raise LaunchEnvError(f"{name} is not set ({why})", variable=name)
    return value


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    return next((name for name in names if name in env), None)


def _port(value: int, label: str) -> int:
    if not 1 <= value <= 65535:
        raise LaunchEnvError(
            f"{label}={value} is outside 1..65535 (a master port must be a usable TCP port; "
            "0 means 'any free port', which the other ranks cannot know)",
            variable=label,
        )
    return value


# --- layout rules ----------------------------------------------------------------------------


def _check_processes(rank: _Int, local_rank: _Int, world: _Int, local_world: _Int) -> None:
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


def _check_layout(
    rank: _Int, local_rank: _Int, world: _Int, local_world: _Int, node: _Int, nodes: _Int
) -> None:
    _check_processes(rank, local_rank, world, local_world)
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


def _node_layout(
    rank: _Int,
    local_rank: _Int,
    world: _Int,
    local_world: _Int,
    node: _Int | None,
    nodes: _Int | None,
    hint: str,
) -> tuple[_Int, _Int]:
    """Fill in the node rank and count a launcher did not give, assuming a uniform layout."""
    _check_processes(rank, local_rank, world, local_world)
    if nodes is None:
        if world.value == local_world.value:
            nodes = _Int(1, "num_nodes", f"1: {local_world.label} == {world.label}")
        elif world.value % local_world.value:
            raise LaunchEnvError(
                f"{world.label}={world.value} is not a multiple of "
                f"{local_world.label}={local_world.value}, so the node count cannot be derived "
                f"(nodes run different numbers of processes); {hint}",
                variable=world.label,
            )
        else:
            nodes = _Int(
                world.value // local_world.value,
                f"num_nodes ({world.label} // {local_world.label})",
                f"derived: {world.label} // {local_world.label}, assuming every node runs "
                f"{local_world.label} processes",
            )
    if node is not None:
        return node, nodes
    if nodes.value == 1:
        return _Int(0, "node_rank", "0: single node"), nodes
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
    derived = _Int(
        rank.value // local_world.value,
        f"node_rank ({rank.label} // {local_world.label})",
        f"derived: {rank.label} // {local_world.label}, assuming ranks are placed node by node "
        "with the same count on every node",
    )
    return derived, nodes


# --- master address and port -----------------------------------------------------------------


def _explicit_master(env: Mapping[str, str], fallback: _Master) -> _Master:
    """Apply MASTER_ADDR / MASTER_PORT, when set, over what the launcher implies."""
    addr, addr_source, port, port_source = fallback
    if "MASTER_ADDR" in env:
        addr, addr_source = env["MASTER_ADDR"], "MASTER_ADDR"
        if not addr:
            raise LaunchEnvError(
                "MASTER_ADDR='' is empty (it must name a host)", variable="MASTER_ADDR"
            )
    given = _int(env, "MASTER_PORT")
    if given is not None:
        port, port_source = _port(given.value, "MASTER_PORT"), "MASTER_PORT"
    return _Master(addr, addr_source, port, port_source)


def _unset_master(env: Mapping[str, str], why: str) -> _Master:
    return _explicit_master(env, _Master(None, f"not set ({why})", None, f"not set ({why})"))


def _default_port(master: _Master, why: str) -> _Master:
    """Give a known master address torch's default port when nothing chose one."""
    if master.addr is None or master.port is not None:
        return master
    return master._replace(
        port=DEFAULT_MASTER_PORT, port_source=f"default {DEFAULT_MASTER_PORT} ({why})"
    )


def _is_loopback(addr: str) -> bool:
    if addr.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


# --- detection -------------------------------------------------------------------------------


class _Step(NamedTuple):
    name: str
    text: str
    kind: str | None  # None for a normal srun task step, else "batch", "interactive", ...


def _slurm_step(env: Mapping[str, str]) -> _Step | None:
    name = _first(env, ("SLURM_STEP_ID", "SLURM_STEPID"))
    if name is None:
        return None
    text = env[name]
    if not re.fullmatch(r"[0-9]+", text):
        raise LaunchEnvError(
            f"{name}={text!r} is not an integer (Slurm sets a step number)", variable=name
        )
    value = int(text)
    kind = None if value <= _SLURM_MAX_NORMAL_STEP_ID else _SLURM_STEP_KINDS.get(value, "special")
    return _Step(name, text, kind)


def _mpi_family(env: Mapping[str, str]) -> tuple[Launcher, _Names] | None:
    for launcher, names in _MPI_FAMILIES:
        if names.rank in env or names.size in env:
            return launcher, names
    return None


def _mpi_disagrees_with_slurm(env: Mapping[str, str], names: _Names) -> bool:
    slurm_world = _first(env, ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"))
    pairs = ((names.rank, "SLURM_PROCID"), (names.size, slurm_world))
    return any(
        mpi in env and slurm is not None and slurm in env and env[mpi] != env[slurm]
        for mpi, slurm in pairs
    )


def _detect(env: Mapping[str, str]) -> _Plan:
    step = _slurm_step(env)
    run_id = env.get("TORCHELASTIC_RUN_ID")
    if run_id is not None or all(n in env for n in ("RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE")):
        reason = (
            f"TORCHELASTIC_RUN_ID={run_id!r} (torchrun / TorchElastic agent)"
            if run_id is not None
            else "RANK, GROUP_RANK and LOCAL_WORLD_SIZE set (torchrun's contract)"
        )
        if step is not None or _first(env, ("SLURM_JOB_ID", "SLURM_JOBID")) is not None:
            reason += "; Slurm variables ignored: torchrun started this process"
        return _Plan("torchrun", reason, _parse_torchrun)
    if "RANK" in env or "WORLD_SIZE" in env:
        if "AZUREML_RUN_ID" in env:
            return _Plan(
                "azureml",
                f"RANK and WORLD_SIZE with AZUREML_RUN_ID={env['AZUREML_RUN_ID']!r} "
                "(Azure ML PyTorch distribution)",
                lambda e, _: _parse_env(e, "Azure ML", "AZUREML_NODE_COUNT"),
            )
        if "KUBERNETES_SERVICE_HOST" in env and not {"LOCAL_RANK", "LOCAL_WORLD_SIZE"} & env.keys():
            return _Plan(
                "kubeflow",
                "RANK and WORLD_SIZE in a Kubernetes pod (KUBERNETES_SERVICE_HOST) without "
                "LOCAL_RANK: Kubeflow PyTorchJob, one process per pod",
                _parse_kubeflow,
            )
        return _Plan(
            "env",
            "RANK and WORLD_SIZE (the env:// contract: Ray Train, a script, by hand)",
            lambda e, _: _parse_env(e, "the launcher", None),
        )
    mpi = _mpi_family(env)
    task_step = step if step is not None and step.kind is None else None
    if task_step is not None and (mpi is None or not _mpi_disagrees_with_slurm(env, mpi[1])):
        reason = f"{task_step.name}={task_step.text} (an srun task step)"
        return _Plan("slurm", reason, _parse_slurm)
    if mpi is not None:
        launcher, names = mpi
        reason = f"{names.rank} / {names.size} set ({launcher})"
        if task_step is not None:
            reason += (
                f"; it disagrees with the Slurm step ({task_step.name}={task_step.text}), "
                "which describes mpirun's daemons, so the MPI variables win"
            )
        azure = _first(env, ("AZ_BATCH_MASTER_NODE", "AZ_BATCHAI_MPI_MASTER_NODE"))
        if azure is not None:
            reason += f"; {azure} set: Azure ML MPI distribution"
            return _Plan("azureml", reason, lambda e, _: _parse_mpi(e, launcher, names, azure))
        return _Plan(launcher, reason, lambda e, _: _parse_mpi(e, launcher, names, None))
    if _LSF.rank in env or _LSF.size in env:
        return _Plan("lsf", f"{_LSF.rank} / {_LSF.size} set (LSF jsrun)", _parse_lsf)
    if "SM_HOSTS" in env or "SM_CURRENT_HOST" in env:
        return _Plan("sagemaker", "SM_HOSTS / SM_CURRENT_HOST set (SageMaker)", _parse_sagemaker)
    return _Plan("none", _none_reason(env, step), _parse_none)


def _none_reason(env: Mapping[str, str], step: _Step | None) -> str:
    job = _first(env, ("SLURM_JOB_ID", "SLURM_JOBID"))
    if job is None and step is None:
        return "no launcher variables found"
    ntasks = env.get("SLURM_NTASKS", env.get("SLURM_NPROCS", "1"))
    start = f"; start the SLURM_NTASKS={ntasks} tasks with `srun`" if ntasks != "1" else ""
    if step is not None:
        where = f"{step.name}={step.text} is Slurm's {step.kind} step, not an srun task step"
    elif env.get("ENVIRONMENT") == "BATCH":
        where = (
            "Slurm batch step (ENVIRONMENT=BATCH, no SLURM_STEP_ID): sbatch runs the script once"
        )
    elif env.get("SLURM_JOB_NAME") in ("bash", "interactive"):
        where = f"interactive Slurm allocation (SLURM_JOB_NAME={env['SLURM_JOB_NAME']!r}, no step)"
    else:
        where = "Slurm allocation without an srun step (no SLURM_STEP_ID, e.g. an salloc shell)"
    return f"{where}: one process{start}"


# --- one parser per launcher -----------------------------------------------------------------


def _parse_torchrun(env: Mapping[str, str], _read: ReadText) -> _Draft:
    run_id = env.get("TORCHELASTIC_RUN_ID")
    why = "torchrun sets it for every worker"
    rank, local_rank = _need(env, "RANK", why), _need(env, "LOCAL_RANK", why)
    world, local_world = _need(env, "WORLD_SIZE", why), _need(env, "LOCAL_WORLD_SIZE", why)
    node = _int(env, "GROUP_RANK")
    if run_id is not None:
        node = _need(env, "GROUP_RANK", why)
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if name not in env:
                raise LaunchEnvError(f"{name} is not set ({why})", variable=name)
    hint = "torchrun sets GROUP_WORLD_SIZE; set it to the number of nodes"
    node, nodes = _node_layout(
        rank, local_rank, world, local_world, node, _int(env, "GROUP_WORLD_SIZE"), hint
    )
    store = env.get("TORCHELASTIC_USE_AGENT_STORE")
    if store not in (None, "True", "False"):
        raise LaunchEnvError(
            f"TORCHELASTIC_USE_AGENT_STORE={store!r} is neither 'True' nor 'False' (torch "
            "compares it with the exact string 'True')",
            variable="TORCHELASTIC_USE_AGENT_STORE",
        )
    store_source = (
        "TORCHELASTIC_USE_AGENT_STORE='True': the agent hosts the TCPStore, every rank connects"
        if store == "True"
        else "False: TORCHELASTIC_USE_AGENT_STORE is not 'True', rank 0 hosts the TCPStore"
    )
    master = _unset_master(env, "torchrun did not set it")
    return _Draft(
        rank, local_rank, world, local_world, node, nodes, master, store == "True", store_source
    )


def _need_rank_and_world(env: Mapping[str, str]) -> tuple[_Int, _Int]:
    for have, lack in (("RANK", "WORLD_SIZE"), ("WORLD_SIZE", "RANK")):
        if have in env and lack not in env:
            raise LaunchEnvError(
                f"{have}={env[have]!r} is set but {lack} is not set "
                "(the env:// contract needs both)",
                variable=lack,
            )
    return _need(env, "RANK", "env://"), _need(env, "WORLD_SIZE", "env://")


def _parse_env(env: Mapping[str, str], who: str, node_count_var: str | None) -> _Draft:
    rank, world = _need_rank_and_world(env)
    local_rank, local_world = _int(env, "LOCAL_RANK"), _int(env, "LOCAL_WORLD_SIZE")
    node, other = _int(env, "NODE_RANK"), _int(env, "GROUP_RANK")
    if node is not None and other is not None and node.value != other.value:
        raise LaunchEnvError(
            f"NODE_RANK={node.value} and GROUP_RANK={other.value} disagree (both name this "
            "node's rank)",
            variable="NODE_RANK",
        )
    node = node or other
    nodes = _int(env, "GROUP_WORLD_SIZE")
    if nodes is None and node_count_var is not None:
        nodes = _int(env, node_count_var)
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
        local_world = _Int(
            world.value // nodes.value,
            f"local_world_size (WORLD_SIZE // {nodes.label})",
            f"derived: WORLD_SIZE // {nodes.label}, assuming every node runs as many processes",
        )
        if local_rank is None and nodes.value == 1:
            local_rank = _Int(rank.value, "RANK", f"RANK: {nodes.label}=1, a single node")
        elif local_rank is None:
            raise LaunchEnvError(
                f"LOCAL_RANK is not set and {nodes.label}={nodes.value} nodes",
                variable="LOCAL_RANK",
            )
    if local_world is None:
        return _single_node(env, rank, world, local_rank, node, who)
    assert local_rank is not None  # both set, or derived above
    hint = "set NODE_RANK and GROUP_WORLD_SIZE"
    node, nodes = _node_layout(rank, local_rank, world, local_world, node, nodes, hint)
    master = _unset_master(env, f"{who} did not set it")
    return _Draft(rank, local_rank, world, local_world, node, nodes, master)


def _single_node(
    env: Mapping[str, str], rank: _Int, world: _Int, local_rank: _Int | None, node: _Int | None,
    who: str,
) -> _Draft:  # fmt: skip
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
    local_world = _Int(world.value, "WORLD_SIZE", f"WORLD_SIZE ({why})")
    local_rank = local_rank or _Int(rank.value, "RANK", f"RANK ({why})")
    node = node or _Int(0, "node_rank", f"0 ({why})")
    nodes = _Int(1, "num_nodes", f"1 ({why})")
    _check_processes(rank, local_rank, world, local_world)
    master = _unset_master(env, f"{who} did not set it")
    return _Draft(rank, local_rank, world, local_world, node, nodes, master)


def _parse_kubeflow(env: Mapping[str, str], _read: ReadText) -> _Draft:
    rank, world = _need_rank_and_world(env)
    per_pod = env.get("PET_NPROC_PER_NODE", "1")
    if _INT.fullmatch(per_pod) and int(per_pod) > 1:
        raise LaunchEnvError(
            f"PET_NPROC_PER_NODE={per_pod} but torchrun did not start this process (no "
            f"TORCHELASTIC_RUN_ID): the Kubeflow PyTorchJob expects `torchrun` in each pod to "
            f"start {per_pod} processes, while RANK={rank.value} is the pod index; run torchrun "
            "inside the pod",
            variable="PET_NPROC_PER_NODE",
        )
    pod = "Kubeflow PyTorchJob runs one process per pod; RANK and WORLD_SIZE count pods"
    return _Draft(
        rank,
        _Int(0, "local_rank", f"0 ({pod})"),
        world,
        _Int(1, "local_world_size", f"1 ({pod})"),
        _Int(rank.value, "RANK", f"RANK ({pod})"),
        _Int(world.value, "WORLD_SIZE", f"WORLD_SIZE ({pod})"),
        _unset_master(env, "the PyTorchJob operator did not set it"),
    )


def _parse_slurm(env: Mapping[str, str], _read: ReadText) -> _Draft:
    why = "srun sets it for every task"
    rank, local_rank = _need(env, "SLURM_PROCID", why), _need(env, "SLURM_LOCALID", why)
    node = _need(env, "SLURM_NODEID", why)
    world_var = _first(env, ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"))
    world = _need(env, world_var or "SLURM_STEP_NUM_TASKS", why)
    counts_var = _first(env, ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"))
    if counts_var is not None:
        text = env[counts_var]
        try:
            counts = _slurm.expand_tasks_per_node(text)
        except _slurm.SlurmFormatError as err:
            raise LaunchEnvError(
                f"{counts_var}={text!r} is not a Slurm tasks-per-node list: {err.problem} at "
                f"position {err.position}",
                variable=counts_var,
            ) from err
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
        local_world = _Int(
            counts[node.value],
            f"{counts_var}[node {node.value}]",
            f"{counts_var}={text!r}, entry SLURM_NODEID={node.value}",
        )
        nodes = _Int(
            len(counts), f"len({counts_var})", f"{counts_var}={text!r}: {len(counts)} nodes"
        )
    else:
        local_world = _need(env, "SLURM_NTASKS_PER_NODE", "no SLURM_STEP_TASKS_PER_NODE either")
        nodes_var = _first(env, ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"))
        count = None if nodes_var is None else _int(env, nodes_var)
        hint = "set SLURM_STEP_TASKS_PER_NODE"
        node, nodes = _node_layout(rank, local_rank, world, local_world, node, count, hint)
    master = _explicit_master(env, _slurm_master(env, counts_var))
    return _Draft(rank, local_rank, world, local_world, node, nodes, master)


def _slurm_master(env: Mapping[str, str], counts_var: str | None) -> _Master:
    addr, addr_source = None, "not set (no SLURM_*NODELIST; set MASTER_ADDR)"
    list_var = _first(env, ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"))
    if list_var is not None:
        text = env[list_var]
        try:
            hosts = _slurm.expand_hostlist(text)
        except _slurm.SlurmFormatError as err:
            raise LaunchEnvError(
                f"{list_var}={text!r} is not a Slurm host list: {err.problem} at position "
                f"{err.position}",
                variable=list_var,
            ) from err
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
    job_var = _first(env, ("SLURM_JOB_ID", "SLURM_JOBID"))
    if job_var is not None:
        job = _need(env, job_var, "")
        port = _port(SLURM_PORT_BASE + int(str(job.value)[-4:]), f"derived from {job_var}")
        port_source = (
            f"derived from {job_var}={job.value}: {SLURM_PORT_BASE} + last 4 digits "
            "(Lightning's convention)"
        )
    return _Master(addr, addr_source, port, port_source)


def _parse_mpi(env: Mapping[str, str], launcher: str, names: _Names, azure: str | None) -> _Draft:
    why = f"{launcher} sets it for every rank"
    rank, world = _need(env, names.rank, why), _need(env, names.size, why)
    local_rank, local_world = _need(env, names.local_rank, why), _need(env, names.local_size, why)
    node, nodes = _node_layout(rank, local_rank, world, local_world, None, None, _MPI_HINT)
    if azure is not None:
        master = _azure_mpi_master(env, azure)
    elif world.value == local_world.value:
        master = _Master(
            "127.0.0.1", "127.0.0.1: single node, every rank is on this host", None, ""
        )
    else:
        unset = "not set: MPI does not export a master {0}; set MASTER_{1}"
        master = _Master(None, unset.format("address", "ADDR"), None, unset.format("port", "PORT"))
    master = _explicit_master(env, master)
    return _Draft(
        rank,
        local_rank,
        world,
        local_world,
        node,
        nodes,
        _default_port(master, "MASTER_PORT not set"),
    )


def _azure_mpi_master(env: Mapping[str, str], var: str) -> _Master:
    text = env[var]
    if var == "AZ_BATCHAI_MPI_MASTER_NODE":
        if not text:
            raise LaunchEnvError(f"{var}='' is empty (it must name a host)", variable=var)
        return _Master(text, var, None, "")
    host, _, port = text.rpartition(":")
    if not host or not re.fullmatch(r"[0-9]+", port):
        raise LaunchEnvError(f"{var}={text!r} is not HOST:PORT", variable=var)
    if not 1 <= int(port) <= 65535:
        raise LaunchEnvError(f"{var}={text!r} has port {int(port)} outside 1..65535", variable=var)
    return _Master(host, f"{var}={text!r}", int(port), f"{var}={text!r}")


def _parse_lsf(env: Mapping[str, str], read: ReadText) -> _Draft:
    why = "jsrun sets it for every task"
    rank, world = _need(env, _LSF.rank, why), _need(env, _LSF.size, why)
    local_rank, local_world = _need(env, _LSF.local_rank, why), _int(env, _LSF.local_size)
    hosts, hosts_from = _lsf_hosts(env, read)
    nodes = None
    if local_world is None:
        if not hosts:
            raise LaunchEnvError(
                f"{_LSF.local_size} is not set and neither LSB_DJOB_RANKFILE nor LSB_MCPU_HOSTS "
                "lists the hosts, so the local world size cannot be derived",
                variable=_LSF.local_size,
            )
        distinct = len(dict.fromkeys(hosts))
        if world.value % distinct:
            raise LaunchEnvError(
                f"{_LSF.size}={world.value} is not a multiple of the {distinct} compute hosts in "
                f"{hosts_from}, so the local world size cannot be derived; set {_LSF.local_size}",
                variable=_LSF.size,
            )
        nodes = _Int(distinct, f"hosts in {hosts_from}", f"{hosts_from}: {distinct} compute hosts")
        local_world = _Int(
            world.value // distinct,
            f"local_world_size ({_LSF.size} // hosts)",
            f"derived: {_LSF.size} // {distinct} hosts, assuming as many tasks on every host",
        )
    hint = "start the same number of tasks on every host, or set MASTER_ADDR and use torchrun"
    node, nodes = _node_layout(rank, local_rank, world, local_world, None, nodes, hint)
    addr, addr_source = None, "not set (no LSB_DJOB_RANKFILE or LSB_MCPU_HOSTS; set MASTER_ADDR)"
    if hosts:
        addr, addr_source = hosts[0], f"first compute host in {hosts_from} (launch node skipped)"
    port, port_source = None, "not set (no LSB_JOBID to derive it from; set MASTER_PORT)"
    job = _int(env, "LSB_JOBID")
    if job is not None:
        port = _port(LSF_PORT_BASE + job.value % 1000, "derived from LSB_JOBID")
        port_source = (
            f"derived from LSB_JOBID={job.value}: {LSF_PORT_BASE} + LSB_JOBID % 1000 "
            "(Lightning's convention)"
        )
    master = _explicit_master(env, _Master(addr, addr_source, port, port_source))
    return _Draft(rank, local_rank, world, local_world, node, nodes, master)


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
    if len(tokens) < 4 or len(tokens) % 2 or not all(_INT.fullmatch(t) for t in tokens[1::2]):
        raise LaunchEnvError(
            f"LSB_MCPU_HOSTS={mcpu!r} is not 'launchnode n host1 n1 host2 n2 ...'",
            variable="LSB_MCPU_HOSTS",
        )
    return tokens[2::2], f"LSB_MCPU_HOSTS={mcpu!r}"


def _parse_sagemaker(env: Mapping[str, str], _read: ReadText) -> _Draft:
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
    fallback = _Master(
        hosts[0],
        "SM_HOSTS[0] (SageMaker's master host)",
        SAGEMAKER_MASTER_PORT,
        f"default {SAGEMAKER_MASTER_PORT} (sagemaker-training-toolkit's torch_distributed port)",
    )
    return _Draft(
        _Int(index, "rank", f"{host} ({one})"),
        _Int(0, "local_rank", f"0 ({one})"),
        _Int(len(hosts), "world_size", f"len(SM_HOSTS) ({one})"),
        _Int(1, "local_world_size", f"1 ({one})"),
        _Int(index, "node_rank", host),
        _Int(len(hosts), "num_nodes", "len(SM_HOSTS)"),
        _explicit_master(env, fallback),
    )


def _parse_none(env: Mapping[str, str], _read: ReadText) -> _Draft:
    single = "single process"
    return _Draft(
        _Int(0, "rank", f"0 ({single})"),
        _Int(0, "local_rank", f"0 ({single})"),
        _Int(1, "world_size", f"1 ({single})"),
        _Int(1, "local_world_size", f"1 ({single})"),
        _Int(0, "node_rank", f"0 ({single})"),
        _Int(1, "num_nodes", f"1 ({single})"),
        _Master(None, f"None ({single}: no master)", None, f"None ({single}: no master)"),
    )


def _finish(plan: _Plan, draft: _Draft, env: Mapping[str, str]) -> LaunchEnv:
    d = draft
    _check_layout(d.rank, d.local_rank, d.world_size, d.local_world_size, d.node_rank, d.num_nodes)
    devices = env.get("CUDA_VISIBLE_DEVICES")
    sources = {
        "launcher": plan.reason,
        "rank": d.rank.source,
        "local_rank": d.local_rank.source,
        "world_size": d.world_size.source,
        "local_world_size": d.local_world_size.source,
        "node_rank": d.node_rank.source,
        "num_nodes": d.num_nodes.source,
        "master_addr": d.master.addr_source,
        "master_port": d.master.port_source,
        "agent_store": d.agent_store_source,
        "cuda_visible_devices": "CUDA_VISIBLE_DEVICES" if devices is not None else "not set",
    }
    return LaunchEnv(
        launcher=plan.launcher,
        rank=d.rank.value,
        local_rank=d.local_rank.value,
        world_size=d.world_size.value,
        local_world_size=d.local_world_size.value,
        node_rank=d.node_rank.value,
        num_nodes=d.num_nodes.value,
        master_addr=d.master.addr,
        master_port=d.master.port,
        agent_store=d.agent_store,
        cuda_visible_devices=devices,
        sources=sources,
    )
