"""On a GPU: init turns torch's Flight Recorder on, and ``distcompat diagnose`` reads its dump.

A world of 1 on NCCL (``_fr_cuda_script.py``, a real process): ``info.reason`` says which
variables init set; a dump asked for through torch's debug pipe lands in distcompat's dump
folder, and ``distcompat diagnose`` reads it. Run by ``nox -s tests_cuda``; skipped without a
CUDA device (not yet run on one when written: the variables are tested on CPU in
test_launch_flight_recorder.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from _rank_processes import run_ranks
from distcompat.cli import main

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device and NCCL"),
]
SCRIPT = Path(__file__).with_name("_fr_cuda_script.py")


def test_an_nccl_dump_through_the_debug_pipe_is_read_by_diagnose(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (ended,) = run_ranks(SCRIPT, 1, args=[str(tmp_path)], env={"TMPDIR": str(tmp_path)})
    detail = ended.stdout + ended.stderr[-3000:]
    assert ended.returncode == 0, detail
    assert "environ: set TORCH_FR_BUFFER_SIZE=2000 TORCH_NCCL_DUMP_ON_TIMEOUT=1" in detail
    match = re.search(r"^DUMP (\S+)$", ended.stdout, re.M)
    assert match, detail
    dump = Path(match[1])
    assert dump.parent == tmp_path / "distcompat-hangs" / "flight-recorder" / dump.parent.name
    capsys.readouterr()
    assert main(["diagnose", str(tmp_path / "distcompat-hangs")]) == 0
    text = capsys.readouterr().out
    assert "1 Flight Recorder dump(s) written by torch" in text, text
    assert re.search(r"rank 0: newest #\d+ nccl:all_reduce\(Float\[4\]\)", text), text
