"""Rank script for tests/test_process_group_torch_api.py: every init signature torch accepts,
one after another in one process, through torch's ``init_process_group`` or distcompat's.

    python _signature_script.py torch|distcompat DIR PORT,PORT,...      # under run_ranks

Each case changes the environment as its caller would (torch's own test harness exports
``WORLD_SIZE`` but no ``RANK``; a ``tcp://`` script has no launcher variables at all), makes the
default group, runs a raw all_reduce on it, destroys it and prints ``rank R: CASE -> OUTCOME``:
the group's rank, size and timeout and the sum, or the error's type. Each case rendezvous on a
port of its own (rank 0 hosts the store), so that no case sees another's keys.
"""

from __future__ import annotations

import os
import sys
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
    """What the default group is: rank, size, timeout, and the sum of rank + 1 over it."""
    total = torch.tensor([float(tdist.get_rank() + 1)])
    tdist.all_reduce(total)  # raw torch on the default group
    backend = tdist.group.WORLD._get_backend(torch.device("cpu"))  # type: ignore[union-attr]
    timeout = backend.options._timeout.total_seconds()
    return (
        f"{tdist.get_rank()} of {tdist.get_world_size()}, timeout {timeout:g}, sum {total.item():g}"
    )


Case = tuple[dict[str, str | None], Callable[[Any, int], None]]


def cases(rank: int, world: int, directory: str) -> dict[str, Case]:
    """Each case: the environment its caller has, and a call of ``init`` given the case's port."""
    api = sys.argv[1]

    def store(init: Any, port: int) -> None:
        client = tdist.TCPStore("127.0.0.1", port, is_master=rank == 0, world_size=world)
        init("gloo", store=tdist.PrefixStore(f"store-{api}", client), rank=rank, world_size=world)

    def harness(init: Any, port: int) -> None:
        init("gloo", init_method=f"file://{directory}/harness-{api}", rank=rank, world_size=world)

    def tcp(init: Any, port: int) -> None:
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
        "pg-options-none": (same, lambda init, port: init("gloo", pg_options=None)),
        "store": (same, store),
        # torch's distributed tests export WORLD_SIZE and pass each rank its rank
        "file-harness": ({"RANK": None}, harness),
        "tcp-no-launcher": (dict.fromkeys(LAUNCHER), tcp),
        "explicit-beats-env": (  # the environment says another rank
            {"RANK": str(world - 1 - rank)},
            lambda init, port: init("gloo", init_method="env://", rank=rank, world_size=world),
        ),
        "twice": (same, twice),
        "after-torch-init": (same, after_torch),
        "device-id-cpu": (same, lambda init, port: init("gloo", device_id=torch.device("cpu"))),
    }


def main() -> None:
    api, directory, ports = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    init = tdist.init_process_group if api == "torch" else dcdist.init_process_group
    destroy = tdist.destroy_process_group if api == "torch" else dcdist.destroy_process_group
    made = cases(rank, world, directory)
    assert len(ports) >= len(made), f"{len(made)} cases need as many ports"
    for (name, (changes, make)), port in zip(made.items(), ports, strict=False):
        own: dict[str, str | None] = {"MASTER_PORT": port, "TORCHELASTIC_USE_AGENT_STORE": None}
        with environ(**(own | changes)):
            try:
                make(init, int(port))
                said = outcome()
            except Exception as exc:  # the outcome under test
                said = f"raised {type(exc).__name__}"
            if tdist.is_initialized():
                destroy()
            if tdist.is_initialized():  # distcompat leaves a group torch made to torch
                tdist.destroy_process_group()
        print(f"rank {rank}: {name} -> {said}", flush=True)


if __name__ == "__main__":
    main()
