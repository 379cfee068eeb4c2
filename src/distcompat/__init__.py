"""distcompat: PyTorch distributed code that behaves the same on every backend and launcher.

The two lines a training script writes::

    import distcompat
    info = distcompat.init_distributed(device="cpu")   # gloo on CPU, nccl on CUDA
    print(info.reason)                                  # why this device, backend, timeout

Importing distcompat configures nothing, writes no environment variable and probes no hardware.
"""

from importlib.metadata import PackageNotFoundError, version

from distcompat._placement import BackendUnavailableError, DeviceBindingError
from distcompat.env import LaunchEnv, LaunchEnvError
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

try:
    __version__ = version("distcompat")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "BackendUnavailableError",
    "DeviceBindingError",
    "DistInfo",
    "DistInitError",
    "LaunchEnv",
    "LaunchEnvError",
    "__version__",
    "barrier",
    "destroy_distributed",
    "distributed_session",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_main_process",
]
