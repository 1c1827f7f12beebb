"""Post-hoc EMA reconstruction (paper Section 3.2, Appendix C.5): EMA profiles of any length after training.

Finds the EMA snapshot files of a run (ours and the release's raw .pkl snapshots), checks that they can
be combined, and streams over them to synthesize each requested profile as the weighted sum of stored
tracks of Eq. 129, with the least-squares weights of edm2.phema (Algorithm 3):

    for std, net, metadata in posthoc.reconstruct("training-runs/run", stds=[0.05, 0.10]):
        save_network(f"ema-{std_tag(std)}.safetensors", net, metadata)
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
import safetensors
import torch
import tqdm

from edm2 import phema
from edm2.errors import EDM2Error, SnapshotError
from edm2.formats.snapshot import (MAX_NIMG, SNAPSHOT_NAME, architecture, architecture_difference, check_readable,
                                   kimg_to_nimg, load_network, read_metadata)

# A requested input sigma_rel selects the tracks within half a unit of the file names' third decimal.
STD_TOLERANCE = 5e-4
# What tells snapshots written before run ids apart: the settings every snapshot of one training shares.
RUN_SETTINGS = ("preset", "dataset", "encoder", "loss")


class PosthocError(EDM2Error):
    """Snapshots that cannot be combined: not EMA tracks, the same track twice, or different networks."""


class NoSnapshotsError(PosthocError):
    """The folder to search is none, or no snapshot file in it matches."""


class NoSuchTimeError(PosthocError):
    """No snapshot was taken at the requested training time."""


@dataclass(frozen=True)
class Track:
    """An EMA track to combine: its name in the outputs' records, when it was taken (images), its sigma_rel,
    and a function that returns it as (net, metadata), a net the reconstruction may overwrite."""

    name: str
    nimg: int
    std: float
    load: Callable[[], tuple[torch.nn.Module, dict]]


@dataclass(frozen=True)
class RunOf:
    """Which training wrote one of our snapshots: its run id, or None for one written before run ids; and the
    settings (RUN_SETTINGS and the training seed, as JSON) that tell such older snapshots apart."""

    run_id: str | None
    settings: str


@dataclass(frozen=True)
class Snapshot:
    """One stored EMA track: where it is, its file name prefix, when it was taken (images), its sigma_rel, and
    for ours the training that wrote it (the release's pickles say nothing of it)."""

    path: Path
    prefix: str
    nimg: int
    std: float
    run: RunOf | None = None

    def track(self) -> Track:
        """This file as a Track named by its file name, loaded by edm2.formats.snapshot.load_network."""
        return Track(self.path.name, self.nimg, self.std, functools.partial(load_network, self.path))


def describe_snapshot(path: Path) -> Snapshot | None:
    """The Snapshot a PREFIX-KIMG-STD file holds; None for our post-hoc reconstructions, which are not tracks.

    Ours carry images and sigma_rel in their metadata; the release's .pkl names give kimg of 1024-image
    batches and sigma_rel.
    """
    match = SNAPSHOT_NAME.fullmatch(path.name)
    if match is None:
        raise PosthocError(f"{path}: not named PREFIX-KIMG-STD.safetensors or .pkl")
    if match["ext"] == "pkl":
        check_readable(path)
        kimg, std = match["kimg"], float(match["std"])
        # A name may hold any number of digits: its length is compared before converting it.
        nimg = kimg_to_nimg(int(kimg)) if len(kimg) <= len(str(MAX_NIMG)) else MAX_NIMG
        if nimg is None:
            raise PosthocError(f"{path}: kimg {int(kimg)} is not a whole number of 1024-image batches")
        if nimg >= MAX_NIMG:
            raise PosthocError(f"{path}: kimg {kimg[:30]} means 2**53 images or more")
    else:
        meta = read_metadata(path)
        if "phema" in meta:
            return None
        nimg, std = meta.get("nimg"), meta.get("ema_std")
        if not all(isinstance(v, t) and not isinstance(v, bool) for v, t in ((nimg, int), (std, (int, float)))):
            raise PosthocError(f"{path}: metadata lacks 'nimg' and 'ema_std'; not a training snapshot")
    if not 0 < std < phema.MAX_STD:
        raise PosthocError(f"{path}: sigma_rel {std} is outside (0, {phema.MAX_STD:.4f})")
    return Snapshot(path, match["prefix"], nimg, float(std), None if match["ext"] == "pkl" else run_of(path, meta))


def run_of(path: Path, meta: dict) -> RunOf:
    """The training that wrote one of our snapshots, from its metadata."""
    run_id = meta.get("run_id")
    if run_id is not None and not isinstance(run_id, str):
        raise PosthocError(f"{path}: its run_id {json.dumps(run_id)[:40]} is not a run id")
    options = meta.get("training_options")
    seed = options.get("seed") if isinstance(options, dict) else None
    return RunOf(run_id, json.dumps([meta.get(key) for key in RUN_SETTINGS] + [seed], sort_keys=True))


def check_one_run(snapshots: Sequence[Snapshot]) -> None:
    """Refuse our snapshots of different trainings, naming one file of each: two run ids, or, where a snapshot was
    written before run ids, settings that differ (such snapshots are taken as one run when nothing tells them
    apart). The release's pickles carry no identity and are not compared."""
    ours = [s for s in snapshots if s.run is not None]
    by_id = {s.run.run_id: s.path for s in ours if s.run.run_id is not None}
    if len(by_id) > 1:
        (a, first), (b, second) = list(by_id.items())[:2]
        raise PosthocError(f"{first} and {second} come from different training runs (run ids {a} and {b}); "
                           "reconstruct each run from its own snapshots")
    if any(s.run.run_id is None for s in ours):
        by_settings = {s.run.settings: s.path for s in ours}
        if len(by_settings) > 1:
            first, second = list(by_settings.values())[:2]
            raise PosthocError(f"{first} and {second} come from different training runs (their settings differ, and "
                               "snapshots written before run ids tell no more); reconstruct each run from its own "
                               "snapshots")


def is_reconstruction(path: str | os.PathLike) -> bool:
    """True for one of our post-hoc outputs (which a rerun may replace); False for anything else."""
    try:
        return "phema" in read_metadata(path)
    except SnapshotError:
        return False


def _candidate_files(source: str | os.PathLike | Iterable[str | os.PathLike]) -> list[Path]:
    """The files of a folder named like snapshots, or the given files."""
    if not isinstance(source, (str, os.PathLike)):
        return [Path(p) for p in source]
    folder = Path(source)
    if not folder.is_dir():
        raise NoSnapshotsError(f"{folder} is not a directory")
    return [p for p in sorted(folder.iterdir()) if SNAPSHOT_NAME.fullmatch(p.name) and p.is_file()]


def list_snapshots(source: str | os.PathLike | Iterable[str | os.PathLike], inprefix: str | None = None,
                   instds: Sequence[float] | None = None) -> list[Snapshot]:
    """The EMA snapshots in a folder (or among the given files), sorted by time, then sigma_rel.

    Only files with name prefix `inprefix` and sigma_rel in `instds` when given; post-hoc outputs are skipped.
    Refuses two files holding the same track, our snapshots of different trainings (check_one_run) and of different
    networks (read from headers).
    """
    snapshots = []
    for path in _candidate_files(source):
        if inprefix is not None and (match := SNAPSHOT_NAME.fullmatch(path.name)) and match["prefix"] != inprefix:
            continue
        snap = describe_snapshot(path)
        if snap is not None and (instds is None or any(abs(snap.std - s) < STD_TOLERANCE for s in instds)):
            snapshots.append(snap)
    if not snapshots:
        where = f"{source} holds" if isinstance(source, (str, os.PathLike)) else "none of the given files is"
        raise NoSnapshotsError(f"{where} no matching snapshot files (PREFIX-KIMG-STD.safetensors or .pkl)")
    snapshots.sort(key=lambda s: (s.nimg, s.std))
    for a, b in zip(snapshots, snapshots[1:]):
        if (a.nimg, a.std) == (b.nimg, b.std):
            raise PosthocError(f"{a.path} and {b.path} hold the same track; keep one or select a prefix (--inprefix)")
    check_one_run(snapshots)
    ours = [s.path for s in snapshots if s.path.suffix == ".safetensors"]
    ref_arch = header_architecture(ours[0]) if ours else None
    for path in ours[1:]:
        check_same_network(path, header_architecture(path), ours[0], ref_arch)
    return snapshots


def select_inputs(snapshots: Sequence[Snapshot], kimg: int | None = None) -> tuple[list[Snapshot], int]:
    """The snapshots taken up to the reconstruction time (kimg, default the newest), and that time in images."""
    if kimg is None:
        out_nimg = snapshots[-1].nimg
    else:
        matches = [s.nimg for s in snapshots if s.nimg // 1000 == kimg]
        if not matches:
            times = sorted({s.nimg // 1000 for s in snapshots})
            raise NoSuchTimeError(f"no snapshot at kimg {kimg}; snapshots exist at kimg {times[0]}..{times[-1]}")
        out_nimg = matches[0]
    inputs = taken_up_to(snapshots, out_nimg)
    if not inputs:
        raise NoSuchTimeError("no snapshot with a positive image count at or before that time")
    return inputs, out_nimg


def taken_up_to(snapshots: Sequence[Snapshot], nimg: int) -> list[Snapshot]:
    """The snapshots a reconstruction at nimg images averages: those taken after 0 and up to nimg."""
    return [s for s in snapshots if 0 < s.nimg <= nimg]


def header_architecture(path: Path) -> dict[str, tuple[int, ...]]:
    """architecture() of one of our snapshot files, read from its header without loading weights."""
    with safetensors.safe_open(str(path), framework="pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}


def check_same_network(name: str | Path, arch: dict, ref_name: str | Path, ref_arch: dict) -> None:
    """Refuse to average snapshots of different networks, naming the first differing tensor."""
    difference = architecture_difference(arch, ref_arch)
    if difference is not None:
        raise PosthocError(f"{name}: network architecture differs from {ref_name} (tensor {difference!r})")


def _accumulate(tracks: Sequence[Track], coefs: np.ndarray, bar: tqdm.tqdm) -> tuple:
    """Load each track once and add coefs[i, j] times its parameters to sum j (Eq. 129), in float32.

    Returns the newest track's (net, metadata), its parameters and the sums.
    """
    sums = ref_arch = None
    for i, track in enumerate(tracks):
        net = meta = params = None  # release the previous input before loading the next
        net, meta = track.load()
        arch = architecture(net.state_dict())
        ref_arch = arch if ref_arch is None else ref_arch
        check_same_network(track.name, arch, tracks[0].name, ref_arch)
        params = [p.detach() for p in net.parameters()]
        if sums is None:
            sums = [[torch.zeros_like(p, dtype=torch.float32) for p in params] for _ in range(coefs.shape[1])]
        for j, acc in enumerate(sums):
            torch._foreach_add_(acc, params, alpha=float(coefs[i, j]))
        bar.update()
    return net, meta, params, sums


def combine(tracks: Sequence[Track], out_nimg: int, stds: Sequence[float], batch: int = 8,
            progress: bool = False) -> Iterator[tuple[float, torch.nn.Module, dict]]:
    """Yield (std, net, metadata) for each sigma_rel in stds at time out_nimg, built from the tracks.

    Streams over the tracks once per `batch` outputs: memory is one input network plus `batch` float32
    sums. The net is the last track's network (buffers included) holding the reconstructed parameters,
    and it is reused for the next output: save or copy it before advancing. metadata is the last track's,
    with nimg, ema_std and a 'phema' record: the inputs with their coefficients and the profile error (Eq. 134).
    """
    stds = [float(s) for s in stds]
    phema.std_to_exp(np.array(stds))  # refuse an impossible sigma_rel before loading anything
    if not tracks or any(not 0 < t.nimg <= out_nimg for t in tracks):
        times = [t.nimg for t in tracks]
        raise PosthocError(f"need tracks taken after 0 and up to {out_nimg} images, got times {times}")
    in_nimg, in_std = [t.nimg for t in tracks], [t.std for t in tracks]
    num_passes = math.ceil(len(stds) / batch)
    with tqdm.tqdm(total=num_passes * len(tracks), unit="snapshot", desc="Reconstructing", disable=not progress) as bar:
        for first in range(0, len(stds), batch):
            group = stds[first:first + batch]
            coefs = phema.solve_posthoc_coefficients(in_nimg, in_std, out_nimg, group)
            net = meta = params = sums = None  # the previous pass's memory goes before this one loads
            net, meta, params, sums = _accumulate(tracks, coefs, bar)
            errors = phema.reconstruction_error(in_nimg, in_std, out_nimg, group, coefs)
            for j, (std, error) in enumerate(zip(group, errors.tolist())):
                for p, total in zip(params, sums[j]):
                    p.copy_(total)
                record = {
                    "inputs": [{"file": t.name, "nimg": t.nimg, "ema_std": t.std, "coef": float(c)}
                               for t, c in zip(tracks, coefs[:, j])],
                    "profile_error": error,
                }
                yield std, net, dict(meta, nimg=out_nimg, ema_std=std, phema=record)


def combine_per_tensor(tracks: Sequence[Track], out_nimg: int, std: float,
                       tensor_stds: Mapping[str, float]) -> tuple[torch.nn.Module, dict]:
    """The network of sigma_rel `std` at out_nimg, except the parameters named in tensor_stds, each reconstructed
    at its own sigma_rel (paper Figure 5b); metadata is combine's for `std`, with the per-tensor lengths added.

    One pass over the tracks per distinct length, each solved alone: a parameter is bit for bit what
    combine(tracks, out_nimg, [its length]) gives (solving lengths together moves the coefficients by float64
    round-off, ~1e-13). Memory: one input network, one output and one copy of the parameters.
    """
    std, tensor_stds = float(std), {name: float(s) for name, s in tensor_stds.items()}
    chosen: dict[str, torch.Tensor] = {}
    net = meta = None
    for length in dict.fromkeys([std, *tensor_stds.values()]):
        for _, net, metadata in combine(tracks, out_nimg, [length], batch=1):
            params = dict(net.named_parameters())
            check_tensor_names(tensor_stds, params)
            chosen.update({name: p.detach().clone() for name, p in params.items()
                           if tensor_stds.get(name, std) == length})
            meta = metadata if length == std else meta
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.copy_(chosen[name])
    return net, dict(meta, tensor_stds=tensor_stds)


def check_tensor_names(names: Iterable[str], params: Mapping[str, object]) -> None:
    """Refuse a per-tensor EMA length for a tensor the network lacks, naming it and some the network has."""
    unknown = [name for name in names if name not in params]
    if unknown:
        known = [name for name in params if name.endswith("weight")][:3]
        raise PosthocError(f"the network has no parameter {unknown[0]!r} (its parameters are named like "
                           f"{', '.join(map(repr, known))})")


# Measured with phema.reconstruction_error for two tracks (0.05, 0.10): the paper's setting (a snapshot every 8Mi
# of 2Gi images) reconstructs sigma_rel 0.02-0.25 with errors below 1e-4; the toy demo's four snapshots give
# 1e-3 to 5e-2 for 0.03-0.2, and lengths far from the tracked ones (0.01 there) 0.4 and more.
GOOD_PROFILE_ERROR = 1e-3  # the averaging profile within ~3% (RMS) of the target's: as if tracked
FAIR_PROFILE_ERROR = 5e-2  # within ~22%: usable, but more snapshots or a nearer tracked length would do better


def profile_quality(error: float) -> str:
    """'good', 'fair' or 'poor': the relative profile error (Eq. 134) against GOOD_ and FAIR_PROFILE_ERROR."""
    return "good" if error < GOOD_PROFILE_ERROR else "fair" if error < FAIR_PROFILE_ERROR else "poor"


def describe_profile_error(error: float) -> str:
    """The relative profile error (Eq. 134) in words: how far the averaging profile is from the target's."""
    error = max(error, 0.0)  # rounding leaves -1e-17 where the target is a tracked length
    rms = math.sqrt(error)  # relative squared L2 distance -> relative RMS distance
    verdict = {
        "good": f"as good as a tracked EMA (below {GOOD_PROFILE_ERROR:.0e})",
        "fair": f"fair (below {GOOD_PROFILE_ERROR:.0e} is as good as a tracked EMA; more snapshots lower it)",
        "poor": f"poor (above {FAIR_PROFILE_ERROR:.0e}: take more snapshots or a sigma_rel nearer the tracked ones)",
    }[profile_quality(error)]
    return f"profile error {error:.1e}: the averaging profile is {rms:.1%} (RMS) from the target's, {verdict}"


def reconstruct(source: str | os.PathLike | Iterable[str | os.PathLike], stds: Sequence[float],
                kimg: int | None = None, inprefix: str | None = None, instds: Sequence[float] | None = None,
                batch: int = 8, progress: bool = False) -> Iterator[tuple[float, torch.nn.Module, dict]]:
    """Yield (std, net, metadata) per sigma_rel in stds from the snapshots in a run folder or a list of files.

    At the time of the snapshot at kimg (default the newest), from every track up to then; see list_snapshots
    for inprefix and instds, and combine for batch and what is yielded.
    """
    inputs, out_nimg = select_inputs(list_snapshots(source, inprefix, instds), kimg)
    yield from combine([s.track() for s in inputs], out_nimg, stds, batch, progress)
