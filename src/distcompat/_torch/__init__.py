"""The one place that knows torch's internals, per release.

Every private or version-dependent torch name distcompat relies on is reached through this
package; ``tests/test_architecture.py`` fails when any other module touches one, and
docs/torch_versions.md carries the table :data:`INTERNALS` holds. A new torch release is a change
here::

    from distcompat import _torch
    _torch.default_store()                  # the default group's store (torch keeps it privately)
    _torch.release()                        # (2, 15): the installed torch, major and minor

The package imports torch and nothing of distcompat: it is the lowest layer.
"""

from distcompat._torch._autograd import (
    CROSS_THREAD_SHAPES,
    RecordFunctionFast,
    begin_record,
    enable_record_function,
    end_record,
    is_grad_enabled,
    profiler_enabled,
    set_grad_enabled,
)
from distcompat._torch._c10d import (
    AllgatherOptions,
    backend_timeout_s,
    caller_files,
    create_work_from_future,
    default_group,
    default_store,
    end_coalescing,
    premul_sum,
    register_cpu_backend,
    start_coalescing,
)
from distcompat._torch._names import INTERNALS, Internal, internals_table
from distcompat._torch._regroup import (
    can_reconfigure,
    ddp_comm_hooks,
    device_meshes,
    fence_mesh,
    forget_group_ranks,
    joining_gloo,
    other_groups,
    reconfigure,
    reconfigure_handle,
    set_world_view,
    update_ddp_group,
)
from distcompat._torch._release import release, release_text
from distcompat._torch._signatures import TorchReleaseError, parameters, require_takes, takes
from distcompat._torch._trampoline import TrampolineUnknownError, trampoline_methods

__all__ = [
    "CROSS_THREAD_SHAPES",
    "INTERNALS",
    "AllgatherOptions",
    "Internal",
    "RecordFunctionFast",
    "TorchReleaseError",
    "TrampolineUnknownError",
    "backend_timeout_s",
    "begin_record",
    "caller_files",
    "can_reconfigure",
    "create_work_from_future",
    "ddp_comm_hooks",
    "default_group",
    "default_store",
    "device_meshes",
    "enable_record_function",
    "end_coalescing",
    "end_record",
    "fence_mesh",
    "forget_group_ranks",
    "internals_table",
    "is_grad_enabled",
    "joining_gloo",
    "other_groups",
    "parameters",
    "premul_sum",
    "profiler_enabled",
    "reconfigure",
    "reconfigure_handle",
    "register_cpu_backend",
    "release",
    "release_text",
    "require_takes",
    "set_grad_enabled",
    "set_world_view",
    "start_coalescing",
    "takes",
    "trampoline_methods",
    "update_ddp_group",
]
