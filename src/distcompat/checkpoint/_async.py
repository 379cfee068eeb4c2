"""Asynchronous saves: copy the state now, write and commit it in a background thread.

The lines a training script writes (every rank)::

    checkpointer = AsyncCheckpointer()            # every rank, together: makes a gloo group
    for step in ...:
        train_step()
        checkpointer.save("ckpt", step, {"model": model.state_dict()}, keep_last=3)
    checkpointer.close()                         # waits for the last save; raises its error

``save`` returns once the state is staged (tensors copied to CPU memory), so the training loop
may change the model straight away. The write and the commit follow the same protocol as
:func:`save_checkpoint`, on a gloo group of their own, so the background collectives never
interleave with the training loop's. At most one save is in flight: ``save`` first waits for the
previous one, and re-raises its error if it failed. Steps are never mixed: each save writes its
own staged copy into its own temp directory.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from distcompat.checkpoint._save import check_save_args, save_with_group
from distcompat.checkpoint._sync import DEFAULT_SYNC_TIMEOUT_S, dedicated_save_group

__all__ = ["AsyncCheckpointer", "stage"]


def stage(obj: Any) -> Any:
    """Return a copy of ``obj`` that later changes to ``obj`` cannot reach.

    Tensors are copied to CPU memory (detached); dicts, lists and tuples are rebuilt around the
    copies; anything else is deep-copied.

    Example:
        >>> import torch
        >>> live = {"w": torch.zeros(2)}
        >>> staged = stage(live)
        >>> _ = live["w"].add_(1)
        >>> staged["w"]
        tensor([0., 0.])
    """
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return type(obj)((key, stage(value)) for key, value in obj.items())
    if isinstance(obj, list):
        return [stage(value) for value in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(stage(value) for value in obj)
    return copy.deepcopy(obj)


class AsyncCheckpointer:
    """Save checkpoints in a background thread, with the commit protocol of save_checkpoint.

    Construct it on every rank at the same point (it makes a gloo group when a process group
    exists, which is a collective). ``timeout`` bounds the wait for every rank to reach a save,
    as in :func:`save_checkpoint`.

    Example:
        >>> import tempfile, torch
        >>> with tempfile.TemporaryDirectory() as tmp, AsyncCheckpointer() as checkpointer:
        ...     _ = checkpointer.save(tmp, 1, {"w": torch.ones(2)})
        ...     checkpointer.wait().name
        'step-1'
    """

    def __init__(self, *, timeout: float = DEFAULT_SYNC_TIMEOUT_S) -> None:
        self._timeout = timeout
        self._group = dedicated_save_group("AsyncCheckpointer()", timeout)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="distcompat-ckpt")
        self._pending: Future[Path] | None = None

    def save(
        self,
        directory: str | os.PathLike[str],
        step: int,
        state: Mapping[str, Any],
        *,
        keep_last: int | None = None,
        metadata: Mapping[str, Any] | None = None,
        replicated: bool = False,
    ) -> Future[Path]:
        """Stage ``state`` and start saving it; returns a future of the committed directory.

        Waits for the previous save first (and raises its error, if it failed). The arguments
        mean what they mean for :func:`save_checkpoint`.
        """
        check_save_args(step, keep_last, metadata)
        self.wait()
        staged = stage(dict(state))
        self._pending = self._executor.submit(
            save_with_group,
            self._group,
            Path(directory),
            step,
            staged,
            keep_last=keep_last,
            metadata=dict(metadata or {}),
            replicated=replicated,
            timeout=self._timeout,
            what=f"AsyncCheckpointer.save(step={step})",
        )
        return self._pending

    def wait(self) -> Path | None:
        """Block until the save in flight is committed; return its directory (None if none).

        Raises the save's error if it failed.
        """
        pending, self._pending = self._pending, None
        return None if pending is None else pending.result()

    def close(self) -> None:
        """Wait for the save in flight, then stop the background thread. Safe to call twice."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
