"""distcompat._torch, the seam: what it reads from the installed torch, on every release CI runs.

No test here skips because a torch file or name moved: the seam raises a clear error instead,
and these tests fail on it.
"""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from distcompat import _torch
from distcompat._torch import _trampoline

DOC = Path(__file__).resolve().parents[1] / "docs" / "torch_versions.md"


def test_the_doc_carries_the_seams_table() -> None:
    assert _torch.internals_table() in DOC.read_text()


def test_every_row_names_a_function_of_the_seam() -> None:
    for item in _torch.INTERNALS:
        if item.used_by.startswith("("):  # "(public)", "(not called)"
            continue
        for name in item.used_by.split(", "):
            assert name in _torch.__all__, (item.name, name)


def test_the_release_is_the_installed_torchs() -> None:
    major, minor = _torch.release()
    assert torch.__version__.startswith(f"{major}.{minor}.")
    assert _torch.release() >= (2, 9)  # the oldest release distcompat supports


def test_the_trampoline_is_read_from_this_torch() -> None:
    """Found on every supported release, at either path; the list holds the collectives."""
    header = _trampoline.trampoline_header()
    assert header.is_file()
    assert {"allreduce", "broadcast", "allgather", "barrier"} <= _torch.trampoline_methods()


def test_a_torch_that_keeps_the_trampoline_elsewhere_is_an_error_not_a_skip(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_trampoline, "HEADERS", ("torch/csrc/nowhere/PyProcessGroup.hpp",))
    with pytest.raises(_torch.TrampolineUnknownError, match=r"nowhere/PyProcessGroup\.hpp"):
        _trampoline.trampoline_header()


def test_a_parameter_this_torch_lacks_is_named_with_the_release() -> None:
    with pytest.raises(_torch.TorchReleaseError, match=re.escape(torch.__version__)):
        _torch.require_takes("init_process_group", "no_such_parameter", 1)
    assert issubclass(_torch.TorchReleaseError, TypeError)
    assert _torch.takes("init_process_group", "device_id")


def test_the_default_group_and_store_are_torchs(tmp_path: Path) -> None:
    """One rank through a file store: the seam's default group is torch's WORLD, its store is
    the rendezvous store, and the CPU backend's timeout is the group's."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
        timeout=timedelta(seconds=42),
    )  # fmt: skip
    try:
        assert _torch.default_group() is dist.GroupMember.WORLD
        _torch.default_store().set("seam", "1")
        assert _torch.default_store().get("seam") == b"1"
        assert _torch.backend_timeout_s(dist.group.WORLD) == 42.0
    finally:
        dist.destroy_process_group()
    assert _torch.default_group() is None


def test_a_work_from_a_future_and_premul_sum() -> None:
    future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
    future.set_result([torch.ones(1)])
    assert _torch.create_work_from_future(future).wait()
    made: Any = _torch.premul_sum(0.5)  # the stubs do not say the op carries .op
    assert made.op == dist.ReduceOp.PREMUL_SUM


def test_the_caller_files_are_torchs() -> None:
    c10d, logger, join = _torch.caller_files()
    assert all(Path(path).is_file() for path in (c10d, logger, join))
    assert Path(c10d).name == "distributed_c10d.py"


def test_a_fenced_device_mesh_refuses_every_use_and_keeps_its_hash(tmp_path: Path) -> None:
    """One rank through a file store: a mesh over the whole world (whose group is the default
    one) is found without a registry; fenced, its size, group and slices raise the error given,
    while its hash, equality and repr still work; a mesh made afterwards works."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    class Stale(RuntimeError):
        pass

    store = f"file://{tmp_path / 'store'}"
    dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)
    try:
        _torch.device_meshes()  # (other tests' meshes may still be alive in this process)
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
        assert mesh in _torch.device_meshes()  # one made since: found
        old_hash = hash(mesh)
        _torch.fence_mesh(mesh, lambda: Stale("made before the regroup"))
        for use in (lambda: mesh.size(), lambda: mesh.shape, lambda: mesh.get_group(),
                    lambda: mesh["dp"]):  # fmt: skip
            with pytest.raises(Stale, match="made before the regroup"):
                use()
        assert isinstance(mesh, DeviceMesh)
        assert hash(mesh) == old_hash
        assert mesh == mesh
        assert "fenced" in repr(mesh)
        assert mesh not in _torch.device_meshes()  # fenced once
        again = init_device_mesh("cpu", (1,))
        assert again.size() == 1
        assert again != mesh
    finally:
        dist.destroy_process_group()


def test_a_pass_that_found_no_mesh_is_not_made_again_until_one_is_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stand-in for torch's DeviceMesh class (its module replaced in ``sys.modules``), so
    that no other test's mesh is alive: a pass that found none is not repeated while the
    class's reference count is the same; a mesh made since is found by the next pass."""
    import gc
    import sys
    import types

    class DeviceMesh:
        pass

    module = types.ModuleType("torch.distributed.device_mesh")
    module.DeviceMesh = DeviceMesh  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch.distributed.device_mesh", module)
    passes: list[int] = []  # counts only: a reference to the class would change its count
    real = gc.get_referrers

    def counted(*objects: Any) -> list[Any]:
        passes.append(len(objects))
        return real(*objects)

    monkeypatch.setattr(gc, "get_referrers", counted)
    assert _torch.device_meshes() == []
    assert _torch.device_meshes() == []
    assert len(passes) == 1  # the second ask returned at once
    mesh = DeviceMesh()
    assert _torch.device_meshes() == [mesh]
    assert len(passes) == 2
