"""One rank of the in-place tests: a hand-written exact-mode loop (or DDP) under InPlace.

    python tests/_inplace_script.py --steps 12 --kill 2@5 [--ddp] [--float] [--zero]

``--kill R@S[,R@S...]``: launch rank R SIGKILLs itself at the start of step S (it prints the
time first; a replacement, ``TORCHELASTIC_RESTART_COUNT`` 1, does not); ``--stop R@S``: it SIGSTOPs
itself there (alive, not taking part). Ranks name themselves by their launch rank (``RANK``): a
replacement is a group of one until InPlace admits it. Each surviving rank prints
``rank R: digest HEX``, ``rank R: world W``, ``rank R: recovery EPOCH LOST JOINED SECONDS HOW``
(``-`` where none) and ``rank R: committed S T`` (the step and when it committed, ``time.time()``).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

import distcompat
from distcompat import _ranks
from distcompat.anysize import ExactGradients, TrainPlan
from distcompat.demo._optim import ZeroAdamW
from distcompat.inplace import InPlace
from distcompat.process_group import _joining


def data(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(2, 8, generator=generator), torch.randn(2, 4, generator=generator)


def digest(model: torch.nn.Module) -> str:
    hasher = hashlib.sha256()
    for tensor in model.state_dict().values():
        hasher.update(tensor.detach().contiguous().numpy().tobytes())
    return hasher.hexdigest()


class _Step(contextlib.nullcontext[None]):
    """What ``--plain`` gives the loop in place of an Attempt: the step, no protection."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step


def _plain(steps: int) -> Iterator[_Step]:
    yield from (_Step(step) for step in range(steps))


def process_started() -> float:
    """When this process started (``time.time()``; imports included), from /proc: its start
    and the uptime, both since boot in 10 ms steps (the boot time itself is whole seconds)."""
    with open(f"/proc/{os.getpid()}/stat") as own:
        ticks = float(own.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as uptime:
        up = float(uptime.read().split()[0])
    return time.time() - (up - ticks / os.sysconf("SC_CLK_TCK"))


def end_at(key: str, how: str) -> None:
    """SIGKILL (or SIGSTOP, resumed 8 s later) this process once ``key`` is in the in-place
    prefix of the store (the grow protocol's keys, ``inplace._grow``)."""
    joining = _joining.pending()
    base = joining.group.base if joining is not None else str(recorded_generation())
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False
    )
    key = f"{_joining.prefix(base)}/{key}"
    while not store.check([key]):
        time.sleep(0.001)
    print(f"rank {os.environ['RANK']}: vanished {how}", flush=True)
    if how == "stop":  # resumed later by a shell of its own
        subprocess.Popen(["sh", "-c", f"sleep 8; kill -CONT {os.getpid()}"])
    os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)


def kill_me(me: int) -> None:
    print(f"rank {me}: killed at {time.time()!r}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def whole_state(opt: ZeroAdamW, model: torch.nn.Module) -> str:
    """The digest of the model and the optimizer's whole state: every rank's shards joined (the
    same at any world size)."""
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, opt.state_dict())
    hasher = hashlib.sha256(f"{states[0]['steps_done']} {digest(model)}".encode())
    for index in range(len(states[0]["shards"])):
        for name in ("master", "exp_avg", "exp_avg_sq"):
            whole = torch.cat([state["shards"][index][name] for state in states])
            numel = opt._params[index].numel()
            hasher.update(whole[:numel].numpy().tobytes())
    return hasher.hexdigest()


def recorded_generation() -> int | str:
    """The init generation of this rank's group (the in-place keys are under it)."""
    found = _ranks.rendezvous()
    assert found is not None
    return found[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--kill", default="")
    parser.add_argument("--stop", default="", help="R@S: launch rank R SIGSTOPs itself at step S")
    parser.add_argument("--timeout", type=float, default=None, help="the group timeout (s)")
    parser.add_argument("--ddp", action="store_true")
    parser.add_argument("--float", action="store_true", help="no exact mode: a float all-reduce")
    parser.add_argument(
        "--zero", action="store_true",
        help="the demo's sharded ZeroAdamW (float mode): each rank prints the digest of the "
        "whole optimizer state at the start of each attempt (``state S HEX``)",
    )  # fmt: skip
    parser.add_argument(
        "--kill-in", choices=("start", "update"), default="start",
        help="where --kill strikes: the attempt's start, or after the backward (a ZeroAdamW "
        "shard updated, its gather not done: the survivors are torn)",
    )  # fmt: skip
    parser.add_argument("--plain", action="store_true", help="the same loop without InPlace")
    parser.add_argument(
        "--subgroup", action="store_true",
        help="make a subgroup and a device mesh of every rank first; at the end, say what a "
        "collective on the subgroup and the mesh's numbers do",
    )  # fmt: skip
    parser.add_argument(
        "--vanish", choices=("kill", "stop"), default=None,
        help="a replacement SIGKILLs (or SIGSTOPs, resumed 8 s later) itself once the members "
        "propose to admit it (the first grow after the first shrink)",
    )  # fmt: skip
    parser.add_argument(
        "--die-at-grow", default="",
        help="R@said: launch rank R SIGKILLs itself once it said yes to the first grow; "
        "R@admitted: once the leader admitted the newcomer (a member lost while the group grows)",
    )  # fmt: skip
    parser.add_argument(
        "--pace", type=float, default=0.0,
        help="seconds each step waits while the group is smaller than it started (so that a "
        "replacement, which imports torch first, comes before the job ends)",
    )  # fmt: skip
    args = parser.parse_args()
    kills = {tuple(int(v) for v in kill.split("@")) for kill in args.kill.split(",") if kill}
    stop_rank, stop_step = (int(v) for v in args.stop.split("@")) if args.stop else (-1, -1)
    torch.set_num_threads(1)
    distcompat.init_distributed(device="cpu", timeout=args.timeout)
    me = int(os.environ["RANK"])
    replacement = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    print(f"rank {me}: started {process_started()!r} pid {os.getpid()}", flush=True)
    if replacement and args.vanish:  # once the members propose to admit it (epoch 1: the
        # first shrink's; its first grow)
        at = ("epoch1/grow0", args.vanish)
        threading.Thread(target=end_at, args=at, daemon=True).start()
    if args.die_at_grow and not replacement:  # R@said: once it said yes to the first grow;
        # R@admitted: once the leader admitted newcomer 3 (before this rank comes to the regroup)
        rank, when = args.die_at_grow.split("@")
        key = f"epoch1/grow0/ack/{me}" if when == "said" else "admit/3"
        if me == int(rank):
            threading.Thread(target=end_at, args=(key, "kill"), daemon=True).start()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    plan = TrainPlan(global_batch=24, micro_batch=2)  # splits over 1, 2, 3, 4 and 6 ranks
    exact = (
        None if args.float or args.zero else ExactGradients(net, micro_batches=plan.micro_batches)
    )
    model: torch.nn.Module = net
    if args.ddp:
        model = DistributedDataParallel(net)
        if exact is not None:
            model.register_comm_hook(None, exact.ddp_comm_hook)
    opt: Any = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    if args.zero:
        opt = ZeroAdamW(net.parameters(), lr=0.01)
    state = {"plan": plan} if exact is None else {"plan": plan, "exact": exact}
    subgroup, mesh = None, None
    if args.subgroup:
        made = dist.new_group(list(range(dist.get_world_size())))
        assert isinstance(made, dist.ProcessGroup)  # every rank is a member
        subgroup = made
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # its group: the default one
    inplace = None if args.plain else InPlace(model, opt, state=state, shard_copies=args.zero)
    attempts = _plain(args.steps) if inplace is None else inplace.steps(args.steps)
    began = time.perf_counter()
    for attempt in attempts:
        with attempt:
            if args.zero:
                print(f"rank {me}: state {attempt.step} {whole_state(opt, net)}", flush=True)
            killed = (me, attempt.step) in kills and not replacement
            if killed and args.kill_in == "start":
                kill_me(me)
            if me == stop_rank and attempt.step == stop_step:
                os.kill(os.getpid(), signal.SIGSTOP)
            if dist.get_world_size() < int(os.environ["WORLD_SIZE"]):
                time.sleep(args.pace)
            share = plan.share()
            while True:
                last = share.micro_batches[-1]
                for micro in share.micro_batches:
                    x, y = data(plan.step, micro)
                    quiet = (args.ddp or args.zero) and micro != last  # they sync at the last
                    holder = model if args.ddp else opt
                    with holder.no_sync() if quiet else contextlib.nullcontext():  # type: ignore[operator]
                        loss = torch.nn.functional.mse_loss(model(x), y) / plan.micro_batches
                        if exact is not None:
                            exact.add_loss(loss)
                        loss.backward()  # type: ignore[no-untyped-call]
                if killed:  # --kill-in update: this rank's shards updated, its gather not
                    time.sleep(0.2)  # (the others wait in step(): torn)
                    kill_me(me)
                if args.zero:
                    break
                if exact is None:
                    for param in net.parameters():
                        assert param.grad is not None
                        dist.all_reduce(param.grad)
                    break
                if exact.reduce().ok:
                    break
            opt.step()
            opt.zero_grad()
            plan.advance()
        done = attempt.step + 1 if inplace is None else inplace.step
        print(f"rank {me}: committed {done} {time.time()!r}", flush=True)
    print(f"rank {me}: loop_s {time.perf_counter() - began!r}", flush=True)
    for recovery in inplace.recoveries if inplace is not None else []:
        lost = ",".join(map(str, recovery.lost))
        joined = ",".join(map(str, recovery.joined)) or "-"
        print(
            f"rank {me}: recovery {recovery.epoch} {lost or '-'} {joined} "
            f"{recovery.seconds:.4f} {recovery.how}"
        )
    if subgroup is not None:
        for name, call in (
            ("distcompat", lambda: distcompat.all_reduce(torch.ones(1), group=subgroup)),
            ("torch", lambda: dist.all_reduce(torch.ones(1), group=subgroup)),
            ("size", lambda: dist.get_world_size(subgroup)),
            ("mesh size", lambda: mesh.size()),  # type: ignore[union-attr]
            ("mesh group", lambda: mesh.get_group()),  # type: ignore[union-attr]
        ):
            try:
                call()
                print(f"rank {me}: subgroup {name} ran", flush=True)
            except Exception as error:
                print(f"rank {me}: subgroup {name} {type(error).__name__}", flush=True)
    print(f"rank {me}: world {dist.get_world_size()}", flush=True)
    print(f"rank {me}: digest {digest(net)}", flush=True)
    distcompat.destroy_distributed()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
