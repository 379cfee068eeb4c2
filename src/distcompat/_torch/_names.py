"""The table of torch names distcompat relies on that are private or differ between releases.

docs/torch_versions.md shows :func:`internals_table` (a test keeps the two the same); the seam's
functions are the only code that reaches these names.

Example:
    >>> any(item.used_by == "default_store" for item in INTERNALS)
    True
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["INTERNALS", "Internal", "internals_table"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Internal:
    """One torch name: what it is, the releases that have it, what distcompat does without it."""

    name: str
    torch_has: str  # the releases, as "2.9-2.15" or "2.14+"
    used_by: str  # the seam function that reaches it
    missing: str  # what distcompat does where a release lacks it


INTERNALS: tuple[Internal, ...] = (
    Internal(
        name="distributed_c10d._get_default_store",
        torch_has="2.9-2.15",
        used_by="default_store",
        missing="nothing yet: every supported release has it (the store of the default group)",
    ),
    Internal(
        name="distributed_c10d._world._default_pg",
        torch_has="2.9-2.15",
        used_by="default_group",
        missing="the public GroupMember.WORLD property (1.5-3 us slower per tiny collective)",
    ),
    Internal(
        name="_C._distributed_c10d._create_work_from_future",
        torch_has="2.9-2.15",
        used_by="create_work_from_future",
        missing="nothing yet: DDP under Join needs a native Work",
    ),
    Internal(
        name="_C._distributed_c10d.AllgatherOptions",
        torch_has="2.9-2.15",
        used_by="AllgatherOptions",
        missing="nothing yet: gloo's allgather takes one",
    ),
    Internal(
        name="ProcessGroup._register_backend, _set_default_backend",
        torch_has="2.9-2.15",
        used_by="register_cpu_backend",
        missing="nothing yet: C++ calls reach gloo through them",
    ),
    Internal(
        name="Backend._start_coalescing, _end_coalescing",
        torch_has="2.9-2.15 (the trampoline asks a Python group for them from 2.14)",
        used_by="start_coalescing, end_coalescing",
        missing="nothing yet: gloo raises torch's own error, as torch's group does",
    ),
    Internal(
        name="ProcessGroup._get_backend(cpu).options._timeout",
        torch_has="2.9-2.15",
        used_by="backend_timeout_s",
        missing="the timeout init recorded, else 1800 s",
    ),
    Internal(
        name="ReduceOp.PREMUL_SUM(factor) / _make_nccl_premul_sum",
        torch_has="the call 2.13+, the maker 2.9-2.15",
        used_by="premul_sum",
        missing="the private maker (before 2.13)",
    ),
    Internal(
        name="distributed_c10d, c10d_logger, algorithms.join (their files)",
        torch_has="2.9-2.15",
        used_by="caller_files",
        missing="nothing yet: the protected group tells Python callers from C++ ones by them",
    ),
    Internal(
        name="_C._set_grad_enabled, _C._autograd._profiler_enabled, _enable_record_function, "
        "_C._profiler._RecordFunctionFast",
        torch_has="2.9-2.15",
        used_by="set_grad_enabled, profiler_enabled, enable_record_function, RecordFunctionFast",
        missing="nothing yet: the collectives' hot path",
    ),
    Internal(
        name="a profiler event ended on another thread (RecordFunctionFast)",
        torch_has="kept with shapes 2.13+; dropped on 2.9",
        used_by="begin_record, end_record",
        missing="torch's future-end mechanism: the event kept, async, without shapes (said once)",
    ),
    Internal(
        name="PyProcessGroup.hpp (the trampoline's method names)",
        torch_has="c10d/ 2.9-2.13, c10d/py/ 2.14+",
        used_by="trampoline_methods",
        missing="TrampolineUnknownError naming the paths looked at (never a skip)",
    ),
    Internal(
        name="Backend._set_sequence_number_for_group",
        torch_has="a no-op since 2.1; warns from 2.14",
        used_by="(not called)",
        missing="not called on any release",
    ),
    Internal(
        name="init_process_group(_ranks=)",
        torch_has="2.10+",
        used_by="takes, require_takes",
        missing="TorchReleaseError naming the release, as torch's TypeError would",
    ),
    Internal(
        name="init_process_group(enable_reconfigure=)",
        torch_has="2.14+",
        used_by="takes, require_takes",
        missing="TorchReleaseError naming the release; where present, torch's own gloo group",
    ),
    Internal(
        name="*_object collectives (weights_only=)",
        torch_has="2.14+",
        used_by="takes",
        missing="distcompat's drop-ins take it on every release (True: torch.load's safe mode)",
    ),
    Internal(
        name="gather_single",
        torch_has="2.14+ (plain gloo raises)",
        used_by="(public)",
        missing="distcompat.gather_single on every release, emulated on gloo",
    ),
    Internal(
        name="ProcessGroupGloo.get_reconfigure_handle, reconfigure; ReconfigureOptions",
        torch_has="2.14+ (experimental)",
        used_by="can_reconfigure, reconfigure_handle, reconfigure",
        missing="a new gloo backend under a fresh store prefix: Python sees the new rank and "
        "size, C++ callers the old ones (DDP gets a comm hook that divides by the new size)",
    ),
    Internal(
        name="ProcessGroupGloo(enable_reconfigure=); a group's backend store "
        "(group name, then device, under init's store)",
        torch_has="2.14+",
        used_by="joining_gloo",
        missing="a newcomer makes a new gloo backend with the members under the epoch's "
        "store prefix, as they do",
    ),
    Internal(
        name="DistributedDataParallel._update_process_group, _comm_hooks",
        torch_has="2.9-2.15",
        used_by="update_ddp_group, ddp_comm_hooks",
        missing="nothing yet: DDP's reducer forgets a step a lost rank broke",
    ),
    Internal(
        name="distributed_c10d._world.pg_group_ranks, pg_map",
        torch_has="2.9-2.15",
        used_by="set_world_view, other_groups, forget_group_ranks",
        missing="nothing yet: torch's ranks of a group and its store",
    ),
    Internal(
        name="set_timeout",
        torch_has="2.14+",
        used_by="(public)",
        missing="distcompat.distributed.set_timeout on every release",
    ),
)


def internals_table() -> str:
    """Return :data:`INTERNALS` as the Markdown table docs/torch_versions.md carries.

    Example:
        >>> internals_table().splitlines()[0]
        '| torch name | releases that have it | the seam function | where it is missing |'
    """
    rows = [
        "| torch name | releases that have it | the seam function | where it is missing |",
        "|---|---|---|---|",
    ]
    for item in INTERNALS:
        rows.append(f"| `{item.name}` | {item.torch_has} | {item.used_by} | {item.missing} |")
    return "\n".join(rows)
