"""The run dashboard under RUN/plots/: at every snapshot, rank 0 measures the EMA network on a fixed batch and
redraws training.png, and at the run's last snapshot magnitudes.png; redraw() draws both again from the run's files
alone.

Files, each written atomically:
  plots/training.json    the numbers training.png plots: stats.jsonl's loss, learning rate and images/s by kimg,
                         per snapshot lambda(sigma) L(D; sigma) and u(sigma) at the noise levels 'sigma' (no u
                         for a run trained with the uncertainty off, 'uncertainty': 'off'), and the image counts
                         where the run resumed ('resumes'); with --validation-loss, the fixed loss's name
                         ('validation_loss', none for the run's own), whose weighting, P_mean and P_std the loss and
                         the noise levels then follow, so that runs trained with other losses compare
  plots/training.png     the dashboard (edm2.plots.run.dashboard_figure)
  plots/magnitudes.json  per snapshot, the RMS of each block's output and of each layer's raw weight
  plots/magnitudes.png   drawn at the last snapshot (its many lines take about a second) and by redraw()
  plots/consistency.png  a consistency model's (--method=sct|scd): stats.jsonl's tangent norm ||g||, gradient norm
                         and u(t) per t-bin, at every snapshot and by redraw()
The fixed batch is PROBE_IMAGES dataset images evenly spaced through the dataset with the draws of seeds
0..PROBE_IMAGES-1 (edm2.eval.validation.ValidationSamples): the same at every snapshot and on every resume. They are
training images, as EDM2 trains on the whole dataset; what is fixed is the batch and its draws. The network is
the first EMA track (the newest snapshot's network, before its float16 rounding in the file).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from edm2.errors import EDM2Error, one_line
from edm2.eval.magnitudes import block_output_rms, weight_rms
from edm2.eval.validation import OWN, ValidationSamples, loss_per_sigma, sigma_grid
from edm2.loss import DEFAULT_NOISE, DEFAULT_UNCERTAINTY, DEFAULT_WEIGHTING
from edm2.runtime import bounded_json, files
from training.presets import DEFAULT_METHOD
from training.run.run_dir import STATS_FILE
from training.step import recipe_loss

PLOTS_DIR = "plots"
TRAINING_JSON, TRAINING_PNG = "training.json", "training.png"
MAGNITUDES_JSON, MAGNITUDES_PNG = "magnitudes.json", "magnitudes.png"
METRICS_PNG = "metrics.png"  # train_edm2.py --metrics, from stats.jsonl's metric rows
CONSISTENCY_PNG = "consistency.png"  # train_edm2.py --method=sct|scd, from stats.jsonl's consistency columns
CONSISTENCY_KEYS = ("kimg", "g_norm", "grad_norm")
PROBE_IMAGES = 8
ROW_KEYS = ("noise_levels", "resumes", "rows")  # the record files' lists that grow as the run goes on
DASHBOARD_DPI = 80  # 880x520 pixels: legible, and quick to save at every snapshot
STATS_KEYS = ("kimg", "loss", "lr", "images_per_s")
# Not the sweep's validation loss (Eq. 14, ln(sigma) drawn from Eq. 16 on --data's samples): an equal-weight mean over
# sigma_grid's levels, which reach 2.5 P_std into both tails, of PROBE_IMAGES training images; so it is larger.
LOSS_MEAN_TAG = "noise_level/loss_mean"


class DashboardError(EDM2Error):
    """A run directory whose records cannot be drawn: no stats.jsonl, or a record file that is not ours."""


def stats_rows(run_dir: Path, keys: Sequence[str], required: bool = True) -> list[dict]:
    """stats.jsonl's rows (parsed within edm2.runtime.bounded_json's bounds) that hold a number under every key; a torn
    or foreign line is skipped. Unless required, a missing file gives no rows."""
    path = run_dir / STATS_FILE
    try:
        with files.open_input(path) as f:  # a FIFO or device is refused, not waited on
            lines = f.read().splitlines()
    except FileNotFoundError:
        if not required:
            return []
        raise DashboardError(f"{run_dir} has no {STATS_FILE}: not a training run directory") from None
    except OSError as e:
        raise DashboardError(f"{path}: cannot read ({e.strerror or e})") from None
    rows = []
    for line in lines:
        try:
            row = bounded_json.parse(line, str(path))
            for key in keys:
                float(row[key])
        except (bounded_json.JSONFileError, TypeError, KeyError, ValueError):
            continue
        rows.append(row)
    return rows


def read_stats(run_dir: Path, required: bool = True) -> dict[str, list[float | None]]:
    """stats.jsonl as columns (kimg, loss, lr, images_per_s, and mfu: None where a row has none); a torn or foreign
    line is skipped.

    Unless required, a missing or empty file gives empty columns (a run whose status interval is longer than its
    snapshot interval has none at its first snapshot)."""
    rows = stats_rows(run_dir, STATS_KEYS, required)
    if required and not rows:
        raise DashboardError(f"{run_dir / STATS_FILE} holds no status rows yet")
    columns = {key: [float(row[key]) for row in rows] for key in STATS_KEYS}
    # MFU where the row has one (rows written before it, or without a known peak, have none).
    columns["mfu"] = [float(row["mfu"]) if _is_number(row.get("mfu")) else None for row in rows]
    return columns


def _is_number(value: object) -> bool:
    """Whether a JSON value is a number (not a bool, a string or null)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def load_records(path: Path) -> dict | None:
    """A record file of ours (a JSON object), or None when there is none."""
    return bounded_json.read_object(path, DashboardError)


def save_json(path: Path, data: dict) -> None:
    """Write data as JSON atomically."""
    with files.atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data))


def _figure(figure_fn: Callable[[dict], Any], data: dict, source: Path) -> Any:
    """figure_fn(data); records that lack what the figure needs are one DashboardError naming their file."""
    try:
        return figure_fn(data)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise DashboardError(f"{source}: malformed records ({type(e).__name__}: {one_line(e)})") from None


def write_dashboard(run_dir: Path, training: dict) -> Path:
    """training.json with stats.jsonl's columns as of now (none yet is fine), and training.png drawn from it."""
    from edm2 import plots  # matplotlib takes a second to import: only runs that reach a snapshot need it
    from edm2.plots.run import dashboard_figure
    training = dict(training, stats=read_stats(run_dir, required=False))
    folder = run_dir / PLOTS_DIR
    figure = _figure(dashboard_figure, training, folder / TRAINING_JSON)
    save_json(folder / TRAINING_JSON, training)
    plots.save_png(figure, folder / TRAINING_PNG, dpi=DASHBOARD_DPI)
    return folder / TRAINING_PNG


def write_metrics(run_dir: Path) -> Path:
    """metrics.png: each metric row of stats.jsonl (train_edm2.py --metrics) against kimg."""
    from edm2 import plots
    from edm2.plots.run import metrics_figure
    rows = [row for row in stats_rows(run_dir, ("kimg",), required=False) if isinstance(row.get("metrics"), dict)]
    path = run_dir / PLOTS_DIR / METRICS_PNG
    plots.save_png(_figure(metrics_figure, rows, run_dir / STATS_FILE), path, dpi=DASHBOARD_DPI)
    return path


def consistency_rows(run_dir: Path) -> list[dict]:
    """stats.jsonl's rows of a consistency model's training: those with ||g||, the gradient norm and u(t) per t-bin
    (edm2.consistency_loss.stats_row)."""
    return [row for row in stats_rows(run_dir, CONSISTENCY_KEYS, required=False)
            if isinstance(row.get("logvar_t"), dict) and all(map(_is_number, row["logvar_t"].values()))]


def write_consistency(run_dir: Path) -> Path:
    """consistency.png: ||g||, the gradient norm and u(t) per t-bin from stats.jsonl (edm2.plots.run)."""
    from edm2 import plots
    from edm2.plots.run import consistency_figure
    path = run_dir / PLOTS_DIR / CONSISTENCY_PNG
    plots.save_png(_figure(consistency_figure, consistency_rows(run_dir), run_dir / STATS_FILE), path,
                   dpi=DASHBOARD_DPI)
    return path


def write_magnitudes(run_dir: Path, magnitudes: dict) -> Path:
    """magnitudes.png drawn from the records (edm2.plots.run.magnitudes_figure)."""
    from edm2 import plots
    from edm2.plots.run import magnitudes_figure
    folder = run_dir / PLOTS_DIR
    plots.save_png(_figure(magnitudes_figure, magnitudes, folder / MAGNITUDES_JSON), folder / MAGNITUDES_PNG)
    return folder / MAGNITUDES_PNG


def redraw(run_dir: str | os.PathLike) -> tuple[list[Path], list[str]]:
    """Draw training.png and magnitudes.png of a run directory from its files; returns (PNGs written, notes).

    Every file is read and every figure drawn before anything is written.
    """
    from edm2 import plots
    from edm2.plots.run import dashboard_figure, magnitudes_figure
    run_dir = Path(run_dir)
    folder = run_dir / PLOTS_DIR
    stats = read_stats(run_dir)
    training, magnitudes = load_records(folder / TRAINING_JSON), load_records(folder / MAGNITUDES_JSON)
    notes = [] if training else [f"{folder / TRAINING_JSON} does not exist: the dashboard shows stats.jsonl only"]
    training = dict(training or {}, stats=stats)
    outputs = [(TRAINING_PNG, _figure(dashboard_figure, training, folder / TRAINING_JSON), DASHBOARD_DPI)]
    if magnitudes:
        outputs.append((MAGNITUDES_PNG, _figure(magnitudes_figure, magnitudes, folder / MAGNITUDES_JSON), 100))
    else:
        notes.append(f"{folder / MAGNITUDES_JSON} does not exist: no magnitudes to draw")
    consistency = consistency_rows(run_dir)
    if consistency:
        from edm2.plots.run import consistency_figure
        outputs.append((CONSISTENCY_PNG, _figure(consistency_figure, consistency, run_dir / STATS_FILE),
                        DASHBOARD_DPI))
    files.remove_stale_temporaries(folder)
    save_json(folder / TRAINING_JSON, training)
    for name, figure, dpi in outputs:
        plots.save_png(figure, folder / name, dpi=dpi)
    return [folder / name for name, _, _ in outputs], notes


class Dashboard:
    """Rank 0's dashboard of a training run: the fixed batch, the records so far, and the update at a snapshot."""

    def __init__(self, run_dir: Path, opts, dataset, encoder, net: torch.nn.Module, device: torch.device,
                 cur_nimg: int):
        self.run_dir, self.duration = run_dir, opts.duration
        self.consistency = opts.method != DEFAULT_METHOD  # a consistency model: consistency.png too
        # The run's own loss, as its snapshots record it, or the fixed validation loss of --validation-loss.
        samples = ValidationSamples(dataset, encoder, net, PROBE_IMAGES, recipe_loss(opts, net.sigma_data),
                                    name=opts.validation_loss)
        self.loss = samples.loss
        self.batch = samples.batch(range(PROBE_IMAGES), device)
        probe = dict(images=PROBE_IMAGES, indices=samples.indices, seeds=f"0-{PROBE_IMAGES - 1}")
        # Another loss is another measurement; EDM2's is named by its absence, as in the records of earlier versions,
        # and so is the learned uncertainty, which all of those had.
        names = {k: v for k, v in self.loss.record().items() if k in ("weighting", "noise")}
        names = {} if names == dict(weighting=DEFAULT_WEIGHTING, noise=DEFAULT_NOISE) else names
        if self.loss.uncertainty != DEFAULT_UNCERTAINTY:
            names["uncertainty"] = self.loss.uncertainty
        if opts.validation_loss != OWN:
            names["validation_loss"] = opts.validation_loss
        self.training = dict(P_mean=self.loss.P_mean, P_std=self.loss.P_std, ema_std=opts.ema_stds[0], probe=probe,
                             sigma=sigma_grid(self.loss.P_mean, self.loss.P_std), noise_levels=[], **names)
        self.magnitudes = dict(ema_std=opts.ema_stds[0], probe=probe, rows=[])
        files.remove_stale_temporaries(run_dir / PLOTS_DIR, owned=True)
        earlier = self._earlier_rows(TRAINING_JSON, self.training, ("noise_levels", "resumes"), cur_nimg)
        self.training["noise_levels"] = earlier["noise_levels"]
        # Where earlier invocations went on after an interruption, and this one if it resumes: marked in the plots.
        resumes = [r for r in earlier["resumes"] if r["nimg"] < cur_nimg]
        self.training["resumes"] = resumes + ([dict(nimg=cur_nimg, kimg=cur_nimg / 1000)] if cur_nimg else [])
        self.magnitudes["rows"] = self._earlier_rows(MAGNITUDES_JSON, self.magnitudes, ("rows",), cur_nimg)["rows"]

    def _earlier_rows(self, name: str, mine: dict, keys: tuple[str, ...], cur_nimg: int) -> dict[str, list[dict]]:
        """For each of keys, the rows up to cur_nimg of an earlier invocation's record file (read once), if it
        recorded the same measurement (every entry of mine but ROW_KEYS equal); [] otherwise."""
        path = self.run_dir / PLOTS_DIR / name
        try:
            stored = load_records(path)
        except DashboardError as e:
            print(f"{e}; its records start afresh.", flush=True)
            stored = None
        same = stored and all(stored.get(k) == v for k, v in mine.items() if k not in ROW_KEYS)
        rows = {}
        for key in keys:
            found = stored.get(key) if same else None
            rows[key] = [row for row in found if isinstance(row, dict) and isinstance(row.get("nimg"), int)
                         and row["nimg"] <= cur_nimg] if isinstance(found, list) else []
        return rows

    def update(self, net: torch.nn.Module, nimg: int) -> None:
        """Measure the EMA network at nimg images, record the numbers, and redraw training.png."""
        y, sigma, noise, labels = self.batch
        errors, logvars = loss_per_sigma(net, y, noise, labels, self.training["sigma"], self.loss)
        activations = block_output_rms(net, y + sigma * noise, sigma, labels)
        levels = dict(weighted_error=errors, **({} if logvars is None else dict(u=logvars)))
        for key, records, row in (("noise_levels", self.training, levels),
                                  ("rows", self.magnitudes, dict(activations=activations, weights=weight_rms(net)))):
            records[key] = [r for r in records[key] if r["nimg"] < nimg] + [dict(nimg=nimg, kimg=nimg / 1000, **row)]
        save_json(self.run_dir / PLOTS_DIR / MAGNITUDES_JSON, self.magnitudes)
        write_dashboard(self.run_dir, self.training)
        if self.consistency:
            write_consistency(self.run_dir)
        if nimg >= self.duration:
            write_magnitudes(self.run_dir, self.magnitudes)

    def numbers(self) -> dict[str, float]:
        """The newest update's numbers for the trackers (snapshot_numbers)."""
        return snapshot_numbers(self.training["sigma"], self.training["noise_levels"][-1], self.magnitudes["rows"][-1])


def snapshot_numbers(sigma: list[float], levels: dict, magnitudes: dict) -> dict[str, float]:
    """A snapshot's numbers for the trackers from its records: the plain mean over the grid's noise levels of
    lambda(sigma) L(D; sigma) on the probe batch (LOSS_MEAN_TAG), that loss and u(sigma) at each level (no u for a
    run that did not learn it), and the magnitudes."""
    errors = [float(e) for e in levels["weighted_error"]]
    numbers = {LOSS_MEAN_TAG: sum(errors) / len(errors)}
    for s, error in zip(sigma, errors):
        numbers[f"noise_level/loss/sigma={s:.3g}"] = error
    for s, u in zip(sigma, levels.get("u", ())):
        numbers[f"noise_level/u/sigma={s:.3g}"] = float(u)
    for kind in ("activations", "weights"):
        numbers.update({f"magnitudes/{kind}/{name}": float(value) for name, value in magnitudes[kind].items()})
    return numbers
