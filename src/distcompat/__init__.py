# ruff: noqa: E402  (the imports follow quiet_own_command() on purpose: see _command)
"""distcompat: PyTorch distributed code that behaves the same on every backend and launcher.

The two lines a training script writes::

    import distcompat
    info = distcompat.init_distributed(device="cpu")   # gloo on CPU, nccl on CUDA
    print(info.reason)                                  # why this device, backend, timeout

Importing distcompat configures nothing, writes no environment variable and probes no hardware;
only in distcompat's own command (``distcompat ...``) does it first hide torch's NumPy warning.
"""

from distcompat._command import quiet_own_command

quiet_own_command()  # before any module below imports torch; a no-op in a user's program

from importlib import import_module
from typing import TYPE_CHECKING, Any

from distcompat._version import __version__
from distcompat.checkpoint import (
    AsyncCheckpointer,
    CheckpointCorruptError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointSyncError,
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
    all_reduce,
    all_reduce_coalesced,
    all_to_all,
    all_to_all_single,
    broadcast,
    broadcast_object_list,
    explain_collective,
    gather,
    gather_object,
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

if TYPE_CHECKING:
    from distcompat.attention import (
        AttentionConfigError,
        AttentionDecision,
        AttentionInputError,
        AttentionUnavailableError,
        attend,
        explain_attention,
    )

#: Names imported on first use: distcompat.attention marks its feature probes for torch.compile,
#: which imports torch._dynamo (about 1.5 s); a process that never attends should not pay for it.
_LAZY = {
    "AttentionConfigError": "distcompat.attention",
    "AttentionDecision": "distcompat.attention",
    "AttentionInputError": "distcompat.attention",
    "AttentionUnavailableError": "distcompat.attention",
    "attend": "distcompat.attention",
    "explain_attention": "distcompat.attention",
}


def __getattr__(name: str) -> Any:
    """Import the lazily exported names (see ``_LAZY``) on first access."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'distcompat' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


# distcompat.barrier is process_group.barrier (device-aware for NCCL); the async form is
# distcompat.collectives.barrier(async_op=True).
__all__ = [
    "AsyncCheckpointer",
    "AttentionConfigError",
    "AttentionDecision",
    "AttentionInputError",
    "AttentionUnavailableError",
    "BackendUnavailableError",
    "Capabilities",
    "CheckpointCorruptError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CheckpointSyncError",
    "CollectiveError",
    "CollectivePlan",
    "CollectiveTimeoutError",
    "CompatWork",
    "DeviceBindingError",
    "DistInfo",
    "DistInitError",
    "EmptyShardError",
    "HangError",
    "LaunchEnv",
    "LaunchEnvError",
    "NoPeerError",
    "NotInGroupError",
    "PeerLostError",
    "ShardedSampler",
    "SingleRankCollectiveError",
    "TokenLoader",
    "UnsupportedCollectiveError",
    "WorldSizeMismatchError",
    "__version__",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_gather_single",
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
    "destroy_distributed",
    "distributed_session",
    "explain_attention",
    "explain_collective",
    "gather",
    "gather_object",
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
