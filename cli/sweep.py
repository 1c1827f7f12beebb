"""The command-line side of `calculate_metrics.py sweep`: its --kimg list, and the checks of its inputs, each
naming the option at fault, made before any network is loaded; then the summary and the plot at the end."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import types
from pathlib import Path
from typing import Callable, Iterator

import click
import torch

from cli.evaluation import GuidanceList
from cli.solver import recorded, schedule_option, solver_option
from cli.types import MAX_KIMG, MAX_SEED_OPTION, MAX_STD_COUNT, Integer, IntList, SigmaInterval, StdList

from edm2.data.dataset import DatasetError
from edm2.data.sources import open_data
from edm2.encoders import Encoder, EncoderError, encoder_from_config
from edm2.errors import SnapshotError
from edm2.eval import sweep
from edm2.eval.validation import OWN, VALIDATION_LOSSES, ValidationError, ValidationSamples, fixed_losses_text
from edm2.formats.snapshot import load_network, read_metadata, save_network, snapshot_name
from edm2.loss import LossError, recorded_loss
from edm2.procedures import posthoc
from edm2.procedures.generation import GenerationError, load_guide
from edm2.runtime import distributed, files, locks
from edm2.runtime.limits import MAX_IMAGES
from edm2.sampler import SELF


EPILOG = """\b
Examples:
  # The validation loss of 13 EMA lengths at two training times, offline (no detector): Figure 5c's curves
  python calculate_metrics.py sweep --indir=training-runs/run --metrics=loss --data=datasets/toy16.zip \\
      --std=0.010,0.030,...,0.250 --kimg=16,32 --num=1000
\b
  # FID of 49 EMA lengths of the newest snapshot, 8 GPUs, 50,000 images each (paper Figure 5a)
  torchrun --standalone --nproc_per_node=8 calculate_metrics.py sweep --indir=training-runs/run \\
      --std=0.010,0.015,...,0.250 --ref=refs/img512.npz --metrics=fid
"""


validation_loss_option = click.option(
    "--validation-loss", help="The validation loss of --metrics=loss: 'own', each run's own (its snapshots' weighting "
    f"and noise distribution), or a fixed one that compares runs trained with other losses ({fixed_losses_text()})",
    type=click.Choice(list(VALIDATION_LOSSES)), default=OWN, show_default=True)


def options(fn: Callable) -> Callable:
    """The sweep's own options (the metric options are calculate_metrics.metric_options')."""
    for option in reversed([
        click.option("--indir", help="Training run: a folder of EMA snapshots", metavar="DIR",
                     type=click.Path(path_type=Path), required=True),
        click.option("--std", "stds", help="EMA lengths sigma_rel, e.g. 0.010,0.015,...,0.250", type=StdList(),
                     required=True),
        click.option("--kimg", "kimgs", help="Training times in kimg, one curve each  [default: the newest snapshot]",
                     type=IntList(0, MAX_KIMG)),
        click.option("--data", "data_path", help="Dataset for --metrics=loss (the validation loss)", metavar="PATH|ZIP"),
        click.option("--ref", "ref_path", help="Reference statistics for the metrics of images", metavar="NPZ|PKL|URL"),
        click.option("--num", "num_images", help="Images generated per EMA length; samples of the loss", metavar="INT",
                     type=Integer(2, MAX_IMAGES), default=50000, show_default=True),
        click.option("--seed", help="First seed of the images and of the loss's samples", metavar="INT",
                     type=Integer(0, MAX_SEED_OPTION), default=0, show_default=True),
        validation_loss_option,
        click.option("--gnet", "gnet_path", help="Guiding network for --guidance, or 'self': the run's own "
                     "unconditional prediction (trained with --label-dropout)", metavar="PATH|URL|self"),
        click.option("--guidance", help="Guidance strength of the generated images (1 = no guidance), or several, "
                     "e.g. 1,1.4,2: every EMA length at each (paper Figure 14)", type=GuidanceList(), default="1",
                     show_default=True),
        click.option("--guidance-interval", help="Guide only the steps whose sigma lies in (SIGMA_LO, SIGMA_HI], "
                     "as in gen  [default: every step]", type=SigmaInterval()),
        solver_option,
        schedule_option,
        click.option("--dest", help="Folder for ema-sweep.json and ema-sweep.png  [default: INDIR/plots]",
                     metavar="DIR", type=click.Path(path_type=Path)),
        click.option("--save", "save_dir", help="Also save every reconstruction here, named as by reconstruct_phema.py",
                     metavar="DIR", type=click.Path(path_type=Path)),
        click.option("--ema-batch", help="EMA lengths built per pass over the snapshots (memory: one snapshot plus "
                     "this many networks)", metavar="INT", type=Integer(1, MAX_STD_COUNT), default=8, show_default=True),
    ]):
        fn = option(fn)
    return fn


def check_options(metrics: list[str], num: int, seed: int, data_path: str | None, ref_path: str | None,
                  gnet_path: str | None, guidance: list[float], guidance_interval: tuple[float, float] | None,
                  solver: str, schedule: str, validation_loss: str = OWN) -> dict:
    """Refuse metrics without their input (the generation options are calculate_metrics.check_generation_options');
    returns the settings a results file records (its rows record the training times and EMA lengths, so a rerun
    may add either; a fixed validation loss is recorded by name, the run's own by its absence, as in the files
    written before there were others)."""
    distances = [metric for metric in metrics if metric != "loss"]
    if "loss" in metrics and data_path is None:
        raise click.BadParameter("--metrics=loss needs the dataset to measure it on", param_hint="--data")
    if distances and ref_path is None:
        raise click.BadParameter(f"--metrics={','.join(distances)} needs reference statistics", param_hint="--ref")
    # Files of one guidance strength predate lists and record a number.
    guidance = guidance[0] if len(guidance) == 1 else guidance
    fixed = {} if validation_loss == OWN or "loss" not in metrics else dict(validation_loss=validation_loss)
    return dict(metrics=metrics, num=num, seed=seed, data=data_path, ref=ref_path, gnet=gnet_path, guidance=guidance,
                guidance_interval=guidance_interval, **recorded(solver, schedule), **fixed)


@dataclasses.dataclass
class SweepPlan:
    """What a sweep will do, all checked: inputs per training time, the run's settings, where results go."""

    times: list[tuple[list[posthoc.Snapshot], int]]
    metadata: dict  # of the newest snapshot: network_kwargs, encoder, loss
    encoder: Encoder
    dest: Path
    save_dir: Path | None
    save: Callable | None
    settings: dict  # what the results file records
    results: sweep.SweepResults | None = None  # read under the lock of the results file (held_outputs)


def _local(path: str | Path | None) -> str | None:
    """A path as the results file records it: absolute when it names a local file, else as given (a URL)."""
    return str(Path(path).resolve()) if path not in (None, SELF) and Path(path).exists() else path


def plan(indir: Path, kimgs: tuple[int, ...] | None, stds: list[float], dest: Path | None, save_dir: Path | None,
         settings: dict) -> SweepPlan:
    """Find the snapshots of every training time (default the newest), read the run's settings, check both output
    folders."""
    try:
        snapshots = posthoc.list_snapshots(indir)
        newest = snapshots[-1].path
        metadata = read_metadata(newest) if newest.suffix == ".safetensors" else load_network(newest)[1]
    except (posthoc.PosthocError, SnapshotError) as e:
        raise click.BadParameter(str(e), param_hint="--indir") from None
    try:
        encoder = encoder_from_config(metadata["encoder"] if isinstance(metadata.get("encoder"), dict) else {})
    except EncoderError as e:
        raise click.BadParameter(f"{newest}: {e}", param_hint="--indir") from None
    try:
        times = [posthoc.select_inputs(snapshots, kimg) for kimg in dict.fromkeys(kimgs or [None])]
    except posthoc.NoSuchTimeError as e:
        raise click.BadParameter(str(e), param_hint="--kimg") from None
    dest = dest if dest is not None else indir / "plots"
    for folder, option in ((dest, "--dest"), (save_dir, "--save")):
        try:
            if folder is not None:
                files.check_writable_dir(folder)
        except files.OutputError as e:
            raise click.BadParameter(str(e), param_hint=option) from None
    settings = dict(settings, indir=_local(indir), data=_local(settings["data"]), ref=_local(settings["ref"]),
                    gnet=_local(settings["gnet"]))
    save = _saver(save_dir, [(nimg, std) for _, nimg in times for std in stds]) if save_dir else None
    return SweepPlan(times, metadata, encoder, dest, save_dir, save, settings)


@contextlib.contextmanager
def held_outputs(plan: SweepPlan) -> Iterator[None]:
    """Hold the results file (and the --save folder) for the sweep, one run at a time (edm2.runtime.locks): two sweeps
    into one --dest each rewrote it with its own rows only. The rows measured so far are read under that lock."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(locks.hold_destination(plan.dest / sweep.SWEEP_JSON, "calculate_metrics.py sweep"))
        if plan.save_dir is not None:
            stack.enter_context(locks.hold_destination(plan.save_dir, "calculate_metrics.py sweep", locks.FOLDER_LOCK))
        plan.results = distributed.main_rank_first(functools.partial(_results, plan))
        yield


def _results(plan: SweepPlan) -> sweep.SweepResults:
    """The results file, with the rows measured so far; one that is not this sweep's names --dest."""
    try:
        return sweep.SweepResults(plan.dest / sweep.SWEEP_JSON, plan.settings)
    except sweep.SweepError as e:
        raise click.BadParameter(str(e), param_hint="--dest") from None


def _saver(folder: Path, outputs: list[tuple[int, float]]) -> Callable:
    """save(std, net, metadata) into folder under reconstruct_phema.py's names, refusing to replace other files."""
    for nimg, std in outputs:
        path = folder / snapshot_name("phema", nimg, std)
        if path.exists() and not posthoc.is_reconstruction(path):
            raise click.BadParameter(f"{path} exists and is not a post-hoc reconstruction", param_hint="--save")
    files.remove_stale_temporaries(folder)

    def save(std: float, net: torch.nn.Module, metadata: dict) -> None:
        save_network(folder / snapshot_name("phema", metadata["nimg"], std), net, metadata)
    return save


def network_shape(metadata: dict) -> types.SimpleNamespace:
    """The stored network's resolution, channels, classes and sigma_data, as attributes (for checks before loading
    it)."""
    kwargs = metadata.get("network_kwargs") or {}
    return types.SimpleNamespace(**{k: kwargs.get(k) for k in ("img_resolution", "img_channels", "label_dim",
                                                               "sigma_data")})


def validation_samples(data_path: str, plan: SweepPlan, num: int, seed: int, name: str = OWN) -> ValidationSamples:
    """The validation loss's fixed samples of --data, checked against the run's network, with the loss the snapshots
    record (their weighting and noise distribution; EDM2's for snapshots from before these were recorded), or the
    fixed validation loss of that name (edm2.eval.validation.VALIDATION_LOSSES)."""
    shape = network_shape(plan.metadata)
    try:
        loss = recorded_loss(plan.metadata.get("loss"), shape.sigma_data)
    except LossError as e:
        raise click.BadParameter(f"the snapshots' metadata: {e}, which --metrics=loss needs", param_hint="--indir")
    try:
        dataset = open_data(data_path, use_labels=bool(shape.label_dim))
        return ValidationSamples(dataset, plan.encoder, shape, num, loss, seed, name)
    except (DatasetError, ValidationError, EncoderError) as e:
        raise click.BadParameter(str(e), param_hint="--data") from None


def finish(plan: SweepPlan, metrics: list[str], guidances: list[float] | None = None) -> None:
    """Draw the results as ema-sweep.png and print the best sigma_rel of every training time (rank 0); with several
    guidance strengths, also the table and the two guidance plots (finish_guidance), ema-sweep.png at the first."""
    from edm2 import plots
    from edm2.plots.sweep import sweep_figure

    png = plan.dest / sweep.SWEEP_PNG
    rows = plan.results.rows
    if guidances and len(guidances) > 1:
        finish_guidance(plan, metrics, guidances)
        rows = [row for row in rows if row.get("guidance") == guidances[0]]
    plots.save_png(sweep_figure(rows, metrics), png)
    for line in sweep.summary_table(rows, metrics):
        click.echo(line)
    best, warnings = {}, {}
    for metric in metrics:
        best_rows = sweep.best_rows(rows, metric)
        best[metric] = {str(nimg // 1000): row["std"] for nimg, row in best_rows.items()}
        warnings[metric] = {str(nimg // 1000): sweep.best_warnings(rows, row) for nimg, row in best_rows.items()}
        click.echo(f"best {metric}: "
                   + ", ".join(f"sigma_rel {std:.3f} at kimg {k}" for k, std in best[metric].items()))
        for kimg, notes in warnings[metric].items():
            for note in notes:
                click.echo(f"  caution, kimg {kimg}: sigma_rel {best[metric][kimg]:.3f} is {note}")
    click.echo(f"Saved {plan.results.path} and {png}")
    click.echo(json.dumps({"results": str(plan.results.path), "plot": str(png), "best": best, "warnings": warnings}))


def finish_guidance(plan: SweepPlan, metrics: list[str], guidances: list[float]) -> None:
    """The sweep over guidance strengths (rank 0): ema-sweep.csv with every row, a table per metric at the newest
    training time (rows: EMA lengths, columns: strengths), and the plots of each metric against EMA length (one line
    per strength, Figure 14) and against guidance (one line per EMA length)."""
    from edm2 import plots
    from edm2.plots.sweep import ema_guidance_figure, guidance_figure

    rows = plan.results.rows
    newest = [row for row in rows if row["nimg"] == max(r["nimg"] for r in rows) and row.get("guidance") in guidances]
    sweep.write_table(plan.dest / sweep.SWEEP_CSV, rows, metrics)
    for metric in metrics:
        click.echo(sweep.table_text(newest, metric, guidances))
    plots.save_png(ema_guidance_figure(newest, metrics), plan.dest / sweep.EMA_GUIDANCE_PNG)
    plots.save_png(guidance_figure(newest, metrics), plan.dest / sweep.GUIDANCE_PNG)
    click.echo(f"Saved {plan.dest / sweep.SWEEP_CSV}, {plan.dest / sweep.EMA_GUIDANCE_PNG} and "
               f"{plan.dest / sweep.GUIDANCE_PNG}")


def guiding_network(gnet_path: str, net, metadata: dict, device: torch.device) -> torch.nn.Module | str:
    """--gnet on device, checked to fit net (whose snapshot's metadata is given; `gen` and `sweep`); SELF for
    --gnet=self, checked to be trained for it."""
    try:
        gnet = distributed.main_rank_first(functools.partial(load_guide, gnet_path, net, metadata))  # rank 0 downloads
    except (SnapshotError, GenerationError, files.DownloadError) as e:
        raise click.BadParameter(str(e), param_hint="--gnet") from None
    return gnet if gnet == SELF else gnet.to(device)
