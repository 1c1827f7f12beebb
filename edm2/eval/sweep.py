"""The EMA-length sweep (paper Figure 5): metrics of post-hoc EMA reconstructions across sigma_rel, at one or
more training times, each network built in memory, measured, and let go.

edm2.procedures.posthoc.combine builds the networks `batch` at a time in one pass over the snapshots, so memory stays at
one input network plus `batch` outputs however many lengths are swept. Each network is rounded to float16 as
a reconstruction file stores it, so a row measures exactly what reconstruct_phema.py would write for that
length. The results file keeps the sweep's settings and one row per (training time, sigma_rel); it is rewritten
atomically after every row, and a rerun measures only the rows it lacks.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from edm2.errors import EDM2Error
from edm2.eval import scores
from edm2.eval.metrics import calculate_stats
from edm2.eval.validation import ValidationSamples, validation_loss
from edm2.procedures import posthoc
from edm2.procedures.generation import generate_images
from edm2.runtime import bounded_json, distributed, files

SWEEP_JSON, SWEEP_PNG = "ema-sweep.json", "ema-sweep.png"
# With several guidance strengths: the table of every row, each metric against EMA length one line per guidance
# strength (paper Figure 14), and against guidance one line per EMA length.
SWEEP_CSV, EMA_GUIDANCE_PNG, GUIDANCE_PNG = "ema-sweep.csv", "ema-guidance.png", "guidance-curves.png"


class SweepError(EDM2Error):
    """A results file that is not a sweep's, or one measured with other settings."""


class SweepResults:
    """A sweep's results file: its settings and rows; a row is added, and the file rewritten, at a time."""

    def __init__(self, path: str | os.PathLike, settings: dict):
        self.path, self.settings = Path(path), json.loads(json.dumps(settings))
        self.rows: list[dict] = []
        if not self.path.exists():
            return
        try:
            stored = bounded_json.read(self.path)
            rows = stored["rows"]
            if not isinstance(rows, list) or not all(isinstance(r, dict) and {"nimg", "std"} <= set(r) for r in rows):
                raise TypeError("rows")
        except bounded_json.JSONFileError as e:
            raise SweepError(f"{self.path} exists and is not a sweep's results file ({e})") from None
        except (OSError, TypeError, KeyError) as e:
            raise SweepError(f"{self.path} exists and is not a sweep's results file ({type(e).__name__}: {e})") from None
        if stored.get("settings") != self.settings:
            differ = sorted(k for k in {*self.settings, *(stored.get("settings") or {})}
                            if (stored.get("settings") or {}).get(k) != self.settings.get(k))
            raise SweepError(f"{self.path} holds a sweep with other settings ({', '.join(differ)}); choose another "
                             "folder or remove it")
        self.rows = rows

    def has(self, nimg: int, std: float, guidance: float | None = None) -> bool:
        """True when the row of this training time and sigma_rel (and guidance strength, if given) is measured; a
        row without one has the settings' (results files of one strength predate the key)."""
        return any(r["nimg"] == nimg and abs(r["std"] - std) < posthoc.STD_TOLERANCE
                   and (guidance is None or r.get("guidance", self.settings.get("guidance")) == guidance)
                   for r in self.rows)

    def add(self, row: dict) -> None:
        """Keep one more row and rewrite the file atomically (rank 0)."""
        self.rows.append(row)
        with files.atomic_path(self.path) as tmp:
            tmp.write_text(json.dumps({"settings": self.settings, "rows": self.rows}, indent=1))


class Measure:
    """The metrics of one network: metrics of generated images against reference statistics (edm2.eval.scores),
    and the validation loss (edm2.eval.validation) on fixed samples; each row's numbers for every rank, and what
    every row records beside them (recorded: the validation loss measured, by name and formula)."""

    def __init__(self, metrics: Sequence[str], encoder, seeds: Sequence[int], batch_size: int,
                 device: torch.device, detectors: dict | None = None, reference: dict | None = None,
                 samples: ValidationSamples | None = None, gnet: torch.nn.Module | str | None = None,
                 guidance: dict | None = None):
        self.metrics, self.encoder, self.seeds, self.batch_size, self.device = metrics, encoder, seeds, batch_size, device
        self.detectors, self.reference, self.samples = detectors or {}, reference or {}, samples
        self.gnet, self.guidance = gnet, guidance or {}  # generate_images' guidance, guidance_interval, solver
        self.keep = max([reference[d]["features"].shape[0] for d in self.reference if "features" in reference[d]]
                        + [0]) if any(scores.needs_features(m) for m in metrics) else 0
        self._loss = math.nan  # the last network's validation loss, which no guidance strength changes
        self.recorded = dict(validation_loss=samples.record()) if "loss" in metrics and samples is not None else {}

    def __call__(self, net: torch.nn.Module, guidance: float | None = None,
                 same_network: bool = False) -> dict[str, float]:
        """{metric: value} of net, in the order of self.metrics, at this guidance strength (default: the one
        given when made); one feature pass of generated images for all the metrics of images. same_network: net
        is the previous call's network with the same weights, whose loss is reused."""
        results = {}
        if self.detectors:
            sampler = dict(self.guidance, **({} if guidance is None else {"guidance": guidance}))
            images = (batch for _, batch, _ in generate_images(net, self.encoder, self.seeds, gnet=self.gnet,
                                                            batch_size=self.batch_size, device=self.device,
                                                            **sampler))
            stats, _ = calculate_stats(images, self.detectors, self.device, progress=False, keep_features=self.keep)
            images_metrics = [metric for metric in self.metrics if metric != "loss"]
            results.update(scores.metric_values(stats, self.reference, images_metrics, self.device))
        if "loss" in self.metrics:
            if not same_network:
                self._loss = validation_loss(net, self.samples, self.batch_size, self.device)
            results["loss"] = self._loss
        return {metric: results[metric] for metric in self.metrics}


def round_to_stored(net: torch.nn.Module) -> torch.nn.Module:
    """Round the parameters to float16 and back, as edm2.formats.snapshot.save_network stores them; returns net."""
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(p.to(torch.float16).to(p.dtype))
    return net


def run_sweep(times: Sequence[tuple[list[posthoc.Snapshot], int]], stds: Sequence[float], measure: Callable,
              results: SweepResults | None, batch: int = 8,
              save: Callable[[float, torch.nn.Module, dict], None] | None = None,
              report: Callable[[str], None] = print, guidances: Sequence[float | None] = (None,),
              recorded: dict | None = None) -> None:
    """Measure every (training time, sigma_rel, guidance strength) that results lacks; times are
    posthoc.select_inputs' answers. Each network is built once and measured at every strength it lacks:
    measure(net, guidance), or measure(net) at the one strength None stands for (the measure's own; rows say none).
    Every row also holds recorded's entries (Measure.recorded: the validation loss it measured).

    Every rank calls this with the same arguments; rank 0 passes the results file and save, the others None.
    """
    missing = distributed.broadcast_object(
        [[[g for g in guidances if not results.has(nimg, s, g)] for s in stds] for _, nimg in times]
        if results else None)
    for (inputs, out_nimg), lacking in zip(times, missing):
        todo = {s: strengths for s, strengths in zip(stds, lacking) if strengths}
        if not todo:
            continue
        outputs = posthoc.combine([s.track() for s in inputs], out_nimg, list(todo), batch)
        with contextlib.closing(outputs):
            for std, net, metadata in outputs:
                round_to_stored(net)
                if save is not None:
                    save(std, net, metadata)
                for index, guidance in enumerate(todo[std]):
                    started = time.monotonic()
                    values = measure(net) if guidance is None else measure(net, guidance, same_network=index > 0)
                    check_finite_values(values, inputs, std, out_nimg)
                    row = dict(kimg=out_nimg // 1000, nimg=out_nimg, std=std,
                               **({} if guidance is None else {"guidance": guidance}), **values,
                               profile_error=metadata["phema"]["profile_error"], seconds=time.monotonic() - started,
                               **(recorded or {}))
                    if results is not None:
                        results.add(row)
                        report(row_text(row, list(values), show_guidance=len(guidances) > 1))
                del net, metadata  # the pass's network must not outlive it (memory: one input plus `batch`)


def check_finite_values(values: dict[str, float], inputs: Sequence[posthoc.Snapshot], std: float, nimg: int) -> None:
    """Raise SweepError naming the snapshots a reconstruction came from when one of its metrics is NaN or infinite
    (weights or data that overflow): such a row would be left out of the ranking silently, so no best is given."""
    bad = next((metric for metric, value in values.items() if not math.isfinite(value)), None)
    if bad is not None:
        files = (", ".join(str(snapshot.path) for snapshot in inputs) if len(inputs) <= 3 else
                 f"{inputs[0].path.parent} ({len(inputs)} snapshots)")
        raise SweepError(f"{files}: the reconstruction of sigma_rel {std:.3f} at {nimg} images has {bad} "
                         f"{values[bad]}, not a finite number; the sweep stops without a best length")


def best_rows(rows: Sequence[dict], metric: str) -> dict[int, dict]:
    """Per training time (nimg), the row with the best value of metric, the lowest or, for precision and the like,
    the highest (NaN never wins)."""
    best: dict[int, dict] = {}
    sign = -1 if scores.higher_is_better(metric) else 1
    for row in rows:
        value = row.get(metric, math.nan)
        if np.isfinite(value) and (row["nimg"] not in best or sign * value < sign * best[row["nimg"]][metric]):
            best[row["nimg"]] = row
    return best


def write_table(path: Path, rows: Sequence[dict], metrics: Sequence[str]) -> None:
    """Every row as CSV (kimg, sigma_rel, guidance, the metrics, the profile error), atomically."""
    columns = ["kimg", "std", "guidance", *metrics, "profile_error"]
    lines = [",".join(columns)] + [",".join("" if row.get(c) is None else repr(row[c]) for c in columns)
                                   for row in sorted(rows, key=lambda r: (r["nimg"], r["std"], r.get("guidance", 0)))]
    with files.atomic_path(path) as tmp:
        tmp.write_text("\n".join(lines) + "\n")


def table_text(rows: Sequence[dict], metric: str, guidances: Sequence[float]) -> str:
    """One metric as a text table: a line per sigma_rel, a column per guidance strength, each column's best value
    (best_rows' rule) starred."""
    stds = sorted({row["std"] for row in rows})
    value = {(row["std"], row["guidance"]): row.get(metric, math.nan) for row in rows}
    best = {g: best_rows([r for r in rows if r["guidance"] == g], metric) for g in guidances}
    best = {g: next(iter(found.values()))["std"] if found else None for g, found in best.items()}
    lines = [f"{metric:>10} " + "".join(f"{'w=' + format(g, 'g'):>12}" for g in guidances)]
    for s in stds:
        cells = (f"{value.get((s, g), math.nan):.4f}{'*' if best[g] == s else ' '}" for g in guidances)
        lines.append(f"{s:>10.3f} " + "".join(f"{cell:>12}" for cell in cells))
    return "\n".join(lines)


def row_text(row: dict, metrics: Sequence[str], show_guidance: bool = False) -> str:
    """One sweep row as a table line: training time, sigma_rel (and guidance), the metrics, and the reconstruction's
    profile error (Eq. 134) with its verdict (edm2.procedures.posthoc.profile_quality)."""
    error = max(row["profile_error"], 0.0)  # rounding leaves -1e-17 where the length is a tracked one
    guidance = f" guidance {row['guidance']:g}" if show_guidance else ""
    return (f"kimg {row['kimg']} sigma_rel {row['std']:.3f}{guidance}: "
            + "  ".join(f"{m} {row[m]:.4f}" for m in metrics)
            + f"  profile error {error:.1e} ({posthoc.profile_quality(error)})")


def summary_table(rows: Sequence[dict], metrics: Sequence[str]) -> list[str]:
    """The rows as a table, by training time and sigma_rel: the metrics and each reconstruction's profile error
    (Eq. 134) with its verdict; a header line first."""
    lines = ["  kimg  sigma_rel  " + "  ".join(f"{m:>10}" for m in metrics) + "  profile error"]
    for row in sorted(rows, key=lambda row: (row["nimg"], row["std"])):
        error = max(row["profile_error"], 0.0)
        lines.append(f"{row['kimg']:>6}  {row['std']:>9.3f}  " + "  ".join(f"{row[m]:>10.4f}" for m in metrics)
                     + f"  {error:.1e} {posthoc.profile_quality(error)}")
    return lines


def best_warnings(rows: Sequence[dict], best: dict) -> list[str]:
    """Why a best row (best_rows') may not be the best length: it lies at an edge of the lengths swept at its
    training time (the minimum may lie beyond), or its reconstruction is poor (its metric measures a profile far
    from the target's, Eq. 134)."""
    stds = [row["std"] for row in rows if row["nimg"] == best["nimg"]]
    warnings = []
    if len(stds) > 1 and best["std"] in (min(stds), max(stds)):
        side, beyond = ("shortest", "shorter") if best["std"] == min(stds) else ("longest", "longer")
        warnings.append(f"the {side} length swept: the minimum may lie beyond it; sweep {beyond} lengths too")
    if posthoc.profile_quality(best["profile_error"]) == "poor":
        warnings.append(f"poorly reconstructed (profile error {best['profile_error']:.1e}, above "
                        f"{posthoc.FAIR_PROFILE_ERROR:.0e}): take more snapshots or track a length nearer it")
    return warnings
