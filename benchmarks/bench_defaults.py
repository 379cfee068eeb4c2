"""What distcompat's protections cost a training run: ``distcompat demo`` with defaults vs off.

    python benchmarks/bench_defaults.py [--rounds 6] [--steps 30] [--nproc 2]

The protections on by default are the report-only watchdog (``DISTCOMPAT_WATCHDOG``) and the
mismatch check (``DISTCOMPAT_MISMATCH_CHECK``). Each round runs the demo twice on ``--nproc``
local gloo ranks, once with default settings and once with both set to ``off``; the order
alternates between rounds so drift in machine load hits both alike. The figure is the demo's own
tokens/s (steps after warm-up); the budget (issue 15) is the defaults within 1 % of everything
off. Writes ``benchmarks/results/defaults_cost.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from bench_demo import machine_facts, run_once

RESULTS = Path(__file__).resolve().parent / "results" / "defaults_cost.json"
OFF = {"DISTCOMPAT_WATCHDOG": "off", "DISTCOMPAT_MISMATCH_CHECK": "off"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--output", type=Path, default=RESULTS)
    options = parser.parse_args()
    for name in OFF:  # the "defaults" side must see distcompat's own defaults
        os.environ.pop(name, None)

    runs: dict[str, list[dict[str, float]]] = {"defaults": [], "off": []}
    ratios = []
    with tempfile.TemporaryDirectory(prefix="bench-defaults-") as tmp:
        for round_index in range(options.rounds):
            order = ("defaults", "off") if round_index % 2 == 0 else ("off", "defaults")
            got = {}
            for side in order:
                out = Path(tmp) / f"round{round_index}-{side}"
                env = OFF if side == "off" else None
                got[side] = run_once(options.nproc, options, out, env)
                runs[side].append(got[side])
            ratios.append(got["defaults"]["tokens_per_sec"] / got["off"]["tokens_per_sec"])
            print(
                f"round {round_index}: defaults {got['defaults']['tokens_per_sec']:,.0f} tok/s, "
                f"off {got['off']['tokens_per_sec']:,.0f} tok/s, ratio {ratios[-1]:.4f}",
                flush=True,
            )
    median = {side: statistics.median(r["tokens_per_sec"] for r in runs[side]) for side in runs}
    summary = {
        "what": "distcompat demo tokens/s, default protections vs DISTCOMPAT_WATCHDOG=off and "
        "DISTCOMPAT_MISMATCH_CHECK=off, interleaved rounds",
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(options).items()},
        "tokens_per_sec_median": median,
        "ratio_per_round": ratios,
        "ratio_median": statistics.median(ratios),
        "goal": "defaults >= 0.99 x off",
        "runs": runs,
        **machine_facts(),
    }
    options.output.parent.mkdir(parents=True, exist_ok=True)
    options.output.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: summary[k] for k in ("tokens_per_sec_median", "ratio_median")}))
    print(f"wrote {options.output}")


if __name__ == "__main__":
    main()
