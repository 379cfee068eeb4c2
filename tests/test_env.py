"""LaunchEnv.from_environ on fabricated launcher environments: every launcher, every error."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import get_args

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distcompat.env import (
    DETECTION_ORDER,
    LaunchEnv,
    LaunchEnvError,
    Launcher,
    detect_launcher,
)
from distcompat.launch import _env as env_module
from strategies import Launch, expected_processes, launches, mpi_envs, nonuniform_layouts

# --- realistic environments, as the launchers write them ------------------------------------

# torchrun --nnodes=2 --nproc-per-node=4, worker with global rank 5 on the second node.
TORCHRUN = {
    "RANK": "5",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "8",
    "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "1",
    "GROUP_WORLD_SIZE": "2",
    "ROLE_RANK": "5",
    "ROLE_NAME": "default",
    "ROLE_WORLD_SIZE": "8",
    "MASTER_ADDR": "10.77.0.1",
    "MASTER_PORT": "41235",
    "TORCHELASTIC_RUN_ID": "job42",
    "TORCHELASTIC_RESTART_COUNT": "0",
    "TORCHELASTIC_MAX_RESTARTS": "0",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "OMP_NUM_THREADS": "1",
    "CUDA_VISIBLE_DEVICES": "0,1,2,3",
}

# srun -N3 -n5 over gpu007, gpu008, cpu3: task 3 is the second task on gpu008.
SLURM = {
    "SLURM_JOB_ID": "1234567",
    "SLURM_JOBID": "1234567",
    "SLURM_JOB_NAME": "train",
    "SLURM_JOB_NODELIST": "gpu[007-008],cpu3",
    "SLURM_NODELIST": "gpu[007-008],cpu3",
    "SLURM_JOB_NUM_NODES": "3",
    "SLURM_NNODES": "3",
    "SLURM_NTASKS": "5",
    "SLURM_NPROCS": "5",
    "SLURM_TASKS_PER_NODE": "2(x2),1",
    "SLURM_STEP_ID": "0",
    "SLURM_STEPID": "0",
    "SLURM_STEP_NODELIST": "gpu[007-008],cpu3",
    "SLURM_STEP_NUM_NODES": "3",
    "SLURM_STEP_NUM_TASKS": "5",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2),1",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_GTIDS": "2,3",
    "SLURMD_NODENAME": "gpu008",
    "SLURM_CPUS_ON_NODE": "8",
}

# The batch step of `sbatch --ntasks=4 -N2` running `python train.py` without srun.
SBATCH = {
    "SLURM_JOB_ID": "99",
    "SLURM_JOBID": "99",
    "SLURM_JOB_NAME": "train.sh",
    "SLURM_JOB_NODELIST": "n[1-2]",
    "SLURM_NODELIST": "n[1-2]",
    "SLURM_NNODES": "2",
    "SLURM_NTASKS": "4",
    "SLURM_NPROCS": "4",
    "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_GTIDS": "0",
    "ENVIRONMENT": "BATCH",
}

OMPI = {  # mpirun -np 8 --map-by ppr:4:node, rank 5
    "OMPI_COMM_WORLD_RANK": "5",
    "OMPI_COMM_WORLD_SIZE": "8",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
    "OMPI_COMM_WORLD_NODE_RANK": "1",
    "OMPI_UNIVERSE_SIZE": "8",
}

KUBEFLOW = {  # PyTorchJob, 1 master + 2 workers, worker-1 (training-operator v1 defaults)
    "RANK": "2",
    "WORLD_SIZE": "3",
    "MASTER_ADDR": "job-master-0",
    "MASTER_PORT": "23456",
    "PYTHONUNBUFFERED": "0",
    "PET_NPROC_PER_NODE": "auto",
    "PET_NODE_RANK": "2",
    "PET_NNODES": "3",
    "KUBERNETES_SERVICE_HOST": "10.96.0.1",
    "KUBERNETES_SERVICE_PORT": "443",
}

LSF = {  # jsrun on a CSM system: batch1 is the launch node
    "JSM_NAMESPACE_RANK": "5",
    "JSM_NAMESPACE_SIZE": "8",
    "JSM_NAMESPACE_LOCAL_RANK": "1",
    "JSM_NAMESPACE_LOCAL_SIZE": "4",
    "LSB_JOBID": "123456",
    "LSB_DJOB_RANKFILE": "/var/lsf/rankfile",
}
RANKFILE = "batch1\nnode1\nnode1\nnode1\nnode1\nnode2\nnode2\nnode2\nnode2\n"

SAGEMAKER = {
    "SM_HOSTS": '["algo-1","algo-2","algo-3"]',
    "SM_CURRENT_HOST": "algo-2",
    "SM_NUM_GPUS": "0",
    "SM_NUM_CPUS": "4",
    "SM_NETWORK_INTERFACE_NAME": "eth0",
    "SM_TRAINING_ENV": "{}",
}

# distcompat.testing's rank processes: the generic env contract, and the parent hosts the store.
HARNESS = {
    "RANK": "1",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_WORLD_SIZE": "2",
    "NODE_RANK": "0",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "41000",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
}


def files(contents: Mapping[str, str]) -> env_module.ReadText:
    """A fabricated file system for LSB_DJOB_RANKFILE."""
    return contents.get


def place(env: LaunchEnv) -> tuple[int, int, int, int, int, int]:
    return (
        env.rank,
        env.local_rank,
        env.world_size,
        env.local_world_size,
        env.node_rank,
        env.num_nodes,
    )


# --- one test per launcher -------------------------------------------------------------------


def test_torchrun_multi_node_with_agent_store() -> None:
    env = LaunchEnv.from_environ(TORCHRUN)
    assert env.launcher == "torchrun"
    assert place(env) == (5, 1, 8, 4, 1, 2)
    assert (env.master_addr, env.master_port) == ("10.77.0.1", 41235)
    assert env.agent_store is True
    assert env.cuda_visible_devices == "0,1,2,3"
    assert env.is_distributed
    assert env.sources["node_rank"] == "GROUP_RANK"
    assert env.sources["num_nodes"] == "GROUP_WORLD_SIZE"
    assert "every rank connects" in env.sources["agent_store"]


def test_torchrun_world_of_one_still_counts_as_distributed() -> None:
    single = TORCHRUN | {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    }
    env = LaunchEnv.from_environ(single)
    assert "rank 0 hosts the TCPStore" in env.sources["agent_store"]
    assert (env.launcher, env.world_size, env.is_distributed, env.agent_store) == (
        "torchrun",
        1,
        True,
        False,
    )


def test_torchrun_without_group_world_size_derives_nodes_and_says_so() -> None:
    env = LaunchEnv.from_environ({k: v for k, v in TORCHRUN.items() if k != "GROUP_WORLD_SIZE"})
    assert env.num_nodes == 2
    assert env.sources["num_nodes"].startswith("derived: WORLD_SIZE // LOCAL_WORLD_SIZE")


def test_torchrun_markers_without_run_id() -> None:
    hand = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    env = LaunchEnv.from_environ(hand | {"GROUP_RANK": "1"})
    assert env.launcher == "torchrun"
    assert place(env) == (3, 1, 4, 2, 1, 2)
    assert env.master_addr is None
    assert "not set" in env.sources["master_addr"]


def test_torchrun_inside_srun_wins_over_the_slurm_step() -> None:
    # srun -N2 --ntasks-per-node=1 torchrun --nproc-per-node=4: one Slurm task per node.
    outer = SLURM | {
        "SLURM_NTASKS": "2",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        "SLURM_STEP_NODELIST": "gpu[007-008]",
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "1",
    }
    env = LaunchEnv.from_environ(outer | TORCHRUN)
    assert env.launcher == "torchrun"
    assert place(env) == (5, 1, 8, 4, 1, 2)
    assert "Slurm variables ignored" in env.sources["launcher"]


def test_generic_env_contract_like_ray_train() -> None:
    ray = {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "NODE_RANK": "1",
        "MASTER_ADDR": "10.0.0.5",
        "MASTER_PORT": "33333",
    }
    env = LaunchEnv.from_environ(ray)
    assert env.launcher == "env"
    assert place(env) == (3, 1, 4, 2, 1, 2)
    assert env.sources["node_rank"] == "NODE_RANK"
    assert "assuming every node runs LOCAL_WORLD_SIZE" in env.sources["num_nodes"]
    assert (env.master_addr, env.master_port, env.agent_store) == ("10.0.0.5", 33333, False)


def test_hand_set_single_node_is_assumed_only_with_a_loopback_master() -> None:
    env = LaunchEnv.from_environ(
        {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    )
    assert place(env) == (1, 1, 2, 2, 0, 1)
    assert "assumed single node" in env.sources["local_world_size"]
    assert "assumed single node" in env.sources["local_rank"]
    with pytest.raises(LaunchEnvError, match=r"MASTER_ADDR='10\.0\.0\.1' is not a loopback"):
        LaunchEnv.from_environ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1"})


def test_env_contract_derives_local_world_size_from_group_world_size() -> None:
    env = LaunchEnv.from_environ(
        {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "GROUP_WORLD_SIZE": "2"}
    )
    assert place(env) == (5, 1, 8, 4, 1, 2)
    assert env.sources["local_world_size"].startswith("derived: WORLD_SIZE // GROUP_WORLD_SIZE")


def test_kubeflow_counts_pods_one_process_each() -> None:
    env = LaunchEnv.from_environ(KUBEFLOW)
    assert env.launcher == "kubeflow"
    assert place(env) == (2, 0, 3, 1, 2, 3)
    assert (env.master_addr, env.master_port) == ("job-master-0", 23456)
    assert "one process per pod" in env.sources["local_world_size"]


def test_kubeflow_pod_with_local_rank_is_the_generic_contract() -> None:
    env = LaunchEnv.from_environ(
        KUBEFLOW | {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "NODE_RANK": "2"}
    )
    assert env.launcher == "env"
    assert place(env) == (2, 0, 3, 1, 2, 3)


def test_kubeflow_expecting_torchrun_in_the_pod_is_an_error() -> None:
    bad = KUBEFLOW | {"PET_NPROC_PER_NODE": "4", "WORLD_SIZE": "12"}
    with pytest.raises(LaunchEnvError) as info:
        LaunchEnv.from_environ(bad)
    assert "PET_NPROC_PER_NODE=4" in str(info.value)
    assert "run torchrun inside the pod" in str(info.value)
    assert info.value.variable == "PET_NPROC_PER_NODE"


def test_azureml_pytorch_distribution() -> None:
    azure = {
        "AZUREML_RUN_ID": "run_1",
        "AZUREML_NODE_COUNT": "2",
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "NODE_RANK": "1",
        "MASTER_ADDR": "10.0.0.4",
        "MASTER_PORT": "6105",
    }
    env = LaunchEnv.from_environ(azure)
    assert env.launcher == "azureml"
    assert place(env) == (5, 1, 8, 4, 1, 2)
    assert "AZUREML_NODE_COUNT" in env.sources["local_world_size"]


def test_azureml_mpi_distribution_multi_node() -> None:
    env = LaunchEnv.from_environ(OMPI | {"AZ_BATCH_MASTER_NODE": "10.0.0.4:6105"})
    assert env.launcher == "azureml"
    assert place(env) == (5, 1, 8, 4, 1, 2)
    assert (env.master_addr, env.master_port) == ("10.0.0.4", 6105)


def test_azureml_mpi_distribution_single_node() -> None:
    single = OMPI | {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "1"}
    env = LaunchEnv.from_environ(single | {"AZ_BATCHAI_MPI_MASTER_NODE": "10.0.0.4"})
    assert (env.launcher, env.master_addr, env.master_port) == ("azureml", "10.0.0.4", 29500)
    assert "default 29500" in env.sources["master_port"]


def test_slurm_srun_task() -> None:
    env = LaunchEnv.from_environ(SLURM)
    assert env.launcher == "slurm"
    assert place(env) == (3, 1, 5, 2, 1, 3)
    assert env.master_addr == "gpu007"
    assert env.master_port == 15000 + 4567
    assert "SLURM_JOB_ID=1234567" in env.sources["master_port"]
    assert "15000 + last 4 digits" in env.sources["master_port"]
    assert env.sources["local_world_size"] == (
        "SLURM_STEP_TASKS_PER_NODE='2(x2),1', entry SLURM_NODEID=1"
    )
    assert env.sources["master_addr"] == "first host of SLURM_STEP_NODELIST='gpu[007-008],cpu3'"


def test_slurm_last_node_with_one_task() -> None:
    last = SLURM | {"SLURM_PROCID": "4", "SLURM_LOCALID": "0", "SLURM_NODEID": "2"}
    assert place(LaunchEnv.from_environ(last)) == (4, 0, 5, 1, 2, 3)


def test_slurm_master_port_and_addr_overrides() -> None:
    env = LaunchEnv.from_environ(SLURM | {"MASTER_PORT": "12345", "MASTER_ADDR": "gpu007-ib"})
    assert (env.master_addr, env.master_port) == ("gpu007-ib", 12345)
    assert env.sources["master_port"] == "MASTER_PORT"


def test_slurm_preserve_env_prefers_the_step_variables() -> None:
    # srun -E -n 2 inside a 5-task allocation keeps the job's SLURM_NTASKS/SLURM_TASKS_PER_NODE.
    step = SLURM | {
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_TASKS_PER_NODE": "2",
        "SLURM_STEP_NODELIST": "gpu008",
        "SLURM_PROCID": "1",
        "SLURM_NODEID": "0",
    }
    env = LaunchEnv.from_environ(step)
    assert place(env) == (1, 1, 2, 2, 0, 1)
    assert env.master_addr == "gpu008"


def test_slurm_with_only_ntasks_per_node() -> None:
    minimal = {
        "SLURM_JOB_ID": "42",
        "SLURM_STEP_ID": "3",
        "SLURM_PROCID": "3",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_NTASKS": "4",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "a[1-2]",
    }
    env = LaunchEnv.from_environ(minimal)
    assert place(env) == (3, 1, 4, 2, 1, 2)
    assert (env.master_addr, env.master_port) == ("a1", 15042)
    assert env.sources["num_nodes"] == "SLURM_NNODES"


def test_sbatch_without_srun_is_one_process_with_the_reason() -> None:
    env = LaunchEnv.from_environ(SBATCH)
    assert env.launcher == "none"
    assert place(env) == (0, 0, 1, 1, 0, 1)
    reason = env.sources["launcher"]
    assert "batch step" in reason
    assert "SLURM_NTASKS=4" in reason
    assert "srun" in reason
    assert not env.is_distributed


def test_interactive_allocation_is_not_a_slurm_launch() -> None:
    salloc = {
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NAME": "interactive",
        "SLURM_NTASKS": "4",
        "SLURM_JOB_NODELIST": "n1",
    }
    env = LaunchEnv.from_environ(salloc)
    assert env.launcher == "none"
    assert "interactive Slurm allocation" in env.sources["launcher"]
    assert "SLURM_NTASKS=4" in env.sources["launcher"]


def test_interactive_job_name_with_srun_step_variables_is_slurm() -> None:
    env = LaunchEnv.from_environ(SLURM | {"SLURM_JOB_NAME": "interactive"})
    assert env.launcher == "slurm"


def test_plain_salloc_shell_is_one_process() -> None:
    env = LaunchEnv.from_environ({"SLURM_JOB_ID": "7", "SLURM_JOB_NAME": "job"})
    assert env.launcher == "none"
    assert "salloc" in env.sources["launcher"]


def test_special_slurm_step_ids_are_not_srun_tasks() -> None:
    batch_step = SBATCH | {"SLURM_STEP_ID": str(0xFFFFFFFB)}
    env = LaunchEnv.from_environ(batch_step)
    assert env.launcher == "none"
    assert "batch step, not an srun task step" in env.sources["launcher"]


def test_mpirun_under_sbatch_beats_the_daemon_step() -> None:
    # mpirun starts one orted per node with srun; the ranks inherit that step's variables.
    daemon_step = {
        "SLURM_JOB_ID": "5",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "1",
        "SLURM_NTASKS": "2",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        "SLURM_STEP_NODELIST": "n[1-2]",
    }
    env = LaunchEnv.from_environ(daemon_step | OMPI | {"MASTER_ADDR": "n1"})
    assert env.launcher == "openmpi"
    assert place(env) == (5, 1, 8, 4, 1, 2)
    assert "mpirun's daemons" in env.sources["launcher"]


def test_srun_with_pmi_that_agrees_stays_slurm() -> None:
    pmi = {"PMI_RANK": "3", "PMI_SIZE": "5", "PMI_FD": "4"}
    assert LaunchEnv.from_environ(SLURM | pmi).launcher == "slurm"


def test_openmpi_single_node_gets_loopback_and_default_port() -> None:
    single = OMPI | {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "1"}
    env = LaunchEnv.from_environ(single)
    assert env.launcher == "openmpi"
    assert place(env) == (1, 1, 4, 4, 0, 1)
    assert (env.master_addr, env.master_port) == ("127.0.0.1", 29500)
    assert "single node" in env.sources["master_addr"]
    assert "default 29500" in env.sources["master_port"]


def test_openmpi_multi_node_without_master_addr_says_what_to_set() -> None:
    env = LaunchEnv.from_environ(OMPI)
    assert place(env) == (5, 1, 8, 4, 1, 2)
    assert env.master_addr is None
    assert env.master_port is None
    assert "set MASTER_ADDR" in env.sources["master_addr"]
    assert "MPI does not export" in env.sources["master_addr"]
    assert "assuming ranks are placed node by node" in env.sources["node_rank"]


def test_openmpi_multi_node_with_master_addr() -> None:
    env = LaunchEnv.from_environ(OMPI | {"MASTER_ADDR": "n1", "MASTER_PORT": "4000"})
    assert (env.master_addr, env.master_port) == ("n1", 4000)
    env = LaunchEnv.from_environ(OMPI | {"MASTER_ADDR": "n1"})
    assert (env.master_addr, env.master_port) == ("n1", 29500)


def test_mpich_and_intel_mpi() -> None:
    hydra = {
        "PMI_RANK": "2",
        "PMI_SIZE": "4",
        "MPI_LOCALRANKID": "0",
        "MPI_LOCALNRANKS": "2",
        "PMI_FD": "6",
        "MASTER_ADDR": "h1",
    }
    env = LaunchEnv.from_environ(hydra)
    assert env.launcher == "mpich"
    assert place(env) == (2, 0, 4, 2, 1, 2)


def test_mvapich2_wins_over_its_generic_pmi_variables() -> None:
    mv2 = {
        "MV2_COMM_WORLD_RANK": "1",
        "MV2_COMM_WORLD_SIZE": "2",
        "MV2_COMM_WORLD_LOCAL_RANK": "1",
        "MV2_COMM_WORLD_LOCAL_SIZE": "2",
        "PMI_RANK": "1",
        "PMI_SIZE": "2",
    }
    env = LaunchEnv.from_environ(mv2)
    assert env.launcher == "mvapich2"
    assert place(env) == (1, 1, 2, 2, 0, 1)


def test_lsf_jsrun_reads_the_rank_file_through_the_seam() -> None:
    env = LaunchEnv.from_environ(LSF, read_text=files({"/var/lsf/rankfile": RANKFILE}))
    assert env.launcher == "lsf"
    assert place(env) == (5, 1, 8, 4, 1, 2)
    assert env.master_addr == "node1"
    assert env.master_port == 10000 + 123456 % 1000
    assert "launch node skipped" in env.sources["master_addr"]
    assert "LSB_JOBID=123456" in env.sources["master_port"]


def test_lsf_falls_back_to_mcpu_hosts_when_the_rank_file_is_missing() -> None:
    env = LaunchEnv.from_environ(
        LSF | {"LSB_MCPU_HOSTS": "batch1 1 node7 42 node8 42"}, read_text=files({})
    )
    assert env.master_addr == "node7"


def test_lsf_without_local_size_derives_it_from_the_hosts() -> None:
    no_local = {k: v for k, v in LSF.items() if k != "JSM_NAMESPACE_LOCAL_SIZE"}
    env = LaunchEnv.from_environ(no_local, read_text=files({"/var/lsf/rankfile": RANKFILE}))
    assert place(env) == (5, 1, 8, 4, 1, 2)
    assert "2 hosts" in env.sources["local_world_size"]


def test_lsf_default_reader_reads_an_existing_rank_file(tmp_path: Path) -> None:
    rankfile = tmp_path / "rankfile"
    rankfile.write_text(RANKFILE, encoding="utf-8")
    env = LaunchEnv.from_environ(LSF | {"LSB_DJOB_RANKFILE": str(rankfile)})
    assert env.master_addr == "node1"
    missing = LSF | {"LSB_DJOB_RANKFILE": str(tmp_path / "absent")}
    assert LaunchEnv.from_environ(missing).master_addr is None


def test_sagemaker_one_process_per_host() -> None:
    env = LaunchEnv.from_environ(SAGEMAKER)
    assert env.launcher == "sagemaker"
    assert place(env) == (1, 0, 3, 1, 1, 3)
    assert (env.master_addr, env.master_port) == ("algo-1", 7777)


def test_sagemaker_torch_distributed_starts_torchrun_which_wins() -> None:
    env = LaunchEnv.from_environ(SAGEMAKER | TORCHRUN)
    assert env.launcher == "torchrun"


def test_no_launcher_is_a_single_process() -> None:
    env = LaunchEnv.from_environ({"PATH": "/usr/bin", "HOME": "/root"})
    assert env.launcher == "none"
    assert place(env) == (0, 0, 1, 1, 0, 1)
    assert (env.master_addr, env.master_port, env.agent_store) == (None, None, False)
    assert env.cuda_visible_devices is None
    assert env.sources["launcher"] == "no launcher variables found"


def test_cuda_visible_devices_is_kept_as_set() -> None:
    assert LaunchEnv.from_environ({"CUDA_VISIBLE_DEVICES": ""}).cuda_visible_devices == ""
    env = LaunchEnv.from_environ(SLURM | {"CUDA_VISIBLE_DEVICES": "2,3"})
    assert env.cuda_visible_devices == "2,3"
    assert env.sources["cuda_visible_devices"] == "CUDA_VISIBLE_DEVICES"


def test_environ_none_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("distcompat.launch._env.os.environ", dict(TORCHRUN))
    assert LaunchEnv.from_environ().rank == 5


# --- the agent store: torch honours TORCHELASTIC_USE_AGENT_STORE whatever the launcher --------


def test_generic_env_contract_with_an_agent_store_connects_every_rank() -> None:
    env = LaunchEnv.from_environ(HARNESS)
    assert env.launcher == "env"
    assert (env.master_addr, env.master_port, env.agent_store) == ("127.0.0.1", 41000, True)
    assert env.sources["agent_store"].startswith("TORCHELASTIC_USE_AGENT_STORE='True'")
    assert "every rank connects" in env.sources["agent_store"]


def test_slurm_with_an_agent_store_connects_every_rank() -> None:
    env = LaunchEnv.from_environ(SLURM | {"TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert (env.launcher, env.agent_store) == ("slurm", True)
    assert "TORCHELASTIC_USE_AGENT_STORE='True'" in env.sources["agent_store"]


@pytest.mark.parametrize(
    ("environ", "launcher"),
    [
        (TORCHRUN, "torchrun"),
        (HARNESS, "env"),
        (KUBEFLOW, "kubeflow"),
        (HARNESS | {"AZUREML_RUN_ID": "run-1"}, "azureml"),
        (SLURM, "slurm"),
        (OMPI | {"MASTER_ADDR": "10.0.0.1"}, "openmpi"),
        (LSF, "lsf"),
        (SAGEMAKER, "sagemaker"),
    ],
)
@pytest.mark.parametrize("value", ["True", "False", None])
def test_every_launcher_with_a_master_reads_the_agent_store(
    environ: dict[str, str], launcher: Launcher, value: str | None
) -> None:
    environ = without(environ, "TORCHELASTIC_USE_AGENT_STORE")
    if value is not None:
        environ["TORCHELASTIC_USE_AGENT_STORE"] = value
    env = LaunchEnv.from_environ(environ, read_text=files({"/var/lsf/rankfile": RANKFILE}))
    assert (env.launcher, env.agent_store) == (launcher, value == "True")
    assert "TORCHELASTIC_USE_AGENT_STORE" in env.sources["agent_store"]
    if value != "True":
        assert "rank 0 hosts the TCPStore" in env.sources["agent_store"]


def test_no_launcher_has_no_store_to_share_whatever_the_variable_says() -> None:
    for value in ("True", "true"):
        env = LaunchEnv.from_environ({"TORCHELASTIC_USE_AGENT_STORE": value})
        assert (env.launcher, env.agent_store) == ("none", False)
        assert "single process" in env.sources["agent_store"]


# --- detection -------------------------------------------------------------------------------


def test_detection_order_names_every_launcher_once() -> None:
    assert sorted(DETECTION_ORDER) == sorted(get_args(Launcher))
    assert DETECTION_ORDER[0] == "torchrun"
    assert DETECTION_ORDER[-1] == "none"


@pytest.mark.parametrize(
    ("environ", "launcher"),
    [
        (TORCHRUN, "torchrun"),
        (SLURM | TORCHRUN, "torchrun"),
        (SLURM, "slurm"),
        (SBATCH, "none"),
        (OMPI, "openmpi"),
        (KUBEFLOW, "kubeflow"),
        (LSF, "lsf"),
        (SAGEMAKER, "sagemaker"),
        ({}, "none"),
        # detection does not validate: a broken value is only reported by from_environ
        ({"RANK": "x"}, "env"),
    ],
)
def test_detect_launcher(environ: dict[str, str], launcher: Launcher) -> None:
    assert detect_launcher(environ) == launcher


# --- every bad value is named in its error ---------------------------------------------------


def without(environ: Mapping[str, str], *names: str) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k not in names}


ERRORS: list[tuple[str, dict[str, str], list[str]]] = [
    ("not an integer", {"RANK": "abc", "WORLD_SIZE": "2"}, ["RANK='abc'", "not an integer"]),
    ("world not int", {"RANK": "0", "WORLD_SIZE": "two"}, ["WORLD_SIZE='two'"]),
    ("float rank", TORCHRUN | {"RANK": "1.0"}, ["RANK='1.0'", "not an integer"]),
    ("negative rank", {"RANK": "-1", "WORLD_SIZE": "2"}, ["RANK=-1", "negative"]),
    (
        "rank above world",
        {"RANK": "5", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost"},
        ["RANK=5 is not below WORLD_SIZE=2 (rank must be in [0, WORLD_SIZE))"],
    ),
    ("empty world", {"RANK": "0", "WORLD_SIZE": "0"}, ["WORLD_SIZE=0", "below 1"]),
    ("rank alone", {"RANK": "1"}, ["RANK='1'", "WORLD_SIZE is not set"]),
    ("world alone", {"WORLD_SIZE": "4"}, ["WORLD_SIZE='4'", "RANK is not set"]),
    (
        "local world without local rank",
        {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"},
        ["LOCAL_WORLD_SIZE=2", "LOCAL_RANK is not"],
    ),
    (
        "local rank not below local world",
        TORCHRUN | {"LOCAL_RANK": "4"},
        ["LOCAL_RANK=4", "LOCAL_WORLD_SIZE=4"],
    ),
    (
        "local world above world",
        TORCHRUN | {"LOCAL_WORLD_SIZE": "16"},
        ["LOCAL_WORLD_SIZE=16", "WORLD_SIZE=8"],
    ),
    (
        "node rank not below nodes",
        TORCHRUN | {"GROUP_RANK": "2"},
        ["GROUP_RANK=2", "GROUP_WORLD_SIZE=2"],
    ),
    (
        "too many nodes",
        TORCHRUN | {"GROUP_WORLD_SIZE": "9"},
        ["GROUP_WORLD_SIZE=9", "WORLD_SIZE=8", "LOCAL_WORLD_SIZE=4"],
    ),
    ("port zero", TORCHRUN | {"MASTER_PORT": "0"}, ["MASTER_PORT=0", "1..65535"]),
    ("port too big", TORCHRUN | {"MASTER_PORT": "70000"}, ["MASTER_PORT=70000", "1..65535"]),
    ("port not int", TORCHRUN | {"MASTER_PORT": "http"}, ["MASTER_PORT='http'"]),
    ("empty addr", TORCHRUN | {"MASTER_ADDR": ""}, ["MASTER_ADDR=''", "empty"]),
    ("torchrun no addr", without(TORCHRUN, "MASTER_ADDR"), ["MASTER_ADDR is not set", "torchrun"]),
    ("torchrun no node", without(TORCHRUN, "GROUP_RANK"), ["GROUP_RANK is not set"]),
    ("torchrun no local", without(TORCHRUN, "LOCAL_RANK"), ["LOCAL_RANK is not set"]),
    (
        "agent store spelling",
        TORCHRUN | {"TORCHELASTIC_USE_AGENT_STORE": "true"},
        ["TORCHELASTIC_USE_AGENT_STORE='true'", "'True'"],
    ),
    (
        "agent store spelling under env://",
        HARNESS | {"TORCHELASTIC_USE_AGENT_STORE": "1"},
        ["TORCHELASTIC_USE_AGENT_STORE='1'", "neither 'True' nor 'False'"],
    ),
    (
        "agent store spelling under srun",
        SLURM | {"TORCHELASTIC_USE_AGENT_STORE": "yes"},
        ["TORCHELASTIC_USE_AGENT_STORE='yes'", "'True'"],
    ),
    (
        "uneven torchrun nodes",
        {
            "RANK": "0",
            "GROUP_RANK": "0",
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "3",
            "WORLD_SIZE": "4",
        },
        ["WORLD_SIZE=4", "LOCAL_WORLD_SIZE=3", "GROUP_WORLD_SIZE"],
    ),
    (
        "node rank names disagree",
        {
            "RANK": "1",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "1",
            "GROUP_WORLD_SIZE": "2",
            "NODE_RANK": "1",
            "GROUP_RANK": "0",
        },
        ["NODE_RANK=1", "GROUP_RANK=0", "disagree"],
    ),
    (
        "local rank differs, no local world",
        {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"},
        ["LOCAL_RANK=1", "RANK=3", "LOCAL_WORLD_SIZE is not set"],
    ),
    (
        "node rank, no local world",
        {"RANK": "3", "WORLD_SIZE": "4", "NODE_RANK": "1"},
        ["NODE_RANK=1", "LOCAL_WORLD_SIZE is not set"],
    ),
    (
        "node count does not divide",
        {"RANK": "0", "WORLD_SIZE": "5", "LOCAL_RANK": "0", "GROUP_WORLD_SIZE": "2"},
        ["GROUP_WORLD_SIZE=2", "WORLD_SIZE=5"],
    ),
    (
        "kubeflow expects torchrun",
        KUBEFLOW | {"PET_NPROC_PER_NODE": "8"},
        ["PET_NPROC_PER_NODE=8", "RANK=2"],
    ),
    ("kubeflow partial", without(KUBEFLOW, "WORLD_SIZE"), ["RANK='2'", "WORLD_SIZE is not set"]),
    (
        "slurm node id out of range",
        SLURM | {"SLURM_NODEID": "3"},
        ["SLURM_NODEID=3", "SLURM_STEP_TASKS_PER_NODE='2(x2),1'", "3 node(s)"],
    ),
    (
        "slurm malformed node list",
        SLURM | {"SLURM_STEP_NODELIST": "gpu[1-3"},
        ["SLURM_STEP_NODELIST='gpu[1-3'", "never closed", "position 3"],
    ),
    (
        "slurm reversed range",
        SLURM | {"SLURM_STEP_NODELIST": "gpu[9-7],a,b"},
        ["SLURM_STEP_NODELIST='gpu[9-7],a,b'", "reversed range '9-7'"],
    ),
    (
        "slurm malformed tasks",
        SLURM | {"SLURM_STEP_TASKS_PER_NODE": "2(x3"},
        ["SLURM_STEP_TASKS_PER_NODE='2(x3'", "position 0"],
    ),
    (
        "slurm tasks do not add up",
        SLURM | {"SLURM_STEP_NUM_TASKS": "6"},
        ["SLURM_STEP_TASKS_PER_NODE='2(x2),1'", "adds up to 5", "SLURM_STEP_NUM_TASKS=6"],
    ),
    (
        "slurm host and node counts differ",
        SLURM | {"SLURM_STEP_NODELIST": "gpu[1-4]"},
        ["SLURM_STEP_NODELIST='gpu[1-4]'", "4 host(s)", "3 node(s)"],
    ),
    ("slurm no procid", without(SLURM, "SLURM_PROCID"), ["SLURM_PROCID is not set", "srun"]),
    (
        "slurm procid too big",
        SLURM | {"SLURM_PROCID": "5"},
        ["SLURM_PROCID=5 is not below SLURM_STEP_NUM_TASKS=5"],
    ),
    (
        "slurm local id too big",
        SLURM | {"SLURM_LOCALID": "2"},
        ["SLURM_LOCALID=2", "SLURM_STEP_TASKS_PER_NODE[node 1]=2"],
    ),
    ("slurm job id", SLURM | {"SLURM_JOB_ID": "12a"}, ["SLURM_JOB_ID='12a'", "not an integer"]),
    ("slurm step id", SLURM | {"SLURM_STEP_ID": "x"}, ["SLURM_STEP_ID='x'", "not an integer"]),
    (
        "slurm no counts at all",
        without(SLURM, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"),
        ["SLURM_NTASKS_PER_NODE is not set"],
    ),
    (
        "openmpi partial",
        {"OMPI_COMM_WORLD_RANK": "0"},
        ["OMPI_COMM_WORLD_SIZE is not set", "openmpi"],
    ),
    (
        "openmpi round robin",
        OMPI | {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0"},
        ["OMPI_COMM_WORLD_LOCAL_RANK=0", "OMPI_COMM_WORLD_RANK=1", "node by node"],
    ),
    (
        "openmpi uneven nodes",
        OMPI | {"OMPI_COMM_WORLD_SIZE": "7", "OMPI_COMM_WORLD_RANK": "1"},
        ["OMPI_COMM_WORLD_SIZE=7", "OMPI_COMM_WORLD_LOCAL_SIZE=4", "not a multiple"],
    ),
    (
        "mpich local rank",
        {"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "x", "MPI_LOCALNRANKS": "2"},
        ["MPI_LOCALRANKID='x'"],
    ),
    (
        "azure master without port",
        OMPI | {"AZ_BATCH_MASTER_NODE": "10.0.0.4"},
        ["AZ_BATCH_MASTER_NODE='10.0.0.4'", "HOST:PORT"],
    ),
    (
        "azure master port zero",
        OMPI | {"AZ_BATCH_MASTER_NODE": "10.0.0.4:0"},
        ["AZ_BATCH_MASTER_NODE='10.0.0.4:0'", "port 0"],
    ),
    ("lsf partial", without(LSF, "JSM_NAMESPACE_LOCAL_RANK"), ["JSM_NAMESPACE_LOCAL_RANK is not"]),
    (
        "lsf one line rank file",
        LSF | {"LSB_DJOB_RANKFILE": "/one"},
        ["LSB_DJOB_RANKFILE='/one'", "1 host line"],
    ),
    (
        "lsf bad mcpu hosts",
        LSF | {"LSB_DJOB_RANKFILE": "/absent", "LSB_MCPU_HOSTS": "a b c"},
        ["LSB_MCPU_HOSTS='a b c'"],
    ),
    (
        "lsf no local size, no hosts",
        without(LSF, "JSM_NAMESPACE_LOCAL_SIZE", "LSB_DJOB_RANKFILE"),
        ["JSM_NAMESPACE_LOCAL_SIZE is not set", "LSB_DJOB_RANKFILE"],
    ),
    ("lsf job id", LSF | {"LSB_JOBID": "j1"}, ["LSB_JOBID='j1'"]),
    ("sagemaker hosts", SAGEMAKER | {"SM_HOSTS": "algo-1"}, ["SM_HOSTS='algo-1'", "JSON list"]),
    (
        "sagemaker unknown host",
        SAGEMAKER | {"SM_CURRENT_HOST": "algo-9"},
        ["SM_HOSTS=", "SM_CURRENT_HOST='algo-9'"],
    ),
    ("sagemaker partial", without(SAGEMAKER, "SM_CURRENT_HOST"), ["SM_HOSTS=", "SM_CURRENT_HOST"]),
]


@pytest.mark.parametrize(
    ("environ", "fragments"), [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS]
)
def test_errors_name_the_variable_and_its_value(
    environ: dict[str, str], fragments: list[str]
) -> None:
    rankfiles = files({"/var/lsf/rankfile": RANKFILE, "/one": "batch1\n"})
    with pytest.raises(LaunchEnvError) as info:
        LaunchEnv.from_environ(environ, read_text=rankfiles)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message
    assert isinstance(info.value, ValueError)
    assert info.value.variable is not None
    assert info.value.variable in message


def test_unreadable_rank_file_is_reported() -> None:
    def denied(path: str) -> str | None:
        raise PermissionError(13, "Permission denied", path)

    with pytest.raises(
        LaunchEnvError, match=r"LSB_DJOB_RANKFILE='/var/lsf/rankfile' cannot be read"
    ):
        LaunchEnv.from_environ(LSF, read_text=denied)


# --- the dataclass ---------------------------------------------------------------------------


def test_launch_env_is_frozen_and_compares_without_sources() -> None:
    env = LaunchEnv.from_environ(SLURM)
    with pytest.raises(dataclasses.FrozenInstanceError):
        env.rank = 0  # type: ignore[misc]
    twin = dataclasses.replace(env, sources={})
    assert twin == env
    assert hash(twin) == hash(env)


def test_direct_construction_is_validated() -> None:
    fields: dict[str, object] = {
        "launcher": "env",
        "rank": 2,
        "local_rank": 0,
        "world_size": 2,
        "local_world_size": 1,
        "node_rank": 0,
        "num_nodes": 2,
        "master_addr": "h",
        "master_port": 1,
        "agent_store": False,
        "cuda_visible_devices": None,
    }
    with pytest.raises(LaunchEnvError, match=r"rank=2 is not below world_size=2"):
        LaunchEnv(**fields)  # type: ignore[arg-type]
    with pytest.raises(LaunchEnvError, match=r"master_port=0"):
        LaunchEnv(**(fields | {"rank": 1, "master_port": 0}))  # type: ignore[arg-type]


def test_describe_lists_every_field_with_its_source() -> None:
    env = LaunchEnv.from_environ(SLURM)
    text = env.describe()
    lines = text.splitlines()
    assert lines[0].split()[:2] == ["launcher", "slurm"]
    assert "SLURM_STEP_ID=0" in lines[0]
    for name in ("rank", "local_rank", "world_size", "local_world_size", "node_rank", "num_nodes",
                 "master_addr", "master_port", "agent_store", "cuda_visible_devices"):  # fmt: skip
        line = next(line for line in lines if line.split()[0] == name)
        assert str(getattr(env, name)) in line
        assert env.sources[name] in line
    assert "rank                  3" in text


# --- properties ------------------------------------------------------------------------------


def parse_or_error(
    environ: Mapping[str, str], read_text: env_module.ReadText | None = None
) -> LaunchEnv | LaunchEnvError:
    try:
        return LaunchEnv.from_environ(environ, read_text=read_text)
    except LaunchEnvError as err:
        return err


@settings(max_examples=150, deadline=None)
@given(launches())
def test_every_process_of_a_launch_finds_its_place(launch: Launch) -> None:
    parsed = [LaunchEnv.from_environ(environ) for environ in launch.envs]
    world = sum(launch.layout)
    assert sorted(p.rank for p in parsed) == list(range(world))
    by_node: defaultdict[int, list[int]] = defaultdict(list)
    for got, want in zip(parsed, launch.expected, strict=True):
        assert got.launcher == launch.launcher
        assert (got.rank, got.local_rank, got.node_rank) == (
            want.rank,
            want.local_rank,
            want.node_rank,
        )
        assert (got.world_size, got.local_world_size, got.num_nodes) == (
            world,
            launch.layout[want.node_rank],
            len(launch.layout),
        )
        assert set(got.sources) == {f.name for f in dataclasses.fields(got)} - {"sources"}
        by_node[got.node_rank].append(got.local_rank)
    for node, locals_ in by_node.items():
        assert sorted(locals_) == list(range(launch.layout[node]))
    assert {(p.master_addr, p.master_port) for p in parsed} == {
        (launch.master_addr, launch.master_port)
    }


@settings(max_examples=60, deadline=None)
@given(nonuniform_layouts, st.sampled_from(["openmpi", "mpich"]))
def test_mpi_on_uneven_nodes_raises_or_still_gets_ranks_right(
    layout: list[int], flavour: Launcher
) -> None:
    launch = mpi_envs(layout, flavour, "10.0.0.1")
    for environ, want in zip(launch.envs, expected_processes(layout), strict=True):
        got = parse_or_error(environ)
        if isinstance(got, LaunchEnvError):
            assert "cannot be derived" in str(got)
            continue
        assert (got.rank, got.local_rank, got.world_size, got.local_world_size) == (
            want.rank,
            want.local_rank,
            want.world_size,
            want.local_world_size,
        )


_NAMES = sorted(
    {
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "NODE_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_USE_AGENT_STORE",
        "KUBERNETES_SERVICE_HOST",
        "PET_NPROC_PER_NODE",
        "AZUREML_RUN_ID",
        "AZUREML_NODE_COUNT",
        "AZ_BATCH_MASTER_NODE",
        "AZ_BATCHAI_MPI_MASTER_NODE",
        "ENVIRONMENT",
        "SLURM_JOB_NAME",
        *SLURM,
        *OMPI,
        "PMI_RANK",
        "PMI_SIZE",
        "MPI_LOCALRANKID",
        "MPI_LOCALNRANKS",
        "MV2_COMM_WORLD_RANK",
        "MV2_COMM_WORLD_SIZE",
        *LSF,
        "LSB_MCPU_HOSTS",
        *SAGEMAKER,
    }
)
_VALUES = st.sampled_from(
    [
        "0",
        "1",
        "2",
        "3",
        "8",
        "-1",
        "",
        "x",
        "1.5",
        "65536",
        "True",
        "2(x2)",
        "n[1-2]",
        "n[",
        "a:1",
        '["a","b"]',
        "[]",
        "4294967291",
        "localhost",
        "batch1 1 n1 2",
    ]
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(_NAMES), _VALUES, max_size=12))
def test_any_environment_parses_or_raises_launch_env_error(environ: dict[str, str]) -> None:
    env = parse_or_error(environ, read_text=files({"n[1-2]": "a\nb\n"}))
    if isinstance(env, LaunchEnvError):
        assert env.variable is None or env.variable in str(env)
        return
    assert 0 <= env.rank < env.world_size
    assert 0 <= env.local_rank < env.local_world_size <= env.world_size
    assert 0 <= env.node_rank < env.num_nodes
    assert env.launcher == detect_launcher(environ)


def test_gloo_socket_ifname_is_read_with_its_source() -> None:
    env = LaunchEnv.from_environ(TORCHRUN | {"GLOO_SOCKET_IFNAME": "eth1"})
    assert env.gloo_socket_ifname == "eth1"
    assert env.sources["gloo_socket_ifname"] == "GLOO_SOCKET_IFNAME"
    assert "gloo_socket_ifname    eth1" in env.describe()
    unset = LaunchEnv.from_environ(TORCHRUN)
    assert unset.gloo_socket_ifname is None
    assert unset.sources["gloo_socket_ifname"] == "not set"


def test_openmpi_single_host_port_comes_from_the_job() -> None:
    """Env-dict parsing only (the real two-job run is in the launchers session's notes).

    Two mpirun jobs on one host used to default to 29500 and the second failed (EADDRINUSE);
    the port now follows Open MPI's job family, and MASTER_PORT still wins.
    """
    one_host = {
        "OMPI_COMM_WORLD_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }
    first = LaunchEnv.from_environ(one_host | {"OMPI_MCA_ess_base_jobid": "1647575041"})
    assert (first.master_addr, first.master_port) == ("127.0.0.1", 20000 + 25140 % 10000)
    assert "OMPI_MCA_ess_base_jobid" in first.sources["master_port"]
    second = LaunchEnv.from_environ(one_host | {"OMPI_MCA_ess_base_jobid": "2081554433"})
    assert second.master_port != first.master_port
    assert LaunchEnv.from_environ(one_host).master_port == 29500
    chosen = one_host | {"OMPI_MCA_ess_base_jobid": "1647575041", "MASTER_PORT": "4000"}
    assert LaunchEnv.from_environ(chosen).master_port == 4000
