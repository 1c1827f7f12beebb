"""`calculate_metrics.py tensor-sweep`: the per-tensor EMA-length sweep of paper Figure 5b on the validation loss,
its inputs checked before any network is loaded, its rows written as JSON and drawn."""

from __future__ import annotations

import json
from pathlib import Path

import click

from cli import sweep as sweep_cli
from cli.command import Command
from cli.speed import threads_option
from cli.types import MAX_KIMG, MAX_SEED_OPTION, MAX_STD_COUNT, Integer, Number, StdList
from edm2 import phema
from edm2.eval import tensor_sweep as ts
from edm2.eval.sweep import Measure
from edm2.eval.validation import OWN
from edm2.procedures import posthoc
from edm2.runtime import distributed, files, locks
from edm2.runtime.limits import MAX_BATCH, MAX_IMAGES

EPILOG = """\b
Example: the validation loss with one tensor per resolution bucket moved from sigma_rel 0.100 (Figure 5b)
  python calculate_metrics.py tensor-sweep --indir=training-runs/run --data=datasets/toy16.zip \\
      --global-std=0.100 --std=0.020,0.040,...,0.200 --tensors=buckets --num=1000
"""


def parse_tensors(ctx: click.Context, param: click.Parameter, value: str) -> str | list[str]:
    """'all', 'buckets' or a comma-separated list of weight tensor names."""
    if value in ts.CHOICES:
        return value
    names = [name.strip() for name in value.split(",") if name.strip()]
    if not names:
        raise click.BadParameter(f"expected {' or '.join(ts.CHOICES)} or tensor names, got {value!r}")
    return names


@click.command("tensor-sweep", cls=Command, epilog=EPILOG)
@click.option("--indir", help="Training run: a folder of EMA snapshots", metavar="DIR", type=click.Path(path_type=Path),
              required=True)
@click.option("--global-std", help="The EMA length of every tensor not being swept", metavar="FLOAT",
              type=Number(), required=True)
@click.option("--std", "stds", help="EMA lengths to give each swept tensor, e.g. 0.020,0.040,...,0.200",
              type=StdList(), required=True)
@click.option("--tensors", help="'all' weight tensors, 'buckets' (the first of each resolution bucket) or names",
              metavar="all|buckets|LIST", callback=parse_tensors, default="buckets", show_default=True)
@click.option("--kimg", help="Training time in kimg  [default: the newest snapshot]", type=Integer(0, MAX_KIMG))
@click.option("--data", "data_path", help="Dataset of the validation loss", metavar="PATH|ZIP", required=True)
@click.option("--num", "num_images", help="Samples of the loss", metavar="INT", type=Integer(2, MAX_IMAGES),
              default=1000, show_default=True)
@click.option("--seed", help="First seed of the loss's samples", metavar="INT", type=Integer(0, MAX_SEED_OPTION),
              default=0, show_default=True)
@sweep_cli.validation_loss_option
@click.option("--batch", "batch_size", help="Samples per batch", metavar="INT", type=Integer(1, MAX_BATCH), default=64,
              show_default=True)
@click.option("--dest", help="Folder for ema-tensor-sweep.json and .png  [default: INDIR/plots]", metavar="DIR",
              type=click.Path(path_type=Path))
@click.option("--ema-batch", help="EMA lengths built per pass over the snapshots", metavar="INT",
              type=Integer(1, MAX_STD_COUNT), default=8, show_default=True)
@threads_option
def command(indir: Path, global_std: float, stds: list[float], tensors: str | list[str], kimg: int | None,
            data_path: str, num_images: int, seed: int, validation_loss: str, batch_size: int, dest: Path | None,
            ema_batch: int) -> None:
    """The validation loss with one weight tensor's EMA length moved at a time (paper Figure 5b)."""
    if not 0 < global_std < phema.MAX_STD:
        raise click.BadParameter(f"{global_std} is outside (0, {phema.MAX_STD:.4f}), the range of sigma_rel",
                                 param_hint="--global-std")
    # A fixed validation loss by name; the run's own by its absence, as in the files written before there were others.
    fixed = {} if validation_loss == OWN else dict(validation_loss=validation_loss)
    settings = dict(metrics=["loss"], num=num_images, seed=seed, data=data_path, ref=None, gnet=None, **fixed)
    plan = sweep_cli.plan(indir, None if kimg is None else (kimg,), stds, dest, None, settings)
    (inputs, out_nimg), = plan.times
    chosen = _chosen(tensors, inputs[-1].path)
    lock = plan.dest / ts.TENSOR_SWEEP_JSON
    with distributed.session(), locks.hold_destination(lock, "calculate_metrics.py tensor-sweep"):
        samples = sweep_cli.validation_samples(data_path, plan, num_images, seed, validation_loss)
        measure = Measure(["loss"], plan.encoder, [], batch_size, distributed.device(), samples=samples)
        try:
            rows = ts.tensor_sweep([s.track() for s in inputs], out_nimg, global_std, stds, chosen, measure, ema_batch,
                                   report=click.echo)
        except posthoc.PosthocError as e:  # a release pickle's names are known only once it is loaded
            raise click.BadParameter(str(e), param_hint="--tensors") from None
        rows = [dict(row, **measure.recorded) for row in rows]
        _finish(plan.dest, rows, global_std, dict(plan.settings, global_std=global_std, kimg=out_nimg // 1000))


def _chosen(tensors: str | list[str], newest: Path) -> list[str]:
    """The tensors to sweep, checked against the newest snapshot's header (ours; a pickle is checked on loading)."""
    if newest.suffix != ".safetensors":
        if not isinstance(tensors, list):
            raise click.BadParameter(f"--tensors={tensors} needs our .safetensors snapshots; name the tensors of a "
                                     "release pickle", param_hint="--tensors")
        return tensors
    shapes = posthoc.header_architecture(newest)
    try:
        return ts.choose_tensors(tensors, list(shapes), list(shapes.values()))
    except posthoc.PosthocError as e:
        raise click.BadParameter(str(e), param_hint="--tensors") from None


def _finish(dest: Path, rows: list[dict], std: float, settings: dict) -> None:
    """Write the rows and Figure 5b, and say where (rank 0)."""
    if not distributed.is_main():
        return
    from edm2 import plots
    from edm2.plots.sweep import tensor_sweep_figure

    json_path, png = dest / ts.TENSOR_SWEEP_JSON, dest / ts.TENSOR_SWEEP_PNG
    with files.atomic_path(json_path) as tmp:
        tmp.write_text(json.dumps({"settings": settings, "rows": rows}, indent=1))
    plots.save_png(tensor_sweep_figure(rows, "loss", std), png)
    click.echo(f"Saved {json_path} and {png}")
