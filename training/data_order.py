"""The order in which a run reads its data and draws its randomness: a function of the images seen only,
so a run resumed at any step reads and draws what the uninterrupted run would have."""

from __future__ import annotations

import contextlib
import signal
from typing import TYPE_CHECKING, Iterator

import numpy as np
import torch

from edm2.runtime import distributed

if TYPE_CHECKING:
    from edm2.data.dataset import ImageFolderDataset


def round_seed(seed: int, rank: int, cur_nimg: int, round_idx: int) -> int:
    """Seed of the random draws (sigma, noise, latent sample, dropout) of one accumulation round."""
    return int(np.random.SeedSequence([seed, rank, cur_nimg, round_idx]).generate_state(1, np.uint64)[0])


def label_dropout_seed(seed: int) -> int:
    """Seed of one round's label dropout draws: a stream of its own, so that drawing it moves no other draw."""
    return int(np.random.SeedSequence([seed, 1]).generate_state(1, np.uint64)[0])


class DataOrder(torch.utils.data.Sampler):
    """Endless dataset indices for one rank.

    Global position p (counted in images) reads item permutation(seed, epoch)[p mod N], epoch = p // N.
    Each optimizer step covers positions [cur_nimg, cur_nimg + batch), split into chunks of batch_gpu
    handed to the ranks in turn.
    """

    def __init__(self, size: int, seed: int, rank: int, world_size: int, batch_gpu: int, start_nimg: int):
        super().__init__()
        self.size, self.seed, self.rank, self.world_size = size, seed, rank, world_size
        self.batch_gpu, self.start_nimg = batch_gpu, start_nimg
        self._epoch, self._perm = -1, None

    def index(self, position: int) -> int:
        """Dataset index read at a global image position."""
        epoch = position // self.size
        if epoch != self._epoch:
            self._epoch = epoch
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.size)
        return int(self._perm[position % self.size])

    def __iter__(self) -> Iterator[int]:
        chunk = self.start_nimg // self.batch_gpu + self.rank
        while True:
            for position in range(chunk * self.batch_gpu, (chunk + 1) * self.batch_gpu):
                yield self.index(position)
            chunk += self.world_size


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _ignore_signals(_worker_id: int) -> None:
    # Interruption is the main process's business: it finishes the step with data already queued. A
    # SIGTERM sent to every process of a job (SLURM) or a process group (torchrun), or Ctrl-C at a terminal,
    # reaches workers too. They are forked with these signals blocked (batches), so none that came meanwhile
    # ran the main process's handler they inherit; ignoring a signal discards it if pending.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def data_loader(dataset: ImageFolderDataset, order: DataOrder, workers: int, device: torch.device):
    """Batches of batch_gpu (images, labels) in the given order."""
    return torch.utils.data.DataLoader(
        dataset, batch_size=order.batch_gpu, sampler=order, num_workers=workers,
        pin_memory=device.type == "cuda", worker_init_fn=_ignore_signals if workers else None,
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
                device: torch.device) -> Iterator[Iterator]:
    """This rank's batches of a run from start_nimg images on, in the DataOrder of seed: the loader's workers
    start when the first batch is asked for and stop on leaving, however the run ends."""
    order = DataOrder(len(dataset), seed, distributed.get_rank(), distributed.get_world_size(), batch_gpu, start_nimg)
    loaded = batches(dataset, order, workers, device)
    try:
        yield loaded
    finally:
        loaded.close()
