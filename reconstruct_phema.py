"""Post-hoc EMA reconstruction (paper Section 3.2, Appendix C.5): choose the EMA length after training."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import click
import safetensors
import torch
import tqdm

from edm2 import phema
from edm2.snapshot import SnapshotError, load_network, read_metadata, save_network, snapshot_name

SNAPSHOT_NAME = re.compile(r"(.+)-(\d+)-(\d+\.\d+)\.(safetensors|pkl)")


@dataclass(frozen=True)
class Snapshot:
    """One stored EMA track: where it is, when it was taken (images) and its sigma_rel."""

    path: Path
    prefix: str
    nimg: int
    std: float


class StdList(click.ParamType):
    """Comma-separated sigma_rel values; 'a,b,...,c' expands to the evenly spaced range a, b, ..., c."""

    name = "LIST"

    def convert(self, value, param, ctx) -> list[float]:
        if isinstance(value, list):
            return value
        tokens = [t.strip() for t in str(value).split(",")]
        try:
            raw = [None if t == "..." else float(t) for t in tokens]
        except ValueError:
            self.fail(f"{value!r} is not a comma-separated list of numbers", param, ctx)
        stds = []
        for i, v in enumerate(raw):
            if v is not None:
                stds.append(v)
                continue
            if i < 2 or raw[i - 2] is None or raw[i - 1] is None or i + 1 >= len(raw) or raw[i + 1] is None:
                self.fail(f"{value!r}: '...' needs two numbers before it and one after", param, ctx)
            a, b, c = raw[i - 2], raw[i - 1], raw[i + 1]
            count = (c - b) / (b - a) if b != a else -1.0
            if count < 1 - 1e-6 or abs(count - round(count)) > 1e-6:
                self.fail(f"{value!r}: {a}, {b}, ..., {c} is not an evenly spaced range", param, ctx)
            stds += [round(b + (b - a) * k, 12) for k in range(1, round(count))]
        bad = [s for s in stds if not 0 < s < phema.MAX_STD]
        if bad:
            self.fail(f"{bad[0]} is outside (0, {phema.MAX_STD:.4f}), the range of sigma_rel", param, ctx)
        stds = sorted(set(stds))
        names = [f"{s:.3f}" for s in stds]
        for s, t, name, next_name in zip(stds, stds[1:], names, names[1:]):
            if name == next_name:
                self.fail(f"{s} and {t} would share the file name suffix {name}", param, ctx)
        return stds


def kimg_to_nimg(kimg: int) -> int | None:
    """Images seen for a release file name's kimg: the multiple of 1024 whose //1000 is kimg, if any."""
    nimg = -(-kimg * 1000 // 1024) * 1024
    return nimg if nimg // 1000 == kimg else None


def newest_run_dir(root: Path = Path("training-runs")) -> Path:
    """The most recently modified run directory under training-runs/."""
    runs = [p for p in root.iterdir() if p.is_dir()] if root.is_dir() else []
    if not runs:
        raise click.UsageError(f"no --indir given and no run directory under {root}/")
    return max(runs, key=lambda p: p.stat().st_mtime)


def describe_snapshot(path: Path, match: re.Match) -> Snapshot | None:
    """The Snapshot for a matching file name; None for our own reconstructions, which are not tracks."""
    prefix, kimg = match.group(1), int(match.group(2))
    if path.suffix == ".pkl":
        nimg = kimg_to_nimg(kimg)
        if nimg is None:
            raise click.ClickException(f"{path}: kimg {kimg} is not a whole number of 1024-image batches")
        return Snapshot(path, prefix, nimg, float(match.group(3)))
    try:
        meta = read_metadata(path)
    except SnapshotError as e:
        raise click.ClickException(str(e)) from None
    if "phema" in meta:
        return None
    if not isinstance(meta.get("nimg"), int) or not isinstance(meta.get("ema_std"), (int, float)):
        raise click.ClickException(f"{path}: metadata lacks 'nimg' and 'ema_std'; not a training snapshot")
    return Snapshot(path, prefix, meta["nimg"], float(meta["ema_std"]))


def list_snapshots(indir: Path, inprefix: str | None, instd: list[float] | None) -> list[Snapshot]:
    """The EMA snapshots in indir (ours and the release's), sorted by time, then sigma_rel."""
    if not indir.is_dir():
        raise click.BadParameter(f"{indir} is not a directory", param_hint="'--indir'")
    snapshots = []
    for path in sorted(indir.iterdir()):
        match = SNAPSHOT_NAME.fullmatch(path.name)
        if not match or not path.is_file() or (inprefix is not None and match.group(1) != inprefix):
            continue
        snap = describe_snapshot(path, match)
        if snap is not None and (instd is None or any(abs(snap.std - s) < 5e-4 for s in instd)):
            snapshots.append(snap)
    if not snapshots:
        raise click.BadParameter(f"{indir} holds no matching snapshot files (PREFIX-KIMG-STD.safetensors or .pkl)",
                                 param_hint="'--indir'")
    snapshots.sort(key=lambda s: (s.nimg, s.std))
    for a, b in zip(snapshots, snapshots[1:]):
        if (a.nimg, a.std) == (b.nimg, b.std):
            raise click.ClickException(f"{a.path} and {b.path} hold the same track; keep one or use --inprefix")
    return snapshots


def select_inputs(snapshots: list[Snapshot], kimg: int | None) -> tuple[list[Snapshot], int]:
    """The snapshots taken up to the reconstruction time, and that time in images."""
    if kimg is None:
        out_nimg = snapshots[-1].nimg
    else:
        matches = [s.nimg for s in snapshots if s.nimg // 1000 == kimg]
        if not matches:
            times = sorted({s.nimg // 1000 for s in snapshots})
            raise click.BadParameter(f"no snapshot at kimg {kimg}; snapshots exist at kimg {times[0]}..{times[-1]}",
                                     param_hint="'--kimg'")
        out_nimg = matches[0]
    inputs = [s for s in snapshots if 0 < s.nimg <= out_nimg]
    if not inputs:
        raise click.BadParameter("no snapshot with a positive image count at or before that time", param_hint="'--kimg'")
    return inputs, out_nimg


def architecture(state: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes: what must agree for snapshots to be averaged."""
    return {name: tuple(t.shape) for name, t in state.items()}


def header_architecture(path: Path) -> dict[str, tuple[int, ...]]:
    """architecture() of one of our snapshot files, read from its header without loading weights."""
    with safetensors.safe_open(str(path), framework="pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}


def check_architecture(path: Path, arch: dict, ref_path: Path, ref_arch: dict) -> None:
    """Refuse to average snapshots of different networks, naming the first difference."""
    if arch == ref_arch:
        return
    diff = sorted(set(arch.items()) ^ set(ref_arch.items()))[0][0]
    raise click.ClickException(f"{path}: network architecture differs from {ref_path} (tensor {diff!r})")


def load_input(snap: Snapshot) -> tuple[torch.nn.Module, dict]:
    """Load one input snapshot as a float32 network, turning file errors into one clear line."""
    try:
        return load_network(snap.path)
    except SnapshotError as e:
        raise click.ClickException(str(e)) from None
    except OSError as e:
        raise click.ClickException(f"{snap.path}: cannot read: {e}") from None


def reconstruct(inputs: list[Snapshot], out_nimg: int, out_stds: list[float], out_paths: list[Path],
                batch: int) -> None:
    """Stream over the inputs once per batch of outputs, accumulating in float32, and save each output."""
    num_passes = math.ceil(len(out_stds) / batch)
    in_nimg = [s.nimg for s in inputs]
    in_std = [s.std for s in inputs]
    ref_arch = None
    with tqdm.tqdm(total=num_passes * len(inputs), unit="snapshot", desc="Reconstructing") as bar:
        for first in range(0, len(out_stds), batch):
            stds, paths = out_stds[first:first + batch], out_paths[first:first + batch]
            coefs = phema.solve_posthoc_coefficients(in_nimg, in_std, out_nimg, stds)
            sums = None
            for i, snap in enumerate(inputs):
                net = meta = params = None  # release the previous input before reading the next
                net, meta = load_input(snap)
                arch = architecture(net.state_dict())
                if ref_arch is None:
                    ref_arch = arch
                check_architecture(snap.path, arch, inputs[0].path, ref_arch)
                params = [p.detach() for p in net.parameters()]
                if sums is None:
                    sums = [[torch.zeros_like(p) for p in params] for _ in stds]
                for j, acc in enumerate(sums):
                    torch._foreach_add_(acc, params, alpha=float(coefs[i, j]))  # Eq. 129
                bar.update()
            # The newest input (the last one read) supplies buffers and the base metadata.
            errors = phema.reconstruction_error(in_nimg, in_std, out_nimg, stds, coefs)
            for j, (std, path, error) in enumerate(zip(stds, paths, errors.tolist())):
                for p, total in zip(params, sums[j]):
                    p.copy_(total)
                record = {
                    "inputs": [{"file": s.path.name, "nimg": s.nimg, "ema_std": s.std, "coef": float(c)}
                               for s, c in zip(inputs, coefs[:, j])],
                    "profile_error": error,
                }
                save_network(path, net, dict(meta, nimg=out_nimg, ema_std=std, phema=record))
                bar.write(f"{path} (relative profile error {error:.1e})")
            del sums


@click.command(epilog="""\b
Examples:
  # sigma_rel 0.10 at the newest snapshot of the newest run, into its phema/ folder
  python reconstruct_phema.py --std=0.10
\b
  # 49 profiles from the release's raw snapshots, 8 per pass over the inputs
  python reconstruct_phema.py --indir=raw-snapshots/edm2-img512-xs --outdir=out \\
      --std=0.010,0.015,...,0.250 --batch=8
""")
@click.option("--indir", type=click.Path(path_type=Path), default=None,
              help="Directory of EMA snapshots  [default: newest run under training-runs/]")
@click.option("--outdir", type=click.Path(path_type=Path), default=None, help="Output directory  [default: INDIR/phema]")
@click.option("--std", "--outstd", "stds", type=StdList(), required=True,
              help="sigma_rel values to reconstruct, e.g. 0.05,0.1 or 0.010,0.015,...,0.250")
@click.option("--kimg", "--outkimg", "kimg", type=click.IntRange(min=0), default=None,
              help="Training time to reconstruct, in thousands of images  [default: newest snapshot]")
@click.option("--inprefix", type=str, default=None, help="Use only inputs with this file name prefix")
@click.option("--instd", type=StdList(), default=None, help="Use only inputs with these sigma_rel values")
@click.option("--batch", type=click.IntRange(min=1), default=8, show_default=True,
              help="Outputs built per pass over the inputs (memory: one input plus this many outputs)")
@click.option("--skip", is_flag=True, help="Skip outputs that already exist")
@click.option("--prefix", "--outprefix", "prefix", type=str, default="phema", show_default=True,
              help="Output file name prefix")
def main(indir, outdir, stds, kimg, inprefix, instd, batch, skip, prefix):
    """Synthesize EMA profiles of any length from the EMA snapshots of a training run.

    Outputs are PREFIX-KIMG-STD.safetensors snapshots that edm2.snapshot.load_network and generate.py
    read. Inputs are our network-snapshot-*.safetensors files or the release's raw snapshot pickles
    (edm2-img512-xs-0134217-0.050.pkl).
    """
    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise click.UsageError("reconstruct_phema.py runs as one process; start it with python, not torchrun")
    indir = indir if indir is not None else newest_run_dir()
    outdir = outdir if outdir is not None else indir / "phema"
    snapshots = list_snapshots(indir, inprefix, instd)
    ours = [s for s in snapshots if s.path.suffix == ".safetensors"]
    if ours:
        ref_arch = header_architecture(ours[0].path)
        for s in ours[1:]:
            check_architecture(s.path, header_architecture(s.path), ours[0].path, ref_arch)
    inputs, out_nimg = select_inputs(snapshots, kimg)
    paths = [outdir / snapshot_name(prefix, out_nimg, std) for std in stds]
    todo = [(std, path) for std, path in zip(stds, paths) if not (skip and path.is_file())]
    if not todo:
        click.echo("All outputs exist; nothing to do.")
        return
    click.echo(f"{len(inputs)} input snapshots up to {out_nimg} images -> {len(todo)} outputs in {outdir}")
    reconstruct(inputs, out_nimg, [t[0] for t in todo], [t[1] for t in todo], batch)


if __name__ == "__main__":
    main()
