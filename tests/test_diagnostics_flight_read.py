"""``distcompat diagnose`` on PyTorch's own Flight Recorder dumps: torch's gloo files, alone or
beside distcompat's dumps, and files that are not plain data.

The gloo dumps are torch's own, written by plain torch scripts on real rank processes
(``_fr_native_script.py``: ``torch._C._distributed_c10d._dump_fr_trace``, no distcompat).
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest

from _rank_processes import run_ranks
from distcompat.cli import main
from distcompat.diagnostics import HangReport, RankState
from distcompat.diagnostics._dump import write_dump
from distcompat.diagnostics._flight_read import FlightReadError, read_flight_dumps

SCRIPT = Path(__file__).with_name("_fr_native_script.py")


@pytest.fixture(scope="module")
def torch_dumps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """torch's gloo dumps of two jobs: rank 1 leaves out call 5 (2 ranks); rank 2 broadcasts
    where the others all_reduce at call 5 (3 ranks)."""
    out = {}
    for mode, world in (("late", 2), ("mismatch", 3)):
        folder = tmp_path_factory.mktemp(mode)
        ranks = run_ranks(SCRIPT, world, args=[str(folder), mode], timeout=60)
        assert [r.returncode for r in ranks] == [0] * world, [r.stderr for r in ranks]
        out[mode] = folder
    return out


def test_diagnose_names_the_rank_that_did_not_join(
    torch_dumps: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["diagnose", str(torch_dumps["late"])]) == 0
    text = capsys.readouterr().out
    assert "2 Flight Recorder dump(s) written by torch" in text
    # torch numbers calls from 1: the fifth is #5; the group named '' in pg_config is found
    assert "rank 1 did not join #5 gloo:all_reduce(Float[4]) of group 0 (default_pg)" in text
    assert "its newest there is #4; rank(s) 0 reached #5" in text
    assert "rank 0: newest #5 gloo:all_reduce(Float[4]) scheduled on group 0" in text


def test_diagnose_names_the_call_ranks_disagree_on(
    torch_dumps: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["diagnose", str(torch_dumps["mismatch"])]) == 0
    text = capsys.readouterr().out
    assert "ranks disagree on #5 of group 0 (default_pg):" in text
    assert "rank 0: #5 gloo:all_reduce(Float[4])" in text
    assert "rank 2: #5 gloo:broadcast(Float[4])" in text
    assert "did not join" not in text


def test_torch_dumps_beside_distcompat_dumps_are_both_read(
    torch_dumps: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """distcompat's part is simulated (a hand-made report written as the watchdog writes it)."""
    shutil.copytree(torch_dumps["late"], tmp_path / "nccl")
    state = RankState(rank=0, host="h", pid=1, reason="t", world_group="0", started={"0": 1},
                      completed={"0": 1}, in_flight=(), recent=(), published=0.0)  # fmt: skip
    report = HangReport(incident=1, written_by=0, timeout=1.0, world_size=2, trigger="t",
                        states={0: state, 1: None}, job="job-a")  # fmt: skip
    write_dump(tmp_path, rank=0, world_size=2, history=[], report=report)
    assert main(["diagnose", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "job job-a, incident 1" in text
    assert "rank 1 did not answer" in text
    assert "=== PyTorch Flight Recorder dumps in the same folder ===" in text
    assert "rank 1 did not join #5 gloo:all_reduce(Float[4])" in text
    # asked for one of distcompat's incidents that is not there: an error, not torch's dumps
    assert main(["diagnose", str(tmp_path), "--incident", "7"]) == 2


def test_a_file_that_is_not_plain_data_is_refused_not_run(tmp_path: Path) -> None:
    """Simulated: a pickle that would call a function when loaded, named like a dump."""
    (tmp_path / "comm_lib_trace_rank_0").write_bytes(pickle.dumps(Path("/etc")))
    with pytest.raises(FlightReadError, match=r"refused: the file names pathlib\.\w*Path"):
        read_flight_dumps(tmp_path)
    (tmp_path / "comm_lib_trace_rank_0").write_bytes(pickle.dumps({"version": "2.10"}))
    with pytest.raises(FlightReadError, match="no Flight Recorder dump"):
        read_flight_dumps(tmp_path)
