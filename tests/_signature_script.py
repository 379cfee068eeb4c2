"""Rank script for tests/test_process_group_torch_api.py: every init signature torch accepts,
one after another in one process, through torch's ``init_process_group`` or distcompat's.

    python _signature_script.py torch|distcompat DIR      # under run_ranks

Each case changes the environment as its caller would (torch's own test harness exports
``WORLD_SIZE`` but no ``RANK``; a ``tcp://`` script has no launcher variables at all), makes the
default group, runs a raw all_reduce on it, destroys it and prints ``rank R: CASE -> OUTCOME``:
the group's rank, size and timeout and the sum, or the error's type. Each case meets at a store
of its own (rank 0 hosts it on a port the OS picks and tells the others through run_ranks'
store), so that no case sees another's keys and no port is chosen ahead of its use.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as tdist

import distcompat.distributed as dcdist

LAUNCHER = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR",
            "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")  # fmt: skip


@contextmanager
def environ(**changes: str | None) -> Iterator[None]:
    """Set (or, with None, unset) variables for one case; restore them after."""
    saved = {name: os.environ.get(name) for name in changes}
    for name, value in changes.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def outcome() -> str:
    """What the default group is: rank, size, timeout, the sum of rank + 1 over it, and the
    backend ``get_backend()`` names (a framework branches on it)."""
    total = torch.tensor([float(tdist.get_rank() + 1)])
    tdist.all_reduce(total)  # raw torch on the default group
    backend = tdist.group.WORLD._get_backend(torch.device("cpu"))  # type: ignore[union-attr]
    timeout = backend.options._timeout.total_seconds()
    return (
        f"{tdist.get_rank()} of {tdist.get_world_size()}, timeout {timeout:g}, "
        f"sum {total.item():g}, backend {tdist.get_backend()}"
    )


Case = tuple[dict[str, str | None], Callable[[Any, int], None]]


def cases(rank: int, world: int, directory: str) -> dict[str, Case]:
    """Each case: the environment its caller has, and a call of ``init`` given the case's port."""
    api = sys.argv[1]

    def store(init: Any, port: int) -> None:
        client = tdist.TCPStore("127.0.0.1", port, is_master=False)
        init("gloo", store=tdist.PrefixStore(f"store-{api}", client), rank=rank, world_size=world)

    def harness(init: Any, port: int) -> None:
        init("gloo", init_method=f"file://{directory}/harness-{api}", rank=rank, world_size=world)

    def tcp(init: Any, port: int) -> None:
        if rank != 0:  # torch's client retries a refused connection after seconds: rank 0 first
            time.sleep(0.5)
        init("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)

    def after_torch(init: Any, port: int) -> None:
        tdist.init_process_group("gloo")  # torch's own, then the call under test
        init("gloo")

    def twice(init: Any, port: int) -> None:
        init("gloo")
        init("gloo")

    same: dict[str, str | None] = {}
    return {
        "env": (same, lambda init, port: init("gloo")),
        "env-url-no-backend": (same, lambda init, port: init(init_method="env://")),
        "timeout": (same, lambda init, port: init("gloo", timeout=timedelta(seconds=37))),
        "group-name": (same, lambda init, port: init("gloo", group_name="mine")),
        "cpu-gloo-backend-string": (same, lambda init, port: init("cpu:gloo")),
        "gloo-device-map": (same, lambda init, port: init("cpu:gloo,cuda:gloo")),
        "pg-options-none": (same, lambda init, port: init("gloo", pg_options=None)),
        "store": (same, store),
        # torch's distributed tests export WORLD_SIZE and pass each rank its rank
        "file-harness": ({"RANK": None}, harness),
        "tcp-no-launcher": (dict.fromkeys(LAUNCHER), tcp),  # rank 0 binds the port itself
        "explicit-beats-env": (  # the environment says another rank
            {"RANK": str(world - 1 - rank)},
            lambda init, port: init("gloo", init_method="env://", rank=rank, world_size=world),
        ),
        "twice": (same, twice),
        "after-torch-init": (same, after_torch),
        "device-id-cpu": (same, lambda init, port: init("gloo", device_id=torch.device("cpu"))),
    }


def _meeting_port(harness: Any, rank: int, key: str, server: bool) -> tuple[int, Any]:
    """Rank 0 makes this case's store (``server``) or finds a free port for torch to bind (tcp://)
    and publishes the port; the others read it. Returns the port and what keeps it alive."""
    if rank == 0:
        if server:
            kept: Any = tdist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            port = kept.port
        else:
            with socket.socket() as probe:  # tcp:// binds it itself, a moment later
                probe.bind(("127.0.0.1", 0))
                port, kept = probe.getsockname()[1], None
        harness.set(key, str(port))
        return port, kept
    return int(harness.get(key)), None


def main() -> None:
    api, directory = sys.argv[1], sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    init = tdist.init_process_group if api == "torch" else dcdist.init_process_group
    destroy = tdist.destroy_process_group if api == "torch" else dcdist.destroy_process_group
    harness = tdist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    for name, (changes, make) in cases(rank, world, directory).items():
        port, kept = _meeting_port(harness, rank, f"{api}/{name}", name != "tcp-no-launcher")
        own: dict[str, str | None] = {"MASTER_PORT": str(port)}  # its store, as an agent's
        with environ(**(own | changes)):
            try:
                make(init, port)
                said = outcome()
                protected = hasattr(tdist.group.WORLD, "protects")
            except Exception as exc:  # the outcome under test
                said, protected = f"raised {type(exc).__name__}", False
            if tdist.is_initialized():
                destroy()
            if tdist.is_initialized():  # distcompat leaves a group torch made to torch
                tdist.destroy_process_group()
        harness.set(f"{api}/{name}/done{rank}", "1")  # rank 0's store outlives every rank's use
        harness.wait([f"{api}/{name}/done{r}" for r in range(world)])
        del kept
        print(f"rank {rank}: {name} -> {said}", flush=True)
        print(f"protected {rank}: {name} -> {protected}", flush=True)
    left = sorted(t.name for t in threading.enumerate() if t.name.startswith("distcompat"))
    print(f"rank {rank}: threads-left -> {left}", flush=True)


if __name__ == "__main__":
    main()
