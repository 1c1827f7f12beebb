"""Metrics while training (train_edm2.py --metrics): at every --metrics-every images, every rank loads the snapshot
just written (the first EMA track, as stored; or, with --metrics-ema, the post-hoc EMA of that length reconstructed
from the run's snapshots so far, Eq. 129), generates its share of --metrics-num images with the seeds
0..N-1 (the same at every evaluation), and the metrics of calculate_metrics.py come from one feature pass summed
over the ranks; 'loss' is the validation loss (Eq. 14) of N fixed samples of the training data, the run's own or,
with --validation-loss, a fixed one named in its metric ('loss_edm2_2k') and recorded in the row.

Each value is named with its sample count ('fid2k', 'loss2k', 'precision_dinov2_2k': metric_name), so a 2k FID never
passes for a 50k one. A row {kimg, nimg, ema_std, seconds, metrics: {name: value}}, and with the loss
validation_loss: {name, weighting, noise, P_mean, P_std} (edm2.eval.validation.loss_record), goes to stats.jsonl
(which a resume trims to its training state, so a resumed run neither repeats nor skips a row), to the trackers
under 'metrics/' and to the dashboard. A metric that fails prints one warning and training goes on.
"""

from __future__ import annotations

import time

import torch

from edm2.errors import one_line
from edm2.eval import scores
from edm2.eval.detectors import load_detector
from edm2.eval.metrics import calculate_stats
from edm2.eval.stats_files import load_stats
from edm2.eval.validation import OWN, ValidationSamples, validation_loss
from edm2.formats.snapshot import load_network
from edm2.procedures import posthoc
from edm2.procedures.generation import generate_images
from edm2.runtime import distributed
from training.options import TrainingOptions
from training.run.run_dir import SNAPSHOT_PREFIX, snapshot_path
from training.step import recipe_loss

BATCH = 32  # images per batch and rank


def metric_name(metric: str, num: int) -> str:
    """The metric with its sample count: fid2k (2,000), fid50k, fid1500; a '_' after a name that ends in a digit."""
    count = f"{num // 1000}k" if num % 1000 == 0 else str(num)
    return f"{metric}{'_' if metric[-1].isdigit() else ''}{count}"


def loss_metric(validation_loss: str) -> str:
    """The loss metric's name: 'loss' for the run's own, 'loss_edm2' for the fixed one named edm2 (another formula is
    another curve, so a resume that changes it never joins the two)."""
    return "loss" if validation_loss == OWN else f"loss_{validation_loss}"


class RunMetrics:
    """The metrics of one run's snapshots; every rank makes the same calls (they hold collectives)."""

    def __init__(self, opts: TrainingOptions, dataset, encoder, device: torch.device):
        self.opts, self.dataset, self.encoder, self.device = opts, dataset, encoder, device
        self.images = [metric for metric in opts.metrics if metric != "loss"]
        # Read at the start: a reference that cannot serve the metrics is bad input (train_edm2.py), not a warning.
        self.reference = load_stats(opts.metrics_ref) if self.images else {}
        self.detectors: dict | None = None  # loaded at the first evaluation
        self.keep = max([self.reference[scores.DETECTOR_OF[m]]["features"].shape[0]
                         for m in self.images if scores.needs_features(m)], default=0)

    def due(self, prev_nimg: int, cur_nimg: int, done: bool) -> bool:
        """Whether the snapshot written at cur_nimg is measured: at the end, and when an interval was crossed."""
        every = self.opts.metrics_every or self.opts.snapshot
        return done or (every > 0 and cur_nimg // every > prev_nimg // every)

    def measure(self, cur_nimg: int) -> dict | None:
        """The row of the snapshot at cur_nimg; None after a warning when a metric fails (training goes on)."""
        distributed.barrier()  # rank 0 has written the snapshot
        started = time.monotonic()
        try:
            values = self._values(cur_nimg)
        except Exception as e:  # a detector download, a decoder, a singular covariance: training must go on
            distributed.print0(f"Warning: the metrics at {cur_nimg} images failed ({type(e).__name__}: "
                               f"{one_line(e)}); training goes on.")
            return None
        return dict(kimg=cur_nimg / 1000, nimg=cur_nimg, ema_std=self.ema_std, seconds=time.monotonic() - started,
                    **values)

    @property
    def ema_std(self) -> float:
        """The sigma_rel measured: --metrics-ema's post-hoc length, else the first track's."""
        return self.opts.ema_stds[0] if self.opts.metrics_ema is None else self.opts.metrics_ema

    def network(self, cur_nimg: int) -> torch.nn.Module:
        """The network measured at cur_nimg: the first track's snapshot, or the post-hoc EMA reconstructed from this
        run's snapshots up to cur_nimg."""
        opts = self.opts
        if opts.metrics_ema is None:
            return load_network(snapshot_path(opts.run_dir, cur_nimg, opts.ema_stds[0]))[0]
        snapshots = posthoc.taken_up_to(posthoc.list_snapshots(opts.run_dir, SNAPSHOT_PREFIX), cur_nimg)
        _, net, _ = next(posthoc.combine([s.track() for s in snapshots], cur_nimg, [opts.metrics_ema]))
        return net

    def _values(self, cur_nimg: int) -> dict:
        """The row's metrics, {metric_name: value} of the measured network in --metrics' order, and with the loss
        the validation loss it measured (validation_loss)."""
        opts, num = self.opts, self.opts.metrics_num
        net = self.network(cur_nimg).to(self.device)
        values = {}
        if self.images:
            self.encoder.init(self.device)  # a latent network's images are decoded by its VAE
            if self.detectors is None:
                self.detectors = {d: distributed.main_rank_first(lambda d=d: load_detector(d, None, self.device))
                                  for d in scores.detectors_for(self.images)}
            batches = (images for _, images, _ in generate_images(net, self.encoder, range(num), batch_size=BATCH,
                                                                 device=self.device))
            stats, _ = calculate_stats(batches, self.detectors, self.device, progress=False, keep_features=self.keep)
            values.update(scores.metric_values(stats, self.reference, self.images, self.device))
        recorded = {}
        if "loss" in opts.metrics:
            samples = ValidationSamples(self.dataset, self.encoder, net, num, recipe_loss(opts, net.sigma_data),
                                        name=opts.validation_loss)
            values["loss"] = validation_loss(net, samples, BATCH, self.device)
            recorded = dict(validation_loss=samples.record())
        names = {metric: loss_metric(opts.validation_loss) if metric == "loss" else metric for metric in opts.metrics}
        return dict(metrics={metric_name(names[metric], num): values[metric] for metric in opts.metrics}, **recorded)
