"""Incidents in Flight Recorder format, and one report per incident, on real rank processes.

One job per world size (2 and 3 ranks, every default on; ``_incident_script.py``) goes through
three incidents: a late rank, a point-to-point wait on a peer that sends late, and a mismatch at
call #3. For each, ``python -m torch.distributed.flight_recorder.fr_trace`` (torch's own
analyzer, a subprocess) reads the incident folder, exits 0 and names the rank, or the call,
that distcompat's report names; and the job's output holds the full report once, written by
one rank, while every other rank prints one line that points to it and to its own dump.
They run in the ``matrix`` nox session, beside the defaults matrix (``nox -s matrix``).
"""

from __future__ import annotations

import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest

from _rank_processes import Ended, run_ranks
from distcompat.diagnostics import PostMortem, read_dumps
from distcompat.diagnostics._flight_dump import (
    FLIGHT_PREFIX,
    analyzer_name,
    flight_dump,
    parse_ranks,
    write_flight_dump,
)

SCRIPT = Path(__file__).with_name("_incident_script.py")
MARK = "=== fr_trace "
#: Runs torch's analyzer on each folder given, in one interpreter (one torch import).
ANALYZE = (
    "import sys\n"
    "from torch.distributed.flight_recorder.fr_trace import main\n"
    "for folder in sys.argv[1:]:\n"
    f"    print({MARK!r} + folder, flush=True)\n"
    "    main([folder])\n"
    "    sys.stderr.flush()\n"
)


def _fr_trace(folders: list[Path]) -> dict[Path, str]:
    """What torch's analyzer says of each folder (its log goes to stderr; merged here)."""
    ran = subprocess.run(
        [sys.executable, "-c", ANALYZE, *map(str, folders)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stdout
    chunks = ran.stdout.split(MARK)[1:]
    return {Path(chunk.split("\n", 1)[0]): chunk for chunk in chunks}


def _full_reports(ranks: list[Ended], incident: int) -> list[int]:
    """The ranks whose output holds the full report of ``incident``."""
    head = re.compile(rf"distcompat hang report \(job \S+, incident {incident}, written by")
    return [r.rank for r in ranks if head.search(r.stderr)]


@pytest.mark.parametrize("world", [2, 3])
def test_torch_analyzer_names_the_rank_distcompat_names(world: int, tmp_path: Path) -> None:
    ranks = run_ranks(SCRIPT, world, args=[str(tmp_path / "dumps")], timeout=90)
    detail = "\n".join(f"--- rank {r.rank}\n{r.stdout}\n{r.stderr[-3000:]}" for r in ranks)
    assert re.search(r"^ENDED (HangError|PeerLostError) ", ranks[0].stdout, re.M), detail
    culprit = world - 1
    # a rank that outlives the others may report their exit as a fourth incident
    incidents: dict[int, PostMortem] = {
        n: read_dumps(tmp_path / "dumps", incident=n) for n in (1, 2, 3)
    }
    late, p2p, mismatch = incidents[1], incidents[2], incidents[3]
    assert late.report.verdict.behind == (culprit,), late.report.describe()
    assert f"rank 0 waits in the backend wait of recv from rank {culprit}" in p2p.report.describe()
    assert mismatch.report.verdict.diverged == tuple(range(world)), mismatch.report.describe()
    assert f"rank {culprit}: #3 broadcast" in mismatch.report.describe()
    folders = {n: next(iter(p.files.values())).parent for n, p in incidents.items()}
    for folder in folders.values():
        assert sorted(p.name for p in folder.glob(f"{FLIGHT_PREFIX}*")) == [
            f"{FLIGHT_PREFIX}{r}" for r in range(world)
        ]
    said = _fr_trace(list(folders.values()))
    for number in (1, 2):  # the late rank, the peer that never sent: the rank that is missing
        text = said[folders[number]]
        sequence = 1 if number == 1 else 0  # call #1; a point-to-point op has no call number
        assert f"Not all ranks joining collective, sequence number: {sequence}" in text, text
        assert f"missing ranks: {{{culprit}}}" in text, text
    text = said[folders[3]]  # the mismatch: call #3, all_reduce against broadcast (which rank
    # torch calls the culprit depends on which file it reads first; distcompat names both)
    assert "Collective sequence number: 3 has errors" in text, text
    assert "Not all ranks joining" not in text, text
    assert re.search(
        r"COLLECTIVE_TYPE_MISMATCH, Expected collective type: '(all_reduce|broadcast)' "
        r"does not match found collective type: '(broadcast|all_reduce)'",
        text,
    ), text
    ended = [re.search(r"^ENDED (\S+) (\S+)", r.stdout, re.M) for r in ranks]
    hang_errors = [m[2] for m in ended if m is not None and m[1] == "HangError"]
    assert hang_errors.count("full") <= 1, detail  # the incident's printer; the rest point to it
    for number in (1, 2, 3):  # one full report per incident in the job's output
        (writer,) = _full_reports(ranks, number)
        pointer = re.compile(
            rf"\[rank (\d+)\] hang incident {number} of job \S+: .*; the full report is in "
            rf"rank {writer}'s output, this rank's dump is \S+incident-{number}/rank\1\.json"
        )
        pointing = sorted(int(m[1]) for r in ranks for m in pointer.finditer(r.stderr))
        assert pointing == [r for r in range(world) if r != writer], detail


def test_the_dump_is_a_plain_pickle_of_the_schema(tmp_path: Path) -> None:
    """Simulated: a recorder's snapshot written by hand, read back as torch's loader reads it."""
    snapshot = {
        "started": {"x": 3},
        "in_flight": [],
        "history": [
            {"seq": 2, "op": "all_gather_into_tensor", "group": "x", "shape": [2, 3],
             "dtype": "float32", "reduce_op": None, "root": None, "site": "a.py:7", "started": 1.0}
        ],
    }  # fmt: skip
    data = flight_dump(snapshot, rank=0, world_size=1, wait=None, job="j", incident=1)
    assert data["entries"] == []  # group "x" is not a group of this process: left out
    path = write_flight_dump(tmp_path, rank=0, data=data)
    loaded = pickle.loads(path.read_bytes())
    assert loaded["version"] == "2.10"
    assert loaded["distcompat"]["job"] == "j"
    assert analyzer_name("reduce_scatter_tensor") == "_reduce_scatter_base"
    assert analyzer_name("something_new") == "barrier"
    assert parse_ranks("[3]") == [3]
    assert parse_ranks("[]") == []
