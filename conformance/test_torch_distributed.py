"""torch's own distributed tests on gloo, with distcompat's group as the default group.

``torch.testing._internal.distributed.distributed_test.DistributedTest._DistTestBase`` ships in
the torch wheel: collectives, object collectives, DDP with hooks, Join, SyncBatchNorm, subgroups,
monitored barrier. Each test starts its ranks, which call ``torch.distributed.init_process_group``;
with ``DISTCOMPAT_CONFORMANCE=distcompat`` (the default) that name is distcompat's drop-in, so the
ranks run on the protected group with every default on; ``DISTCOMPAT_CONFORMANCE=torch`` runs
torch's own, for the side-by-side table (``nox -s conformance``).

The ranks are forked from this process (CPU gloo only: no CUDA is initialized here), not
spawned: a spawned rank imports torch and torch's test module again, about 10 s of a 2-core
machine per test, a fork none (the whole run: about 4 minutes, not 15).
``DISTCOMPAT_CONFORMANCE_START=spawn`` starts them as torch's own runner does.
"""

from __future__ import annotations

import os
import tempfile

# Read by torch's test module at import, in this process and in every spawned rank.
os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="distcompat-conformance-"))

import types

import torch.distributed as dist
import torch.multiprocessing as mp
from torch.testing._internal.distributed import distributed_test
from torch.testing._internal.distributed.distributed_test import (
    DistributedTest,
    TestDistBackend,
)


class _DropIn(types.ModuleType):
    """``torch.distributed`` as torch's test module sees it, with distcompat's init and destroy.

    Only the test module's name is rebound: distcompat itself calls torch's own.
    """

    def __getattr__(self, name: str) -> object:
        return getattr(dist, name)


if os.environ.get("DISTCOMPAT_CONFORMANCE", "distcompat") == "distcompat":
    import distcompat.distributed as dropin

    seen = _DropIn("torch.distributed")
    seen.init_process_group = dropin.init_process_group  # type: ignore[attr-defined]
    seen.destroy_process_group = dropin.destroy_process_group  # type: ignore[attr-defined]
    distributed_test.dist = seen  # type: ignore[attr-defined]


START = os.environ.get("DISTCOMPAT_CONFORMANCE_START", "fork")


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):  # type: ignore[misc]
    """torch's test class, its ranks started per test (forked; see the module docstring)."""

    def setUp(self) -> None:
        """Start this test's ranks."""
        super().setUp()
        if START == "spawn":
            self._spawn_processes()
        else:
            self._start_processes(mp.get_context("fork").Process)
