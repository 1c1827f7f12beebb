"""What train() checks before it writes anything: the options against the data and encoder it is given, the batch
against the processes, and an --init snapshot against the data and the options; as train_edm2.py checks them. And
what train_edm2.py tells a run from an --init snapshot (init_notes)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from edm2.errors import SnapshotError, shown
from edm2.formats.snapshot import read_metadata
from training.architecture import InitSnapshot, NetworkMisfit, check_init, hyperparameters_given, read_init
from training.lr_schedule import learning_rate_schedule
from training.options import OptionsError, TrainingOptions, rounds_per_step
from training.text_conditioning import text_description

if TYPE_CHECKING:
    from edm2.data.dataset import ImageFolderDataset
    from edm2.encoders import Encoder


def dataset_description(dataset: ImageFolderDataset) -> dict:
    """The data as a run's options describe it (TrainingOptions.dataset): with its class names when its dataset.json
    records them (dataset_tool.py convert), so that a snapshot says which class is which."""
    classes = {} if dataset.classes is None or not dataset.label_dim else dict(classes=dataset.classes)
    return dict(resolution=dataset.resolution, num_channels=dataset.num_channels, label_dim=dataset.label_dim,
                **classes, **text_description(dataset))


def init_notes(init: InitSnapshot, classes: dict[str, int] | None, opts: TrainingOptions) -> list[str]:
    """What a run started from an --init snapshot should be told: whether the data's classes line up with the
    snapshot's (by the class names both record, else by number), and the label dropout and learning rate this run
    uses against those the snapshot's run used and ended with (when the snapshot records them)."""
    name, network_classes = os.path.basename(init.path), init.network_kwargs["label_dim"]
    recorded = read_init_record(init.path)
    dataset = recorded.get("dataset") if recorded else None  # a file's contents: any JSON
    theirs = dataset.get("classes") if isinstance(dataset, dict) else None
    notes = []
    if opts.cond and network_classes and classes and isinstance(theirs, dict):
        moved = [f"{shown(c)} is class {theirs[c]} of {name} but {label} of the data" for c, label in classes.items()
                 if c in theirs and theirs[c] != label]
        new = [shown(c) for c in classes if c not in theirs]
        if moved or new:
            notes.append("Warning: the classes do not line up: " + "; ".join(
                moved + ([f"{', '.join(new)} not among {name}'s classes"] if new else []))
                + " (dataset_tool.py convert --labels=ORIGINAL_DATASET keeps its numbers).")
    elif opts.cond and network_classes:
        unnamed = f"{name} records" if not isinstance(theirs, dict) else "the data's dataset.json records"
        notes.append(f"Note: {unnamed} no class names, so the data's labels train {name}'s classes by number "
                     f"(of 0-{network_classes - 1}); class folders converted alone are numbered from 0 "
                     "(dataset_tool.py convert --labels=MAP keeps the original numbers).")
    options = (recorded or {}).get("training_options")
    was = ""
    if isinstance(options, dict) and _is_number(recorded.get("nimg")) and all(
            _is_number(options.get(k)) and options[k] >= 0 for k in ("batch", "lr", "decay", "rampup_Mimg")) and (
            options["batch"] > 0):
        last = learning_rate_schedule(max(recorded["nimg"] - options["batch"], 0), options["batch"], options["lr"],
                                      options["decay"], options["rampup_Mimg"])
        was = (f"; {name}'s run used label dropout {options.get('label_dropout', 0.0)} and ended at learning rate "
               f"{last:.4g}")
    notes.append(f"--init: this run uses label dropout {opts.label_dropout} and learning rate alpha_ref {opts.lr:.4g} "
                 f"(Eq. 67 from image 0: ramp-up over {opts.rampup_Mimg} Mimg, decay t_ref {opts.decay}){was}; "
                 "--label-dropout and --lr choose them.")
    return notes


def read_init_record(path: str) -> dict | None:
    """The metadata of an --init snapshot of ours (a local .safetensors file), None for any other (release pickles
    record no training)."""
    if not path.endswith(".safetensors") or not os.path.isfile(path):
        return None
    try:
        return read_metadata(path)
    except SnapshotError:
        return None


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
    given = dict(channels=opts.channels, **hyperparameters_given(opts.network))
    check_init(snapshot, resolution=dataset.resolution, num_channels=dataset.num_channels, label_dim=dataset.label_dim,
               encoder=encoder, given=given, preset=opts.preset, text=opts.dataset.get("text_encoding"))
    name, classes = os.path.basename(snapshot.path), snapshot.network_kwargs["label_dim"]
    network = opts.to_json()["network"]
    if network != snapshot.network:
        raise NetworkMisfit(f"network={network} is not the U-Net of {name} ({snapshot.network}); take the "
                            "snapshot's (training.architecture.read_init)")
    # Labels of some of the network's classes train it as they are, one-hot over all its classes.
    if dataset.label_dim not in (0, classes) and "text_encoding" not in opts.dataset:
        raise NetworkMisfit(f"{name} is a network of {classes} classes, but the data's labels are one-hot over "
                            f"{dataset.label_dim}: set the dataset's label_dim to {classes}, as train_edm2.py does")
