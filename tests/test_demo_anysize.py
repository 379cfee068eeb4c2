"""``distcompat demo`` at several world sizes and across a resize (``nox -s anysize``).

Exact mode: the final parameters' SHA-256 is the same at 1, 2, 3 and 4 ranks, after a 2->3 and
a 3->2 resize, and after a rank lost in place (``--kill 1@6 --in-place``: the other goes on
alone, no restart). Default mode: a 2->3 resize, and a rank lost in place, keep the global batch
and the global data position (every sample once) and end PASS. Each run is the real command
with every default on.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.anysize, pytest.mark.slow]

#: 12 steps of 12 sequences in micro-batches of 2 (6 micro-batches: 1, 2, 3 and 6 ranks), a
#: small model; --checkpoint-at 2 keeps the resume check (steps 3-5) away from the resizes.
SMALL = [
    "--steps", "12", "--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--seq-len", "64",
    "--global-batch", "12", "--micro-batch", "2", "--allreduce-reps", "2",
    "--corpus-bytes", "65536", "--checkpoint-at", "2", "--checkpoint-every", "3",
]  # fmt: skip


def _demo(out: Path, *flags: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "distcompat", "demo", "--out", str(out), *SMALL, *flags],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    manifest: dict[str, Any] = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["resume_matched"]
    assert manifest["replicas_equal"]
    return manifest


@pytest.fixture(scope="module")
def exact_one_rank(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _demo(tmp_path_factory.mktemp("exact") / "one", "--exact", "--nproc", "1")


@pytest.mark.parametrize(
    "flags",
    [
        ("--nproc", "2"), ("--nproc", "3"), ("--resize", "2:3@6"), ("--resize", "3:2@6"),
        ("--kill", "1@6", "--in-place"),
    ],
    ids=["2 ranks", "3 ranks", "2->3", "3->2", "2->1 in place"],
)  # fmt: skip
def test_exact_mode_ends_with_the_same_bits(
    flags: tuple[str, ...], exact_one_rank: dict[str, Any], tmp_path: Path
) -> None:
    manifest = _demo(tmp_path / "run", "--exact", *flags)
    assert manifest["final_params_sha256"] == exact_one_rank["final_params_sha256"]
    assert manifest["losses"] == exact_one_rank["losses"]
    sizes = manifest["sizes"]
    assert sizes["mode"] == "exact"
    assert sizes["samples_consumed"] == 12 * 12
    if flags[0] == "--resize":
        old, new = (int(n) for n in flags[1].split("@")[0].split(":"))
        assert manifest["restarts"] == 1
        assert (sizes["resumed_from_world_size"], sizes["world_size"]) == (old, new)
        assert sizes["resize"] == flags[1]
    if "--in-place" in flags:
        _assert_went_on_in_place(manifest)


def _assert_went_on_in_place(manifest: dict[str, Any]) -> None:
    """Rank 1 was killed at step 6; rank 0 went on alone, in the same process, no restart."""
    assert manifest["restarts"] == 0
    assert manifest["sizes"]["world_size"] == 1
    timings = manifest["restart_timings"]
    assert timings["in_place"]
    assert (timings["killed_rank"], timings["killed_at_step"]) == (1, 6)
    assert timings["world_size_after"] == 1
    assert timings["went_on_from_step"] in (5, 6)  # the lost step redone, or it was whole
    assert timings["lost_s"] > 0


def test_exact_mode_at_four_ranks(exact_one_rank: dict[str, Any], tmp_path: Path) -> None:
    """4 ranks need a global batch of a multiple of 4 micro-batches: 8 in micro-batches of 2,
    compared with 1 rank of the same plan."""
    plan = ("--exact", "--global-batch", "8")
    one = _demo(tmp_path / "one", *plan, "--nproc", "1")
    four = _demo(tmp_path / "four", *plan, "--nproc", "4")
    assert four["final_params_sha256"] == one["final_params_sha256"]


def test_default_mode_resize_keeps_the_global_batch_and_every_sample_once(tmp_path: Path) -> None:
    manifest = _demo(tmp_path / "run", "--resize", "2:3@6")
    sizes = manifest["sizes"]
    assert sizes["mode"] == "float"
    assert (sizes["resumed_from_world_size"], sizes["world_size"]) == (2, 3)
    assert sizes["global_batch"] == 12
    assert sizes["samples_consumed"] == 12 * 12
    assert len(manifest["losses"]) == 12
    assert manifest["preemption"]["step"] == 6  # every rank stopped together after step 6


def test_default_mode_in_place_keeps_the_global_batch_and_every_sample_once(
    tmp_path: Path,
) -> None:
    """Float mode, ZeroAdamW: the survivor re-cuts the whole optimizer state from the copies
    (its own half and rank 1's, which it held) and takes the whole global batch from step 6."""
    manifest = _demo(tmp_path / "run", "--kill", "1@6", "--in-place")
    sizes = manifest["sizes"]
    assert sizes["mode"] == "float"
    assert sizes["global_batch"] == 12
    assert sizes["samples_consumed"] == 12 * 12
    assert len(manifest["losses"]) == 12
    _assert_went_on_in_place(manifest)
