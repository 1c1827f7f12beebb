"""Generate images with the EDM sampler from our snapshots or the release's published EDM2 models, or with a consistency
model's own 1-, 2- or N-step sampler from a consistency model's snapshot."""

from __future__ import annotations

import cli.wait_policy  # noqa: F401  first: PyTorch's OpenMP reads its wait policy once, when it loads
import contextlib
import functools
import math
import re
from pathlib import Path
from typing import Callable, Sequence, TypeVar

import click
import numpy as np
import torch

from cli.command import Command
from cli.config import config_option
from cli.solver import schedule_option, solver_option
from cli.speed import apply_speed, sampling_speed_options, threads_option
from cli.types import Guidance, Integer, Number, SeedList, SigmaInterval
from edm2.data.dataset_files import MAX_IMAGE_PIXELS
from edm2.errors import EDM2Error, one_line, shown
from edm2.consistency_sampler import T_MID, check_cm_settings, cm_times, consistency_sample, default_t_max, \
    is_consistency_model
from edm2.eval.flops import count_flops, sampling_evaluations
from edm2.formats.snapshot import load_generator, load_network, read_metadata
from edm2.procedures.generation import (GRID_FILE, LABELS_FILE, GenerationError, SeedRanges, generate_images,
                                        load_guide, read_generated_labels, save_generated_labels)
from edm2.procedures.image_grid import labelled_rows, save_png, tile
from edm2.procedures.presets_generate import DEFAULT_PRESET, PRESETS
from edm2.procedures.prompts import (PromptConditions, PromptsError, is_text_network, load_prompt_encoder,
                                     prompt_index, read_prompts, text_record)
from edm2.runtime import distributed, files, locks
from edm2.runtime.limits import MAX_BATCH
from edm2.sampler import SELF, SamplerError, check_settings

T = TypeVar("T")

# --class and --steps: ImageNet has 1000 classes; the paper samples with 32 steps.
MAX_STEPS = 10**4
# The sampler's settings whose options have their names: its errors (NAME=VALUE) name them as --NAME=VALUE.
SAMPLER_OPTIONS = ("sigma_min", "sigma_max", "rho", "guidance", "S_churn", "S_min", "S_max", "S_noise", "schedule")
DIFFUSION_STEPS, CONSISTENCY_STEPS = 32, 2  # --steps by default: the paper's 32, sCM's 2
# The EDM sampler's options that a consistency model's sampler has no use for, with their defaults (option: setting).
DIFFUSION_ONLY = {"--solver": ("solver", "heun"), "--schedule": ("schedule", "edm"), "--sigma_min": ("sigma_min", 0.002),
                  "--rho": ("rho", 7), "--S_churn": ("S_churn", 0), "--S_min": ("S_min", 0),
                  "--S_max": ("S_max", float("inf")), "--S_noise": ("S_noise", 1)}


def resolve_networks(preset: str | None, net: str | None, gnet: str | None, guidance: float | None):
    """Fill --net, --gnet and --guidance from the preset where not given; check they fit together."""
    if preset is None and net is None:
        preset = DEFAULT_PRESET
    if preset is not None:
        if preset not in PRESETS:
            raise click.BadParameter(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}", param_hint="--preset")
        chosen = PRESETS[preset]
        net = net or chosen.net
        gnet = gnet or chosen.gnet
        guidance = chosen.guidance if guidance is None else guidance
    guidance = 1.0 if guidance is None else guidance
    # A consistency model's --guidance is the scale its guidance embedding takes (sampling_plan): no --gnet needed.
    if guidance != 1 and gnet is None and not local_consistency_model(net):
        raise click.UsageError(f"--guidance={guidance:g} needs a guiding network: give --gnet or a --preset that has one")
    return net, gnet, guidance


def local_consistency_model(net_path: str | None) -> bool:
    """Whether net_path is a local snapshot of a consistency model (its metadata alone read); False for anything else,
    whose loading reports its own errors."""
    if net_path is None or not net_path.endswith(".safetensors") or not Path(net_path).is_file():
        return False
    try:
        return is_consistency_model(read_metadata(net_path))
    except EDM2Error:
        return False


def check_before_work(outdir: str, guidance: float, guidance_interval: tuple[float, float] | None,
                      sampler_kwargs: dict) -> None:
    """Refuse sampler settings that cannot work and an output folder that cannot be written, before any loading."""
    if guidance_interval is not None and guidance == 1:
        raise click.BadParameter("applies only with guidance: give --guidance other than 1 and --gnet (or a --preset "
                                 "that has them)", param_hint="--guidance-interval")
    try:
        check_settings(guidance=guidance, **sampler_kwargs)
    except SamplerError as e:
        raise click.ClickException(re.sub(rf"\b({'|'.join(SAMPLER_OPTIONS)})=", r"--\1=", str(e))) from None
    files.check_writable_dir(outdir)


def earlier_labels(outdir: Path) -> dict[str, int]:
    """The labels of earlier runs into outdir (read under its lock); a labels file that is not ours names --outdir."""
    try:
        return read_generated_labels(outdir / LABELS_FILE)
    except GenerationError as e:
        raise click.BadParameter(str(e), param_hint="--outdir") from None


def load_for_option(option: str, load: Callable[[], T]) -> T:
    """load() on rank 0 first (it alone downloads); a failure is one line that names the option."""
    try:
        return distributed.main_rank_first(load)
    except (EDM2Error, OSError) as e:
        raise click.ClickException(f"{option}: {one_line(e)}") from None


def sampling_plan(net, metadata: dict, gnet_path: str | None, guidance: float, guidance_interval,
                  t_mid: float | None, sampler_kwargs: dict) -> tuple[Callable | None, dict, int, str]:
    """(sampler (None: the EDM sampler), its keyword arguments, network evaluations per image, a line saying how it
    samples) for the network
    whose snapshot's metadata is given; the options that do not fit it refused, one line each, before any sampling."""
    steps = sampler_kwargs["num_steps"]
    if not is_consistency_model(metadata):
        if t_mid is not None:
            raise click.BadParameter("applies to consistency models only; this is a diffusion model",
                                     param_hint="--t-mid")
        kwargs = dict(sampler_kwargs, num_steps=steps or DIFFUSION_STEPS, guidance_interval=guidance_interval)
        about = f"{kwargs['solver']} solver, {kwargs['num_steps']} steps of the {kwargs['schedule']} schedule"
        return None, kwargs, sampling_evaluations(metadata, kwargs["num_steps"], kwargs["solver"]), about
    if gnet_path is not None or guidance_interval is not None:
        option = "--gnet" if gnet_path is not None else "--guidance-interval"
        raise click.BadParameter("a consistency model samples without a guiding network", param_hint=option)
    if guidance != 1 and not getattr(net.network, "guidance_embedding", False):
        raise click.BadParameter(f"{guidance:g}: this consistency model has no guidance embedding (it was not "
                                 "distilled from a guided teacher), so it takes no guidance scale", param_hint="--guidance")
    for option, (name, default) in DIFFUSION_ONLY.items():
        if sampler_kwargs[name] != default:
            raise click.BadParameter("the EDM sampler's option: a consistency model samples with its own steps "
                                     "(--steps, --t-mid, --sigma_max); leave it out", param_hint=option)
    steps, t_mid = steps or CONSISTENCY_STEPS, T_MID if t_mid is None else t_mid
    t_max = default_t_max(sampler_kwargs["sigma_max"], net.sigma_data)
    try:
        check_cm_settings(steps, t_mid, t_max)
    except SamplerError as e:
        raise click.ClickException(str(e).replace("t_mid=", "--t-mid=").replace("steps=", "--steps=")) from None
    times = ", ".join(f"{t:.4g}" for t in cm_times(steps, t_max, t_mid, net.sigma_data))
    kwargs = dict(steps=steps, t_mid=t_mid, sigma_max=sampler_kwargs["sigma_max"],
                  **({} if guidance == 1 else dict(guidance_scale=guidance)))
    scale = "" if guidance == 1 else f", guidance scale {guidance:g} embedded"
    return consistency_sample, kwargs, steps, f"consistency model, {steps} step(s) at TrigFlow times t = {times}{scale}"


def read_prompt_options(prompt: Sequence[str], prompts_path: str | None) -> list[str] | None:
    """The prompts of --prompt (each one given) or --prompts (a file, one a line), None for neither; both, or a
    file without a prompt, refused in one line."""
    if prompt and prompts_path is not None:
        raise click.UsageError("give --prompt or --prompts, not both")
    if prompts_path is None:
        return list(prompt) or None
    try:
        return read_prompts(prompts_path)
    except PromptsError as e:
        raise click.BadParameter(str(e), param_hint="--prompts") from None


def prompt_conditions(net, metadata: dict, prompts: list[str] | None, classes: SeedRanges | None,
                      text_encoder: str | None) -> PromptConditions | None:
    """The conditions of the prompts for a text network (its recorded text encoder loaded and checked), None for
    another network; prompts for a network without text, classes for one with text, and a text network without
    prompts or its text encoder refused in one line each."""
    if not is_text_network(net):
        if prompts is not None:
            kind = "class-conditional" if net.label_dim else "unconditional"
            raise click.BadParameter(f"this network is {kind}, not a text-to-image network: it takes no prompts",
                                     param_hint="--prompt/--prompts")
        return None
    if classes is not None:
        raise click.BadParameter("this is a text-to-image network: it takes prompts (--prompt or --prompts), not "
                                 "classes", param_hint="--class")
    if prompts is None:
        raise click.UsageError("this is a text-to-image network: give --prompt=TEXT or --prompts=FILE")
    record = text_record(metadata)
    if record is None:
        raise click.BadParameter("the snapshot records no text encoding (metadata dataset.text_encoding), so its "
                                 "text encoder is unknown", param_hint="--net")
    encoder = load_for_option("--text-encoder", functools.partial(load_prompt_encoder, record, text_encoder))
    return PromptConditions(encoder, prompts)


def load_networks(net_path: str, gnet_path: str | None, guidance: float, classes: SeedRanges | None,
                  plan: Callable[[torch.nn.Module, dict], T], prompts: list[str] | None = None,
                  text_encoder: str | None = None):
    """(net, gnet or None, encoder, plan(net, metadata), prompt conditions or None) on this rank's device, the
    encoder's VAE loaded too (before any sampling) after plan has accepted the network and a text network's text
    encoder has been checked (prompt_conditions); gnet is loaded only when guidance uses it, and is SELF for
    --gnet=self."""
    net, encoder, metadata = load_for_option("--net", functools.partial(load_generator, net_path))
    planned = plan(net, metadata)
    conditions = prompt_conditions(net, metadata, prompts, classes, text_encoder)
    load_for_option("--net", functools.partial(encoder.init, distributed.device()))
    guided = guidance != 1 and gnet_path is not None  # a consistency model's scale needs no guiding network
    gnet = load_for_option("--gnet", functools.partial(load_guide, gnet_path, net, metadata)) if guided else None
    highest = max((r[-1] for r in classes.ranges), default=None) if classes is not None else None
    if highest is not None and highest >= net.label_dim:
        raise click.BadParameter(f"{highest} is not a class of this network ({net.label_dim} classes)",
                                 param_hint="--class")
    device = distributed.device()
    return net.to(device), (gnet.to(device) if gnet not in (None, SELF) else gnet), encoder, planned, conditions


def print_dry_run(net_path: str, net, evaluations: int, about: str, images: int) -> None:
    """What a run would sample, at what cost: network evaluations and Gflops per image (edm2.eval.flops) and in all."""
    per_evaluation = count_flops(net).total
    print(f"{'Network':<13}{shown(net_path)}")
    print(f"{'Sampling':<13}{about}")
    print(f"{'Evaluations':<13}{evaluations} per image, {evaluations * images:,} for {images:,} images")
    print(f"{'Gflops':<13}{evaluations * per_evaluation / 1e9:.4g} per image ({per_evaluation / 1e9:.4g} per "
          f"evaluation), {evaluations * per_evaluation * images / 1e9:.4g} in all; a guiding network's come on top")


def grid_columns(count: int, rows: int) -> int:
    """Columns of grid.png: one per seed with several classes (a row each), else a square."""
    return count // rows if rows > 1 else math.isqrt(count - 1) + 1


def check_grid(count: int, rows: int, resolution: int) -> None:
    """Refuse a --grid of count images (rows classes) that cannot be drawn: a grid of images no smaller than the
    network's resolution (decoding never shrinks them) beyond MAX_IMAGE_PIXELS, an image our own readers refuse,
    kept in memory whole until the end."""
    cols = grid_columns(count, rows)
    side = resolution + 1  # an image and its one-pixel gap
    pixels = (-(-count // cols) * side - 1) * (cols * side - 1)
    if pixels > MAX_IMAGE_PIXELS:
        raise click.BadParameter(f"{count} images of {resolution}x{resolution} pixels or more make a grid of over "
                                 f"{pixels:,} pixels, beyond the {MAX_IMAGE_PIXELS:,} of an image our tools read; "
                                 "leave out --grid or give fewer --seeds or --class", param_hint="--grid")


def gather_grid(keys: Sequence, generated: dict, cols: int) -> np.ndarray | None:
    """Tile every rank's images, in the order of keys (seeds, or (class, seed) pairs), into one HWC array on rank 0
    (None elsewhere), cols images wide (grid_columns), with a one-pixel gap between them (image_grid.tile)."""
    stack = gather_images(keys, generated)
    return None if stack is None else tile(stack, cols)


def prompt_grid(seeds: Sequence[int], prompts: list[str], generated: dict) -> np.ndarray | None:
    """grid.png of a text network on rank 0 (None elsewhere): one row per prompt (in the order given, those of no
    seed left out), the images of its seeds (prompt_index) in seed order, the prompt drawn at the row's left."""
    rows = [(k, [seed for seed in seeds if prompt_index(seed, len(prompts)) == k]) for k in range(len(prompts))]
    rows = [(k, row) for k, row in rows if row]
    stack = gather_images([(None, seed) for _, row in rows for seed in row], generated)
    if stack is None:
        return None
    ends = np.cumsum([len(row) for _, row in rows])[:-1]
    return labelled_rows(np.split(stack, ends), [prompts[k] for k, _ in rows])


def gather_images(keys: Sequence, generated: dict) -> np.ndarray | None:
    """Every rank's images, in the order of keys (keys of generated on the rank that made them), as one NHWC array
    on rank 0 (None elsewhere)."""
    shape = distributed.broadcast_object(next(iter(generated.values())).shape if distributed.is_main() else None)
    stack = torch.zeros([len(keys), *shape], dtype=torch.uint8, device=distributed.device())
    for i, key in enumerate(keys):
        if key in generated:
            stack[i] = torch.from_numpy(generated[key])
    # Each image comes from exactly one rank, so a sum gathers them without overflow.
    stack = distributed.all_reduce_sum(stack).cpu().numpy()
    return stack if distributed.is_main() else None


def image_path(outdir: Path, seed: int, subdirs: bool, class_idx: int | None = None) -> Path:
    """Where the image of a seed goes: OUTDIR/SEED.png, or OUTDIR/BLOCK/SEED.png with --subdirs; SEED-cCLASS.png
    when one run samples several classes."""
    name = f"{seed:06d}" + ("" if class_idx is None else f"-c{class_idx:04d}")
    return outdir / (f"{seed - seed % 1000:06d}" if subdirs else "") / f"{name}.png"


def save_images(batches, outdir: Path, subdirs: bool, rows: Sequence[int | None], labels: dict[str, int],
                generated: dict | None) -> None:
    """Save each batch's images as PNG (named by class too when rows, the classes asked for, are several), noting
    their classes in labels and, for the grid, keeping them in generated under (class row, seed)."""
    several = len(rows) > 1
    with contextlib.closing(batches):  # on an error, the progress bar ends before the error line
        for batch_seeds, images, classes in batches:
            for i, (seed, image) in enumerate(zip(batch_seeds, images.permute(0, 2, 3, 1).cpu().numpy())):
                row = classes[i] if several else rows[0]
                path = image_path(outdir, seed, subdirs, row if several else None)
                save_png(path, image)
                if classes is not None:
                    labels[path.relative_to(outdir).as_posix()] = classes[i]
                if generated is not None:
                    generated[row, seed] = image


def save_labels(outdir: Path, earlier: dict[str, int], labels: dict[str, int]) -> None:
    """Gather every rank's {image name: class} and write them, with those of earlier runs, to OUTDIR/labels.json."""
    gathered = distributed.all_gather_object(labels)
    if distributed.is_main():
        merged = dict(earlier)
        for part in gathered:
            merged.update(part)
        save_generated_labels(outdir / LABELS_FILE, merged)


@click.command(cls=Command, epilog="""\b
Examples:
  # 64 images from the release's EDM2-S (ImageNet-512), guided by its XS unconditional model, into out/
  python generate.py --guidance=1.4
  # A named release preset, 8 GPUs
  torchrun --nproc_per_node=8 generate.py --preset=edm2-img512-xxl-guid-fid --seeds=0-49999 --subdirs
  # Our own snapshot, class 88 only, plus grid.png for a quick look
  python generate.py --net=training-runs/run/network-snapshot-0008388-0.100.safetensors --class=88 --seeds=0-15 --grid
  # A text-to-image snapshot: two prompts, guided by its empty-caption branch, one grid row per prompt
  python generate.py --net=run/network-snapshot-0008388-0.100.safetensors --text-encoder=t5-folder \\
      --prompt="a red circle on the left" --prompt="a blue square on the right" --gnet=self --guidance=2 --grid
""")
@config_option()
@click.option("--preset", help="Release configuration preset (net, gnet and guidance) [default: edm2-img512-s-guid-fid without --net]")
@click.option("--net", help="Main network: our .safetensors snapshot or a release .pkl, path or URL")
@click.option("--gnet", help="Guiding network for --guidance other than 1: path or URL, or 'self' for the main "
              "network's own unconditional prediction (a network trained with --label-dropout or --text-dropout)")
@click.option("--outdir", type=click.Path(file_okay=False), default="out", show_default=True, help="Where to save the images")
@click.option("--subdirs", is_flag=True, help="Put each block of 1000 seeds in its own subdirectory")
@click.option("--seeds", type=SeedList(), default="0-63", show_default=True, help="Seeds: list and/or ranges, e.g. 0-63,100")
@click.option("--prompt", multiple=True, help="A text-to-image network's prompt; repeat it for several: seed s gets "
              "prompt number s mod (number of prompts)")
@click.option("--prompts", "prompts_path", metavar="FILE", help="A text-to-image network's prompts, one a line: seed s "
              "gets prompt number s mod (number of prompts)")
@click.option("--text-encoder", metavar="DIR|ID", help="A text-to-image network's text encoder: the one its training "
              "data's embeddings came from (checked against the snapshot's record; by default the recorded folder, where it "
              "exists here); an ID may download")
@click.option("--class", "classes", type=SeedList(noun="class"), metavar="CLASSES",
              help="Classes, e.g. 3 or 0-9 or 1,5,7: every seed in each class, the networks loaded once  "
                   "[default: random per seed]")
@click.option("--batch", "batch_size", type=Integer(1, MAX_BATCH), default=32, show_default=True, help="Images per batch and process")
@click.option("--steps", "num_steps", type=Integer(1, MAX_STEPS), default=None,
              help=f"Sampling steps  [default: {DIFFUSION_STEPS}; {CONSISTENCY_STEPS} for a consistency model]")
@click.option("--t-mid", type=Number(min=0, min_open=True), default=None,
              help=f"A consistency model's TrigFlow time of its second step, in (0, arctan(sigma_max / sigma_data))  "
                   f"[default: {T_MID}, the sCM paper's]")
@solver_option
@schedule_option
@click.option("--sigma_min", type=Number(min=0, min_open=True), default=0.002, show_default=True, help="Lowest noise level")
@click.option("--sigma_max", type=Number(min=0, min_open=True), default=80, show_default=True, help="Highest noise level")
@click.option("--rho", type=Number(min=0, min_open=True), default=7, show_default=True,
              help="Time step exponent of --schedule=edm (EDM Eq. 5)")
@click.option("--guidance", type=Guidance(), help="Guidance strength w of Eq. 152; 1 = no guidance [default: from preset, else 1]")
@click.option("--S_churn", "S_churn", type=Number(min=0), default=0, show_default=True, help="Stochasticity strength")
@click.option("--S_min", "S_min", type=Number(min=0), default=0, show_default=True, help="Stochasticity from this noise level")
@click.option("--S_max", "S_max", type=Number(min=0, allow_inf=True), default=float("inf"), show_default=True,
              help="Stochasticity up to this noise level")
@click.option("--S_noise", "S_noise", type=Number(min=0), default=1, show_default=True, help="Stochastic noise inflation")
@click.option("--grid", is_flag=True, help="Also save all images as one grid.png (one-pixel white gaps): in seed "
              "order, or with several --class one row per class, or with prompts one row per prompt, labelled with it")
@click.option("--guidance-interval", type=SigmaInterval(), default=None,
              help="Guide only the steps whose noise level sigma lies in (SIGMA_LO, SIGMA_HI], e.g. 0.28,5.42 "
                   "(Kynkaanniemi et al. 2024); unguided elsewhere  [default: every step]")
@click.option("-n", "--dry-run", is_flag=True, help="Print how the network would sample and at what cost (network "
              "evaluations and Gflops per image), then stop: nothing is written")
@sampling_speed_options
@threads_option
def main(preset, net, gnet, outdir, subdirs, seeds, prompt, prompts_path, text_encoder, classes, batch_size, guidance,
         grid, guidance_interval, speed, t_mid, dry_run, **sampler_kwargs):
    """Generate images with the EDM sampler (EDM2 paper Appendix D.1) and save them as PNG.

    A conditional network's images get their classes in OUTDIR/labels.json ({"labels": [[file, class], ...]},
    the release's dataset.json format; the entries of earlier runs into the same folder are kept).
    """
    net_path, gnet_path, guidance = resolve_networks(preset, net, gnet, guidance)
    prompts = read_prompt_options(prompt, prompts_path)
    check_before_work(outdir, guidance, guidance_interval,
                      dict(sampler_kwargs, num_steps=sampler_kwargs["num_steps"] or DIFFUSION_STEPS))
    plan = functools.partial(sampling_plan, gnet_path=gnet_path, guidance=guidance,
                             guidance_interval=guidance_interval, t_mid=t_mid, sampler_kwargs=sampler_kwargs)
    if dry_run:
        network, metadata = load_for_option("--net", functools.partial(load_network, net_path))
        print_dry_run(net_path, network, *plan(network, metadata)[2:], images=len(seeds) * len(classes or [None]))
        return
    outdir = Path(outdir)
    # One run at a time writes outdir: two would each write labels.json with their own images only.
    with distributed.session(), locks.hold_destination(outdir, "generate.py", locks.FOLDER_LOCK):
        earlier = distributed.main_rank_first(functools.partial(earlier_labels, outdir))
        if distributed.is_main():  # what an earlier, killed run left half-written
            files.remove_stale_temporaries(outdir, recursive=subdirs)
        net, gnet, encoder, (sampler, sampler_kwargs, _, about), conditions = load_networks(
            net_path, gnet_path, guidance, classes, plan, prompts, text_encoder)
        rows = list(classes) if classes is not None else [None]  # each below label_dim: load_networks checked
        if grid:
            check_grid(len(seeds) * len(rows), len(rows), net.img_resolution)
        net, gnet = apply_speed(speed, net, gnet, distributed.device())
        interval = "" if guidance_interval is None else " for sigma in ({:g}, {:g}]".format(*guidance_interval)
        guide = "its own unconditional prediction" if gnet == SELF else gnet_path
        distributed.print0(f"Generating {len(seeds) * len(rows)} images from {net_path}"
                           + (f", {len(seeds)} in each of {len(rows)} classes" if len(rows) > 1 else "")
                           + (f" for {len(prompts)} prompt(s)" if conditions is not None else "")
                           + (f", guided by {guide} at {guidance:g}{interval}" if gnet is not None else "")
                           + f": {about}")
        generated, labels = {}, {}
        # Several classes share batches: every seed in each class, the batches filled across classes.
        batches = generate_images(net, encoder, seeds, class_idx=classes if len(rows) > 1 else rows[0], gnet=gnet,
                                  guidance=guidance if gnet is not None else 1, batch_size=batch_size,
                                  device=distributed.device(), sampler=sampler,
                                  conditions=None if conditions is None else conditions.of_seeds, **sampler_kwargs)
        save_images(batches, outdir, subdirs, rows, labels, generated if grid else None)
        if net.label_dim:
            save_labels(outdir, earlier, labels)
        if grid:
            keys = [(c, seed) for c in rows for seed in seeds]  # one row per class when there are several
            tiles = prompt_grid(seeds, prompts, generated) if conditions is not None else \
                gather_grid(keys, generated, cols=grid_columns(len(keys), len(rows)))
            if tiles is not None:
                save_png(outdir / GRID_FILE, tiles)
        distributed.barrier()
        extras = [name for name, made in ((LABELS_FILE, net.label_dim), (GRID_FILE, grid)) if made]
        listed = (", ".join([f"{len(seeds) * len(rows)} images", *extras[:-1]])
                  + "".join(f" and {name}" for name in extras[-1:]))
        distributed.print0(f"Saved {listed} in {outdir}")


if __name__ == "__main__":
    main()
