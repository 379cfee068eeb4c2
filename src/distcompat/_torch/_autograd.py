"""torch's private autograd and profiler switches that the collectives' hot paths call.

* ``set_grad_enabled``: the C function under ``torch.set_grad_enabled`` (the context manager
  costs about 1 us per collective; the function about 40 ns);
* ``profiler_enabled``, ``RecordFunctionFast``, ``enable_record_function``: whether torch's
  profiler records on this thread, an event, and turning events off for a block.

The same names on 2.9 through 2.15 (``torch._C``, ``torch._C._profiler``, ``torch._C._autograd``).

Example:
    >>> profiler_enabled()
    False
"""

from __future__ import annotations

import torch
from torch._C import _set_grad_enabled as set_grad_enabled
from torch._C import is_grad_enabled
from torch._C._autograd import _enable_record_function as enable_record_function
from torch._C._autograd import _profiler_enabled as profiler_enabled

__all__ = [
    "RecordFunctionFast",
    "enable_record_function",
    "is_grad_enabled",
    "profiler_enabled",
    "set_grad_enabled",
]

#: torch's fast record function: ``RecordFunctionFast(name, inputs, kwargs)`` as a context manager.
RecordFunctionFast = torch._C._profiler._RecordFunctionFast
