"""torch.distributed setup from torchrun's environment; a plain single process works without it."""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from typing import Callable, Iterator, Sequence, TypeVar

import torch
import torch.distributed as dist

from edm2.errors import EDM2Error

T = TypeVar("T")


class DistributedError(EDM2Error):
    """A command was started with more processes than it can use."""


def launched() -> bool:
    """Whether a launcher (torchrun, or a command that starts its own ranks) started this process as a rank, even of
    a group of one."""
    return "WORLD_SIZE" in os.environ


def launched_world_size() -> int:
    """The number of processes torchrun started (1 for a plain `python` start), before any process group exists."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_rank() -> int:
    """This process's rank as torchrun started it (0 for a plain `python` start), before any process group exists."""
    return int(os.environ.get("RANK", "0"))


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now, for a rendezvous on this machine."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_launch_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables torchrun sets for rank `rank` of `world_size` processes on this machine meeting at
    127.0.0.1:port, which init() and session() read."""
    return dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def describe_local_launch(rank: int, world_size: int, port: int) -> None:
    """Set this process's environment as torchrun sets it (local_launch_environment), so that init() and session()
    join their group (processes a script or a test spawns itself)."""
    os.environ.update(local_launch_environment(rank, world_size, port))


@contextlib.contextmanager
def session(single_process: bool = False) -> Iterator[None]:
    """Join torchrun's process group for the duration of a command and always leave it again.

    With single_process, a start under torchrun with several processes is refused before anything runs.
    """
    if single_process and launched_world_size() > 1:
        raise DistributedError("this command runs as one process; start it with python, not torchrun")
    init()
    try:
        yield
    finally:
        shutdown()


def init(backend: str | None = None, timeout_s: float = 1800) -> None:
    """Join the process group torchrun describes (NCCL on CUDA, Gloo on CPU); no-op for one process."""
    if dist.is_initialized() or launched_world_size() <= 1:
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(own_gpu())
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))


def own_gpu() -> int:
    """The index of this process's GPU: its local rank, refused in one line where this machine has fewer GPUs than
    processes (torchrun --nproc_per_node above the GPU count), which CUDA would answer with a traceback."""
    local_rank, count = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if local_rank >= count:
        raise DistributedError(f"process {local_rank} on this machine has no GPU of its own: {count} GPU(s) visible; "
                               f"start at most {count} process(es) per machine (torchrun --nproc_per_node={count})")
    return local_rank


def shutdown() -> None:
    """Leave the process group if this process joined one."""
    if dist.is_initialized():
        dist.destroy_process_group()


def get_rank() -> int:
    """Global rank of this process (0 without torch.distributed)."""
    return dist.get_rank() if dist.is_initialized() else 0


def get_world_size() -> int:
    """Number of processes (1 without torch.distributed)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    """True on the process that writes files and prints."""
    return get_rank() == 0


def device() -> torch.device:
    """The device this rank computes on: its own GPU under torchrun, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", own_gpu())
    return torch.device("cpu")


def barrier() -> None:
    """Wait for every rank (no-op for one process)."""
    if dist.is_initialized():
        dist.barrier()


def print0(*args, **kwargs) -> None:
    """print() on rank 0 only."""
    if is_main():
        print(*args, **kwargs, flush=True)


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over ranks in place and return it (identity for one process)."""
    if dist.is_initialized():
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def all_gather_object(obj: object) -> list:
    """The picklable objects of all ranks, in rank order ([obj] for one process)."""
    if not dist.is_initialized():
        return [obj]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def gather_to_main(x: torch.Tensor) -> torch.Tensor | None:
    """Every rank's x (all of one shape) flattened and concatenated in rank order, on rank 0 only (None on the
    others; x itself for one process). A collective call: every rank must make it. Only rank 0 allocates."""
    if not dist.is_initialized():
        return x
    world_size, x = dist.get_world_size(), x.reshape(-1)
    if dist.get_rank() != 0:
        dist.gather(x, dst=0)
        return None
    out = torch.empty([world_size * x.numel()], dtype=x.dtype, device=x.device)
    dist.gather(x, list(out.view(world_size, x.numel()).unbind(0)), dst=0)
    return out


def cpu_group() -> object | None:
    """A Gloo group of all ranks for small CPU collectives beside NCCL (None for one process)."""
    return dist.new_group(backend="gloo") if dist.is_initialized() else None


def any_rank(flag: bool, group: object | None = None) -> bool:
    """True on every rank when flag is true on any (a collective call: every rank must make it); group, e.g.
    cpu_group(), must accept CPU tensors."""
    if not dist.is_initialized():
        return flag
    total = torch.tensor([float(flag)])
    dist.all_reduce(total, group=group)
    return bool(total.item() > 0)


def broadcast_object(obj: object, src: int = 0) -> object:
    """Send a picklable object from rank src to every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def part_bounds(numel: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of part index of numel elements split into parts parts: np.array_split's and
    torch.tensor_split's rule, the first numel % parts parts one element longer."""
    size, extra = divmod(numel, parts)
    start = index * size + min(index, extra)
    return start, start + size + (index < extra)


class RankBatches(Sequence[list[int]]):
    """One rank's batches of a sequence, computed batch by batch: the items are never copied into one list."""

    def __init__(self, items: Sequence[int], batch_size: int, rank: int, world_size: int, skip_empty: bool = False):
        self.items = items
        self.num_batches = max(-(-len(items) // (batch_size * world_size)), 1) * world_size
        # Parts are empty only when there are fewer items than parts: those from index len(items) on.
        self.indices = range(rank, min(self.num_batches, len(items)) if skip_empty else self.num_batches, world_size)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i):
        """Batch i of this rank, as a list of the items' ints (a slice gives a list of batches)."""
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        start, stop = part_bounds(len(self.items), self.num_batches, self.indices[i])
        return [int(item) for item in self.items[start:stop]]


def rank_batches(items: Sequence[int], batch_size: int, rank: int, world_size: int,
                 skip_empty: bool = False) -> RankBatches:
    """This rank's share of items (seeds, dataset indices) in batches of at most batch_size.

    Every rank gets the same number of batches, the last ones short or empty; skip_empty leaves the empty
    ones out (they come only at the end, when there are fewer items than batches). Batch j of all ranks
    together is part j of np.array_split(items, num_batches); rank r takes parts r, r + world_size, ...
    Each batch is computed when asked for, so items may be a huge lazy sequence.
    """
    return RankBatches(items, batch_size, rank, world_size, skip_empty)


_SHARED = "_edm2_raised_by_main_rank"  # the attribute that marks, on another rank, rank 0's error (on_main_rank)


def on_main_rank(fn: Callable[[], T], errors: tuple[type[BaseException], ...] = (EDM2Error, OSError)) -> T | None:
    """fn() on rank 0 (None on the others); if it raises one of errors, every rank raises that exception, marked on
    the other ranks as rank 0's (raised_by_main_rank)."""
    result, error = None, None
    if is_main():
        try:
            result = fn()
        except errors as e:  # shared with the other ranks, then raised everywhere
            error = e
    error = broadcast_object(error)
    if error is not None:
        if not is_main():
            setattr(error, _SHARED, True)
        raise error
    return result


def raised_by_main_rank(error: BaseException) -> bool:
    """Whether error, raised on a rank other than 0, is rank 0's (on_main_rank): rank 0 reports it."""
    return getattr(error, _SHARED, False)


def main_rank_first(fn: Callable[[], T]) -> T:
    """Call fn on rank 0, then on the other ranks, so rank 0 alone fills caches (downloads).

    If rank 0 raises, every rank raises that exception without calling fn.
    """
    result = on_main_rank(fn, errors=(Exception,))
    return result if is_main() else fn()
