"""What calculate_metrics.py's commands share beyond the Frechet distances: the reference features the feature
metrics need, guidance lists, the reporting protocol over disjoint seed sets (each value, mean +- std, minimum),
and the results file that records every input of a number with its SHA-256."""

from __future__ import annotations

import inspect
import json
import re
import statistics
from pathlib import Path
from typing import Callable, Sequence

import click
import numpy as np

from cli.types import MAX_SEED_OPTION, Guidance, Integer, shown
from edm2.data.dataset import DatasetError, ImageData
from edm2.data.sources import open_data
from edm2.eval import prdc, scores
from edm2.eval.detectors import PUBLISHED
from edm2.eval.stats_files import MAX_KEPT_FEATURES
from edm2.procedures.generation import MAX_SEED
from edm2.runtime import distributed, files
from edm2.runtime.pinned_files import stream_sha256
from edm2.sampler import SELF, edm_sampler

MAX_SEED_SETS = 1000  # disjoint seed sets of one report: papers use 3
DEFAULT_REF_FEATURES = 10000  # features `ref` keeps per detector (prdc's and torchmetrics' customary 10k)


def _feature_count(ctx: click.Context, param: click.Parameter, value: int) -> int:
    """--features: 0, or more than the k of the k-NN balls (edm2.eval.prdc.DEFAULT_K)."""
    if 0 < value <= prdc.DEFAULT_K:
        raise click.BadParameter(f"{value} features make no k-NN balls of k = {prdc.DEFAULT_K}; keep 0 or more than "
                                 f"{prdc.DEFAULT_K}")
    return value


features_option = click.option(
    "--features", callback=_feature_count, help="Features kept per detector, of a random subset of the images (seeded: the same every time), "
    "for kid, precision, recall, density and coverage; 0 = none", metavar="INT",
    type=Integer(0, MAX_KEPT_FEATURES), default=DEFAULT_REF_FEATURES, show_default=True)


def reference_order(num_images: int, keep: int) -> np.ndarray:
    """Dataset indices in the order `ref` reads them: first a seeded random subset of keep images in file order
    (whose features the statistics keep: a class-sorted dataset gives every class), then the others; the
    statistics do not depend on the order."""
    if keep >= num_images:
        return np.arange(num_images)
    subset = np.sort(np.random.RandomState(0).permutation(num_images)[:keep])
    return np.concatenate([subset, np.setdiff1d(np.arange(num_images), subset)])


def open_images(path: str, option: str) -> ImageData:
    """The images at path, in any format PIL reads, checked to be uint8 RGB or grayscale."""
    try:
        dataset = open_data(path, use_labels=False, blends=False, any_format=True)
        image, _ = dataset[0]
    except DatasetError as e:
        raise click.BadParameter(str(e), param_hint=option) from None
    if image.dtype != np.uint8 or image.shape[0] not in (1, 3):
        raise click.BadParameter(f"{path} holds {image.dtype} images with {image.shape[0]} channels; metrics need "
                                 "uint8 RGB or grayscale images (decode latent datasets first)", param_hint=option)
    return dataset


def check_dest(dest_path: str) -> Path:
    """The statistics file to write: a .npz or .pkl name in a folder we can write; checked before any work."""
    dest = Path(dest_path)
    if dest.suffix not in (".npz", ".pkl"):
        raise click.BadParameter(f"{dest_path}: use a .npz (ours) or .pkl (release format) name", param_hint="--dest")
    check_output_file(dest, "--dest", "the statistics file")
    return dest


def check_output_file(path: Path, option: str, what: str) -> None:
    """Refuse, naming the option, a folder or an unwritable place for a file to write (before any work)."""
    if path.is_dir():
        raise click.BadParameter(f"{path} is a folder; name {what} to write", param_hint=option)
    try:
        files.check_writable_dir(path.parent)
    except files.OutputError as e:
        raise click.BadParameter(str(e), param_hint=option) from None


def check_features(reference: dict, ref_path: str, metrics: Sequence[str]) -> None:
    """Refuse, naming --ref, reference statistics without the kept features a metric needs (or too few for its
    k-NN balls)."""
    for metric in metrics:
        if not scores.needs_features(metric):
            continue
        detector = scores.DETECTOR_OF[metric]
        kept = reference.get(detector, {}).get("features")
        if kept is None or kept.shape[0] <= prdc.DEFAULT_K:
            held = "none" if kept is None else f"only {kept.shape[0]}"
            raise click.BadParameter(
                f"{ref_path} keeps {held} {detector} features, which --metrics={metric} compares with; compute its "
                f"statistics with them: python calculate_metrics.py ref --data=DATASET --dest=REF.npz "
                f"--features={DEFAULT_REF_FEATURES}", param_hint="--ref")


def features_to_keep(reference: dict, metrics: Sequence[str]) -> int:
    """How many generated features the feature metrics compare: as many as the reference keeps (0 if none of
    the metrics needs features)."""
    counts = [reference[scores.DETECTOR_OF[m]]["features"].shape[0] for m in metrics if scores.needs_features(m)]
    return max(counts, default=0)


class GuidanceList(click.ParamType):
    """Guidance strengths '1,1.5,2' (or one): distinct, in increasing order, each at least 1 (below 1 the sampler
    moves away from what the guiding network improves on, toward it)."""

    name = "LIST"

    def convert(self, value, param, ctx) -> list[float]:
        """Parse value into sorted, distinct strengths >= 1."""
        if isinstance(value, list):
            return value
        strengths = [Guidance().convert(part.strip(), param, ctx) for part in str(value).split(",")]
        low = [w for w in strengths if w < 1]
        if low:
            self.fail(f"{low[0]:g} is below 1: guidance extrapolates from the guiding network's prediction toward "
                      "the network's (Eq. 1 of autoguidance), so strengths are >= 1 (1 = no guidance)", param, ctx)
        return sorted(set(strengths))


class SeedSets(click.ParamType):
    """A count of disjoint seed sets ('3': --num seeds each, one after another from --seed) or the sets
    themselves ('0-49999,50000-99999,100000-149999')."""

    name = "N|RANGES"
    _RANGE = re.compile(r"\s*([0-9]{1,10})\s*-\s*([0-9]{1,10})\s*")

    def convert(self, value, param, ctx) -> int | list[range]:
        """An int in [1, MAX_SEED_SETS] or disjoint ranges of at least 2 seeds below 2**32."""
        if isinstance(value, (int, list)):
            return value
        text = str(value).strip()
        if text.isdigit() and len(text) <= 10:
            if not 1 <= int(text) <= MAX_SEED_SETS:
                self.fail(f"{shown(text)}: expected a count of seed sets in [1, {MAX_SEED_SETS}]", param, ctx)
            return int(text)
        sets = []
        for part in text.split(","):
            match = self._RANGE.fullmatch(part)
            if not match:
                self.fail(f"{shown(text)}: expected a count (3) or ranges like 0-49999,50000-99999", param, ctx)
            first, last = int(match[1]), int(match[2])
            if not first < last < MAX_SEED:
                self.fail(f"{part.strip()!r}: a seed set is at least 2 seeds, all below 2**32", param, ctx)
            sets.append(range(first, last + 1))
        ordered = sorted(sets, key=lambda r: r.start)
        for a, b in zip(ordered, ordered[1:]):
            if b.start < a.stop:
                self.fail(f"seed sets {a.start}-{a.stop - 1} and {b.start}-{b.stop - 1} overlap; the sets must be "
                          "disjoint", param, ctx)
        return sets


def seed_set_options(fn: Callable) -> Callable:
    """gen's options of the reporting protocol: --seed-sets and --results."""
    for option in reversed(_SEED_SET_OPTIONS):
        fn = option(fn)
    return fn


_SEED_SET_OPTIONS = [
    click.option("--seed-sets", help="Compute each metric over this many disjoint sets of --num seeds, one after "
                 "another from --seed (papers: 3), or over the sets given, e.g. 0-49999,50000-99999,100000-149999; "
                 "reports each value, their mean +- std and the minimum", type=SeedSets(), default="1",
                 show_default=True),
    click.option("--results", "results_path", help="Also write the values with every input's SHA-256 (reference, "
                 "networks, detectors), the EMA length, the sampler and the seeds to this JSON file", metavar="JSON",
                 type=click.Path(path_type=Path)),
]


def check_results_path(path: Path | None) -> None:
    """Refuse, naming --results, a folder or an unwritable place for the results file (before any work)."""
    if path is not None:
        check_output_file(path, "--results", "the results file")


def seed_sets(sets: int | list[range], seed: int, num: int) -> list[range]:
    """The seed sets: `sets` as given, or that many consecutive sets of num seeds from seed; refused, naming
    --seed-sets, when they go past the last seed."""
    if isinstance(sets, list):
        return sets
    if seed + sets * num > MAX_SEED:
        raise click.BadParameter(f"{sets} sets of --num={num} seeds from --seed={seed} need seeds up to "
                                 f"{seed + sets * num - 1}, past {MAX_SEED_OPTION}; give fewer sets or a smaller "
                                 "--num", param_hint="--seed-sets")
    return [range(seed + k * num, seed + (k + 1) * num) for k in range(sets)]


def summary(values: Sequence[float]) -> dict[str, float]:
    """Each value's mean, sample standard deviation (n - 1; 0 for one value) and minimum, as papers report them."""
    return dict(mean=statistics.fmean(values), std=statistics.stdev(values) if len(values) > 1 else 0.0,
                min=min(values))


def report_line(values: dict[str, float]) -> str:
    """'fid 2.3400  kid 0.0012' with as many digits as KID's small values need."""
    return "  ".join(f"{metric} {value:.6g}" if abs(value) < 0.01 else f"{metric} {value:.4f}"
                     for metric, value in values.items())


def report(values: dict[str, float], num_images: int, source: str, ref_path: str) -> None:
    """Print one human line and one JSON line with each metric's value (rank 0)."""
    if distributed.is_main():
        click.echo(f"{report_line(values)}  ({num_images} images from {source}, reference {ref_path})")
        click.echo(json.dumps({"results": values, "num_images": num_images, "images": source, "ref": ref_path}))


def file_digest(path_or_url: str | None) -> str | None:
    """SHA-256 of a local file or of a URL's cached download; None for no file or 'self'."""
    if path_or_url in (None, SELF):
        return None
    with open(files.cached_path(path_or_url), "rb") as file:
        return stream_sha256(file)[0]


def inputs_record(ref_path: str, net_path: str, gnet_path: str | None, metadata: dict, metrics: Sequence[str],
                  sampler: dict) -> dict:
    """Everything a reported number depends on: each file with its SHA-256, the EMA length, the sampler and its
    settings, and the digests of the detectors the metrics used."""
    phema = metadata.get("phema") or {}
    return dict(
        ref=dict(path=ref_path, sha256=file_digest(ref_path)),
        net=dict(path=net_path, sha256=file_digest(net_path), nimg=metadata.get("nimg"),
                 ema_std=metadata.get("ema_std", phema.get("std"))),
        gnet=None if gnet_path is None else dict(path=gnet_path, sha256=file_digest(gnet_path)),
        sampler=dict(sampler, num_steps=inspect.signature(edm_sampler).parameters["num_steps"].default),
        metrics=list(metrics),
        detectors={detector: dict(url=PUBLISHED[detector].url, sha256=PUBLISHED[detector].sha256)
                   for detector in scores.detectors_for(metrics)},
    )


def write_results(path: Path, record: dict) -> None:
    """The results file, atomically, as JSON (rank 0); values that are not finite are written as null."""
    clean = json.loads(json.dumps(record), parse_constant=lambda _: None)
    with files.atomic_path(path) as tmp:
        tmp.write_text(json.dumps(clean, indent=1, default=str) + "\n")


def finish_sets(inputs: dict, sets: list[range], per_set: list[dict[str, float]], source: str,
                results_path: Path | None) -> None:
    """Rank 0: a line per seed set and, for several, each metric's mean +- std and minimum; the record (inputs,
    sets, values, summary) as the last line of JSON and, with results_path, as the results file."""
    record = dict(inputs, seed_sets=[f"{r.start}-{r.stop - 1}" for r in sets], values=per_set)
    if len(sets) > 1:
        record["summary"] = {metric: summary([values[metric] for values in per_set]) for metric in per_set[0]}
    for r, values in zip(sets, per_set):
        click.echo(f"seeds {r.start}-{r.stop - 1}: {report_line(values)}  ({len(r)} images from {source})")
    for metric, s in record.get("summary", {}).items():
        click.echo(f"{metric}: mean {s['mean']:.6g} +- {s['std']:.3g} (std over {len(sets)} seed sets), "
                   f"min {s['min']:.6g}")
    if results_path is not None:
        write_results(results_path, record)
        click.echo(f"Saved {results_path}")
    click.echo(json.dumps(record, default=str))
