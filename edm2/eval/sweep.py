"""The EMA-length sweep (paper Figure 5): metrics of post-hoc EMA reconstructions across sigma_rel, at one or
more training times, each network built in memory, measured, and let go.

edm2.posthoc.combine builds the networks `batch` at a time in one pass over the snapshots, so memory stays at
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

from edm2 import posthoc
from edm2.errors import EDM2Error
from edm2.eval.metrics import calculate_stats, frechet_distance
from edm2.eval.validation import ValidationSamples, validation_loss
from edm2.generation import generate_images
from edm2.runtime import bounded_json, distributed, files

SWEEP_JSON, SWEEP_PNG = "ema-sweep.json", "ema-sweep.png"


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

    def has(self, nimg: int, std: float) -> bool:
        """True when the row of this training time and sigma_rel is measured."""
        return any(r["nimg"] == nimg and abs(r["std"] - std) < posthoc.STD_TOLERANCE for r in self.rows)

    def add(self, row: dict) -> None:
        """Keep one more row and rewrite the file atomically (rank 0)."""
        self.rows.append(row)
        with files.atomic_path(self.path) as tmp:
            tmp.write_text(json.dumps({"settings": self.settings, "rows": self.rows}, indent=1))


class Measure:
    """The metrics of one network: Frechet distances of generated images to reference statistics, and the
    validation loss (edm2.eval.validation) on fixed samples; each row's numbers for every rank."""

    def __init__(self, metrics: Sequence[str], encoder, seeds: Sequence[int], batch_size: int,
                 device: torch.device, detectors: dict | None = None, reference: dict | None = None,
                 samples: ValidationSamples | None = None, gnet: torch.nn.Module | str | None = None,
                 guidance: dict | None = None):
        self.metrics, self.encoder, self.seeds, self.batch_size, self.device = metrics, encoder, seeds, batch_size, device
        self.detectors, self.reference, self.samples = detectors or {}, reference or {}, samples
        self.gnet, self.guidance = gnet, guidance or {}  # generate_images' guidance, guidance_interval, solver

    def __call__(self, net: torch.nn.Module) -> dict[str, float]:
        """{metric: value} of net, in the order of self.metrics."""
        results = {}
        if self.detectors:
            images = (batch for _, batch, _ in generate_images(net, self.encoder, self.seeds, gnet=self.gnet,
                                                            batch_size=self.batch_size, device=self.device,
                                                            **self.guidance))
            stats, _ = calculate_stats(images, self.detectors, self.device, progress=False)
            for metric, detector_stats in stats.items():
                ref = self.reference[metric]
                results[metric] = frechet_distance(detector_stats["mu"], detector_stats["sigma"], ref["mu"], ref["sigma"])
        if "loss" in self.metrics:
            results["loss"] = validation_loss(net, self.samples, self.batch_size, self.device)
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
              report: Callable[[str], None] = print) -> None:
    """Measure every (training time, sigma_rel) that results lacks; times are posthoc.select_inputs' answers.

    Every rank calls this with the same arguments; rank 0 passes the results file and save, the others None.
    """
    done = distributed.broadcast_object([[results.has(nimg, s) for s in stds] for _, nimg in times] if results else None)
    for (inputs, out_nimg), skip in zip(times, done):
        todo = [s for s, measured in zip(stds, skip) if not measured]
        if not todo:
            continue
        outputs = posthoc.combine([s.track() for s in inputs], out_nimg, todo, batch)
        with contextlib.closing(outputs):
            for std, net, metadata in outputs:
                round_to_stored(net)
                if save is not None:
                    save(std, net, metadata)
                started = time.monotonic()
                values = measure(net)
                row = dict(kimg=out_nimg // 1000, nimg=out_nimg, std=std, **values,
                           profile_error=metadata["phema"]["profile_error"], seconds=time.monotonic() - started)
                if results is not None:
                    results.add(row)
                    report(row_text(row, list(values)))
                del net, metadata  # the pass's network must not outlive it (memory: one input plus `batch`)


def best_rows(rows: Sequence[dict], metric: str) -> dict[int, dict]:
    """Per training time (nimg), the row with the lowest value of metric (NaN never wins)."""
    best: dict[int, dict] = {}
    for row in rows:
        value = row.get(metric, math.nan)
        if np.isfinite(value) and (row["nimg"] not in best or value < best[row["nimg"]][metric]):
            best[row["nimg"]] = row
    return best


def row_text(row: dict, metrics: Sequence[str]) -> str:
    """One sweep row as a table line: training time, sigma_rel, the metrics, and the reconstruction's profile error
    (Eq. 134) with its verdict (edm2.posthoc.profile_quality)."""
    error = max(row["profile_error"], 0.0)  # rounding leaves -1e-17 where the length is a tracked one
    return (f"kimg {row['kimg']} sigma_rel {row['std']:.3f}: " + "  ".join(f"{m} {row[m]:.4f}" for m in metrics)
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
