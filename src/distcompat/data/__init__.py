"""Sharded, resumable data loading that never leaves a rank without data.

The two lines a training script writes::

    loader = distcompat.data.TokenLoader(files, batch_size=8, seq_len=1024)   # LM pretraining
    sampler = distcompat.data.ShardedSampler(dataset, shuffle=True)          # map-style datasets
    scores = distcompat.gather_for_metrics(scores, eval_sampler)     # every sample once, in order

Everything here shards by a global position (epoch, seed, samples consumed by all ranks), so
``state_dict()`` resumes exactly, also on another world size; a rank that would get no data raises
:class:`EmptyShardError` on every rank instead of hanging the others. See docs/data.md.
"""

from distcompat.data._gather import gather_for_metrics
from distcompat.data._sampler import ShardedSampler
from distcompat.data._shard import MODES, EmptyShardError, ShardMode, shard_indices, shard_sizes
from distcompat.data._sharders import (
    RowGroup,
    parquet_row_group_counts,
    shard_files,
    shard_iterable,
    shard_row_groups,
)
from distcompat.data._state import EpochRepeatWarning, LoaderStateError, epoch_order
from distcompat.data._tokenfile import (
    ReaderChoice,
    TokenFileError,
    TokenRangeError,
    write_tokens,
)
from distcompat.data._tokens import TokenLoader

__all__ = [
    "MODES",
    "EmptyShardError",
    "EpochRepeatWarning",
    "LoaderStateError",
    "ReaderChoice",
    "RowGroup",
    "ShardMode",
    "ShardedSampler",
    "TokenFileError",
    "TokenLoader",
    "TokenRangeError",
    "epoch_order",
    "gather_for_metrics",
    "parquet_row_group_counts",
    "shard_files",
    "shard_indices",
    "shard_iterable",
    "shard_row_groups",
    "shard_sizes",
    "write_tokens",
]
