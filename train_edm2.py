"""Train an EDM2 model with the paper's recipe on one CPU or many GPUs (torchrun); rerun to resume."""

from __future__ import annotations

import cli.wait_policy  # noqa: F401  first: PyTorch's OpenMP reads its wait policy once, when it loads
import json
import signal

import click
import numpy as np
import torch

from cli.command import Command
from cli.config import config_option
from cli.speed import threads_note, threads_option
from cli.types import (MAX_BATCH, MAX_SEED_OPTION, MAX_WORKERS, GridSize, ImageCount, Integer, IntList, Number,
                       StdList)
from edm2.data.dataset import DatasetError, ImageFolderDataset
from edm2.encoders import Encoder, StabilityVAEEncoder, StandardRGBEncoder
from edm2.errors import SnapshotError, one_line
# The U-Net options' bounds are its arguments' (edm2.network_args), --attn-resolutions' too.
from edm2.network_args import MAX_BLOCKS, MAX_CHANNELS, MAX_MULT, MAX_RESOLUTION
from edm2.runtime import distributed, files
from training.architecture import (
    UNET_OPTIONS, NetworkMisfit, check_init, check_network_fits_data, read_init, unet_options,
)
from training.run.dry_run import parameter_count, start_or_resume, timed_speed
from training.loop import train
from training.options import (
    DATA_FIELDS, DEFAULT_GRID, DEFAULT_GRID_STEPS, PRECISIONS, RECIPE_FIELDS, TRACKERS, OptionsError, TrainingOptions,
    check_derived, check_label_dropout, rounds_per_step,
)
from training.run.preflight import dataset_description
from training.presets import PRESETS, get_preset
from training.run.run_dir import RUN_ID_KEY
from training.run.sample_grid import MAX_GRID_STEPS
from training.run.signals import die_by
from training.run.trackers import TrackerUnavailable, check_installed

MAX_KEPT_STATES = 10**6  # training states to keep: far beyond any run's count of them

EXAMPLES = """
\b
Examples:
  # ImageNet-512, EDM2-S, 8 GPUs; run again to resume from the newest checkpoint
  torchrun --standalone --nproc_per_node=8 train_edm2.py --preset=edm2-img512-s
\b
  # About five minutes on a CPU: 16x16 toy shapes from `python dataset_tool.py toy --resolution=16`
  python train_edm2.py --preset=toy-small --data=datasets/toy16.zip
\b
  # Print the resolved options without training
  python train_edm2.py --preset=edm2-img64-s --data=datasets/img64.zip --dry-run
\b
  # 48x48 grayscale data (dataset_tool.py convert keeps it one-channel) with a three-level U-Net
  python train_edm2.py --preset=toy-small --data=datasets/gray48.zip --channel-mult=1,2,2 --attn-resolutions=12
\b
  # Fine-tune the release's EDM2-S on other ImageNet-512 latents: a new run starting from its weights
  python train_edm2.py --preset=edm2-img512-s --data=datasets/other-sd.zip --duration=64Mi \\
      --init=https://nvlabs-fi-cdn.nvidia.com/edm2/posthoc-reconstructions/edm2-img512-s-2147483-0.130.pkl
"""


def open_dataset(data: str, cond: bool) -> ImageFolderDataset:
    """The training data, checked for labels when training a class-conditional model."""
    try:
        dataset = ImageFolderDataset(data, use_labels=cond)
    except DatasetError as e:
        raise click.BadParameter(str(e), param_hint="--data") from None
    if cond and not dataset.has_labels:
        raise click.UsageError(f"--cond=True but {data} has no labels (dataset.json); pass --cond=False")
    return dataset


def choose_encoder(dataset: ImageFolderDataset) -> Encoder:
    """StandardRGBEncoder for PNG data of any channel count (grayscale, RGB, ...), StabilityVAEEncoder for
    8-channel mean/std latents."""
    image, _ = dataset[0]
    channels = dataset.num_channels
    if image.dtype == np.uint8:
        return StandardRGBEncoder()
    encoder = StabilityVAEEncoder()
    if channels != 2 * len(encoder.scale):
        raise click.BadParameter(
            f"{dataset.path}: .npy latents have {channels} channel(s); expected {2 * len(encoder.scale)} "
            f"(mean and std of {len(encoder.scale)} VAE channels, `dataset_tool.py encode`)",
            param_hint="--data",
        )
    return encoder


def network_options(preset: str, resolution: int, channels: int | None, given: dict) -> dict:
    """The preset's U-Net arguments with --channel-mult, --num-blocks and --attn-resolutions; impossible ones are
    refused with a line that names the option."""
    network = unet_options(get_preset(preset).network, given)
    try:
        check_network_fits_data(resolution, channels or get_preset(preset).channels, network,
                                explicit=any(value is not None for value in given.values()))
    except NetworkMisfit as e:
        raise click.UsageError(str(e)) from None
    return network


def init_options(init: str, dataset: ImageFolderDataset, encoder: Encoder, given: dict) -> tuple[Encoder, dict]:
    """The snapshot's encoder, and its architecture as run options (channels, network, init); a snapshot that
    cannot load, or does not fit the data or the options given, is refused naming --init.

    Data labeled with some of the network's classes trains it with its labels as they are: the dataset's one-hot
    labels widen to the network's classes."""
    try:
        snapshot = read_init(init)
        check_init(snapshot, resolution=dataset.resolution, num_channels=dataset.num_channels,
                   label_dim=dataset.label_dim, encoder=encoder, given=given)
    except (SnapshotError, files.DownloadError, NetworkMisfit) as e:
        raise click.BadParameter(one_line(e), param_hint="--init") from None
    dataset.label_dim = snapshot.network_kwargs["label_dim"] if dataset.label_dim else 0
    return snapshot.encoder, dict(channels=snapshot.channels, network=snapshot.network, init=snapshot.path)


def build_options(preset: str, dataset: ImageFolderDataset, encoder: Encoder, **values) -> TrainingOptions:
    """The run's options for this data; what their own checks refuse (TrainingOptions.__post_init__) is one line."""
    try:
        return TrainingOptions.from_preset(preset, dataset_description(dataset), encoder.config(), **values)
    except OptionsError as e:
        raise click.UsageError(str(e)) from None


def config_params(values: dict, path: str) -> dict:
    """A training_options.json (or --dry-run output) as parameters: the U-Net shape options taken out of its
    network, the fields derived from the data and the preset left out (check_derived compares them later), and the
    run's identity too: a branch into another directory is another run, a rerun in the same one keeps its own."""
    network = values.get("network", {})
    if not isinstance(network, dict):
        raise click.BadParameter(f"{path}: network: expected an object", param_hint="--config")
    params = {k: v for k, v in values.items() if k not in (*DATA_FIELDS, *RECIPE_FIELDS, RUN_ID_KEY)}
    return {**{k: network[k] for k in UNET_OPTIONS if k in network}, **params}


def print_dry_run(opts: TrainingOptions, dataset: ImageFolderDataset, encoder: Encoder, time_steps: int) -> None:
    """The options as JSON on stdout (a valid --config); on stderr, the data, the network's size, where the run
    would start or resume and, with time_steps, its speed."""
    click.echo(json.dumps(opts.to_json(), indent=2))
    count = parameter_count(opts, encoder.out_channels(dataset.num_channels))
    click.echo(f"Dataset: {len(dataset)} images. Network: {count:,} parameters.", err=True)
    click.echo(start_or_resume(opts.run_dir, opts.duration), err=True)
    click.echo(threads_note(), err=True)
    if time_steps:
        try:
            click.echo(timed_speed(opts, dataset, encoder, time_steps), err=True)
        except torch.OutOfMemoryError:
            raise click.BadParameter(f"{opts.batch_gpu or opts.batch} images per round do not fit in this device's "
                                     "memory; give a smaller --batch-gpu", param_hint="--time-steps") from None
    click.echo("Dry run: nothing written.", err=True)


@click.command(cls=Command, epilog=EXAMPLES)
@config_option(config_params, exclude=("dry_run",), expose=True, help="Read options from a JSON file: a run's "
               "training_options.json or --dry-run output reruns or branches it; the command line overrides it")
@click.option("--preset", type=click.Choice(list(PRESETS)), required=True, help="Training recipe")
@click.option("--outdir", "run_dir", metavar="DIR", help="Run directory  [default: training-runs/<preset>]")
@click.option("--data", metavar="ZIP|DIR", help="Dataset  [default: the preset's, e.g. datasets/img512-sd.zip]")
@click.option("--cond", type=bool, default=True, show_default=True, help="Train a class-conditional model")
@click.option("--duration", type=ImageCount(min=1), help="Training duration in images  [default: preset]")
@click.option("--batch", type=Integer(1, MAX_BATCH), help="Total batch size  [default: preset]")
@click.option("--channels", type=Integer(1, MAX_CHANNELS), help="Channel multiplier  [default: preset]")
@click.option("--dropout", type=Number(0, 1, max_open=True), help="Dropout probability  [default: preset]")
@click.option("--label-dropout", type=Number(0, 1, max_open=True), default=0, show_default=True,
              help="Probability of training an image with the all-zero label, so that the network can guide itself "
                   "(generate.py --gnet=self); needs --cond=True")
@click.option("--P_mean", "P_mean", type=Number(), help="Noise level mean  [default: preset]")
@click.option("--P_std", "P_std", type=Number(min=0, min_open=True), help="Noise level std  [default: preset]")
@click.option("--lr", type=Number(min=0, min_open=True), help="Learning rate alpha_ref  [default: preset]")
@click.option("--decay", type=Number(min=0), help="Learning rate decay t_ref in iterations, 0 = none  [default: preset]")
@click.option("--rampup", "rampup_Mimg", type=Number(min=0), help="Learning rate ramp-up in millions of images, "
              "0 = none  [default: preset]")
@click.option("--ema-stds", type=StdList(), help="EMA lengths sigma_rel to track, one snapshot each, e.g. 0.05,0.1  "
              "[default: preset]")
@click.option("--batch-gpu", type=Integer(0, MAX_BATCH), default=0, show_default=True,
              help="Images per GPU and round, 0 = batch / GPUs; smaller values accumulate gradients")
@click.option("--precision", type=click.Choice(PRECISIONS), default="fp16", show_default=True,
              help="U-Net activations on CUDA (on the CPU float32 unless --cpu-16bit)")
@click.option("--ls", type=Number(min=0, min_open=True), default=1, show_default=True, help="Loss scaling")
@click.option("--status", type=ImageCount(), help="Status line interval, 0 = none  [default: preset]")
@click.option("--snapshot", type=ImageCount(), help="Snapshot interval, 0 = only at the end  [default: preset]")
@click.option("--checkpoint", type=ImageCount(), help="Training-state interval, 0 = only at the end  [default: preset]")
@click.option("--keep-states", type=Integer(0, MAX_KEPT_STATES), default=0, show_default=True,
              help="Keep this many newest training states, deleting older ones once a newer one reads back whole; "
                   "0 = all")
@click.option("--seed", type=Integer(0, MAX_SEED_OPTION), default=0, show_default=True, help="Random seed")
@click.option("--workers", type=Integer(0, MAX_WORKERS), default=2, show_default=True, help="Data loader processes per GPU")
@click.option("--compile/--no-compile", "compile", default=None,
              help="torch.compile the network and loss  [default: on CUDA only]")
@click.option("--channels-last/--no-channels-last", default=None,
              help="Channels-last (NHWC) convolutions  [default: on CUDA only]")
@click.option("--checkpoint-activations", is_flag=True,
              help="Recompute each U-Net block's activations in the backward pass: less memory, ~1/3 more compute")
@click.option("--cpu-16bit", is_flag=True, help="Compute in --precision on the CPU too (use bf16), not float32")
@click.option("--ema-shard", is_flag=True,
              help="Under torchrun, each process keeps only its 1/N of every EMA track, gathered on rank 0 to write "
                   "snapshots and training states (the same files); with one process it changes nothing")
@click.option("-n", "--dry-run", is_flag=True, help="Print the options (stdout), the parameter count and whether "
              "the run would start or resume (stderr), and exit")
@click.option("--time-steps", type=click.IntRange(min=0, max=1000), default=0, show_default=True,
              help="With --dry-run: time this many training steps after a warm-up step (nothing is written) and "
                   "estimate images/s and the run's remaining time")
# The U-Net for data the presets do not cover, and fine-tuning: stored in the snapshots and kept on resume.
@click.option("--channel-mult", type=IntList(1, MAX_MULT), help="Channel multiplier per U-Net level, e.g. 1,2,2 (each "
              "level after the first halves the resolution)  [default: preset]")
@click.option("--num-blocks", type=Integer(1, MAX_BLOCKS), help="Encoder blocks per level (decoder: one more)  "
              "[default: preset]")
@click.option("--attn-resolutions", type=IntList(1, MAX_RESOLUTION, allow_empty=True), help="Resolutions with self-attention, "
              "e.g. 16,8; empty for none (the lowest level's first decoder block always has it)  [default: preset]")
@click.option("--init", metavar="SNAPSHOT|PKL|URL", help="Start a new run from this snapshot's weights (ours or a "
              "release pickle); its architecture and encoder are taken, Adam starts afresh")
@click.option("--logger", "loggers", type=click.Choice(TRACKERS), multiple=True,
              help="Log to this experiment tracker too (repeatable; needs the package extra of its name)  "
                   "[default: none]")
@click.option("--grid", type=GridSize(), default="x".join(map(str, DEFAULT_GRID)), show_default=True,
              help="Sample grid at every snapshot, RUN/samples/grid-KIMG.png (row r: class r); 0 = none")
@click.option("--grid-steps", type=Integer(1, MAX_GRID_STEPS), default=DEFAULT_GRID_STEPS,
              show_default=True, help="Sampler steps of the sample grid")
@click.option("--peak-tflops", type=click.FloatRange(min=0, min_open=True, max=1e6),
              help="One process's peak TFLOP/s for the MFU in the status lines  [default: a listed GPU's data sheet; "
                   "on a CPU its matmul peak, measured once and cached]")
@threads_option
def main(config: dict | None, preset: str, run_dir: str | None, data: str | None, cond: bool, batch_gpu: int,
         precision: str, ls: float, seed: int, workers: int, compile: bool | None, channels_last: bool | None,
         checkpoint_activations: bool, cpu_16bit: bool, dry_run: bool, time_steps: int,
         channel_mult: tuple[int, ...] | None, num_blocks: int | None, attn_resolutions: tuple[int, ...] | None, init: str | None, **overrides) -> None:
    """Train an EDM2 diffusion model (paper Section 2-3 recipe) or resume its run directory.

    SIGTERM (preemption) or Ctrl-C finishes the current step and writes a training state; after Ctrl-C the
    process then ends by SIGINT, so scripts stop too. A run directory is used by one training at a time.

    --init starts a new run from a snapshot's weights (its network and EMA tracks; Adam starts afresh): the
    architecture and encoder come from the snapshot, the rest of the recipe from --preset and the options. The
    run counts its own images, so the learning rate ramps up and decays (Eq. 67) as in any run, with --lr and
    --decay as given. Rerunning the same command resumes the run from its own training states.
    """
    if time_steps and not dry_run:
        raise click.BadParameter("needs --dry-run (a training reports its speed in its status lines)",
                                 param_hint="--time-steps")
    for name in overrides["loggers"]:
        try:
            check_installed(name)
        except TrackerUnavailable as e:
            raise click.BadParameter(str(e), param_hint=f"'--logger={name}'") from None
    try:
        check_label_dropout(overrides["label_dropout"], cond)
    except OptionsError as e:
        raise click.BadParameter(str(e), param_hint="'--label-dropout'") from None
    data = data or get_preset(preset).data
    dataset = open_dataset(data, cond)
    encoder = choose_encoder(dataset)
    given = dict(channel_mult=channel_mult, num_blocks=num_blocks, attn_resolutions=attn_resolutions)
    if init is None:
        overrides["network"] = network_options(preset, dataset.resolution, overrides["channels"], given)
    else:
        encoder, from_init = init_options(init, dataset, encoder, dict(given, channels=overrides["channels"]))
        overrides.update(from_init)
    opts = build_options(
        preset, dataset, encoder, run_dir=run_dir, data=data, cond=cond, batch_gpu=batch_gpu, precision=precision,
        ls=ls, seed=seed, workers=workers, compile=compile, channels_last=channels_last,
        checkpoint_activations=checkpoint_activations, cpu_16bit=cpu_16bit, **overrides,
    )
    try:
        check_derived(config or {}, opts.to_json(), UNET_OPTIONS)
    except OptionsError as e:
        raise click.BadParameter(str(e), param_hint="--config") from None
    try:
        rounds_per_step(opts.batch, opts.batch_gpu, distributed.launched_world_size())
    except OptionsError as e:
        raise click.BadParameter(str(e), param_hint="'--batch' / '--batch-gpu'") from None
    if dry_run:
        print_dry_run(opts, dataset, encoder, time_steps)
        return
    files.check_writable_dir(opts.run_dir)
    try:
        with distributed.session():
            distributed.print0(threads_note())
            stopped_by = train(opts, dataset, encoder)
    except DatasetError as e:  # an image the data loader could not use
        raise click.BadParameter(one_line(e), param_hint="--data") from None
    if stopped_by == signal.SIGINT:
        die_by(signal.SIGINT)


if __name__ == "__main__":
    main()
