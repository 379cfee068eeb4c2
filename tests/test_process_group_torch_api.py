"""``distcompat.distributed.init_process_group``: every signature torch accepts means the same.

The cases run for real, one after another in each rank process (``_signature_script.py``), once
through torch's ``init_process_group`` and once through distcompat's, every default on; each
case makes the default group (at a store of its own), runs a raw all_reduce and destroys it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from _rank_processes import Ended, run_ranks

SCRIPT = Path(__file__).with_name("_signature_script.py")

#: What distcompat does on purpose where torch refuses (docs/launching.md says why).
ACCEPTED_WHERE_TORCH_REFUSES = {
    "twice": "a second call keeps the first group, as init_distributed does",
    "after-torch-init": "the group torch made is adopted, with its own timeout",
    "device-id-cpu": "device_id=cpu means the CPU run device",
}


def _outcomes(api: str, world: int, tmp_path: Path) -> dict[int, dict[str, str]]:
    folder = tmp_path / api
    folder.mkdir()
    ranks: list[Ended] = run_ranks(SCRIPT, world, args=(api, str(folder)), timeout=240)
    assert [r.returncode for r in ranks] == [0] * world, [r.stderr[-3000:] for r in ranks]
    said: dict[int, dict[str, str]] = {}
    for ended in ranks:
        lines = re.findall(rf"^rank {ended.rank}: (\S+) -> (.*)$", ended.stdout, re.M)
        said[ended.rank] = dict(lines)
        marks = re.findall(rf"^protected {ended.rank}: (\S+) -> (.*)$", ended.stdout, re.M)
        said[ended.rank] |= {f"{case}/protected": mark for case, mark in marks}
    return said


@pytest.mark.slow
def test_every_signature_torch_accepts_makes_the_same_group(tmp_path: Path) -> None:
    """Explicit rank / world_size / init_method / store beat the environment (torch's harness
    exports WORLD_SIZE and no RANK; a contradicting RANK), env://, tcp:// without any launcher
    variable, file://, a timeout, a group name, "cpu:gloo", a device map of gloo, pg_options:
    each gives the group torch's call gives (rank, size, the all_reduce's sum, the name
    ``get_backend()`` answers; the timeout where one was asked for, distcompat's 600 s default
    otherwise), and every group distcompat makes is its protected one. The three calls torch
    refuses work on purpose.
    After the last destroy no thread distcompat started is left (each group's shared-memory
    engine, the store thread, the watchdog), though torch keeps some destroyed groups alive.
    3 ranks: a contradicting RANK is another rank's for every rank but the middle one."""
    world = 3
    torch_said = _outcomes("torch", world, tmp_path)
    ours = _outcomes("distcompat", world, tmp_path)
    total = world * (world + 1) // 2
    maps = {"cpu-gloo-backend-string": "cpu:gloo", "gloo-device-map": "cpu:gloo,cuda:gloo"}
    maps["env-url-no-backend"] = "undefined"  # torch names a group asked without a backend so
    for rank in range(world):
        assert set(ours[rank]) == set(torch_said[rank])
        # destroy ends every thread distcompat started, for each of the 14 groups made
        assert ours[rank].pop("threads-left") == "[]"
        torch_said[rank].pop("threads-left")
        # every group distcompat made is its protected one, device maps of gloo included; the
        # group torch made before is adopted as it is
        marks = {c: m for c, m in ours[rank].items() if c.endswith("/protected")}
        assert [c for c, m in marks.items() if m != "True"] == ["after-torch-init/protected"]
        for case, theirs in torch_said[rank].items():
            if case.endswith("/protected"):
                continue
            mine = ours[rank][case]
            if case in ACCEPTED_WHERE_TORCH_REFUSES:
                assert theirs.startswith("raised "), (case, theirs)
                timeout = "1800" if case == "after-torch-init" else "600"
                assert mine == f"{rank} of {world}, timeout {timeout}, sum {total}, backend gloo"
                continue
            if case != "timeout":  # torch's default is 1800 s, distcompat's 600 s
                theirs = theirs.replace("timeout 1800", "timeout 600")
            assert mine == theirs, case
            assert theirs == f"{rank} of {world}, timeout {37 if case == 'timeout' else 600}, " \
                f"sum {total}, backend {maps.get(case, 'gloo')}", case  # fmt: skip
