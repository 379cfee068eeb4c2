# ruff: noqa: E402  (the imports follow quiet_own_command() on purpose: see _command)
"""distcompat: PyTorch distributed code that behaves the same on every backend and launcher.

The two lines a training script writes::

    import distcompat
    info = distcompat.init_distributed(device="cpu")   # gloo on CPU, nccl on CUDA
    print(info.reason)                                  # why this device, backend, timeout

Importing distcompat configures nothing, writes no environment variable and probes no hardware;
only in distcompat's own command (``distcompat ...``) does it first hide torch's NumPy warning.
It imports no subpackage either: each public name is imported on its first use (``_EXPORTS``),
so ``import distcompat`` costs no more than the modules a program goes on to use.
"""

from distcompat._command import quiet_own_command

quiet_own_command()  # before any distcompat module imports torch; a no-op in a user's program

from importlib import import_module
from typing import TYPE_CHECKING, Any

from distcompat._version import __version__

if TYPE_CHECKING:  # type checkers, IDEs and the docs see every name; Python imports it on first use
    from distcompat.anysize import BatchSplitError, ExactGradients, TrainPlan, counter_rng
    from distcompat.attention import (
        AttentionConfigError,
        AttentionDecision,
        AttentionInputError,
        AttentionUnavailableError,
        attend,
        explain_attention,
    )
    from distcompat.checkpoint import (
        AsyncCheckpointer,
        CheckpointCorruptError,
        CheckpointExistsError,
        CheckpointNotFoundError,
        CheckpointSyncError,
        CheckpointWriteError,
        WorldSizeMismatchError,
        atomic_save,
        latest_checkpoint,
        load_checkpoint,
        save_checkpoint,
    )
    from distcompat.collectives import (
        CollectiveError,
        CollectivePlan,
        CollectiveTimeoutError,
        CompatWork,
        NoPeerError,
        NotInGroupError,
        PeerLostError,
        UnsupportedCollectiveError,
        all_gather,
        all_gather_into_tensor,
        all_gather_object,
        all_gather_single,
        all_gather_uneven,
        all_reduce,
        all_reduce_coalesced,
        all_to_all,
        all_to_all_single,
        broadcast,
        broadcast_object_list,
        explain_collective,
        gather,
        gather_object,
        gather_single,
        irecv,
        isend,
        recv,
        reduce,
        reduce_scatter,
        reduce_scatter_coalesced,
        reduce_scatter_single,
        reduce_scatter_tensor,
        scatter,
        scatter_object_list,
        send,
    )
    from distcompat.collectives._capabilities import Capabilities, capabilities
    from distcompat.data import (
        EmptyShardError,
        ShardedSampler,
        TokenLoader,
        gather_for_metrics,
        shard_indices,
        write_tokens,
    )
    from distcompat.diagnostics import (
        HangError,
        SingleRankCollectiveError,
        single_rank_region,
        watchdog,
    )
    from distcompat.join import all_have_data, join_uneven
    from distcompat.launch import LaunchEnv, LaunchEnvError
    from distcompat.launch._placement import BackendUnavailableError, DeviceBindingError
    from distcompat.preemption import Preemption, PreemptionError, StopReport
    from distcompat.process_group import (
        DistInfo,
        DistInitError,
        barrier,
        destroy_distributed,
        distributed_session,
        get_local_rank,
        get_rank,
        get_world_size,
        init_distributed,
        is_main_process,
    )
    from distcompat.rank_logging import get_logger, print0, progress, rank_zero_only, warn_once

#: Where each public name lives. ``distcompat.X`` imports ``_EXPORTS["X"]`` on first access and
#: keeps the value here, so the second access is an ordinary attribute. Keep it and ``__all__``
#: and the imports above in step (tests/test_import_time.py checks).
_EXPORTS = {
    "BatchSplitError": "distcompat.anysize",
    "ExactGradients": "distcompat.anysize",
    "TrainPlan": "distcompat.anysize",
    "counter_rng": "distcompat.anysize",
    "AttentionConfigError": "distcompat.attention",
    "AttentionDecision": "distcompat.attention",
    "AttentionInputError": "distcompat.attention",
    "AttentionUnavailableError": "distcompat.attention",
    "attend": "distcompat.attention",
    "explain_attention": "distcompat.attention",
    "AsyncCheckpointer": "distcompat.checkpoint",
    "CheckpointCorruptError": "distcompat.checkpoint",
    "CheckpointExistsError": "distcompat.checkpoint",
    "CheckpointNotFoundError": "distcompat.checkpoint",
    "CheckpointSyncError": "distcompat.checkpoint",
    "CheckpointWriteError": "distcompat.checkpoint",
    "WorldSizeMismatchError": "distcompat.checkpoint",
    "atomic_save": "distcompat.checkpoint",
    "latest_checkpoint": "distcompat.checkpoint",
    "load_checkpoint": "distcompat.checkpoint",
    "save_checkpoint": "distcompat.checkpoint",
    "CollectiveError": "distcompat.collectives",
    "CollectivePlan": "distcompat.collectives",
    "CollectiveTimeoutError": "distcompat.collectives",
    "CompatWork": "distcompat.collectives",
    "NoPeerError": "distcompat.collectives",
    "NotInGroupError": "distcompat.collectives",
    "PeerLostError": "distcompat.collectives",
    "UnsupportedCollectiveError": "distcompat.collectives",
    "all_gather": "distcompat.collectives",
    "all_gather_into_tensor": "distcompat.collectives",
    "all_gather_object": "distcompat.collectives",
    "all_gather_single": "distcompat.collectives",
    "all_gather_uneven": "distcompat.collectives",
    "all_reduce": "distcompat.collectives",
    "all_reduce_coalesced": "distcompat.collectives",
    "all_to_all": "distcompat.collectives",
    "all_to_all_single": "distcompat.collectives",
    "broadcast": "distcompat.collectives",
    "broadcast_object_list": "distcompat.collectives",
    "explain_collective": "distcompat.collectives",
    "gather": "distcompat.collectives",
    "gather_single": "distcompat.collectives",
    "gather_object": "distcompat.collectives",
    "irecv": "distcompat.collectives",
    "isend": "distcompat.collectives",
    "recv": "distcompat.collectives",
    "reduce": "distcompat.collectives",
    "reduce_scatter": "distcompat.collectives",
    "reduce_scatter_coalesced": "distcompat.collectives",
    "reduce_scatter_single": "distcompat.collectives",
    "reduce_scatter_tensor": "distcompat.collectives",
    "scatter": "distcompat.collectives",
    "scatter_object_list": "distcompat.collectives",
    "send": "distcompat.collectives",
    "Capabilities": "distcompat.collectives._capabilities",
    "capabilities": "distcompat.collectives._capabilities",
    "EmptyShardError": "distcompat.data",
    "ShardedSampler": "distcompat.data",
    "TokenLoader": "distcompat.data",
    "gather_for_metrics": "distcompat.data",
    "shard_indices": "distcompat.data",
    "write_tokens": "distcompat.data",
    "HangError": "distcompat.diagnostics",
    "SingleRankCollectiveError": "distcompat.diagnostics",
    "single_rank_region": "distcompat.diagnostics",
    "watchdog": "distcompat.diagnostics",
    "all_have_data": "distcompat.join",
    "join_uneven": "distcompat.join",
    "LaunchEnv": "distcompat.launch",
    "LaunchEnvError": "distcompat.launch",
    "BackendUnavailableError": "distcompat.launch._placement",
    "DeviceBindingError": "distcompat.launch._placement",
    "DistInfo": "distcompat.process_group",
    "DistInitError": "distcompat.process_group",
    "barrier": "distcompat.process_group",
    "destroy_distributed": "distcompat.process_group",
    "distributed_session": "distcompat.process_group",
    "get_local_rank": "distcompat.process_group",
    "get_rank": "distcompat.process_group",
    "get_world_size": "distcompat.process_group",
    "init_distributed": "distcompat.process_group",
    "is_main_process": "distcompat.process_group",
    "get_logger": "distcompat.rank_logging",
    "Preemption": "distcompat.preemption",
    "PreemptionError": "distcompat.preemption",
    "StopReport": "distcompat.preemption",
    "print0": "distcompat.rank_logging",
    "progress": "distcompat.rank_logging",
    "rank_zero_only": "distcompat.rank_logging",
    "warn_once": "distcompat.rank_logging",
}

#: The subpackages and modules ``distcompat.<name>`` reached without importing them first, as it
#: could when the face imported them all.
_SUBMODULES = frozenset(
    {
        "anysize",
        "attention",
        "bench",
        "checkpoint",
        "cli",
        "collectives",
        "data",
        "demo",
        "diagnostics",
        "distributed",
        "env",
        "join",
        "preemption",
        "launch",
        "process_group",
        "rank_logging",
        "runtime",
        "testing",
    }
)


def __getattr__(name: str) -> Any:
    """Import a public name (see ``_EXPORTS``) or a subpackage on first access (PEP 562)."""
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(import_module(module), name)
    elif name in _SUBMODULES:
        value = import_module(f"distcompat.{name}")
    else:
        raise AttributeError(f"module 'distcompat' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """Return the public names and what is already here, imported or not."""
    return sorted(set(globals()) | set(__all__))


# distcompat.barrier is process_group.barrier (device-aware for NCCL); the async form is
# distcompat.collectives.barrier(async_op=True).
__all__ = [
    "AsyncCheckpointer",
    "AttentionConfigError",
    "AttentionDecision",
    "AttentionInputError",
    "AttentionUnavailableError",
    "BackendUnavailableError",
    "BatchSplitError",
    "Capabilities",
    "CheckpointCorruptError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CheckpointSyncError",
    "CheckpointWriteError",
    "CollectiveError",
    "CollectivePlan",
    "CollectiveTimeoutError",
    "CompatWork",
    "DeviceBindingError",
    "DistInfo",
    "DistInitError",
    "EmptyShardError",
    "ExactGradients",
    "HangError",
    "LaunchEnv",
    "LaunchEnvError",
    "NoPeerError",
    "NotInGroupError",
    "PeerLostError",
    "Preemption",
    "PreemptionError",
    "ShardedSampler",
    "SingleRankCollectiveError",
    "StopReport",
    "TokenLoader",
    "TrainPlan",
    "UnsupportedCollectiveError",
    "WorldSizeMismatchError",
    "__version__",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_gather_single",
    "all_gather_uneven",
    "all_have_data",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "atomic_save",
    "attend",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "capabilities",
    "counter_rng",
    "destroy_distributed",
    "distributed_session",
    "explain_attention",
    "explain_collective",
    "gather",
    "gather_for_metrics",
    "gather_object",
    "gather_single",
    "get_local_rank",
    "get_logger",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "irecv",
    "is_main_process",
    "isend",
    "join_uneven",
    "latest_checkpoint",
    "load_checkpoint",
    "print0",
    "progress",
    "rank_zero_only",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_coalesced",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "save_checkpoint",
    "scatter",
    "scatter_object_list",
    "send",
    "shard_indices",
    "single_rank_region",
    "warn_once",
    "watchdog",
    "write_tokens",
]
