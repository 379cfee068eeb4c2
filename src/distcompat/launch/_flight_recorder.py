"""torch's Flight Recorder on NCCL: which of its variables init sets, and why, before the group.

torch records every NCCL collective in a ring buffer and, on a timeout, can dump it per rank;
``distcompat diagnose`` and torch's ``fr_trace`` read those dumps. ``init_distributed`` asks here,
before it makes an NCCL group (torch reads the variables then), and sets what the user left
unset; the variables it set are withdrawn at destroy, and ``info.reason`` says what it did::

    choice = plan_flight_recorder("cuda", None, launch, dump_dir=default_dump_dir())
    choice.make_folder()
    print(choice.reason)   # "set TORCH_FR_BUFFER_SIZE=2000 TORCH_NCCL_DUMP_ON_TIMEOUT=1 ..."

These are torch's variables, not distcompat's switches (``_settings``) nor the launcher's
(``_env``); they are read here and nowhere else. On gloo nothing is set: torch's gloo recorder is
on by default, and distcompat's watchdog writes a gloo hang in Flight Recorder format itself.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from distcompat.launch._env import LaunchEnv
from distcompat.launch._host import probe_host
from distcompat.launch._placement import choose_backend, resolve_device
from distcompat.launch._rules import LaunchEnvError

__all__ = [
    "FLIGHT_RECORDER_BUFFER",
    "FLIGHT_RECORDER_VARIABLES",
    "FlightRecorderChoice",
    "choose_flight_recorder",
    "flight_recorder_folder",
    "plan_flight_recorder",
]

#: torch's Flight Recorder variables init may set on NCCL, each with the older name torch also
#: reads (the first name wins in torch; a user who set either keeps their value).
FLIGHT_RECORDER_VARIABLES = {
    "TORCH_FR_BUFFER_SIZE": "TORCH_NCCL_TRACE_BUFFER_SIZE",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "TORCH_FR_DUMP_ON_TIMEOUT",
    "TORCH_FR_DUMP_TEMP_FILE": "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
}
#: Entries torch's Flight Recorder keeps (torch's own default).
FLIGHT_RECORDER_BUFFER = 2000
#: The file name before the rank: torch's default, which its analyzer finds without ``-p``.
_FLIGHT_PREFIX = "comm_lib_trace_rank_"


@dataclass(frozen=True, slots=True, kw_only=True)
class FlightRecorderChoice:
    """The Flight Recorder variables init sets before an NCCL group is made, and why.

    ``values`` is empty where nothing is set (not NCCL, or the user set every variable);
    ``folder`` is where torch writes its dumps when init chose it (None otherwise); ``reason``
    is empty where the group is not NCCL (torch's own gloo recorder needs nothing, and
    distcompat's watchdog writes gloo hangs in Flight Recorder format itself).

    Example:
        >>> from pathlib import Path
        >>> choice = choose_flight_recorder("nccl", folder=Path("/d"), environ={})
        >>> choice.values["TORCH_FR_DUMP_TEMP_FILE"]
        '/d/comm_lib_trace_rank_'
    """

    values: dict[str, str]
    folder: Path | None
    reason: str

    def make_folder(self) -> None:
        """Create :attr:`folder` (torch writes its dumps there but does not create it)."""
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)


def flight_recorder_folder(dump_dir: Path, launch: LaunchEnv) -> Path:
    """Where init has torch write an NCCL job's Flight Recorder dumps: one folder per rendezvous.

    The job's name (which distcompat's watchdog agrees through the store) is not known before
    the group exists, and torch reads the variables when the group is made; the rendezvous
    address and port are known to every rank by then. A later job on the same address and port
    writes over each rank's file, as every job does at torch's default location.

    Example:
        >>> from distcompat.launch import LaunchEnv
        >>> env = LaunchEnv.from_environ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
        ...     "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "node1", "MASTER_PORT": "29500"})
        >>> flight_recorder_folder(Path("/tmp/h"), env).as_posix()
        '/tmp/h/flight-recorder/node1-29500'
    """
    where = f"{launch.master_addr or 'local'}-{launch.master_port or 0}"
    return dump_dir / "flight-recorder" / re.sub(r"[^A-Za-z0-9._-]", "_", where)


def choose_flight_recorder(
    backend: str, *, folder: Path, environ: Mapping[str, str] | None = None
) -> FlightRecorderChoice:
    """Decide torch's Flight Recorder variables for a new ``backend`` group.

    On NCCL (``backend`` names it, alone or in a per-device map), every variable of
    :data:`FLIGHT_RECORDER_VARIABLES` that the user left unset (neither name) is set: a ring of
    :data:`FLIGHT_RECORDER_BUFFER` entries, a dump on timeout, dumps into ``folder`` (files
    ``comm_lib_trace_rank_<R>``, which ``distcompat diagnose`` and torch's analyzer read). A
    variable the user set is kept and the reason says so. A malformed buffer size raises
    :class:`LaunchEnvError`. ``environ`` defaults to ``os.environ``.

    Example:
        >>> choose_flight_recorder("gloo", folder=Path("/d"), environ={}).reason
        ''
        >>> choice = choose_flight_recorder("nccl", folder=Path("/d"),
        ...     environ={"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"})
        >>> sorted(choice.values)
        ['TORCH_FR_BUFFER_SIZE', 'TORCH_FR_DUMP_TEMP_FILE']
    """
    if "nccl" not in backend.lower():
        return FlightRecorderChoice(values={}, folder=None, reason="")
    env = os.environ if environ is None else environ
    wanted = {
        "TORCH_FR_BUFFER_SIZE": str(FLIGHT_RECORDER_BUFFER),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": f"{folder}/{_FLIGHT_PREFIX}",
    }
    values: dict[str, str] = {}
    kept: list[str] = []
    for name, alias in FLIGHT_RECORDER_VARIABLES.items():
        given = next((n for n in (name, alias) if n in env), None)
        if given is None:
            values[name] = wanted[name]
        else:
            kept.append(f"{given}={env[given]}")
    size_name = next((n for n in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
                      if n in env), None)  # fmt: skip
    if size_name is not None and not env[size_name].strip().isdigit():
        raise LaunchEnvError(
            f"{size_name}={env[size_name]!r} is not a number of entries (0 turns the Flight "
            "Recorder off)",
            variable=size_name,
        )
    off = size_name is not None and int(env[size_name]) == 0
    listed = " ".join(f"{n}={v}" for n, v in values.items())
    parts = []
    if values:
        parts.append(
            f"set {listed} for this process, before the NCCL group was made (torch's Flight "
            "Recorder: a hang's collectives are dumped on timeout where `distcompat diagnose` "
            "and torch's fr_trace read them)"
        )
    if kept:
        parts.append(f"kept the user's {' '.join(kept)}")
    if off:
        parts.append("the Flight Recorder is off (buffer size 0): an NCCL hang leaves no dump")
    dumps_to = folder if "TORCH_FR_DUMP_TEMP_FILE" in values else None
    return FlightRecorderChoice(values=values, folder=dumps_to, reason="; ".join(parts))


def plan_flight_recorder(
    device: str | torch.device,
    backend: str | None,
    launch: LaunchEnv,
    *,
    dump_dir: Path,
    environ: Mapping[str, str] | None = None,
) -> FlightRecorderChoice:
    """Decide the Flight Recorder variables for the group init is about to make for ``launch``.

    The backend is the one the group will use (``device`` and ``backend`` as init received them,
    resolved by the same rules); the dumps go to :func:`flight_recorder_folder` under
    ``dump_dir``. See :func:`choose_flight_recorder`.

    Example:
        >>> from distcompat.launch import LaunchEnv
        >>> env = LaunchEnv.from_environ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
        ...     "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
        >>> plan_flight_recorder("cpu", None, env, dump_dir=Path("/tmp/h")).values
        {}
    """
    host = probe_host()
    chosen = resolve_device(device, local_rank=launch.local_rank, env=launch, host=host)
    picked = choose_backend(chosen.device, backend, host=host)
    folder = flight_recorder_folder(dump_dir, launch)
    return choose_flight_recorder(picked.backend, folder=folder, environ=environ)
