"""Post-hoc EMA reconstruction (paper Section 3.2, Appendix C.5): choose the EMA length after training.

The work is edm2.procedures.posthoc's; this command line finds the inputs, names the outputs and writes them.
"""

from __future__ import annotations

import cli.wait_policy  # noqa: F401  first: PyTorch's OpenMP reads its wait policy once, when it loads
import contextlib
from pathlib import Path

import click
import tqdm

from cli.command import Command
from cli.speed import threads_option
from cli.types import MAX_KIMG, MAX_STD_COUNT, Integer, StdList
from edm2.formats.snapshot import save_network, snapshot_name
from edm2.procedures import posthoc
from edm2.runtime import distributed, files, locks


def newest_run_dir(root: Path = Path("training-runs")) -> Path:
    """The most recently modified run directory under training-runs/."""
    runs = [p for p in root.iterdir() if p.is_dir()] if root.is_dir() else []
    if not runs:
        raise click.UsageError(f"no --indir given and no run directory under {root}/")
    return max(runs, key=lambda p: p.stat().st_mtime)


def find_inputs(indir: Path, inprefix: str | None, instd: list[float] | None,
                kimg: int | None) -> tuple[list[posthoc.Snapshot], int]:
    """The input snapshots and the reconstruction time in images; a failure names the option at fault."""
    try:
        snapshots = posthoc.list_snapshots(indir, inprefix, instd)
    except posthoc.NoSnapshotsError as e:
        raise click.BadParameter(str(e), param_hint="'--indir'") from None
    try:
        return posthoc.select_inputs(snapshots, kimg)
    except posthoc.NoSuchTimeError as e:
        raise click.BadParameter(str(e), param_hint="'--kimg'") from None


def check_replaceable(todo: list[tuple[float, Path]]) -> None:
    """Refuse outputs that would replace anything but an earlier post-hoc output, e.g. a training snapshot."""
    for _, path in todo:
        if path.exists() and not posthoc.is_reconstruction(path):
            raise click.BadParameter(f"{path} exists and is not a post-hoc reconstruction; choose another "
                                     "--outdir or --prefix", param_hint="'--prefix'")


def write_outputs(inputs: list[posthoc.Snapshot], out_nimg: int, todo: list[tuple[float, Path]], batch: int) -> None:
    """Reconstruct and save each (std, path) in todo."""
    paths = dict(todo)
    outputs = posthoc.combine([s.track() for s in inputs], out_nimg, list(paths), batch, progress=True)
    # closing(): on an error, the progress bar ends before the error line is printed.
    with contextlib.closing(outputs):
        for std, net, metadata in outputs:
            save_network(paths[std], net, metadata)
            tqdm.tqdm.write(f"{paths[std]} ({posthoc.describe_profile_error(metadata['phema']['profile_error'])})")
            del net, metadata  # a pass's network must not outlive it: memory stays one input plus --batch outputs


@click.command(cls=Command, epilog="""\b
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
@click.option("--kimg", "--outkimg", "kimg", type=Integer(0, MAX_KIMG), default=None,
              help="Training time to reconstruct, in thousands of images  [default: newest snapshot]")
@click.option("--inprefix", type=str, default=None, help="Use only inputs with this file name prefix")
@click.option("--instd", type=StdList(), default=None, help="Use only inputs with these sigma_rel values")
@click.option("--batch", type=Integer(1, MAX_STD_COUNT), default=8, show_default=True,
              help="Outputs built per pass over the inputs (memory: one input plus this many outputs)")
@click.option("--skip", is_flag=True, help="Skip outputs that already exist")
@click.option("--prefix", "--outprefix", "prefix", type=str, default="phema", show_default=True,
              help="Output file name prefix")
@threads_option
def main(indir, outdir, stds, kimg, inprefix, instd, batch, skip, prefix):
    """Synthesize EMA profiles of any length from the EMA snapshots of a training run.

    Outputs are PREFIX-KIMG-STD.safetensors snapshots that edm2.formats.snapshot.load_network and generate.py
    read. Inputs are our network-snapshot-*.safetensors files or the release's raw snapshot pickles
    (edm2-img512-xs-0134217-0.050.pkl). From Python: edm2.procedures.posthoc.reconstruct.
    """
    with distributed.session(single_process=True):
        indir = indir if indir is not None else newest_run_dir()
        outdir = outdir if outdir is not None else indir / "phema"
        inputs, out_nimg = find_inputs(indir, inprefix, instd, kimg)
        files.check_writable_dir(outdir)
        # One run at a time per outdir, which decides under the lock what to skip and what it may replace; an
        # outdir the lock created is removed again if no output lands in it (a full disk, Ctrl-C).
        with locks.hold_destination(outdir, "reconstruct_phema.py", locks.FOLDER_LOCK):
            paths = [outdir / snapshot_name(prefix, out_nimg, std) for std in stds]
            todo = [(std, path) for std, path in zip(stds, paths) if not (skip and path.is_file())]
            if not todo:
                click.echo("All outputs exist; nothing to do.")
                return
            check_replaceable(todo)
            files.remove_stale_temporaries(outdir)
            click.echo(f"{len(inputs)} input snapshots up to {out_nimg} images -> {len(todo)} outputs in {outdir}")
            write_outputs(inputs, out_nimg, todo, batch)


if __name__ == "__main__":
    main()
