"""Train an EDM2 model with the paper's recipe on one CPU or many GPUs (torchrun); rerun to resume."""

from __future__ import annotations

import cli.wait_policy  # noqa: F401  first: PyTorch's OpenMP reads its wait policy once, when it loads
import json
import signal

import click

from cli import local_launch
from cli.command import Command
from cli.config import config_option
from cli.evaluation import check_features
from cli.network_options import given_hyperparameters, hyperparameter_names, hyperparameter_options
from cli.run_setup import choose_encoder, open_dataset, run_network, teacher_options, unrecorded_encoding
from cli.speed import THREADS, threads_note, threads_option
from cli.training_options import field_options
from cli.types import bound_type
from edm2.data.dataset import DatasetError, ImageData
from edm2.encoders import Encoder
from edm2.errors import one_line
from edm2.eval.scores import DETECTOR_OF
from edm2.eval.stats_files import StatsError, load_stats
from edm2.runtime import distributed, files
from edm2 import families
from training.architecture import init_path, read_init
from training.run.dry_run import blend_shares, parameter_count, start_or_resume, timed_speed
from training.options import (
    BOUNDS, DATA_FIELDS, RECIPE_FIELDS, OptionsError, TrainingOptions, check_derived, check_label_dropout, check_method,
    default_grid, rounds_per_step,
)
from training.run.loop import train
from training.run.preflight import dataset_description, init_notes
from training.presets import get_preset
from training.run.run_dir import RUN_ID_KEY
from training.run.signals import die_by
from training.run.trackers import TrackerUnavailable, check_installed

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


def field_type(name: str) -> click.ParamType:
    """The option type of a TrainingOptions field, made from the bound the field declares (training.sections)."""
    return bound_type(BOUNDS[name])


def check_metrics_ref(metrics: tuple[str, ...], ref_path: str | None) -> None:
    """Refuse, before training, reference statistics that cannot serve the metrics of images (naming
    --metrics-ref)."""
    images = [metric for metric in metrics if metric != "loss"]
    if not images or ref_path is None:
        return  # no metric of images, or no reference: TrainingOptions refuses the latter
    try:
        ref = load_stats(ref_path)
    except (StatsError, files.DownloadError) as e:
        raise click.BadParameter(str(e), param_hint="--metrics-ref") from None
    missing = [metric for metric in images if DETECTOR_OF[metric] not in ref]
    if missing:
        raise click.BadParameter(f"{ref_path} has no statistics for {', '.join(missing)}",
                                 param_hint="--metrics-ref")
    try:
        check_features(ref, ref_path, images)
    except click.BadParameter as e:
        raise click.BadParameter(e.message, param_hint="--metrics-ref") from None


def build_options(preset: str, dataset: ImageData, encoder: Encoder, **values) -> TrainingOptions:
    """The run's options for this data (--grid's default from its classes); what their own checks refuse
    (TrainingOptions.__post_init__) is one line."""
    if values["grid"] is None:
        values["grid"] = default_grid(dataset.label_dim if values["cond"] else 0)
    try:
        return TrainingOptions.from_preset(preset, dataset_description(dataset), encoder.config(), **values)
    except OptionsError as e:
        raise click.UsageError(str(e)) from None


def check_before_the_data(fields: dict, cond: bool, dry_run: bool, time_steps: int) -> None:
    """Refuse, before the data is opened, what the options alone show cannot work: a metrics reference, timing
    without --dry-run, a tracker that is not installed, label dropout without labels."""
    check_metrics_ref(fields["metrics"] or (), fields["metrics_ref"])  # None: --metrics not given
    if time_steps and not dry_run:
        raise click.BadParameter("needs --dry-run (a training reports its speed in its status lines)",
                                 param_hint="--time-steps")
    for name in fields["loggers"]:
        try:
            check_installed(name)
        except TrackerUnavailable as e:
            raise click.BadParameter(str(e), param_hint=f"'--logger={name}'") from None
    try:
        check_label_dropout(fields["label_dropout"], cond)
    except OptionsError as e:
        raise click.BadParameter(str(e), param_hint="'--label-dropout'") from None


def report_init(opts: TrainingOptions, dataset: ImageData) -> None:
    """On stderr, from the first process only: what a run from an --init snapshot should know (init_notes)."""
    if opts.init is not None and distributed.launched_rank() == 0:
        for line in init_notes(read_init(opts.init), dataset.classes, opts):
            click.echo(line, err=True)


def config_params(values: dict, path: str) -> dict:
    """A training_options.json (or --dry-run output) as parameters: the network family's options taken out of its
    network, the fields derived from the data and the preset left out (check_derived compares them later), and the
    run's identity too: a branch into another directory is another run, a rerun in the same one keeps its own."""
    network = values.get("network", {})
    if not isinstance(network, dict):
        raise click.BadParameter(f"{path}: network: expected an object", param_hint="--config")
    params = {k: v for k, v in values.items() if k not in (*DATA_FIELDS, *RECIPE_FIELDS, RUN_ID_KEY)}
    arch = {"arch": network["family"]} if "family" in network else {}
    return {**{k: network[k] for k in hyperparameter_names() if k in network}, **arch, **params}


def run_processes(opts: TrainingOptions) -> int:
    """The processes the run trains as (cli.local_launch.processes): one per core on a CPU unless told, of those the
    batch splits over."""
    return local_launch.processes(opts.processes, opts.threads, lambda count: splits(opts, count))


def splits(opts: TrainingOptions, processes: int) -> bool:
    """Whether the batch splits over this many processes (training.options.rounds_per_step)."""
    try:
        rounds_per_step(opts.batch, opts.batch_gpu, processes)
    except OptionsError:
        return False
    return True


def print_dry_run(opts: TrainingOptions, dataset: ImageData, encoder: Encoder, time_steps: int,
                  note: str | None, starting: int) -> None:
    """The options as JSON on stdout (a valid --config); on stderr, the note on the data's encoding, if any, the
    data, the network's size, where the run would start or resume and, with time_steps, its speed. Under torchrun
    (or --processes) every process times the steps together and the first prints; `starting`: the processes the
    command itself would start (1 under torchrun)."""
    first = distributed.launched_rank() == 0
    if first:
        click.echo(json.dumps(opts.to_json(), indent=2))
        if note:
            click.echo(note, err=True)
        count = parameter_count(opts, encoder.out_channels(dataset.num_channels))
        click.echo(f"Dataset: {len(dataset)} images. Network: {count:,} parameters.", err=True)
        shares = blend_shares(dataset)
        if shares:
            click.echo(shares, err=True)
        click.echo(start_or_resume(opts.run_dir, opts.duration), err=True)
        if starting > 1:
            click.echo(local_launch.note(opts.processes, starting, "Would train as"), err=True)
        click.echo(threads_note(starting), err=True)
    if time_steps:  # running out of memory is one line naming --batch-gpu (cli.command)
        with distributed.session():
            speed = timed_speed(opts, dataset, encoder, time_steps)
        if first:
            click.echo(speed, err=True)
    if first:
        click.echo("Dry run: nothing written.", err=True)


@click.command(cls=Command, epilog=EXAMPLES)
@config_option(config_params, exclude=("dry_run",), expose=True, help="Read options from a JSON file: a run's "
               "training_options.json or --dry-run output reruns or branches it; the command line overrides it")
@field_options(TrainingOptions)  # the options that set the run's options, each declared on its field
# The network, for data the presets do not cover, and fine-tuning: stored in the snapshots and kept on resume.
@click.option("--arch", type=click.Choice(families.names()),
              help="Network family (edm2.families): " + "; ".join(f"{name}: {families.get(name).summary}"
                                                                 for name in families.names())
              + "  [default: the preset's, --init's snapshot's]")
@click.option("--channels", type=field_type("channels"), help="Channel multiplier  [default: preset]")
# The network family's hyperparameters (--num-blocks, --depth, ...), e.g. for data the presets do not cover:
# stored in the snapshots and kept on resume.
@hyperparameter_options
@click.option("-n", "--dry-run", is_flag=True, help="Print the options (stdout), the parameter count and whether "
              "the run would start or resume (stderr), and exit")
@click.option("--time-steps", type=click.IntRange(min=0, max=1000), default=0, show_default=True,
              help="With --dry-run: time this many training steps after a warm-up step (nothing is written) and "
                   "estimate images/s and the run's remaining time")
@threads_option
def main(config: dict | None, arch: str | None, channels: int | None, dry_run: bool, time_steps: int, preset: str,
         data: str | None, cond: bool, init: str | None, **fields) -> None:
    """Train an EDM2 diffusion model (paper Section 2-3 recipe) or resume its run directory.

    SIGTERM (preemption) or Ctrl-C finishes the current step and writes a training state; after Ctrl-C the
    process then ends by SIGINT, so scripts stop too. A run directory is used by one training at a time.

    --init starts a new run from a snapshot's weights (its network and EMA tracks; Adam starts afresh): the
    architecture and encoder come from the snapshot, the rest of the recipe from --preset and the options. The
    run counts its own images, so the learning rate ramps up and decays (Eq. 67) as in any run, with --lr and
    --decay as given. Rerunning the same command resumes the run from its own training states.
    """
    local_launch.follow_launcher()
    check_before_the_data(fields, cond, dry_run, time_steps)
    try:
        teacher = fields["teacher"] and init_path(fields["teacher"])  # as a run's options record it, and --init
        check_method(fields["method"] or get_preset(preset).method, teacher, init and init_path(init))
    except OptionsError as e:
        raise click.UsageError(str(e)) from None
    data = data or get_preset(preset).data
    dataset = open_dataset(data, cond)
    encoder = choose_encoder(dataset)
    given = given_hyperparameters(fields)
    if fields["teacher"] is not None:  # the student starts from the teacher's weights, as a network of its own
        encoder, network = teacher_options(fields["teacher"], arch, dataset, encoder, dict(given, channels=channels),
                                           preset)
        init = network["init"]
    else:
        encoder, network = run_network(preset, arch, init, dataset, encoder, given, channels)
    values = {**fields, "data": data, "cond": cond, "channels": channels, **network}  # --init's network wins
    opts = build_options(preset, dataset, encoder, **values, threads=click.get_current_context().meta.get(THREADS))
    try:
        check_derived(config or {}, opts.to_json(), (*hyperparameter_names(), "family"))
    except OptionsError as e:
        raise click.BadParameter(str(e), param_hint="--config") from None
    processes = run_processes(opts)
    try:
        rounds_per_step(opts.batch, opts.batch_gpu, processes)
    except OptionsError as e:
        hint = "'--batch' / '--batch-gpu'" + (" / '--processes'" if opts.processes else "")
        raise click.BadParameter(str(e), param_hint=hint) from None
    starting = 1 if distributed.launched() else processes  # the processes this command starts itself
    if starting > 1 and (time_steps or not dry_run):
        if not dry_run:
            files.check_writable_dir(opts.run_dir)
        lead = "Timing the steps as" if dry_run else "Training as"
        click.get_current_context().exit(
            local_launch.relaunch(__file__, processes, opts.processes, opts.threads, lead))
    note = unrecorded_encoding(dataset, encoder) if init is None else None
    report_init(opts, dataset)
    if dry_run:
        print_dry_run(opts, dataset, encoder, time_steps, note, starting)
        return
    files.check_writable_dir(opts.run_dir)
    try:
        with distributed.session():
            stopped_by = train(opts, dataset, encoder, start_notes=[line for line in (note, threads_note()) if line])
    except DatasetError as e:  # an image the data loader could not use
        raise click.BadParameter(one_line(e), param_hint="--data") from None
    if stopped_by == signal.SIGINT:
        die_by(signal.SIGINT)


if __name__ == "__main__":
    main()
