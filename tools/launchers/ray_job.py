"""Ray Train: a ``TorchTrainer`` with CPU workers, each running the probe in the group Ray made.

    python tools/launchers/ray_job.py --workers 2 --out DIR

Ray creates the gloo process group before the worker function runs, so distcompat must adopt it
(``DistInfo.adopted``) and leave it alone at teardown. Ray sets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``NODE_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` in the
workers, which docs/launching.md files under the ``env`` launcher label. The truth the probe
compares with is Ray's own train context. A private local Ray instance (``address="local"``,
its own temp dir) is started and shut down here, so a Ray cluster of someone else's is never
joined.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray
import ray.train
from probe import Expectation, run_probe
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer
from truth import Truth

HERE = Path(__file__).resolve().parent
GROUP_TIMEOUT_S = 60


def worker_loop(config: dict[str, Any]) -> None:
    """Ray's worker function: read Ray's own view of this worker, then run the probe."""
    context = ray.train.get_context()
    truth = Truth(
        source="ray.train.get_context()",
        rank=context.get_world_rank(),
        local_rank=context.get_local_rank(),
        world_size=context.get_world_size(),
        local_world_size=context.get_local_world_size(),
        node_rank=context.get_node_rank(),
    )
    expect = Expectation(
        launcher="env", world_size=int(config["workers"]), adopted=True, timeout=GROUP_TIMEOUT_S
    )
    run_probe(expect, truth, Path(config["out"]))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="CPU workers (ranks)")
    parser.add_argument("--out", type=Path, required=True, help="directory for rank-<R>.json")
    args = parser.parse_args(argv)
    # Ray's socket paths must stay short (AF_UNIX: 107 bytes), so its temp dir is not under --out.
    temp = Path(tempfile.mkdtemp(prefix="dcray"))
    try:
        ray.init(
            address="local",
            num_cpus=args.workers,
            include_dashboard=False,
            _temp_dir=str(temp),
            runtime_env={"env_vars": {"PYTHONPATH": str(HERE)}},  # probe.py for the workers
        )
        trainer = TorchTrainer(
            worker_loop,
            train_loop_config={"workers": args.workers, "out": str(args.out)},
            scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False),
            torch_config=TorchConfig(backend="gloo", timeout_s=GROUP_TIMEOUT_S),
            run_config=RunConfig(storage_path=str(args.out / "ray-results"), name="probe"),
        )
        trainer.fit()
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    print(f"[ray_job] TorchTrainer finished with {args.workers} workers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
