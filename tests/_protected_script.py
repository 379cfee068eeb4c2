"""Rank script for tests/test_collectives_protected.py: DDP, FSDP2, DCP and raw torch calls on
the group ``distcompat.distributed.init_process_group`` makes, every default on.

    python _protected_script.py SCENARIO [DIR]      # under run_ranks (torchrun's contract)

Each scenario prints ``rank R: ...`` lines the test reads.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as tdist
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

import distcompat.distributed as dist
from distcompat.collectives.shm import _path as shm


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))


def ddp(rank: int, stall: bool, kill: bool, fork: bool = False) -> None:
    """Six DDP steps; rank 1 stalls 7 s before step 3 (``stall``) or is SIGKILLed there.

    ``fork``: rank 1 first forks a child that sleeps 30 s holding its sockets (a DataLoader
    worker's case: gloo sees no closed socket); rank 0 then says whether it still lived when
    rank 0's error came.
    """
    child = _forked_child(rank) if fork else 0
    model = DistributedDataParallel(_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(6):
        if rank == 1 and step == 3 and stall:
            time.sleep(7)  # the stalled line the report must name
        if rank == 1 and step == 3 and kill:
            os.kill(os.getpid(), signal.SIGKILL)
        x = torch.full((4, 8), float(rank + step))
        try:
            model(x).square().mean().backward()
            opt.step()  # the typed error lands right after backward(), maybe a few lines on
            opt.zero_grad()
        except Exception as exc:
            print(f"rank {rank}: raised {type(exc).__name__}: {exc}", flush=True)
            if child:
                print(f"rank {rank}: child alive then {_alive(child)}", flush=True)
                os.kill(child, signal.SIGKILL)
            raise
    weights = torch.cat([p.detach().view(-1) for p in model.parameters()])
    print(f"rank {rank}: ddp done {weights.sum().item()!r}", flush=True)
    engine = shm._groups.get(tdist.group.WORLD)  # the ops the shared-memory path ran
    print(f"rank {rank}: shm calls {getattr(engine, 'calls', 0)}", flush=True)


def _forked_child(rank: int) -> int:
    """Rank 1 forks a child that sleeps 30 s; every rank returns its pid.

    The child, as a DataLoader worker would, keeps rank 1's end of gloo's connections open for
    as long as it lives: gloo sees no closed socket when rank 1 dies.
    """
    child = torch.zeros(1)
    if rank == 1:
        pid = os.fork()
        if pid == 0:
            time.sleep(30)
            os._exit(0)
        child += pid
    tdist.broadcast(child, src=1)
    return int(child.item())


def forked_kill(rank: int) -> None:
    """Rank 1 forks a child (:func:`_forked_child`) and is SIGKILLed; rank 0 all-reduces.

    Rank 0 prints what it raised, and whether the child was still alive then.
    """
    child = _forked_child(rank)
    total = torch.ones(256)
    for _ in range(8):  # past the mismatch check's look at a new call: the backend's own wait
        tdist.all_reduce(total)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        tdist.all_reduce(total)
    except Exception as exc:
        alive = _alive(child)
        print(f"rank {rank}: raised {type(exc).__name__}: {exc}", flush=True)
        print(f"rank {rank}: child alive then {alive}", flush=True)
        os.kill(child, signal.SIGKILL)
        os._exit(1)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def adopted_late(rank: int) -> None:
    """torch's own init, adopted by init_distributed; rank 1 comes 7 s late to an all_reduce."""
    import distcompat

    info = distcompat.init_distributed()  # adopts the group torch made, with its store
    print(f"rank {rank}: adopted {info.adopted}", flush=True)
    if rank == 1:
        time.sleep(7)  # the late line the report must name
    total = torch.ones(1)
    dist.all_reduce(total)
    print(f"rank {rank}: total {total.item()!r}", flush=True)
    tdist.destroy_process_group()


def raw(rank: int, directory: str) -> None:
    """Raw torch calls: a mismatch, a compiled functional all_reduce, a DCP save."""
    try:
        tdist.all_reduce(torch.ones(4 if rank == 0 else 5))
    except Exception as exc:  # the typed error, on every rank
        print(f"rank {rank}: raised {type(exc).__name__}", flush=True)
    import torch.distributed._functional_collectives as fc
    import torch.distributed.checkpoint as dcp

    group = tdist.group.WORLD

    @torch.compile(fullgraph=True, backend="eager")  # fullgraph: one graph or an error
    def doubled_sum(x: torch.Tensor) -> torch.Tensor:
        assert group is not None
        out: torch.Tensor = fc.all_reduce(x * 2, "sum", group) + 1
        return out

    got = doubled_sum(torch.full((3,), float(rank + 1)))
    print(f"rank {rank}: compiled {got.tolist()!r}", flush=True)
    state = {"w": torch.arange(12.0) * (1 + rank), "step": torch.tensor(7)}
    dcp.save(state, checkpoint_id=directory)  # type: ignore[attr-defined]
    print(f"rank {rank}: saved", flush=True)


def load(rank: int, directory: str) -> None:
    """Load what ``raw`` saved, on this world size."""
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.zeros(12), "step": torch.tensor(0)}
    dcp.load(state, checkpoint_id=directory)  # type: ignore[attr-defined]
    print(f"rank {rank}: loaded {state['w'].tolist()!r} {int(state['step'])}", flush=True)


def _sharded_mlp(mesh: DeviceMesh | None = None) -> torch.nn.Module:
    """The MLP with each Linear and the whole model under FSDP2 (HSDP on a 2-D ``mesh``)."""
    from torch.distributed.fsdp import fully_shard

    model = _mlp()
    for layer in model.children():
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full_state(rank: int, model: torch.nn.Module) -> str:
    """The digest and sum of the full state dict (a functional all-gather per parameter),
    offloaded to rank 0: what rank 0 holds, or nothing elsewhere."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=options)
    names = sorted(full) if rank == 0 else []
    values = [value for name in names if isinstance(value := full[name], torch.Tensor)]
    total = sum(float(v.double().sum()) for v in values)
    return f"{_digest(values)} {total!r}"


def fsdp(rank: int, directory: str | None, hsdp: bool = False) -> None:
    """Four FSDP2 steps on a 3-layer MLP with gradient clipping; print each step's loss, then
    the full state dict's digest and sum; save the sharded state dict with DCP to ``directory``.
    ``hsdp``: on a 2 x (world / 2) mesh, replicated across its first dimension."""
    mesh = None
    if hsdp:
        from torch.distributed.device_mesh import init_device_mesh

        world = dist.get_world_size()
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    model = _sharded_mlp(mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(4):
        if rank == 1 and step == 2 and os.environ.get("STALL") == "1":
            time.sleep(7)
        x = torch.linspace(-1, 1, 32).view(4, 8) * (rank + 1 + step)
        loss = model(x).square().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    print(f"rank {rank}: fsdp losses {losses!r}", flush=True)
    print(f"rank {rank}: fsdp state {_full_state(rank, model)}", flush=True)
    if directory is not None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        dcp.save(get_model_state_dict(model), checkpoint_id=directory)  # type: ignore[attr-defined]


def fsdp_load(rank: int, directory: str) -> None:
    """Load the sharded state dict ``fsdp`` saved into the FSDP2 model on this world size;
    print its full state dict's digest and sum."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    model = _sharded_mlp()
    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=directory)  # type: ignore[attr-defined]
    set_model_state_dict(model, state)
    print(f"rank {rank}: fsdp state {_full_state(rank, model)}", flush=True)


def functional(rank: int, iterations: int) -> None:
    """The issue-40 mixes that hung: distcompat all_reduces (sync and async, waited late) between
    functional all-gathers, reduce-scatters and all-reduces; rank 1 comes 7 s late to one
    all-gather (``STALL``). Prints a digest of every result."""
    import torch.distributed._functional_collectives as fc

    group, world = tdist.group.WORLD, dist.get_world_size()
    assert group is not None
    results: list[torch.Tensor] = []
    for i in range(iterations):
        total = torch.full((8,), float(rank + i))
        dist.all_reduce(total)
        if rank == 1 and i == 3 and os.environ.get("STALL") == "1":
            time.sleep(7)  # the late line the report must name
        gathered = fc.all_gather_tensor(torch.full((4,), float(rank * i)), 0, group)
        summed = fc.all_reduce(torch.full((3,), float(rank - i)), "sum", group)
        late = torch.full((5,), float(i))
        handle = dist.all_reduce(late, async_op=True)
        scattered = fc.reduce_scatter_tensor(
            torch.arange(4.0 * world) * (rank + 1) + i, "sum", 0, group
        )
        assert handle is not None
        handle.wait()
        waited = [fc.wait_tensor(t) for t in (gathered, summed, scattered)]  # type: ignore[no-untyped-call]
        results += [total, *waited, late]
    print(f"rank {rank}: functional {_digest(results)}", flush=True)


def _digest(tensors: list[torch.Tensor]) -> str:
    """A digest of the tensors' bytes: equal digests mean bitwise equal results."""
    import hashlib

    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def main() -> None:
    scenario = sys.argv[1]
    if scenario == "adopt-late":
        tdist.init_process_group(backend="gloo")  # torch's own init: a plain gloo group
        adopted_late(tdist.get_rank())
        return
    dist.init_process_group(backend="gloo")  # the user's own init line, through distcompat
    rank = dist.get_rank()
    if scenario in ("ddp-stall", "ddp-kill", "ddp-fork-kill"):
        ddp(rank, stall=scenario == "ddp-stall", kill=scenario != "ddp-stall",
            fork=scenario == "ddp-fork-kill")  # fmt: skip
    elif scenario == "fork-kill":
        forked_kill(rank)
    elif scenario == "raw":
        raw(rank, sys.argv[2])
    elif scenario == "load":
        load(rank, sys.argv[2])
    elif scenario in ("fsdp", "hsdp"):
        fsdp(rank, sys.argv[2] if len(sys.argv) > 2 else None, hsdp=scenario == "hsdp")
    elif scenario == "fsdp-load":
        fsdp_load(rank, sys.argv[2])
    elif scenario == "functional":
        functional(rank, int(sys.argv[2]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
