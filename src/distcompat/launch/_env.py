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

This module reads the environment and decides; the parsing lives beside it, in private modules:
``_contract`` for torchrun and the ``env://`` launchers,
``_schedulers`` for Slurm, MPI, LSF and SageMaker, and ``_rules``
for the layout and rendezvous rules both share (and :class:`LaunchEnvError`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from distcompat.launch._contract import parse_env, parse_kubeflow, parse_none, parse_torchrun
from distcompat.launch._rules import (
    Draft,
    LaunchEnvError,
    NamedInt,
    check_layout,
    check_port,
    first_set,
)
from distcompat.launch._rules import ReadText as ReadText  # from_environ's read_text type
from distcompat.launch._schedulers import (
    LSF,
    VarNames,
    parse_lsf,
    parse_mpi,
    parse_sagemaker,
    parse_slurm,
)

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

_FIELDS = (
    "rank", "local_rank", "world_size", "local_world_size", "node_rank", "num_nodes",
    "master_addr", "master_port", "agent_store", "cuda_visible_devices", "gloo_socket_ifname",
)  # fmt: skip


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchEnv:
    """Where this process sits in the job, as its launcher described it.

    ``master_addr`` and ``master_port`` are ``None`` only where nothing tells us (no launcher;
    multi-node MPI or an ``env://`` launch without ``MASTER_ADDR``). ``agent_store`` is True
    when ``TORCHELASTIC_USE_AGENT_STORE=True``: an agent (torchrun's, or a parent process such as
    distcompat's test harness) already hosts the TCPStore at ``master_addr:master_port`` and
    every rank must connect to it as a client. Like torch, every launcher with a master honours
    it. ``gloo_socket_ifname`` is ``GLOO_SOCKET_IFNAME``, the interface(s) gloo binds (None when
    unset: gloo then binds the address the host name resolves to). ``sources`` maps each field
    (and ``"launcher"``) to the variable or the reason it came from.

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
    gloo_socket_ifname: str | None = None
    sources: dict[str, str] = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        names = ("rank", "local_rank", "world_size", "local_world_size", "node_rank", "num_nodes")
        values = [NamedInt(getattr(self, name), name, "") for name in names]
        for value in values:
            if value.value < 0:
                raise LaunchEnvError(f"{value.label}={value.value} is negative")
        check_layout(*values)
        if self.master_port is not None:
            check_port(self.master_port, "master_port")

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


# --- reading the environment: the only place distcompat touches os.environ or a file ---------


def _read_text_if_exists(path: str) -> str | None:
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as handle:
        return handle.read()


# --- detection -------------------------------------------------------------------------------


class _Plan(NamedTuple):
    launcher: Launcher
    reason: str
    parse: Callable[[Mapping[str, str], ReadText], Draft]


_MPI_FAMILIES: tuple[tuple[Launcher, VarNames], ...] = (
    ("openmpi", VarNames("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                         "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")),
    ("mvapich2", VarNames("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE",
                          "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE")),
    # PMI_* are generic (MVAPICH2's and srun's PMI set them too), so MPICH comes last.
    ("mpich", VarNames("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")),
)  # fmt: skip
_SLURM_MAX_NORMAL_STEP_ID = 0xFFFFFFF0  # slurm.h; above it: batch, extern, interactive steps
_SLURM_STEP_KINDS = {0xFFFFFFFA: "interactive", 0xFFFFFFFB: "batch", 0xFFFFFFFC: "extern"}


class _Step(NamedTuple):
    name: str
    text: str
    kind: str | None  # None for a normal srun task step, else "batch", "interactive", ...


def _slurm_step(env: Mapping[str, str]) -> _Step | None:
    name = first_set(env, ("SLURM_STEP_ID", "SLURM_STEPID"))
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


def _mpi_family(env: Mapping[str, str]) -> tuple[Launcher, VarNames] | None:
    for launcher, names in _MPI_FAMILIES:
        if names.rank in env or names.size in env:
            return launcher, names
    return None


def _mpi_disagrees_with_slurm(env: Mapping[str, str], names: VarNames) -> bool:
    slurm_world = first_set(env, ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"))
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
        if step is not None or first_set(env, ("SLURM_JOB_ID", "SLURM_JOBID")) is not None:
            reason += "; Slurm variables ignored: torchrun started this process"
        return _Plan("torchrun", reason, parse_torchrun)
    if "RANK" in env or "WORLD_SIZE" in env:
        if "AZUREML_RUN_ID" in env:
            return _Plan(
                "azureml",
                f"RANK and WORLD_SIZE with AZUREML_RUN_ID={env['AZUREML_RUN_ID']!r} "
                "(Azure ML PyTorch distribution)",
                lambda e, _: parse_env(e, "Azure ML", "AZUREML_NODE_COUNT"),
            )
        if "KUBERNETES_SERVICE_HOST" in env and not {"LOCAL_RANK", "LOCAL_WORLD_SIZE"} & env.keys():
            return _Plan(
                "kubeflow",
                "RANK and WORLD_SIZE in a Kubernetes pod (KUBERNETES_SERVICE_HOST) without "
                "LOCAL_RANK: Kubeflow PyTorchJob, one process per pod",
                parse_kubeflow,
            )
        return _Plan(
            "env",
            "RANK and WORLD_SIZE (the env:// contract: Ray Train, a script, by hand)",
            lambda e, _: parse_env(e, "the launcher", None),
        )
    mpi = _mpi_family(env)
    task_step = step if step is not None and step.kind is None else None
    if task_step is not None and (mpi is None or not _mpi_disagrees_with_slurm(env, mpi[1])):
        reason = f"{task_step.name}={task_step.text} (an srun task step)"
        return _Plan("slurm", reason, parse_slurm)
    if mpi is not None:
        launcher, names = mpi
        reason = f"{names.rank} / {names.size} set ({launcher})"
        if task_step is not None:
            reason += (
                f"; it disagrees with the Slurm step ({task_step.name}={task_step.text}), "
                "which describes mpirun's daemons, so the MPI variables win"
            )
        azure = first_set(env, ("AZ_BATCH_MASTER_NODE", "AZ_BATCHAI_MPI_MASTER_NODE"))
        if azure is not None:
            reason += f"; {azure} set: Azure ML MPI distribution"
            return _Plan("azureml", reason, lambda e, _: parse_mpi(e, launcher, names, azure))
        return _Plan(launcher, reason, lambda e, _: parse_mpi(e, launcher, names, None))
    if LSF.rank in env or LSF.size in env:
        return _Plan("lsf", f"{LSF.rank} / {LSF.size} set (LSF jsrun)", parse_lsf)
    if "SM_HOSTS" in env or "SM_CURRENT_HOST" in env:
        return _Plan("sagemaker", "SM_HOSTS / SM_CURRENT_HOST set (SageMaker)", parse_sagemaker)
    return _Plan("none", _none_reason(env, step), parse_none)


def _none_reason(env: Mapping[str, str], step: _Step | None) -> str:
    job = first_set(env, ("SLURM_JOB_ID", "SLURM_JOBID"))
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


# --- final assembly: one launcher's draft, checked, becomes the LaunchEnv ---------------------


def _finish(plan: _Plan, draft: Draft, env: Mapping[str, str]) -> LaunchEnv:
    d = draft
    check_layout(d.rank, d.local_rank, d.world_size, d.local_world_size, d.node_rank, d.num_nodes)
    devices = env.get("CUDA_VISIBLE_DEVICES")
    ifname = env.get("GLOO_SOCKET_IFNAME")
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
        "agent_store": d.master.agent_store_source,
        "cuda_visible_devices": "CUDA_VISIBLE_DEVICES" if devices is not None else "not set",
        "gloo_socket_ifname": "GLOO_SOCKET_IFNAME" if ifname is not None else "not set",
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
        agent_store=d.master.agent_store,
        cuda_visible_devices=devices,
        gloo_socket_ifname=ifname,
        sources=sources,
    )
