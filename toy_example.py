"""2-D toy example of the autoguidance paper ("Guiding a Diffusion Model with a Bad Version of Itself", Figure 1),
and of few-step generation (sCM) against its exact density.

The ground truth is edm2.toy.gmm's, the denoiser edm2.toy.model's, the training training.toy's and the figure
edm2.plots.toy's; the consistency model is edm2.toy.consistency's, its distillation training.toy_consistency's
and the scoring edm2.toy.scoring's; this command line checks the options, wires them and reports.
"""

from __future__ import annotations

import cli.wait_policy  # noqa: F401  first: PyTorch's OpenMP reads its wait policy once, when it loads
import dataclasses
from pathlib import Path

import click

from cli.command import Group
from cli.types import Guidance, Integer, IntList, Number
from edm2 import plots
from edm2.errors import EDM2Error, one_line
from edm2.network_args import MAX_BLOCKS, MAX_CHANNELS
from edm2.plots.toy import progress_figure, samples_figure, toy_figure
from edm2.runtime import distributed, files, locks
from edm2.toy.consistency import ToyFlow
from edm2.toy.gmm import ground_truth
from edm2.toy.scoring import mean_loglik, snapshot_classes, toy_samples
from edm2.toy.snapshot import load_toy, save_toy
from training.toy import ToyTraining, train_toy
from training.toy_consistency import METHODS, ToyDistillation, train_toy_consistency

RELEASE_URL = "https://nvlabs-fi-cdn.nvidia.com/edm2/toy-example/"
DEFAULT_NET = RELEASE_URL + "clsA-layers04-dim64/iter4096.pkl"  # the main model of the paper's Figure 1
DEFAULT_GNET = RELEASE_URL + "clsA-layers04-dim32/iter0512.pkl"  # its guiding model: smaller, trained shorter


@click.group(cls=Group, epilog="""\b
Examples:
  # The paper's figure from the release's published toy models (downloaded once)
  python toy_example.py plot --save=toy.png
\b
  # Train a main model and a guiding model (smaller, shorter), then plot autoguidance
  python toy_example.py train --outdir=toy/clsA-layers04-dim64 --cls=A --layers=4 --dim=64
  python toy_example.py train --outdir=toy/clsA-layers04-dim32 --cls=A --layers=4 --dim=32 --iters=512
  python toy_example.py plot --net=toy/clsA-layers04-dim64/iter4096.safetensors \\
      --gnet=toy/clsA-layers04-dim32/iter0512.safetensors --guidance=3 --save=toy.png
\b
  # Classifier-free guidance instead: guide by a model of both classes
  python toy_example.py train --outdir=toy/clsAB-layers04-dim32 --cls=AB --layers=4 --dim=32 --iters=512
\b
  # A quick look on a CPU (about two minutes)
  python toy_example.py train --outdir=toy/quick-main --iters=512
  python toy_example.py train --outdir=toy/quick-guide --dim=32 --iters=64
  python toy_example.py plot --net=toy/quick-main/iter0512.safetensors --gnet=toy/quick-guide/iter0064.safetensors
\b
  # Few-step generation: distill the main model (sCD), then score it and the teacher by the exact density
  python toy_example.py distill --method=scd --net=toy/clsA-layers04-dim64/iter4096.safetensors --outdir=toy/scd
  python toy_example.py score --net=toy/scd/iter2048.safetensors --steps=1,2 --plot=scd.png
  python toy_example.py score --net=toy/clsA-layers04-dim64/iter4096.safetensors --steps=2,4,8,32
""")
def main() -> None:
    """2-D toy example from the paper "Guiding a Diffusion Model with a Bad Version of Itself" (Figure 1)."""
    if distributed.launched_world_size() > 1:
        raise click.UsageError("the toy example runs in one process; start it without torchrun")


@main.command()
@click.option("--outdir", type=click.Path(path_type=Path), required=True,
              help="Where the snapshots iterNNNN.safetensors go (a new or empty folder)")
@click.option("--cls", type=click.Choice(["A", "B", "AB"]), default="A", show_default=True,
              help="Classes of the ground truth to learn")
@click.option("--layers", type=Integer(1, MAX_BLOCKS), default=ToyTraining.num_layers, show_default=True,
              help="Number of hidden layers")
@click.option("--dim", type=Integer(1, MAX_CHANNELS), default=ToyTraining.hidden_dim, show_default=True,
              help="Hidden dimension")
@click.option("--viz", type=bool, default=True, show_default=True,
              help="Draw the samples of every snapshot into OUTDIR/progress.png")
@click.option("--iters", type=Integer(1, 10**7), default=4096, show_default=True,
              help="Training iterations of 4096 points (a snapshot every 256 and at the end)")
def train(outdir: Path, cls: str, layers: int, dim: int, viz: bool, iters: int) -> None:
    """Train a toy denoiser on the ground truth of the given classes."""
    files.check_writable_dir(outdir)
    # One training at a time per outdir: two would replace each other's snapshots.
    with locks.hold_destination(outdir, "toy_example.py train", locks.FOLDER_LOCK):
        files.remove_stale_temporaries(outdir)
        earlier = sorted(outdir.glob("iter*.safetensors"))
        if earlier:
            raise click.BadParameter(f"{outdir} already holds snapshots ({earlier[0].name}); choose a new folder",
                                     param_hint="--outdir")
        _train(outdir, ToyTraining(classes=cls, num_layers=layers, hidden_dim=dim, iterations=iters), viz)


def _train(outdir: Path, opts: ToyTraining, viz: bool) -> None:
    """Train into outdir, a snapshot (and with viz the progress figure) every 256 iterations and at the end."""
    where = distributed.device()
    what = f"class {opts.classes}, {opts.num_layers} layers of {opts.hidden_dim}"

    def snapshot(iteration: int, ema) -> None:
        path = outdir / f"iter{iteration:04d}.safetensors"
        save_toy(path, ema, {"iteration": iteration, "training": dataclasses.asdict(opts)})
        if viz:
            plots.save_png(progress_figure(ema, f"{what}, {iteration} iterations", where), outdir / "progress.png",
                           dpi=80)
        click.echo(f"{path}")

    click.echo(f"Training on {where}: {what}, {opts.iterations} iterations into {outdir}")
    train_toy(opts, where, snapshot)
    click.echo("Done.")


@main.command()
@click.option("--net", metavar="PATH|URL", default=DEFAULT_NET, show_default=True,
              help="Main model: our .safetensors toy snapshot or the release's .pkl")
@click.option("--gnet", metavar="PATH|URL", default=DEFAULT_GNET, show_default=True,
              help="Guiding model: the main model's worse version (autoguidance) or an unconditional one")
@click.option("--guidance", type=Guidance(), default=3.0, help="Guidance weight w (Eq. 152)  [default: 3]")
@click.option("--save", type=click.Path(path_type=Path, dir_okay=False), default="toy-example.png",
              show_default=True, help="Where to write the figure (PNG)")
def plot(net: str, gnet: str, guidance: float, save: Path) -> None:
    """Draw the sample distributions with and without guidance, and a close-up of densities and trajectories."""
    if save.suffix.lower() != ".png":
        raise click.BadParameter(f"{save} does not end in .png; the figure is written as PNG", param_hint="--save")
    files.check_writable_dir(save.parent)
    where = distributed.device()
    click.echo("Loading models...")
    models = []
    for option, path in (("--net", net), ("--gnet", gnet)):
        model = _load(path, option)[0]
        if isinstance(model, ToyFlow):
            raise click.BadParameter(f"{path} is a consistency model; draw it with score --plot", param_hint=option)
        models.append(model.to(where))
    click.echo("Drawing...")
    plots.save_png(toy_figure(*models, guidance, where), save, dpi=80)
    click.echo(f"Saved {save}")


def _load(path: str, option: str):
    """(network, metadata) of a toy snapshot, or a click error naming the option."""
    try:
        return load_toy(path)
    except (EDM2Error, OSError) as e:
        raise click.BadParameter(one_line(e), param_hint=option) from None


@main.command()
@click.option("--method", type=click.Choice(METHODS), required=True,
              help="Consistency distillation from the teacher's ODE (scd) or consistency training on data (sct)")
@click.option("--net", metavar="PATH|URL", required=True,
              help="Teacher: a toy denoiser snapshot (the student starts by fitting its ODE)")
@click.option("--outdir", type=click.Path(path_type=Path), required=True,
              help="Where the student's snapshots iterNNNN.safetensors go (a new or empty folder)")
@click.option("--layers", type=Integer(1, MAX_BLOCKS), default=ToyDistillation.num_layers, show_default=True,
              help="The student's number of hidden layers")
@click.option("--dim", type=Integer(1, MAX_CHANNELS), default=ToyDistillation.hidden_dim, show_default=True,
              help="The student's hidden dimension")
@click.option("--iters", type=Integer(1, 10**7), default=ToyDistillation.iterations, show_default=True,
              help="Iterations of 4096 points (a snapshot every 256 and at the end)")
@click.option("--init-iters", type=Integer(0, 10**7), default=ToyDistillation.init_iterations, show_default=True,
              help="Iterations fitting the student to the teacher's velocity first")
@click.option("--lr", type=Number(0, 1, min_open=True), default=ToyDistillation.lr, show_default=True,
              help="Adam's learning rate after the initialization")
@click.option("--P-mean", "P_mean", type=Number(-10, 10), default=ToyDistillation.P_mean, show_default=True,
              help="Mean of ln(sigma_d tan t) of the training times")
@click.option("--P-std", "P_std", type=Number(0, 10, min_open=True), default=ToyDistillation.P_std,
              show_default=True, help="Standard deviation of ln(sigma_d tan t) of the training times")
@click.option("--warmup", type=Integer(0, 10**7), default=ToyDistillation.warmup_iterations, show_default=True,
              help="Iterations of tangent warmup (r from 0 to 1)")
@click.option("--viz", type=bool, default=True, show_default=True,
              help="Draw the student's 1- and 2-step samples of every snapshot into OUTDIR/progress.png")
def distill(method: str, net: str, outdir: Path, layers: int, dim: int, iters: int, init_iters: int, lr: float,
            P_mean: float, P_std: float, warmup: int, viz: bool) -> None:
    """Train a few-step consistency model from a toy teacher (sCD or sCT)."""
    files.check_writable_dir(outdir)
    teacher, metadata = _load(net, "--net")
    if isinstance(teacher, ToyFlow):
        raise click.BadParameter(f"{net} is a consistency model; the teacher is a toy denoiser", param_hint="--net")
    try:
        classes = snapshot_classes(metadata)
    except EDM2Error as e:
        raise click.BadParameter(one_line(e), param_hint="--net") from None
    opts = ToyDistillation(method=method, classes=classes, num_layers=layers, hidden_dim=dim, iterations=iters,
                           init_iterations=init_iters, lr=lr, P_mean=P_mean, P_std=P_std, warmup_iterations=warmup)
    with locks.hold_destination(outdir, "toy_example.py distill", locks.FOLDER_LOCK):
        files.remove_stale_temporaries(outdir)
        earlier = sorted(outdir.glob("iter*.safetensors"))
        if earlier:
            raise click.BadParameter(f"{outdir} already holds snapshots ({earlier[0].name}); choose a new folder",
                                     param_hint="--outdir")
        _distill(outdir, opts, teacher, Path(str(net)).name, viz)


def _distill(outdir: Path, opts: ToyDistillation, teacher, teacher_name: str, viz: bool) -> None:
    """Distill into outdir, a snapshot (and with viz the progress figure) every 256 iterations and at the end."""
    where = distributed.device()
    consistency = opts.consistency_metadata(teacher_name, teacher.sigma_data)

    def snapshot(iteration: int, ema: ToyFlow) -> None:
        path = outdir / f"iter{iteration:04d}.safetensors"
        save_toy(path, ema, {"iteration": iteration, "training": dataclasses.asdict(opts),
                             "consistency": consistency})
        if viz:
            samples = {f"{opts.method}, {iteration} iterations, {s} step{'s' * (s > 1)}": toy_samples(ema, s)
                       for s in (1, 2)}
            plots.save_png(samples_figure(samples, where, opts.classes), outdir / "progress.png", dpi=80)
        click.echo(f"{path}")

    click.echo(f"Distilling on {where} ({opts.method}): {opts.init_iterations} iterations fitting the teacher, "
               f"then {opts.iterations} into {outdir}")
    train_toy_consistency(opts, teacher, ground_truth(opts.classes, where), where, snapshot)
    click.echo("Done.")


@main.command()
@click.option("--net", metavar="PATH|URL", required=True,
              help="A toy snapshot: a denoiser (sampled with Heun) or a consistency model (its own sampler)")
@click.option("--steps", type=IntList(1, 1024), default="1,2", show_default=True,
              help="Step counts to score (Heun steps take 2 S - 1 evaluations, consistency steps S)")
@click.option("--plot", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Also draw the samples of each step count over the true density (PNG)")
def score(net: str, steps: tuple[int, ...], plot: Path | None) -> None:
    """Print the mean exact log-likelihood under the true mixture of 4,096 samples per step count."""
    if plot is not None:
        if plot.suffix.lower() != ".png":
            raise click.BadParameter(f"{plot} does not end in .png; the figure is written as PNG",
                                     param_hint="--plot")
        files.check_writable_dir(plot.parent)
    model, metadata = _load(net, "--net")
    try:
        classes = snapshot_classes(metadata)
    except EDM2Error as e:
        raise click.BadParameter(one_line(e), param_hint="--net") from None
    where = distributed.device()
    model, truth = model.to(where), ground_truth(classes, where)
    kind = "consistency" if isinstance(model, ToyFlow) else "Heun"
    samples, results = {}, []
    for s in steps:
        samples[f"{kind}, {s} step{'s' * (s > 1)}"] = points = toy_samples(model, s)
        results.append(f"steps={s} loglik={mean_loglik(truth, points):.4f}")
        click.echo(f"{kind} {results[-1]}")
    if plot is not None:
        plots.save_png(samples_figure(samples, where, classes), plot, dpi=80)
        click.echo(f"Saved {plot}")
    click.echo(" ".join(results))


if __name__ == "__main__":
    main()
