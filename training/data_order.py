"""The order in which a run reads its data and draws its randomness: a function of the images seen only,
so a run resumed at any step reads and draws what the uninterrupted run would have."""

from __future__ import annotations

import contextlib
import signal
import sys
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np
import torch

from edm2.data.blend import BlendDataset
from edm2.data.permutation import FeistelPermutation
from edm2.runtime import distributed

if TYPE_CHECKING:
    from edm2.data.dataset import ImageFolderDataset


def round_seed(seed: int, rank: int, cur_nimg: int, round_idx: int) -> int:
    """Seed of the random draws (sigma, noise, latent sample, dropout) of one accumulation round."""
    return int(np.random.SeedSequence([seed, rank, cur_nimg, round_idx]).generate_state(1, np.uint64)[0])


def label_dropout_seed(seed: int) -> int:
    """Seed of one round's label dropout draws: a stream of its own, so that drawing it moves no other draw."""
    return int(np.random.SeedSequence([seed, 1]).generate_state(1, np.uint64)[0])


# The orders a training state may record (TrainingState.data_order). "permutation" is the order of states written
# before "feistel" existed (a stored numpy permutation per epoch, O(size) memory); they keep reading it.
ORDERS = ("feistel", "permutation")
ORDER = "feistel"


class DataOrder(torch.utils.data.Sampler):
    """Endless dataset indices for one rank: a function of (seed, global position) alone.

    Global position p (counted in images) reads item P_e(p mod N) of epoch e = p // N, P_e the Feistel permutation
    keyed by (seed, e) (edm2.data.permutation: O(1) memory). Each optimizer step covers positions
    [cur_nimg, cur_nimg + batch), split into chunks of batch_gpu handed to the ranks in turn: the sequence is
    the same for every world size, and each rank reads its slice of each global batch.

    With segments (a blend, edm2.data.blend), items are the sources one after another: blend epoch e permutes
    [0, sum(segments)), whose k-th segment stands for source k; the t-th draw of source k overall reads its
    sample P_{k,f}(t mod N_k) of its own epoch f = t // N_k, so each source is read in a permutation of its own
    and makes up exactly its segment of every blend epoch.
    """

    def __init__(self, size: int, seed: int, rank: int, world_size: int, batch_gpu: int, start_nimg: int,
                 kind: str = ORDER, sizes: list[int] | None = None, segments: list[int] | None = None):
        super().__init__()
        self.size, self.seed, self.rank, self.world_size = size, seed, rank, world_size
        self.batch_gpu, self.start_nimg, self.kind = batch_gpu, start_nimg, kind
        self.sizes, self.segments = sizes, segments
        self._epoch, self._perm = -1, None

    def index(self, position: int) -> int:
        """Dataset index read at a global image position."""
        return int(self.indices(np.array([position]))[0])

    def indices(self, positions: np.ndarray) -> np.ndarray:
        """Dataset indices read at global image positions (computed together)."""
        if self.segments is not None:
            return self._blend_indices(positions)
        if self.kind == "permutation":
            return np.array([self._stored(int(p)) for p in positions], dtype=np.int64)
        return _permuted(positions, self.size, self.seed)

    def _stored(self, position: int) -> int:
        """The order of states written before the Feistel order: a numpy permutation per epoch."""
        epoch = position // self.size
        if epoch != self._epoch:
            self._epoch = epoch
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.size)
        return int(self._perm[position % self.size])

    def _blend_indices(self, positions: np.ndarray) -> np.ndarray:
        epoch_size = sum(self.segments)
        starts = np.cumsum([0] + self.segments)
        slot = _permuted(positions, epoch_size, self.seed)
        source = np.searchsorted(starts, slot, side="right") - 1
        out = np.empty_like(positions, dtype=np.int64)
        offsets = np.cumsum([0] + self.sizes)
        for k in np.unique(source):
            mine = source == k
            draws = positions[mine] // epoch_size * self.segments[k] + slot[mine] - starts[k]
            out[mine] = offsets[k] + _permuted(draws, self.sizes[k], self.seed, 1 + int(k))
        return out

    def __iter__(self) -> Iterator[int]:
        chunk = self.start_nimg // self.batch_gpu + self.rank
        while True:
            positions = np.arange(chunk * self.batch_gpu, (chunk + 1) * self.batch_gpu, dtype=np.int64)
            yield from self.indices(positions).tolist()
            chunk += self.world_size


def _permuted(positions: np.ndarray, size: int, seed: int, *stream: int) -> np.ndarray:
    """P_e(p mod size) for each position p of epoch e = p // size, P_e the Feistel permutation of (seed, e)."""
    epochs = positions // size
    out = np.empty_like(positions, dtype=np.int64)
    for epoch in np.unique(epochs):
        mine = epochs == epoch
        # The key (seed, epoch) for a single dataset; a blend's source k adds a third word, 1 + k.
        out[mine] = FeistelPermutation(size, seed, int(epoch), *stream)(positions[mine] % size)
    return out


def order_for(dataset: object, seed: int, rank: int, world_size: int, batch_gpu: int, start_nimg: int,
              kind: str = ORDER) -> DataOrder:
    """The DataOrder of a dataset, or of a blend (BlendDataset: its sizes and segments)."""
    blend = isinstance(dataset, BlendDataset)
    return DataOrder(len(dataset), seed, rank, world_size, batch_gpu, start_nimg, kind,
                     sizes=dataset.sizes if blend else None, segments=dataset.segments if blend else None)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _ignore_signals(_worker_id: int) -> None:
    # Interruption is the main process's business: it finishes the step with data already queued. A
    # SIGTERM sent to every process of a job (SLURM) or a process group (torchrun), or Ctrl-C at a terminal,
    # reaches workers too. They are forked with these signals blocked (batches), so none that came meanwhile
    # ran the main process's handler they inherit; ignoring a signal discards it if pending.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def _hiding_lost_parent(hook: Callable[..., None]) -> Callable[..., None]:
    """sys.excepthook for a data loader worker, around its previous hook: a worker talks only to its main process
    (multiprocessing's resource sharer, whose thread reports its errors to sys.excepthook, hands that process the
    batches' file descriptors), so a connection error there means the main process has ended, killed say. That end
    is reported where it is watched (cli.local_launch names a killed rank), and the worker ends with it without a
    traceback of its own. Any other error is printed as before."""
    def excepthook(exc_type: type[BaseException], exc: BaseException, tb) -> None:
        if not issubclass(exc_type, ConnectionError):
            hook(exc_type, exc, tb)
    return excepthook


def _init_worker(worker_id: int) -> None:
    """A data loader worker's start: the stop signals ignored, and no traceback when its main process is gone."""
    _ignore_signals(worker_id)
    sys.excepthook = _hiding_lost_parent(sys.excepthook)


def data_loader(dataset: ImageFolderDataset, order: DataOrder, workers: int, device: torch.device):
    """Batches of batch_gpu (images, labels) in the given order."""
    return torch.utils.data.DataLoader(
        dataset, batch_size=order.batch_gpu, sampler=order, num_workers=workers,
        pin_memory=device.type == "cuda", worker_init_fn=_init_worker if workers else None,
        prefetch_factor=2 if workers else None,
    )


def batches(dataset: ImageFolderDataset, order: DataOrder, workers: int, device: torch.device) -> Iterator:
    """The data loader's batches, its worker processes started only when the first batch is asked for and
    stopped when the generator is closed or the batches end by an error (an image a worker could not use)."""
    loader = data_loader(dataset, order, workers, device)
    # The workers are forked here: with SIGINT and SIGTERM blocked, a signal that comes meanwhile waits for the
    # main process (delivered when the mask is restored) instead of reaching a worker's inherited handler.
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        loaded = iter(loader)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    try:
        yield from loaded
    finally:
        if workers:
            # The workers ignore SIGTERM, and an error's (or a second Ctrl-C's) traceback keeps the loader alive
            # until exit, where multiprocessing terminates its children by SIGTERM and joins them: it would wait
            # forever. Shut them down here, on every way out.
            loaded._shutdown_workers()


@contextlib.contextmanager
def run_batches(dataset: ImageFolderDataset, seed: int, start_nimg: int, batch_gpu: int, workers: int,
                device: torch.device, kind: str = ORDER) -> Iterator[Iterator]:
    """This rank's batches of a run from start_nimg images on, in the DataOrder of seed (of `kind`, ORDERS): the
    loader's workers start when the first batch is asked for and stop on leaving, however the run ends. A blend's
    shares of each source are logged."""
    order = order_for(dataset, seed, distributed.get_rank(), distributed.get_world_size(), batch_gpu, start_nimg,
                      kind)
    if isinstance(dataset, BlendDataset):
        distributed.print0(dataset.describe())
    loaded = batches(dataset, order, workers, device)
    try:
        yield loaded
    finally:
        loaded.close()
