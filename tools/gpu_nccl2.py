"""The questions issue 53 asks of NCCL on torch 2.15 (where ``nccl`` means ProcessGroupNCCL2), on
one GPU, answered with evidence; run by ``tools/gpu_checks.sh nccl2``::

    PYTHON=/path/to/python-with-torch-2.15 bash tools/gpu_checks.sh nccl2

1. Does distcompat's drop-in init bind the right device without ``device_id``? (2.15's NCCL
   needs a bound device.) The group's bound device, the current device, one all_reduce.
2. Do torch's Flight Recorder dumps land where distcompat points them? The variables init set
   (``TORCH_FR_DUMP_TEMP_FILE``), a dump written through torch's own call, the files there.
3. Does ``distcompat diagnose`` read the dump's entries (``nccl2:`` or ``nccl:`` op names)?

Each answer is one line ``QUESTION: yes|no|unknown: evidence``; the script exits 0 when every
answer is yes, 1 otherwise. It runs one rank (world size 1: one GPU), under a launcher
environment it sets itself.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
from pathlib import Path
from typing import Any


def _say(question: str, ok: bool | None, evidence: str) -> bool:
    verdict = {True: "yes", False: "no", None: "unknown"}[ok]
    print(f"{question}: {verdict}: {evidence}", flush=True)
    return ok is True


def _dump_call(c10d: Any) -> Any:
    for name in ("_dump_nccl2_trace", "_dump_nccl_trace", "_dump_fr_trace"):
        found = getattr(c10d, name, None)
        if found is not None:
            return name, found
    return None, None


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="nccl2-"))
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533"})  # fmt: skip
    import torch
    import torch.distributed as tdist

    import distcompat.distributed as dist
    from distcompat._ranks import recorded
    from distcompat.diagnostics._config import default_dump_dir

    print(f"torch {torch.__version__}, cuda {torch.version.cuda}, {torch.cuda.get_device_name()}")
    answers = []
    dist.init_process_group("nccl")
    world: Any = tdist.group.WORLD
    bound = getattr(world, "bound_device_id", None)
    value = torch.ones(4, device="cuda")
    dist.all_reduce(value)
    torch.cuda.synchronize()
    info = recorded()
    answers.append(_say(
        "drop-in binds the device without device_id",
        bound is not None and bound == torch.device("cuda", torch.cuda.current_device())
        and value.sum().item() == 4.0,
        f"bound_device_id={bound}, current=cuda:{torch.cuda.current_device()}, "
        f"backend={tdist.get_backend()}, sum={value.sum().item()}, "
        f"device_reason={info.device_reason if info else None}",
    ))  # fmt: skip
    target = os.environ.get("TORCH_FR_DUMP_TEMP_FILE", "")
    name, dump = _dump_call(torch._C._distributed_c10d)
    folder = Path(target).parent if target else work / "dumps"
    if dump is None:
        answers.append(_say("Flight Recorder dumps land where distcompat points", None,
                            "this torch has no _dump_*_trace call"))  # fmt: skip
    else:
        folder.mkdir(parents=True, exist_ok=True)
        written = folder / f"{Path(target).name or 'comm_lib_trace_rank_'}0"
        written.write_bytes(dump())
        answers.append(_say(
            "Flight Recorder dumps land where distcompat points",
            target.startswith(str(default_dump_dir())) and written.stat().st_size > 0,
            f"TORCH_FR_DUMP_TEMP_FILE={target!r}, {name}() wrote {written.stat().st_size} bytes "
            f"to {written}",
        ))  # fmt: skip
    from distcompat.cli import main as cli

    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        code = cli(["diagnose", str(folder)])
    text = said.getvalue()
    answers.append(_say(
        "diagnose reads the NCCL entries",
        code == 0 and ("nccl2:" in text or "nccl:" in text),
        " | ".join(text.strip().splitlines()[:6]),
    ))  # fmt: skip
    dist.destroy_process_group()
    return 0 if all(answers) else 1


if __name__ == "__main__":
    sys.exit(main())
