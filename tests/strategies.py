"""Hypothesis strategies for launcher environments and Slurm strings.

A *layout* is a list of per-node process counts, e.g. ``[2, 2, 1]``. For a layout, the builders here
fabricate the environment every process would see under one launcher, written from what the
launchers actually export (torch's local_elastic_agent.py, Slurm's env.c, Open MPI and Hydra docs),
together with what `LaunchEnv` should report for it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from hypothesis import strategies as st

from distcompat.env import Launcher

# --- layouts ---------------------------------------------------------------------------------

layouts = st.lists(st.integers(1, 8), min_size=1, max_size=8)
uniform_layouts = st.builds(lambda nodes, per: [per] * nodes, st.integers(1, 8), st.integers(1, 8))
nonuniform_layouts = layouts.filter(lambda counts: len(set(counts)) > 1)


@dataclass(frozen=True)
class Expected:
    """What one process of a layout should parse to (block placement: node by node)."""

    rank: int
    local_rank: int
    node_rank: int
    world_size: int
    local_world_size: int
    num_nodes: int


def expected_processes(layout: list[int]) -> list[Expected]:
    world = sum(layout)
    out: list[Expected] = []
    for node, count in enumerate(layout):
        for local in range(count):
            out.append(Expected(len(out), local, node, world, count, len(layout)))
    return out


@dataclass(frozen=True)
class Launch:
    """Fabricated per-process environments of one launch, with the answers."""

    launcher: Launcher
    layout: tuple[int, ...]
    envs: tuple[dict[str, str], ...]
    expected: tuple[Expected, ...]
    master_addr: str | None
    master_port: int | None


# --- Slurm string compressors (test-side, written independently of distcompat.launch._slurm) ---


def compress_counts(counts: list[int]) -> str:
    """Run-length encode per-node counts the way Slurm writes SLURM_TASKS_PER_NODE."""
    parts = []
    for value, group in itertools.groupby(counts):
        repeat = len(list(group))
        parts.append(f"{value}(x{repeat})" if repeat > 1 else str(value))
    return ",".join(parts)


def compress_numbers(numbers: list[int], width: int) -> str:
    """Bracket body for ascending unique numbers: consecutive runs become ``lo-hi``."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ",".join(
        f"{run[0]:0{width}d}" if len(run) == 1 else f"{run[0]:0{width}d}-{run[-1]:0{width}d}"
        for run in runs
    )


@dataclass(frozen=True)
class HostGroup:
    prefix: str
    width: int
    numbers: tuple[int, ...]
    bracket_single: bool  # write one host as ``n[5]`` instead of ``n5``

    def hosts(self) -> list[str]:
        return [f"{self.prefix}{n:0{self.width}d}" for n in self.numbers]

    def compressed(self) -> str:
        if len(self.numbers) == 1 and not self.bracket_single:
            return self.hosts()[0]
        return f"{self.prefix}[{compress_numbers(list(self.numbers), self.width)}]"


_prefix = st.builds(
    lambda body, last: body + last,
    st.text(alphabet="abcgnoprx-.", max_size=5),
    st.sampled_from("abcnxz"),  # a prefix ends in a letter, so the number after it is separate
)


@st.composite
def host_group(draw: st.DrawFn, prefix: str | None = None, size: int | None = None) -> HostGroup:
    width = draw(st.integers(1, 4))
    count = size if size is not None else draw(st.integers(1, min(12, 10**width)))
    numbers = draw(
        st.lists(st.integers(0, 10**width - 1), min_size=count, max_size=count, unique=True)
    )
    chosen_prefix = prefix if prefix is not None else draw(_prefix)
    return HostGroup(chosen_prefix, width, tuple(sorted(numbers)), draw(st.booleans()))


@st.composite
def host_lists(draw: st.DrawFn) -> tuple[str, list[str]]:
    """A compressed Slurm host list and the hosts it names, in order."""
    prefixes = draw(st.lists(_prefix, min_size=1, max_size=4, unique=True))
    groups = [draw(host_group(prefix=p)) for p in prefixes]
    return ",".join(g.compressed() for g in groups), [h for g in groups for h in g.hosts()]


# --- per-launcher environment builders -------------------------------------------------------


def torchrun_envs(layout: list[int], master: str, port: int, store: bool) -> Launch:
    expected = expected_processes(layout)
    envs = tuple(
        {
            "RANK": str(p.rank),
            "LOCAL_RANK": str(p.local_rank),
            "WORLD_SIZE": str(p.world_size),
            "LOCAL_WORLD_SIZE": str(p.local_world_size),
            "GROUP_RANK": str(p.node_rank),
            "GROUP_WORLD_SIZE": str(p.num_nodes),
            "ROLE_RANK": str(p.rank),
            "ROLE_NAME": "default",
            "ROLE_WORLD_SIZE": str(p.world_size),
            "MASTER_ADDR": master,
            "MASTER_PORT": str(port),
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": "none",
            "TORCHELASTIC_USE_AGENT_STORE": str(store),
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
            "OMP_NUM_THREADS": "1",
        }
        for p in expected
    )
    return Launch("torchrun", tuple(layout), envs, tuple(expected), master, port)


def slurm_envs(layout: list[int], job_id: int, hosts: HostGroup) -> Launch:
    """Every task of ``srun`` over ``layout`` (one host per node, block distribution)."""
    expected = expected_processes(layout)
    names = hosts.hosts()
    nodelist, counts = hosts.compressed(), compress_counts(layout)
    world = str(sum(layout))
    common = {
        "SLURM_JOB_ID": str(job_id),
        "SLURM_JOBID": str(job_id),
        "SLURM_JOB_NAME": "train",
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_NODELIST": nodelist,
        "SLURM_JOB_NUM_NODES": str(len(layout)),
        "SLURM_NNODES": str(len(layout)),
        "SLURM_NTASKS": world,
        "SLURM_NPROCS": world,
        "SLURM_TASKS_PER_NODE": counts,
        "SLURM_STEP_ID": "0",
        "SLURM_STEPID": "0",
        "SLURM_STEP_NODELIST": nodelist,
        "SLURM_STEP_NUM_NODES": str(len(layout)),
        "SLURM_STEP_NUM_TASKS": world,
        "SLURM_STEP_TASKS_PER_NODE": counts,
        "SLURM_SRUN_COMM_PORT": "40123",
        "SLURM_CLUSTER_NAME": "cluster",
        "SLURM_SUBMIT_DIR": "/home/user",
    }
    envs = tuple(
        common
        | {
            "SLURM_PROCID": str(p.rank),
            "SLURM_LOCALID": str(p.local_rank),
            "SLURM_NODEID": str(p.node_rank),
            "SLURMD_NODENAME": names[p.node_rank],
            "SLURM_TOPOLOGY_ADDR": names[p.node_rank],
            "SLURM_CPUS_ON_NODE": str(2 * p.local_world_size),
        }
        for p in expected
    )
    port = 15000 + int(str(job_id)[-4:])
    return Launch("slurm", tuple(layout), envs, tuple(expected), names[0], port)


def mpi_envs(layout: list[int], flavour: Launcher, master: str | None) -> Launch:
    """Every rank of ``mpirun`` over ``layout`` for Open MPI or MPICH / Intel MPI (Hydra)."""
    expected = expected_processes(layout)
    extra = {} if master is None else {"MASTER_ADDR": master}
    envs: list[dict[str, str]] = []
    for p in expected:
        if flavour == "openmpi":
            env = {
                "OMPI_COMM_WORLD_RANK": str(p.rank),
                "OMPI_COMM_WORLD_SIZE": str(p.world_size),
                "OMPI_COMM_WORLD_LOCAL_RANK": str(p.local_rank),
                "OMPI_COMM_WORLD_LOCAL_SIZE": str(p.local_world_size),
                # Counts across every job on the node: not a node index; distcompat ignores it.
                "OMPI_COMM_WORLD_NODE_RANK": str(p.local_rank),
                "OMPI_UNIVERSE_SIZE": str(p.world_size),
                "OMPI_MCA_orte_ess_num_procs": str(p.world_size),
            }
        else:
            env = {
                "PMI_RANK": str(p.rank),
                "PMI_SIZE": str(p.world_size),
                "MPI_LOCALRANKID": str(p.local_rank),
                "MPI_LOCALNRANKS": str(p.local_world_size),
                "PMI_FD": "6",
                "HYDRA_CONTROL_FD": "7",
            }
        envs.append(env | extra)
    single = len(layout) == 1
    addr = master if master is not None else ("127.0.0.1" if single else None)
    port = 29500 if addr is not None else None
    return Launch(flavour, tuple(layout), tuple(envs), tuple(expected), addr, port)


@st.composite
def launches(draw: st.DrawFn, layout_strategy: st.SearchStrategy[list[int]] = layouts) -> Launch:
    """One launch of any layout under torchrun, Slurm, Open MPI or MPICH.

    MPI exports no node index, so MPI launches only get layouts with the same count on every node
    (the assumption distcompat documents); torchrun and Slurm get any layout.
    """
    flavours: tuple[Launcher, ...] = ("torchrun", "slurm", "openmpi", "mpich")
    launcher = draw(st.sampled_from(flavours))
    if launcher in ("openmpi", "mpich"):
        layout = draw(uniform_layouts)
        master = None if len(layout) == 1 else draw(st.sampled_from([None, "10.0.0.1"]))
        return mpi_envs(layout, launcher, master)
    layout = draw(layout_strategy)
    if launcher == "torchrun":
        return torchrun_envs(
            layout, "node-0.cluster", draw(st.integers(1, 65535)), draw(st.booleans())
        )
    hosts = draw(host_group(size=len(layout)))
    return slurm_envs(layout, draw(st.integers(1, 10**9)), hosts)
