"""What train() checks before it writes anything: the options against the data and encoder it is given, the batch
against the processes, and an --init snapshot against the data and the options; as train_edm2.py checks them."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from training.architecture import UNET_OPTIONS, NetworkMisfit, check_init, read_init
from training.options import OptionsError, TrainingOptions, rounds_per_step

if TYPE_CHECKING:
    from edm2.data.dataset import ImageFolderDataset
    from edm2.encoders import Encoder


def dataset_description(dataset: ImageFolderDataset) -> dict:
    """The data as a run's options describe it (TrainingOptions.dataset)."""
    return dict(resolution=dataset.resolution, num_channels=dataset.num_channels, label_dim=dataset.label_dim)


def check_run(opts: TrainingOptions, dataset: ImageFolderDataset, encoder: Encoder, world_size: int) -> None:
    """Raise OptionsError or NetworkMisfit (SnapshotError, DownloadError for an --init that cannot load) unless the
    options describe this data and encoder, their batch splits over world_size processes, and their --init snapshot
    fits the data and has the options' architecture."""
    description = dataset_description(dataset)
    if opts.dataset != description:
        raise OptionsError(f"the options describe the data as {opts.dataset}, but {opts.data} is {description}")
    if opts.encoder != encoder.config():
        raise OptionsError(f"the options' encoder is {opts.encoder}, but the data's is {encoder.config()}")
    rounds_per_step(opts.batch, opts.batch_gpu, world_size)
    if opts.init is None:
        return
    snapshot = read_init(opts.init)
    given = dict(channels=opts.channels, **{name: opts.network.get(name) for name in UNET_OPTIONS})
    check_init(snapshot, resolution=dataset.resolution, num_channels=dataset.num_channels, label_dim=dataset.label_dim,
               encoder=encoder, given=given, preset=opts.preset)
    name, classes = os.path.basename(snapshot.path), snapshot.network_kwargs["label_dim"]
    network = opts.to_json()["network"]
    if network != snapshot.network:
        raise NetworkMisfit(f"network={network} is not the U-Net of {name} ({snapshot.network}); take the "
                            "snapshot's (training.architecture.read_init)")
    # Labels of some of the network's classes train it as they are, one-hot over all its classes.
    if dataset.label_dim not in (0, classes):
        raise NetworkMisfit(f"{name} is a network of {classes} classes, but the data's labels are one-hot over "
                            f"{dataset.label_dim}: set the dataset's label_dim to {classes}, as train_edm2.py does")
