"""The rank side of the test harness: one long-lived process per rank, running tasks on request.

A worker sets the torchrun-style environment it was given, joins the group through
:func:`distcompat.init_distributed` (so the harness exercises the library's own init path), then
loops: receive a pickled task, make sure a group exists, run it, send back the value or the error
with its traceback. Messages are plain pickles of tuples:

* parent -> worker: ``("run", task_id, fn, args, kwargs, reset)`` or ``("stop",)``
* worker -> parent: ``("ok", task_id, value)`` or ``("err", task_id, exc_or_None, summary, tb)``

This module imports torch lazily, after the environment is set.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import pickle
import signal
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any

from distcompat.testing._startup import load_hint

__all__ = ["STACK_SIGNAL", "worker_main"]

#: Signal the parent sends to a rank it is about to kill, so the rank dumps its Python stacks.
STACK_SIGNAL = signal.SIGUSR1
_PR_SET_PDEATHSIG = 1
_PARENT_POLL_S = 1.0


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this worker when the parent dies, so no rank outlives a killed run."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _describe(exc: BaseException) -> tuple[bytes | None, str]:
    summary = f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}"
    try:
        return pickle.dumps(exc), summary
    except Exception:  # an exception that cannot cross processes: keep its text only
        return None, summary


def _error_reply(task_id: int, exc: BaseException) -> tuple[Any, ...]:
    blob, summary = _describe(exc)
    return ("err", task_id, blob, summary, traceback.format_exc())


def worker_main(
    conn: Connection,
    environ: dict[str, str],
    backend: str,
    group_timeout_s: float,
    stack_path: str,
) -> None:
    """Run tasks for the parent until told to stop or the parent goes away."""
    parent = os.getppid()
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    os.environ.update(environ)
    with open(stack_path, "w") as stacks:
        faulthandler.register(STACK_SIGNAL, file=stacks, all_threads=True)
        _serve(conn, backend, group_timeout_s, parent)


def _serve(conn: Connection, backend: str, group_timeout_s: float, parent: int) -> None:
    # Heavy, and order matters: torch (and distcompat, which imports it) only now, after the
    # environment is set, since torch reads some of its variables (threads, gloo) at import.
    import torch.distributed as dist

    from distcompat.process_group import destroy_distributed

    conn.send_bytes(pickle.dumps(("ready",)))  # past spawn's re-import of the main script
    try:
        _loop(conn, backend, group_timeout_s, parent)
    finally:
        # Exiting with a live gloo group can end in C++ "terminate called without an active
        # exception" while its threads are torn down; leave cleanly instead.
        destroy_distributed()
        if dist.is_initialized():
            dist.destroy_process_group()


def _loop(conn: Connection, backend: str, group_timeout_s: float, parent: int) -> None:
    import torch.distributed as dist  # after the environment is set: see _serve

    from distcompat.process_group import destroy_distributed, init_distributed

    device = "cpu" if backend == "gloo" else "auto"
    while True:
        if not conn.poll(_PARENT_POLL_S):
            if os.getppid() != parent:
                return
            continue
        try:
            message = pickle.loads(conn.recv_bytes())
        except EOFError:
            return
        except Exception as exc:  # the task could not be unpickled here (e.g. import error)
            failed = _error_reply(-1, exc)
            conn.send_bytes(pickle.dumps((*failed[:3], load_hint(exc), failed[4])))
            continue
        if message[0] == "stop":
            return
        _, task_id, fn, args, kwargs, reset = message
        try:
            if reset:
                destroy_distributed()
                if dist.is_initialized():
                    dist.destroy_process_group()
            if not dist.is_initialized():
                init_distributed(device=device, backend=backend, timeout=group_timeout_s)
            reply: tuple[Any, ...] = ("ok", task_id, fn(*args, **kwargs))
            payload = pickle.dumps(reply)
        except BaseException as exc:
            payload = pickle.dumps(_error_reply(task_id, exc))
        conn.send_bytes(payload)
