"""A hang incident written in PyTorch's Flight Recorder format, for torch's own analyzer to read.

Beside its ``rank<R>.json``, each rank writes its collective history as a Flight Recorder dump
(schema ``2.10``: a pickled dict with ``version``, ``pg_config``, ``pg_status`` and ``entries``)
named ``comm_lib_trace_rank_<R>``, torch's own file name, in the incident folder. Then::

    python -m torch.distributed.flight_recorder.fr_trace DIR/<job>/incident-<N>

reads the folder as it reads an NCCL job's dumps and names the same rank as distcompat's report
(the rank that did not join the call, or the call the ranks disagree on). The watchdog writes::

    data = flight_dump(snapshot, rank=0, world_size=2, wait=current_wait(), job=j, incident=1)
    write_flight_dump(folder, rank=0, data=data)

The entries are distcompat's own records, not torch's native gloo ones: distcompat's collectives
may run through shared memory or checks that gloo never sees, and torch 2.13's native gloo
dumps are not readable by its analyzer (their ``pg_config`` names the default group ``''``).
What each field holds:

* ``collective_seq_id``: distcompat's sequence number on the group (``#N`` in its report, so
  both tools name the same call); ``record_id``: the call's position in this rank's history.
* ``profiling_name``: ``gloo:<op>`` with torch's name for the op (``all_gather_into_tensor`` is
  ``_all_gather_base``); ``frames``: the user's call site, where the record has one.
* ``state``: ``started`` while the call is in flight on this rank, else ``completed``.
* ``input_sizes`` / ``output_sizes``: the recorded shape; for a gathering op the output is that
  many elements times the group size, for a scattering op the input is (the size check torch's
  analyzer makes then compares what distcompat compared: the recorded shapes).
* A point-to-point wait outside any collective (``recv`` from a rank that never sends) is one
  entry ``gloo:recv <me><-<peer>`` on a two-rank group of its own (``p2p:<a>-<b>``), so the
  analyzer expects only the peer in it and names that rank; completed point-to-point calls are
  not recorded (distcompat records collectives only).
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from distcompat._files import atomic_write_bytes
from distcompat.collectives._wait import Wait
from distcompat.diagnostics import _records
from distcompat.diagnostics._records import CollectiveRecord

__all__ = [
    "FLIGHT_PREFIX",
    "FLIGHT_VERSION",
    "analyzer_name",
    "flight_dump",
    "flight_path",
    "parse_ranks",
    "write_flight_dump",
]

#: The Flight Recorder schema written (torch 2.13's own; ``fr_trace`` checks all ranks agree).
FLIGHT_VERSION = "2.10"
#: File name before the rank: torch's default, so ``fr_trace`` finds the files without ``-p``.
FLIGHT_PREFIX = "comm_lib_trace_rank_"
_BACKEND = "gloo"  # the analyzer accepts gloo, nccl, xccl, ... as the prefix of an op name
#: distcompat op name -> the name torch's analyzer knows (the others are the same in both).
_TORCH_NAMES = {
    "all_gather_into_tensor": "_all_gather_base",
    "reduce_scatter_tensor": "_reduce_scatter_base",
    "all_gather_object": "all_gather",
    "gather_object": "gather",
    "broadcast_object_list": "broadcast",
    "scatter_object_list": "scatter",
    "all_reduce_coalesced": "allreduce_coalesced",
}
#: Collective names torch 2.13's analyzer accepts (``types.COLLECTIVES``), as far as used here.
_KNOWN = frozenset(
    {
        "broadcast", "reduce", "all_gather", "_all_gather_base", "all_reduce", "reduce_scatter",
        "_reduce_scatter_base", "gather", "scatter", "all_to_all", "all_to_all_single", "barrier",
        "allreduce_coalesced",
    }
)  # fmt: skip
_GATHERING = frozenset({"all_gather", "_all_gather_base"})
_SCATTERING = frozenset({"reduce_scatter", "_reduce_scatter_base"})
_DTYPES = {"float32": "Float", "float64": "Double", "float16": "Half", "bfloat16": "BFloat16",
           "int64": "Long", "int32": "Int", "int16": "Short", "int8": "Char", "uint8": "Byte",
           "bool": "Bool"}  # fmt: skip


def analyzer_name(op: str) -> str:
    """Return the op name torch's analyzer expects for distcompat's ``op``.

    An op the analyzer has no name for is written as ``barrier`` (its own name stays in
    ``frames``), so the analyzer reads the file rather than rejecting it.

    Example:
        >>> analyzer_name("all_gather_into_tensor"), analyzer_name("all_reduce")
        ('_all_gather_base', 'all_reduce')
    """
    name = _TORCH_NAMES.get(op, op)
    return name if name in _KNOWN else "barrier"


def flight_path(folder: Path, rank: int) -> Path:
    """Where rank ``rank`` writes its Flight Recorder dump in an incident ``folder``.

    Example:
        >>> flight_path(Path("/d/job/incident-1"), 3).name
        'comm_lib_trace_rank_3'
    """
    return folder / f"{FLIGHT_PREFIX}{rank}"


def _group_of(label: str) -> Any:
    """Return the process group distcompat labelled ``label`` (None: not known here)."""
    for group, known in list(_records._labels.items()):
        if known == label:
            return dist.group.WORLD if group is None else group
    return None


def _group_config(label: str) -> dict[str, str] | None:
    """``pg_config``'s entry for the group labelled ``label``: its name, desc and global ranks."""
    group = _group_of(label)
    if group is None:
        return None
    try:
        ranks = list(dist.get_process_group_ranks(group))
    except (RuntimeError, ValueError, KeyError):  # destroyed since it was recorded (2.13: KeyError)
        return None
    desc = "default_pg" if group is dist.group.WORLD else getattr(group, "group_desc", "")
    return {"name": label, "desc": str(desc or "undefined"), "ranks": str(ranks)}


def _sizes(record: CollectiveRecord, op: str, group_size: int) -> tuple[list[Any], list[Any]]:
    shape = list(record.shape) if record.shape is not None else None
    if shape is None:
        return [], []
    numel = 1
    for n in shape:
        numel *= n
    if op in _GATHERING:
        return [shape], [[numel * group_size]]
    if op in _SCATTERING:
        return [[numel * group_size]], [shape]
    return [shape], [shape]


def _dtype(record: CollectiveRecord) -> list[str]:
    return [] if record.dtype is None else [_DTYPES.get(record.dtype, record.dtype)]


def _frames(op: str, site: str) -> list[dict[str, Any]]:
    path, _, line = site.rpartition(":")
    if not path or not line.isdigit():
        return []
    return [{"name": op, "filename": path, "line": int(line)}]


def _entry(
    record: CollectiveRecord, *, record_id: int, pg_id: int, desc: str, group_size: int,
    state: str,
) -> dict[str, Any]:  # fmt: skip
    op = analyzer_name(record.op)
    inputs, outputs = _sizes(record, op, group_size)
    started_ns = int(record.started * 1e9)
    return {
        "frames": _frames(record.op, record.site),
        "record_id": record_id,
        "pg_id": pg_id,
        "process_group": (record.group, desc),
        "thread_name": "distcompat",
        "thread_id": "",
        "collective_seq_id": record.seq,
        "p2p_seq_id": 0,
        "op_id": record_id,
        "profiling_name": f"{_BACKEND}:{op}",
        "time_created_ns": started_ns,
        "input_sizes": inputs,
        "input_dtypes": _dtype(record),
        "output_sizes": outputs,
        "output_dtypes": _dtype(record),
        "state": state,
        "time_discovered_started_ns": started_ns,
        "time_discovered_completed_ns": None,
        "retired": state == "completed",
        "timeout_ms": 0,
        "is_p2p": False,
    }


def _p2p_entry(wait: Wait, *, rank: int, record_id: int, pg_id: int) -> tuple[str, Any] | None:
    """Return the entry of a point-to-point wait on one known peer (on a group of the two)."""
    peers = wait.awaited() if wait.awaited is not None else None
    if wait.op not in ("send", "recv") or not peers or len(peers) != 1:
        return None
    peer = peers[0]
    pair = sorted((rank, peer))
    name = f"p2p:{pair[0]}-{pair[1]}"
    me, other = pair.index(rank), pair.index(peer)
    meta = f"{me}->{other}" if wait.op == "send" else f"{me}<-{other}"
    started_ns = int((wait.started + _records._WALL_OFFSET) * 1e9)
    entry = {
        "frames": [],
        "record_id": record_id,
        "pg_id": pg_id,
        "process_group": (name, wait.call),
        "thread_name": "distcompat",
        "thread_id": "",
        "collective_seq_id": 0,
        "p2p_seq_id": 1,
        "op_id": record_id,
        "profiling_name": f"{_BACKEND}:{wait.op} {meta}",
        "time_created_ns": started_ns,
        "input_sizes": [],
        "input_dtypes": [],
        "output_sizes": [],
        "output_dtypes": [],
        "state": "started",
        "time_discovered_started_ns": started_ns,
        "time_discovered_completed_ns": None,
        "retired": False,
        "timeout_ms": 0,
        "is_p2p": True,
    }
    return name, (entry, {"name": name, "desc": wait.call, "ranks": str(pair)})


def flight_dump(
    snapshot: Mapping[str, Any], *, rank: int, world_size: int, wait: Wait | None, job: str,
    incident: int,
) -> dict[str, Any]:  # fmt: skip
    """Return this rank's history (``Recorder.snapshot()``) as a Flight Recorder dump dict.

    ``wait`` is the wait on peers the main thread is in (a point-to-point call outside any
    collective is written as its own entry). Records on a group that no longer exists here are
    left out. The extra key ``distcompat`` names the job and incident (torch's analyzer ignores
    it; ``distcompat diagnose`` uses it to tell these files from torch's own).

    Example:
        >>> flight_dump({"history": [], "in_flight": [], "started": {}}, rank=0, world_size=1,
        ...     wait=None, job="j", incident=1)["version"]
        '2.10'
    """
    history = [CollectiveRecord.from_json(r) for r in snapshot["history"]]
    open_calls = {(r["group"], r["seq"]) for r in snapshot["in_flight"]}
    first_id = sum(int(n) for n in snapshot["started"].values()) - len(history)
    configs: dict[str, dict[str, str]] = {}
    pg_ids: dict[str, int] = {}
    entries: list[dict[str, Any]] = []
    status: dict[str, dict[str, int]] = {}
    for index, record in enumerate(history):
        config = configs.get(record.group)
        if config is None:
            found = _group_config(record.group)
            if found is None:
                continue
            config = configs[record.group] = found
            pg_ids[record.group] = len(pg_ids)
        state = "started" if (record.group, record.seq) in open_calls else "completed"
        entry = _entry(
            record, record_id=first_id + index, pg_id=pg_ids[record.group], desc=config["desc"],
            group_size=len(parse_ranks(config["ranks"])), state=state,
        )  # fmt: skip
        entries.append(entry)
        mark = status.setdefault(
            str(pg_ids[record.group]),
            {"last_enqueued_collective": -1, "last_started_collective": -1,
             "last_completed_collective": -1},
        )  # fmt: skip
        mark["last_enqueued_collective"] = record.seq
        mark["last_started_collective"] = record.seq
        if state == "completed":
            mark["last_completed_collective"] = record.seq
    p2p = None if wait is None or not wait.call else _p2p_entry(
        wait, rank=rank, record_id=first_id + len(history), pg_id=len(pg_ids)
    )  # fmt: skip
    if p2p is not None:
        name, (entry, config) = p2p
        configs[name] = config
        entries.append(entry)
    return {
        "version": FLIGHT_VERSION,
        "comm_lib_version": f"distcompat (gloo, torch {torch.__version__})",
        "pg_config": configs,
        "pg_status": status,
        "entries": entries,
        "distcompat": {"job": job, "incident": incident, "rank": rank, "world_size": world_size,
                       "written": time.time()},
    }  # fmt: skip


def parse_ranks(text: str) -> list[int]:
    """Parse ``pg_config``'s ``ranks`` string (``"[0, 1]"``) (no ``eval``).

    Example:
        >>> parse_ranks("[0, 2, 5]")
        [0, 2, 5]
    """
    inner = text.strip().removeprefix("[").removesuffix("]")
    return [int(part) for part in inner.split(",") if part.strip()]


def write_flight_dump(folder: Path, *, rank: int, data: Mapping[str, Any]) -> Path:
    """Write ``data`` as rank ``rank``'s Flight Recorder dump in ``folder``, atomically.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     write_flight_dump(Path(tmp), rank=1, data={"version": "2.10"}).name
        'comm_lib_trace_rank_1'
    """
    path = flight_path(folder, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, pickle.dumps(dict(data), protocol=2))  # as torch's C++ pickler
    return path
