"""Durable single-file writes: atomic_save, atomic_write_bytes, atomic_write_json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from distcompat._files import hash_file, write_durable
from distcompat.checkpoint import atomic_save, atomic_write_bytes, atomic_write_json


class _Unpicklable:
    def __reduce__(self) -> Any:
        raise RuntimeError("cannot pickle this")


def test_atomic_save_round_trip_and_no_temp_left(tmp_path: Path) -> None:
    target = tmp_path / "model.pt"
    atomic_save({"w": torch.arange(4)}, target)
    assert torch.equal(torch.load(target, weights_only=True)["w"], torch.arange(4))
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]


def test_failed_save_keeps_the_previous_file(tmp_path: Path) -> None:
    target = tmp_path / "model.pt"
    atomic_save({"v": 1}, target)
    with pytest.raises(RuntimeError, match="cannot pickle"):
        atomic_save({"v": 2, "bad": _Unpicklable()}, target)
    assert torch.load(target, weights_only=True) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]  # the temp file was removed


def test_bytes_and_json_replace_whole_files(tmp_path: Path) -> None:
    target = tmp_path / "a.bin"
    atomic_write_bytes(target, b"x" * 1000)
    atomic_write_bytes(target, b"y")
    assert target.read_bytes() == b"y"
    doc = tmp_path / "run.json"
    atomic_write_json(doc, {"step": 1, "lr": 0.5})
    assert json.loads(doc.read_text()) == {"lr": 0.5, "step": 1}


def test_unserialisable_json_leaves_no_file(tmp_path: Path) -> None:
    with pytest.raises(TypeError):
        atomic_write_json(tmp_path / "x.json", {"bad": object()})
    assert list(tmp_path.iterdir()) == []


def test_write_durable_refuses_an_existing_file(tmp_path: Path) -> None:
    target = tmp_path / "rank.pt"
    target.write_bytes(b"old")
    with pytest.raises(FileExistsError):
        write_durable(target, lambda path: path.write_bytes(b"new"))
    assert target.read_bytes() == b"old"


@pytest.mark.parametrize("numel", [10, 5 << 20])  # one read chunk, several
def test_streamed_digest_equals_a_fresh_read(tmp_path: Path, numel: int) -> None:
    target = tmp_path / "t.pt"
    digest = write_durable(target, lambda path: torch.save({"w": torch.ones(numel)}, path))
    assert digest == hash_file(target)
    assert digest.size == target.stat().st_size
