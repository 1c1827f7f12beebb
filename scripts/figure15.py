"""Paper Figure 15 (and Figure 3) for runs of different configurations: the magnitudes of activations and weights
per resolution bucket (max and mean over features, Appendix A.6) at every snapshot of each run, drawn one row per
run, with each bucket's growth (last snapshot over first). Example:

    python scripts/figure15.py C=training-runs/config-c G=training-runs/config-g --data=datasets/mnist16.zip \\
        --dest=figure15
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from cli.command import Command  # noqa: E402
from edm2 import plots  # noqa: E402
from edm2.data.sources import open_data  # noqa: E402
from edm2.encoders import encoder_from_config  # noqa: E402
from edm2.eval.magnitudes import bucket_magnitudes  # noqa: E402
from edm2.eval.validation import ValidationSamples  # noqa: E402
from edm2.formats.snapshot import load_network  # noqa: E402
from edm2.loss import recorded_loss  # noqa: E402
from edm2.plots.ladder import PANELS, figure15, growth  # noqa: E402
from edm2.procedures import posthoc  # noqa: E402
from edm2.runtime import files  # noqa: E402


def run_records(folder: Path, data: str, std: float, num: int, seed: int) -> list[dict]:
    """bucket_magnitudes of each EMA snapshot of sigma_rel std in folder, on the same num samples of data."""
    snapshots = [s for s in posthoc.list_snapshots(folder) if abs(s.std - std) < posthoc.STD_TOLERANCE]
    if not snapshots:
        raise click.BadParameter(f"{folder} holds no snapshots of sigma_rel {std:.3f}", param_hint="RUNS")
    records, batch = [], None
    for snap in snapshots:
        net, meta = load_network(snap.path)
        if batch is None:
            dataset = open_data(data, use_labels=bool(net.label_dim))
            samples = ValidationSamples(dataset, encoder_from_config(meta["encoder"]), net, num,
                                        recorded_loss(meta.get("loss"), net.sigma_data), seed)
            batch = samples.batch(range(num))
        y, sigma, noise, labels = batch
        records.append(dict(kimg=snap.nimg / 1000, **bucket_magnitudes(net.eval(), y + sigma * noise, sigma, labels)))
    return records


@click.command(cls=Command)
@click.argument("runs", nargs=-1, required=True, metavar="NAME=RUN...")
@click.option("--data", help="Dataset the probe's samples come from (folder, ZIP, shards or blend, as --data of "
              "train_edm2.py)", metavar="PATH|ZIP|SHARDS|BLEND", required=True)
@click.option("--dest", help="Folder for figure15.{json,png}", metavar="DIR", type=click.Path(path_type=Path),
              required=True)
@click.option("--std", help="EMA track to probe", type=float, default=0.100, show_default=True)
@click.option("--num", help="Samples of the probe", type=click.IntRange(1, 4096), default=256, show_default=True)
@click.option("--seed", help="Seed of the probe's samples", type=click.IntRange(0, 2**31), default=0, show_default=True)
def main(runs: tuple[str, ...], data: str, dest: Path, std: float, num: int, seed: int) -> None:
    """Figure 15 for each NAME=RUN, and each bucket's growth from the first snapshot to the last."""
    pairs = [run.split("=", 1) for run in runs]
    if any(len(pair) != 2 or not Path(pair[1]).is_dir() for pair in pairs):
        raise click.BadParameter("each run is NAME=RUN with RUN a run directory", param_hint="RUNS")
    files.check_writable_dir(dest)
    torch.manual_seed(seed)
    records = {name: run_records(Path(folder), data, std, num, seed) for name, folder in pairs}
    table = {name: {f"{kind} {how}": growth(recs, kind, how) for kind, how in PANELS} for name, recs in records.items()}
    with files.atomic_path(dest / "figure15.json") as tmp:
        tmp.write_text(json.dumps({"std": std, "records": records, "growth": table}, indent=1))
    plots.save_png(figure15(records), dest / "figure15.png")
    click.echo("growth, last snapshot over first (median over buckets [min, max]):")
    for name, columns in table.items():
        cells = [f"{col} {np.median(list(v.values())):.2f} [{min(v.values()):.2f}, {max(v.values()):.2f}]"
                 for col, v in columns.items()]
        click.echo(f"  {name}: " + "; ".join(cells))
    click.echo(f"Saved {dest / 'figure15.json'} and {dest / 'figure15.png'}")


if __name__ == "__main__":
    main()
