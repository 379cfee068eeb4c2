"""``distcompat diagnose`` on PyTorch's own Flight Recorder dumps: torch's gloo files, alone or
beside distcompat's dumps, and files that are not plain data.

The gloo dumps are torch's own, written by plain torch scripts on real rank processes
(``_fr_native_script.py``: ``torch._C._distributed_c10d._dump_fr_trace``, no distcompat).
"""

from __future__ import annotations

import os
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
    where the others all_reduce at call 5 (3 ranks). ``TORCH_FR_BUFFER_SIZE`` is set, as a user
    of torch 2.9 must set it: 2.9's gloo records nothing without it (2.13's records by
    default)."""
    out = {}
    for mode, world in (("late", 2), ("mismatch", 3)):
        folder = tmp_path_factory.mktemp(mode)
        ranks = run_ranks(SCRIPT, world, args=[str(folder), mode], timeout=60,
                          env={"TORCH_FR_BUFFER_SIZE": "2000"})  # fmt: skip
        assert [r.returncode for r in ranks] == [0] * world, [r.stderr for r in ranks]
        out[mode] = folder
    return out


@pytest.mark.slow
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


@pytest.mark.slow
def test_diagnose_names_the_call_ranks_disagree_on(
    torch_dumps: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["diagnose", str(torch_dumps["mismatch"])]) == 0
    text = capsys.readouterr().out
    assert "ranks disagree on #5 of group 0 (default_pg):" in text
    assert "rank 0: #5 gloo:all_reduce(Float[4])" in text
    assert "rank 2: #5 gloo:broadcast(Float[4])" in text
    assert "did not join" not in text


@pytest.mark.slow
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
    """Simulated: a pickle that would call a function when loaded, named like a dump; and a
    named pipe named like one (opening it would block), passed over."""
    os.mkfifo(tmp_path / "comm_lib_trace_rank_1")
    (tmp_path / "comm_lib_trace_rank_0").write_bytes(pickle.dumps(Path("/etc")))
    with pytest.raises(FlightReadError, match=r"refused: the file names pathlib\.\w*Path"):
        read_flight_dumps(tmp_path)
    (tmp_path / "comm_lib_trace_rank_0").write_bytes(pickle.dumps({"version": "2.10"}))
    with pytest.raises(FlightReadError, match="no Flight Recorder dump"):
        read_flight_dumps(tmp_path)


def _nccl_entry(record_id: int, seq: int, name: str, *, p2p: bool = False, state: str = "completed",
                group: tuple[str, str] = ("0", "default_pg")) -> dict[str, object]:  # fmt: skip
    return {
        "record_id": record_id, "pg_id": 0, "process_group": group, "collective_seq_id": seq,
        "p2p_seq_id": 1 if p2p else 0, "op_id": record_id, "profiling_name": name,
        "time_created_ns": 0, "input_sizes": [[8]], "input_dtypes": ["Float"],
        "output_sizes": [[8]], "output_dtypes": ["Float"], "state": state, "is_p2p": p2p,
        "frames": [{"name": "step", "filename": "train.py", "line": 40 + record_id}],
    }  # fmt: skip


def test_nccl_shaped_dumps_a_peer_wait_and_a_missing_file(tmp_path: Path) -> None:
    """Simulated: dumps shaped as NCCL writes them (4 ranks, rank 3's file missing): rank 0's
    newest entry is a recv from rank 1 still started; rank 1's old send (completed) is no wait."""
    config = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"}}
    dumps = {
        0: [_nccl_entry(0, 1, "nccl:all_reduce"), _nccl_entry(1, 1, "nccl:recv 0<-1", p2p=True,
                                                              state="started")],
        1: [_nccl_entry(0, 1, "nccl:all_reduce"), _nccl_entry(1, 1, "nccl:send 1->2", p2p=True),
            _nccl_entry(2, 2, "nccl:all_reduce", state="started")],
        2: [_nccl_entry(0, 1, "nccl:all_reduce"), _nccl_entry(1, 1, "nccl:recv 2<-1", p2p=True),
            _nccl_entry(2, 2, "nccl:all_reduce", state="started")],
    }  # fmt: skip
    for rank, entries in dumps.items():
        data = {"version": "2.10", "pg_config": config, "pg_status": {}, "entries": entries}
        (tmp_path / f"nccl_trace_rank_{rank}").write_bytes(pickle.dumps(data))
    found = read_flight_dumps(tmp_path)
    assert found.prefix == "nccl_trace_rank_"
    findings = found.findings()
    assert findings == [
        "rank 3 wrote no dump here (it died, was not reached, or its file was not copied)",
        "rank 0 did not join #2 nccl:all_reduce(Float[8]) of group 0 (default_pg): its newest "
        "there is #1; rank(s) 1, 2 reached #2",
        "rank 0 waits in recv from rank 1 on group 0 (default_pg)",
    ]
    assert "rank 1: newest #2 nccl:all_reduce(Float[8]) started at train.py:42" in found.describe()
