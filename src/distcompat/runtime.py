"""nanochat-shaped runtime helpers: ``compute_init`` and friends, on every backend and launcher.

The two lines a nanochat-style script writes (``from nanochat.common import ...`` becomes)::

    from distcompat.runtime import autodetect_device_type, compute_init, compute_cleanup, print0
    ddp, rank, local_rank, world_size, device = compute_init(autodetect_device_type())

What changes against the code this replaces (seed 000): the group is created by
:func:`distcompat.init_distributed`, so a CPU run gets gloo (also on a host with a GPU), CUDA gets
NCCL bound by ``LOCAL_RANK``, MPS gets gloo through host memory, and every launcher distcompat reads
(torchrun, Slurm, MPI, ...) works. :func:`compute_dtype` picks the compute dtype from the RUN device
and says why. Nothing happens at import time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from distcompat._ranks import get_world_size as _get_world_size
from distcompat.launch import LaunchEnv
from distcompat.process_group import destroy_distributed, init_distributed
from distcompat.process_group import get_local_rank as _get_local_rank
from distcompat.process_group import get_rank as _get_rank
from distcompat.rank_logging import print0

__all__ = [
    "ComputeInit",
    "DistInfoTuple",
    "DtypeChoice",
    "autodetect_device_type",
    "compute_cleanup",
    "compute_dtype",
    "compute_init",
    "get_dist_info",
    "print0",
]

_DEVICE_TYPES = ("cuda", "mps", "cpu")


class ComputeInit(NamedTuple):
    """What :func:`compute_init` set up, in nanochat's order.

    A NamedTuple, not a dataclass: nanochat scripts unpack the result positionally
    (``ddp, rank, local_rank, world_size, device = compute_init(...)``), and a tuple subclass keeps
    that working while new code can read fields by name.

    Example:
        >>> r = ComputeInit(False, 0, 0, 1, torch.device("cpu"))
        >>> ddp, rank, local_rank, world_size, device = r
        >>> r.world_size, device
        (1, device(type='cpu'))
    """

    ddp: bool
    rank: int
    local_rank: int
    world_size: int
    device: torch.device


class DistInfoTuple(NamedTuple):
    """``get_dist_info()``'s answer, in nanochat's order (a tuple so that unpacking works).

    Example:
        >>> DistInfoTuple(True, 1, 1, 2).rank
        1
    """

    ddp: bool
    rank: int
    local_rank: int
    world_size: int


@dataclass(frozen=True, slots=True, kw_only=True)
class DtypeChoice:
    """The compute (autocast) dtype for a run device, and why it was chosen.

    Example:
        >>> choice = compute_dtype("cpu")
        >>> choice.dtype, choice.reason.split(":")[0]
        (torch.float32, 'float32')
    """

    dtype: torch.dtype
    reason: str


def autodetect_device_type() -> str:
    """Return ``"cuda"`` if a CUDA device is usable, else ``"mps"`` if available, else ``"cpu"``.

    This only answers "what could this host run on"; pass the answer (or the user's explicit
    choice) to :func:`compute_init`, which decides the backend from the device actually used.

    Example:
        >>> autodetect_device_type() in ("cuda", "mps", "cpu")
        True
    """
    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def get_dist_info() -> DistInfoTuple:
    """Return ``(ddp, rank, local_rank, world_size)`` for this process.

    ``ddp`` is True when a launcher started this process (a torchrun world of 1 included) or a
    process group already exists. Read from the group if there is one, else from the launcher
    environment (:meth:`distcompat.LaunchEnv.from_environ`); no group is created.

    Example:
        >>> get_dist_info()
        DistInfoTuple(ddp=False, rank=0, local_rank=0, world_size=1)
    """
    group = torch.distributed.is_available() and torch.distributed.is_initialized()
    ddp = group or LaunchEnv.from_environ().is_distributed
    return DistInfoTuple(ddp, _get_rank(), _get_local_rank(), _get_world_size())


def compute_init(device_type: str = "cuda", *, seed: int | None = 42) -> ComputeInit:
    """Create the process group for ``device_type`` and return ``(ddp, rank, local_rank, ...)``.

    ``device_type`` is ``"cuda"``, ``"mps"`` or ``"cpu"``. The group (when a launcher started this
    process) is made by :func:`distcompat.init_distributed`: gloo for cpu and mps, NCCL for cuda
    with the device bound by ``LOCAL_RANK``. Idempotent, like ``init_distributed``.

    Args:
        device_type: the run device type; the backend follows it, not the host's hardware.
        seed: seeds torch's generators as nanochat's ``compute_init`` does (42 there too);
            ``None`` leaves them alone.

    Raises:
        ValueError: ``device_type`` is not one of ``"cuda"``, ``"mps"``, ``"cpu"``.

    Example:
        >>> ddp, rank, local_rank, world_size, device = compute_init("cpu")
        >>> ddp, rank, world_size, device
        (False, 0, 1, device(type='cpu'))
        >>> compute_cleanup()
    """
    if device_type not in _DEVICE_TYPES:
        raise ValueError(
            f"device_type={device_type!r} is not one of {', '.join(map(repr, _DEVICE_TYPES))}"
        )
    if seed is not None:
        torch.manual_seed(seed)  # also seeds every CUDA device
    info = init_distributed(device=device_type)
    return ComputeInit(info.has_group, info.rank, info.local_rank, info.world_size, info.device)


def compute_cleanup() -> None:
    """Destroy the group :func:`compute_init` created; safe without one and when called twice.

    Example:
        >>> compute_cleanup()
    """
    destroy_distributed()


def compute_dtype(device: str | torch.device) -> DtypeChoice:
    """Choose the compute dtype from the RUN device (never from the host's hardware).

    * cuda: bfloat16 when the device has bf16 tensor cores (compute capability 8.0 or later),
      else float32 (float16 would need a gradient scaler, which nanochat-style loops lack);
    * mps and cpu: float32 (bf16 matmuls are emulated or slower there, and CPU autocast would
      change results against a GPU run for no speed gain); any other device: float32.

    So a CPU run on a host with a GPU gets float32.

    Example:
        >>> compute_dtype(torch.device("cpu")).dtype
        torch.float32
    """
    run = torch.device(device)
    if run.type == "cuda":
        index = run.index if run.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        name = torch.cuda.get_device_name(index)
        if (major, minor) >= (8, 0):
            return DtypeChoice(
                dtype=torch.bfloat16,
                reason=f"bfloat16: {name} (sm_{major}{minor}) has bf16 tensor cores",
            )
        return DtypeChoice(
            dtype=torch.float32,
            reason=(
                f"float32: {name} (sm_{major}{minor}) predates bf16 tensor cores (sm_80); "
                "float16 would need a gradient scaler"
            ),
        )
    if run.type == "mps":
        return DtypeChoice(
            dtype=torch.float32, reason="float32: run device mps (bf16 support on mps is partial)"
        )
    if run.type == "cpu":
        return DtypeChoice(
            dtype=torch.float32,
            reason=(
                "float32: run device cpu (bf16 matmuls on CPU are no faster without AMX and "
                "would change numerics), whatever accelerators the host has"
            ),
        )
    return DtypeChoice(
        dtype=torch.float32,
        reason=f"float32: run device {run.type} (no bf16 rule for it here: the safe default)",
    )
