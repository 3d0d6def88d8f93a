"""Provoke one real distributed failure and print what each rank gets, for
tests/diagnosis/test_knowledge.py.

Run under torchrun (gloo, CPU), e.g. ``torchrun --nproc-per-node 3 tests/scripts/error_texts.py
all_gather_size``. Each rank prints one ``CAUGHT {json}`` line with the time, its rank and
what ddpwatch's agent would record of the exception, then re-raises, so the launcher sees
the failure as a user would; a rank that finishes prints ``DONE {json}``. Ranks aborted from
C++ (gloo's "Received data size doesn't match expected size") print nothing: their exit
status (-6, SIGABRT) and stderr show it. $ODD, $SIZE and $BASE pick the odd rank and sizes.
"""

import json
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset


def report(rank: int, err: BaseException) -> None:
    """One JSON line with what ddpwatch's agent records of an exception (hooks.error_info)."""
    caught = {
        "t": round(time.time(), 3),
        "rank": rank,
        "type": type(err).__name__,
        "module": type(err).__module__,
        "message": str(err),
        "traceback": "".join(traceback.format_exception(type(err), err, err.__traceback__)),
    }
    sys.stdout.flush()
    # one write: ranks raising in the same millisecond share the pipe, and print() writes the
    # text and its newline separately, so two records could end up on one line
    os.write(1, ("CAUGHT " + json.dumps(caught) + "\n").encode())


def size(rank: int) -> int:
    """$BASE elements (default 4), except on rank $ODD (default 2): $SIZE (default 5)."""
    odd = int(os.environ.get("ODD", "2"))
    return int(os.environ.get("SIZE", "5")) if rank == odd else int(os.environ.get("BASE", "4"))


def init(timeout_s: float = 10.0) -> int:
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    return dist.get_rank()


def all_gather_size(rank: int) -> None:
    """Every rank allocates the usual output; the odd rank's input does not fit it."""
    mine = torch.ones(size(rank))
    out = [torch.zeros(size(-1)) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)


def all_gather_like(rank: int) -> None:
    """The usual bug: the output list is built from this rank's own (data-dependent) size."""
    mine = torch.ones(size(rank))
    dist.all_gather([torch.zeros_like(mine) for _ in range(dist.get_world_size())], mine)


def all_gather_into_tensor_size(rank: int) -> None:
    mine = torch.ones(size(rank))
    out = torch.zeros(size(-1) * dist.get_world_size())
    dist.all_gather_into_tensor(out, mine)


def all_reduce_size(rank: int) -> None:
    dist.all_reduce(torch.ones(size(rank)))


def broadcast_size(rank: int) -> None:
    dist.broadcast(torch.ones(size(rank)), src=0)


def allreduce_vs_broadcast(rank: int) -> None:
    if rank == int(os.environ.get("ODD", "2")):
        dist.all_reduce(torch.ones(4))
    else:
        dist.broadcast(torch.ones(4), src=0)


def allreduce_vs_barrier(rank: int) -> None:
    if rank == int(os.environ.get("ODD", "2")):
        dist.all_reduce(torch.ones(4))
    else:
        dist.barrier()


def monitored_barrier(rank: int) -> None:
    if rank != 0:
        time.sleep(6)
    dist.monitored_barrier(timeout=timedelta(seconds=2))


def monitored_barrier_all(rank: int) -> None:
    if rank != 0:
        time.sleep(6)
    dist.monitored_barrier(timeout=timedelta(seconds=2), wait_all_ranks=True)


def monitored_barrier_one(rank: int) -> None:
    """Only rank 2 is late: rank 1 passes its side and then learns that rank 0 failed."""
    if rank == 2:
        time.sleep(6)
    dist.monitored_barrier(timeout=timedelta(seconds=2))


def ddp_model_mismatch(rank: int) -> None:
    """Rank 1 builds a model with one layer fewer."""
    layers = [nn.Linear(4, 4)] if rank == 1 else [nn.Linear(4, 4), nn.Linear(4, 4)]
    nn.parallel.DistributedDataParallel(nn.Sequential(*layers))


class Skippy(nn.Module):
    """Rank 1 skips ``extra`` in forward: its parameters get no gradient there."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.extra = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.body(x)
        if dist.get_rank() != 1:
            x = self.extra(x)
        return x


def ddp_unused(rank: int) -> None:
    model = nn.parallel.DistributedDataParallel(Skippy())
    for step in range(3):
        print(f"rank={rank} step {step}", flush=True)
        model(torch.randn(2, 4)).sum().backward()


class Suicidal(Dataset):
    """A dataset whose worker dies like the OOM killer's victim would ($DIE: KILL, BUS or EXIT)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == 2:
            how = os.environ.get("DIE", "KILL")
            if how == "EXIT":
                os._exit(3)
            os.kill(os.getpid(), getattr(signal, f"SIG{how}"))
        return torch.ones(2)


class Sleepy(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(5)
        return torch.ones(2)


def dataloader_killed(_: int) -> None:
    for _batch in DataLoader(Suicidal(), batch_size=1, num_workers=1):
        pass


def dataloader_killed_thread(rank: int) -> None:
    """Off the main thread DataLoader has no SIGCHLD handler: the other text."""
    errors: list[BaseException] = []

    def consume() -> None:
        try:
            dataloader_killed(rank)
        except Exception as err:
            errors.append(err)

    thread = threading.Thread(target=consume)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


def dataloader_timeout(_: int) -> None:
    for _batch in DataLoader(Sleepy(), batch_size=1, num_workers=1, timeout=1):
        pass


def missing_rank(_: int) -> None:
    """torchrun starts 2 ranks but the script claims 3. torchrun's agent hosts the store, so
    both ranks wait for rank 2's address ("wait timeout after ..., keys: ...")."""
    os.environ["WORLD_SIZE"] = "3"
    init_timeout = float(os.environ.get("INIT_TIMEOUT", "4"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=init_timeout))


def missing_rank_tcp(_: int) -> None:
    """Without torchrun (RANK set by hand, 2 processes): rank 0 hosts the store (tcp://) and
    waits for a third client that never comes ("2/3 clients joined")."""
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{os.environ['TCP_PORT']}",
        rank=int(os.environ["RANK"]),
        world_size=3,
        timeout=timedelta(seconds=float(os.environ.get("INIT_TIMEOUT", "4"))),
    )


NO_INIT = {
    dataloader_killed,
    dataloader_killed_thread,
    dataloader_timeout,
    missing_rank,
    missing_rank_tcp,
}


def main() -> None:
    scenario = globals()[sys.argv[1]]
    rank = int(os.environ.get("RANK", "0"))
    try:
        if scenario not in NO_INIT:
            rank = init()
        scenario(rank)
        print("DONE " + json.dumps({"t": round(time.time(), 3), "rank": rank}), flush=True)
    except Exception as err:
        report(rank, err)
        raise


if __name__ == "__main__":
    main()
