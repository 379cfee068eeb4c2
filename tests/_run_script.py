"""A process for tests/test_run.py: what ``distcompat run``'s bootstrap did to this interpreter.

    python _run_script.py SCENARIO      # prints one JSON object on stdout

``no-torch``: imports nothing; says which torch/distcompat modules exist and whether the finder
is on ``sys.meta_path``. ``torch``: imports torch.distributed, then makes and destroys groups of
one rank on torch's API (gloo, then the ``fake`` backend and ``mpi``) and says what each was.
``late``: torch first, then :func:`distcompat.run.install` (no bootstrap on the path).
``newer``: torch's init with the newest torch's parameter (``enable_reconfigure=True``, where
this torch has it) and with every parameter at torch's default, each under a launcher
environment of one rank; says what each made.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any


def _finder() -> bool:
    return any(getattr(finder, "distcompat_run", False) for finder in sys.meta_path)


def no_torch() -> dict[str, Any]:
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "distcompat"))
    custom = sys.modules.get("sitecustomize")
    return {
        "loaded": loaded,
        "finder": _finder(),
        "sitecustomize": getattr(custom, "__file__", None),
        "chained": getattr(__import__("builtins"), "CHAINED_SITECUSTOMIZE", False),
    }


def _marks() -> dict[str, bool]:
    import torch.distributed as dist
    from torch.distributed import device_mesh, distributed_c10d

    holders = {"dist": dist, "c10d": distributed_c10d, "device_mesh": device_mesh}
    return {
        f"{where}.{name}": getattr(getattr(module, name, None), "__distcompat_run__", False)
        for where, module in holders.items()
        for name in ("init_process_group", "destroy_process_group", "monitored_barrier")
        if hasattr(module, name)
    }


def with_torch() -> dict[str, Any]:
    import inspect
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from distcompat._ranks import recorded

    said: dict[str, Any] = {"marks": _marks(), "finder": _finder()}
    said["signature"] = list(inspect.signature(dist.init_process_group).parameters)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    said["protected"] = hasattr(dist.group.WORLD, "protects")
    said["backend"] = str(dist.get_backend())
    said["recorded"] = recorded() is not None
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # again
    side: Any = dist.new_group(backend="gloo")  # Lightning's, for its monitored_barrier
    dist.monitored_barrier(side, timeout=timedelta(seconds=10))
    dist.monitored_barrier(timeout=timedelta(seconds=10))  # the protected group's
    total = torch.ones(3)
    dist.all_reduce(total, op=dist.ReduceOp.AVG)
    said["avg"] = total.tolist()
    dist.destroy_process_group()
    said["after_destroy"] = [dist.is_initialized(), recorded() is not None]

    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    said["fake"] = [str(dist.get_backend()), hasattr(dist.group.WORLD, "protects")]
    said["fake_recorded"] = recorded() is not None
    dist.destroy_process_group()
    try:
        dist.init_process_group("mpi")
    except Exception as exc:  # torch's own error: this build has no MPI
        said["mpi"] = f"{type(exc).__name__}: {exc}"
    said["framework_calls"] = _framework_calls()
    said["own_init"] = _own_init()
    return said


def _launch_env_of_one_rank(**extra: str) -> None:
    """A launcher environment of one rank (torchrun's variables), on a free port."""
    import os
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port), **extra,
    )  # fmt: skip


def _framework_calls() -> dict[str, bool]:
    """torch's init called as DeepSpeed and Accelerate call it (the shapes in their sources,
    docs/no-line-changed.md; not the frameworks themselves): is the group protected?"""
    from datetime import timedelta

    import torch.distributed as dist

    protected = {}
    _launch_env_of_one_rank()
    calls: dict[str, Callable[[], None]] = {
        # DeepSpeed's TorchBackend.init_process_group: positional backend, rank=-1, world_size=-1
        "deepspeed": lambda: dist.init_process_group(
            "gloo", init_method=None, timeout=timedelta(minutes=30), rank=-1, world_size=-1
        ),
        # Accelerate's PartialState on multi-CPU: backend=, rank, world_size (env:// rendezvous)
        "accelerate": lambda: dist.init_process_group(backend="gloo", rank=0, world_size=1),
    }
    for name, call in calls.items():
        call()
        protected[name] = hasattr(dist.group.WORLD, "protects")
        dist.destroy_process_group()
    return protected


def _own_init() -> str:
    """distcompat's own init, making torch's gloo group (protection off): no second init inside."""
    import distcompat

    _launch_env_of_one_rank(DISTCOMPAT_PROTECT_GROUP="off")
    info = distcompat.init_distributed(device="cpu")
    distcompat.destroy_distributed()
    return info.backend_reason


def newer() -> dict[str, Any]:
    import inspect

    import torch.distributed as dist

    from distcompat._ranks import recorded

    said: dict[str, Any] = {
        "patched": getattr(dist.init_process_group, "__distcompat_run__", False),
        "signature": list(inspect.signature(dist.init_process_group).parameters),
    }
    _launch_env_of_one_rank()
    defaults = {
        name: parameter.default
        for name, parameter in inspect.signature(dist.init_process_group).parameters.items()
        if parameter.default is not inspect.Parameter.empty
    }
    dist.init_process_group(**defaults)  # every parameter spelled out, at torch's default
    said["all_defaults"] = [hasattr(dist.group.WORLD, "protects"), dist.get_backend()]
    dist.destroy_process_group()
    if "enable_reconfigure" in said["signature"]:
        dist.init_process_group("gloo", enable_reconfigure=True)
        world = dist.group.WORLD
        info = recorded()
        said["reconfigure"] = {
            "protected": hasattr(world, "protects"),
            "supports": bool(getattr(world, "supports_reconfigure", False)),
            "backend_reason": info.backend_reason if info is not None else None,
        }
        dist.destroy_process_group()
    return said


def late() -> dict[str, Any]:
    import torch.distributed  # noqa: F401  (torch first: the late path)

    from distcompat.run import install

    return {"before": _marks(), "installed": install(), "after": _marks()}


if __name__ == "__main__":
    scenario = sys.argv[1]
    run = {"no-torch": no_torch, "torch": with_torch, "late": late, "newer": newer}[scenario]
    print(json.dumps(run()), flush=True)
