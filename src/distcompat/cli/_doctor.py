"""``distcompat doctor``: what the launcher env says and what init would choose, with reasons.

It decides exactly as :func:`distcompat.init_distributed` would, but creates no process group, so
it is safe under any launcher, on any number of ranks::

    torchrun --standalone --nproc-per-node=2 --no-python distcompat doctor
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from distcompat.collectives.shm import host_reason
from distcompat.launch import LaunchEnv, LaunchEnvError, launch_pitfalls
from distcompat.launch._host import HostInfo, probe_host
from distcompat.launch._placement import (
    BackendUnavailableError,
    DeviceBindingError,
    choose_backend,
    choose_timeout,
    resolve_device,
)
from distcompat.launch._rules import LaunchEnvError as SettingError
from distcompat.launch._settings import (
    choose_mismatch_check,
    choose_protection,
    choose_watchdog,
)

__all__ = ["DoctorReport", "collect_report"]


@dataclass(frozen=True, slots=True, kw_only=True)
class DoctorReport:
    """Everything ``distcompat doctor`` prints for one rank; ``problems`` empty means healthy."""

    env: LaunchEnv | None
    host: HostInfo
    device: str | None
    device_reason: str
    backend: str | None
    backend_reason: str
    timeout_reason: str
    problems: tuple[str, ...]
    pitfalls: tuple[str, ...] = ()
    watchdog_reason: str = ""
    mismatch_reason: str = ""
    shm_reason: str = ""
    group_reason: str = ""

    @property
    def ok(self) -> bool:
        """True when nothing stops :func:`distcompat.init_distributed` from working."""
        return not self.problems

    def to_text(self) -> str:
        """Readable lines, each prefixed with the rank so several ranks' output stays legible."""
        tag = f"[rank {self.env.rank}] " if self.env is not None else "[rank ?] "
        lines = []
        if self.env is not None:
            lines.append(
                f"launcher {self.env.launcher}: rank {self.env.rank} of {self.env.world_size}, "
                f"local rank {self.env.local_rank} of {self.env.local_world_size}, "
                f"node {self.env.node_rank} of {self.env.num_nodes}"
            )
            lines += [f"  {line}" for line in self.env.describe().splitlines()]
        lines += [
            f"device:  {self.device or '-'}  ({self.device_reason})",
            f"backend: {self.backend or '-'}  ({self.backend_reason})",
            f"timeout: {self.timeout_reason}",
            f"watchdog: {self.watchdog_reason}",
            f"mismatch check: {self.mismatch_reason}",
            f"shared memory: {self.shm_reason}",
            f"group: {self.group_reason}",
            f"torch {self.host.torch_version}; collective backends built in: "
            f"{', '.join(sorted(self.host.backends)) or 'none'}; devices: "
            f"cuda={self.host.cuda_device_count} xpu={self.host.xpu_device_count} "
            f"mps={int(self.host.mps_available)}",
        ]
        lines += [f"PROBLEM: {p}" for p in self.problems]
        lines += [f"PITFALL: {p}" for p in self.pitfalls]
        lines.append("ok: init_distributed() would succeed" if self.ok else "not ok")
        return "\n".join(tag + line for line in lines)

    def to_json(self) -> str:
        """One JSON object (a line per rank when several ranks print)."""
        env = self.env
        return json.dumps(
            {
                "launcher": env.launcher if env else None,
                "rank": env.rank if env else None,
                "local_rank": env.local_rank if env else None,
                "world_size": env.world_size if env else None,
                "local_world_size": env.local_world_size if env else None,
                "node_rank": env.node_rank if env else None,
                "master_addr": env.master_addr if env else None,
                "master_port": env.master_port if env else None,
                "sources": dict(env.sources) if env else {},
                "device": self.device,
                "device_reason": self.device_reason,
                "backend": self.backend,
                "backend_reason": self.backend_reason,
                "timeout_reason": self.timeout_reason,
                "watchdog_reason": self.watchdog_reason,
                "mismatch_reason": self.mismatch_reason,
                "shm_reason": self.shm_reason,
                "group_reason": self.group_reason,
                "torch_version": self.host.torch_version,
                "backends": sorted(self.host.backends),
                "cuda_device_count": self.host.cuda_device_count,
                "problems": list(self.problems),
                "pitfalls": list(self.pitfalls),
                "ok": self.ok,
            },
            sort_keys=True,
        )


def collect_report(
    device: str = "auto",
    backend: str | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    launcher_argv: Sequence[str] | None = None,
) -> DoctorReport:
    """Decide what init would do for this rank, collecting every problem instead of raising.

    Launch pitfalls (:func:`distcompat.diagnostics.launch_pitfalls`) are listed as ``pitfalls``;
    a missing rendezvous host is a problem. ``launcher_argv`` is torchrun's command line after
    ``torchrun`` (default: read from the parent process when it is torchrun).

    Example:
        >>> collect_report(device="cpu", environ={}).backend
        'gloo'
    """
    host = probe_host()
    problems: list[str] = []
    pitfalls: list[str] = []
    try:
        env: LaunchEnv | None = LaunchEnv.from_environ(environ)
    except LaunchEnvError as exc:
        env, problems = None, [f"launcher environment: {exc}"]
    device_name: str | None = None
    backend_name: str | None = None
    device_reason = backend_reason = "not decided: the launcher environment is invalid"
    if env is not None:
        try:
            chosen = resolve_device(device, local_rank=env.local_rank, env=env, host=host)
            device_name, device_reason = str(chosen.device), chosen.reason
            picked = choose_backend(chosen.device, backend, host=host)
            backend_name, backend_reason = picked.backend, picked.reason
        except (DeviceBindingError, BackendUnavailableError, ValueError) as exc:
            problems.append(str(exc))
            device_reason = device_reason if device_name else f"failed: {exc}"
            backend_reason = "not decided" if backend_name is None else backend_reason
        for pitfall in launch_pitfalls(env, backend=backend_name, argv=launcher_argv):
            if pitfall.name == "no-rendezvous-host":  # init would fail: a problem, not a pitfall
                problems.append(pitfall.describe())
            else:
                pitfalls.append(pitfall.describe())
        if not env.is_distributed:
            backend_reason = f"none needed: single process ({backend_reason} if it were launched)"
    timeout = choose_timeout(None)
    try:
        watch = choose_watchdog(None, group_timeout=timeout.timeout, environ=environ).reason
    except SettingError as exc:
        problems.append(str(exc))
        watch = f"failed: {exc}"
    try:
        mismatch = choose_mismatch_check(environ).reason
    except SettingError as exc:
        problems.append(str(exc))
        mismatch = f"failed: {exc}"
    try:
        shm = host_reason(environ)
    except SettingError as exc:
        problems.append(str(exc))
        shm = f"failed: {exc}"
    try:
        group = choose_protection(backend_name or "gloo", environ).reason
    except SettingError as exc:
        problems.append(str(exc))
        group = f"failed: {exc}"
    if env is not None and not env.is_distributed:
        watch = f"none needed: single process ({watch.split(':')[0]} if it were launched)"
        mismatch = f"none needed: single process ({mismatch.split(':')[0]} if it were launched)"
        shm = f"none needed: single process ({shm.split(':')[0]} if it were launched)"
        group = f"none needed: single process ({group.split(':')[0]} if it were launched)"
    return DoctorReport(
        env=env,
        host=host,
        device=device_name,
        device_reason=device_reason,
        backend=backend_name,
        backend_reason=backend_reason,
        timeout_reason=timeout.reason,
        problems=tuple(problems),
        pitfalls=tuple(pitfalls),
        watchdog_reason=watch,
        mismatch_reason=mismatch,
        shm_reason=shm,
        group_reason=group,
    )
