"""One rank of a tiny resumable run told to stop, started by tests/test_preemption.py.

    python _preempt_script.py --ckpt DIR --result FILE [--term RANK@STEP] [--term-in step|save]

The run of ``_resume_script.py`` (a ``ShardedSampler``, one sample per rank per step, a buffer
counting how often each sample was trained on, ``resume`` at the start, a save every
``--every`` steps) with a :class:`distcompat.preemption.Preemption` asked each step whether to
stop. ``--term R@S``: rank R sends itself SIGTERM before step S (``step``), while its state is
pickled in the save of step S (``save``), or from a thread at a random moment of step S
(``random``, seeded by ``--seed``). ``--slow-save R``: rank R's stop save takes 60 s (past any
grace). Each rank that stops writes ``FILE.stop-<rank>.json`` (the report) and exits as the
report says; rank 0 of a run that ends writes ``FILE``: the counts, the parameters' SHA-256 and
the step it resumed from.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import distcompat
from _resume_script import (  # the same run, with a Preemption
    Pickled,
    start_run,
    train_on,
    write_result,
)
from distcompat.checkpoint import save_checkpoint, training_state
from distcompat.preemption import Preemption


def _term() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", type=Path, required=True)
    parser.add_argument("--result", type=Path, required=True)
    parser.add_argument("--samples", type=int, default=24)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--term", default="")
    parser.add_argument("--term-in", choices=("step", "save", "random"), default="step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--grace", type=float, default=30.0)
    parser.add_argument("--slow-save", type=int, default=-1)
    args = parser.parse_args()
    term_rank, term_step = (int(v) for v in args.term.split("@")) if args.term else (-1, -1)

    info, model, optimizer, sampler, resumed = start_run(args.ckpt, args.samples)
    preemption = Preemption(grace_s=args.grace)
    step = resumed.step
    for index in iter(sampler):
        step += 1
        told_here = info.rank == term_rank and step == term_step
        if told_here and args.term_in == "step":
            _term()
        if told_here and args.term_in == "random":
            delay = random.Random(args.seed).uniform(0.0, 0.02)
            threading.Timer(delay, _term).start()
        train_on(model, optimizer, index, info.world_size)
        if told_here and args.term_in == "random":
            time.sleep(0.03)  # the timer's signal lands before the step ends
        saved = step % args.every == 0
        if saved:
            extra = {"signal": Pickled(_term)} if told_here and args.term_in == "save" else {}
            state = training_state(model=model, optimizer=optimizer, loader=sampler, extra=extra)
            save_checkpoint(args.ckpt, step, state, keep_last=2)
        if preemption.should_stop(step):
            slow = {"slow": Pickled(lambda: time.sleep(60))} if info.rank == args.slow_save else {}

            def save(step: int = step, slow: dict[str, Any] = slow) -> None:
                state = training_state(model=model, optimizer=optimizer, loader=sampler, extra=slow)
                save_checkpoint(args.ckpt, step, state, keep_last=2)

            report = preemption.stop(save=None if saved else save, exit=False)
            stop_file = args.result.with_name(f"{args.result.name}.stop-{info.rank}.json")
            stop_file.write_text(json.dumps(asdict(report)), encoding="utf-8")
            preemption.exit(report)
    preemption.close()
    if info.rank == 0:
        write_result(args.result, model, resumed, step, info.world_size)
    distcompat.destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
