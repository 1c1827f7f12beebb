"""Calculate FID and FD_DINOv2 (paper Appendix A.5, D.4) for image folders or a network, on one GPU or many."""

from __future__ import annotations

import cli.wait_policy  # noqa: F401  first: PyTorch's OpenMP reads its wait policy once, when it loads
import functools
import json
from pathlib import Path
from typing import Callable

import click
import numpy as np
import torch

from cli import evaluation, sweep as sweep_cli, tensor_sweep
from cli.command import Group
from cli.config import config_option
from cli.solver import schedule_option, solver_option
from cli.speed import apply_speed, sampling_speed_options, threads_option
from cli.types import MAX_SEED_OPTION, Guidance, Integer, SigmaInterval
from edm2.encoders import Encoder, EncoderError
from edm2.errors import EDM2Error, one_line
from edm2.eval import clip_score, scores
from edm2.eval.detectors import PUBLISHED, DetectorError, load_detector
from edm2.eval.fid_clip import Generate, fid_clip_curve, prompt_source
from edm2.eval.metrics import calculate_stats
from edm2.eval.stats_files import NotStatisticsError, StatsError, load_stats, save_stats
from edm2.eval.sweep import Measure, run_sweep
from edm2.formats.snapshot import SnapshotError, load_generator
from edm2.networks import Precond
from edm2.plots import save_png
from edm2.plots.fid_clip import fid_clip_figure
from edm2.procedures.generation import MAX_SEED, generate_images, sample_batch
from edm2.procedures.prompts import (PromptConditions, PromptsError, is_text_network, load_prompt_encoder,
                                     read_prompts, text_record)
from edm2.procedures.image_batches import GRID_FILE, image_batches, sample_indices
from edm2.runtime import distributed, files, locks
from edm2.runtime.limits import MAX_BATCH, MAX_IMAGES, MAX_WORKERS
from edm2.runtime.speed import SamplingSpeed

# Detector weights option per metric, so a bad file or URL is reported against the option that named it.
WEIGHTS_OPTIONS = {"fid": "inception", "fd_dinov2": "dinov2"}


def parse_metrics(ctx: click.Context, param: click.Parameter, value: str) -> list[str]:
    """'fid,fd_dinov2' -> ['fid', 'fd_dinov2'], refusing unknown names ('sweep' also knows 'loss')."""
    choices = [*scores.METRICS, *(["loss"] if ctx.info_name == "sweep" else [])]
    names = list(dict.fromkeys(name.strip() for name in value.split(",") if name.strip()))
    unknown = [name for name in names if name not in choices]
    if unknown or not names:
        raise click.BadParameter(f"unknown metric {', '.join(map(repr, unknown)) or '(none given)'}; "
                                 f"choose from {', '.join(choices)}")
    return names


inception_option = click.option(
    "--inception", help="A copy of the published Inception-v3 TorchScript file (FID), verified by its SHA-256  [default: $EDM2_CACHE_DIR/detectors/inception-2015-12-05.pt, downloaded once]",
    metavar="PATH|URL", default=None)


def metric_options(batch_default: int) -> Callable:
    """Options every command shares: which metrics, detector weights, batch size."""
    def decorate(fn: Callable) -> Callable:
        options = [
            click.option("--metrics", help="Metrics to compute: fid, fd_dinov2; kid, precision, recall, density, "
                         "coverage (Inception features; with _dinov2, e.g. recall_dinov2, DINOv2's)", metavar="LIST",
                         callback=parse_metrics,
                         default="fid,fd_dinov2", show_default=True),
            click.option("--batch", "batch_size", help="Images per batch and GPU", metavar="INT",
                         type=Integer(1, MAX_BATCH), default=batch_default, show_default=True),
            inception_option,
            click.option("--dinov2", help="A copy of the published DINOv2 ViT-L/14 weights (FD_DINOv2), verified by their SHA-256  [default: $EDM2_CACHE_DIR/detectors/dinov2_vitl14_pretrain.pth, downloaded once]",
                         metavar="PATH|URL", default=None),
        ]
        for option in reversed(options):
            fn = option(fn)
        return fn
    return decorate


workers_option = click.option("--workers", "num_workers", help="Data loading processes per GPU", metavar="INT",
                              type=Integer(0, MAX_WORKERS), default=2, show_default=True)


def load_reference(ref_path: str, metrics: list[str]) -> dict:
    """Reference statistics holding every requested metric (and the features the feature metrics compare); bad files
    and missing metrics name --ref."""
    try:
        ref = distributed.main_rank_first(functools.partial(load_stats, ref_path))
    except NotStatisticsError as e:
        raise click.BadParameter(f"{e}; compute its statistics first: python calculate_metrics.py ref "
                                 f"--data={ref_path} --dest=REF.npz, then pass --ref=REF.npz", param_hint="--ref") from None
    except (StatsError, files.DownloadError) as e:
        raise click.BadParameter(str(e), param_hint="--ref") from None
    missing = [metric for metric in metrics if scores.DETECTOR_OF[metric] not in ref]
    if missing:
        have = [m for m in metrics if m not in missing]
        raise click.BadParameter(f"{ref_path} has no statistics for {', '.join(missing)} (it has "
                                 f"{', '.join(ref)}); choose --metrics={','.join(have)}", param_hint="--ref")
    evaluation.check_features(ref, ref_path, metrics)
    return ref


def load_detectors(metrics: list[str], weights: dict[str, str | None], device: torch.device) -> dict:
    """The detector of each metric's features on this rank's device, each once; bad weights name their option."""
    detectors = {}
    for metric in scores.detectors_for(metrics):
        try:
            detectors[metric] = distributed.main_rank_first(
                functools.partial(load_detector, metric, weights[metric], device))
        except (DetectorError, files.DownloadError) as e:
            raise click.BadParameter(str(e), param_hint=f"--{WEIGHTS_OPTIONS[metric]}") from None
    return detectors


def check_dimensions(ref: dict, ref_path: str, detectors: dict) -> None:
    """Refuse reference statistics whose width differs from the detector's features (before computing any)."""
    for metric, detector in detectors.items():
        dim = ref[metric]["mu"].shape[0]
        if dim != detector.feature_dim:
            option = WEIGHTS_OPTIONS[metric]
            raise click.BadParameter(f"{ref_path} holds {dim}-dimensional {metric} statistics but the --{option} "
                                     f"detector gives {detector.feature_dim} features; they were computed with "
                                     f"another detector", param_hint="--ref")


def network_for_option(path: str, option: str, device: torch.device) -> tuple[Precond, Encoder, dict]:
    """A snapshot (ours or the release's .pkl) on device, its encoder and metadata; bad files name the option."""
    try:
        net, encoder, metadata = load_generator(path)
    except (SnapshotError, files.DownloadError) as e:
        raise click.BadParameter(str(e), param_hint=option) from None
    return net.to(device), encoder, metadata


def load_decoder(encoder: Encoder, option: str, device: torch.device) -> None:
    """Load what the encoder decodes with (the VAE of a latent-space network) before any image is generated; a
    failure names the option of the network."""
    try:
        distributed.main_rank_first(functools.partial(encoder.init, device))
    except EncoderError as e:
        raise click.BadParameter(str(e), param_hint=option) from None


def check_generation_options(gnet_path: str | None, guidance: float, guidance_interval: tuple[float, float] | None,
                             seed: int, num_images: int) -> None:
    """Refuse, before any work, guidance without a guiding network, an interval without guidance, and seeds past
    2**32 (gen and sweep generate alike)."""
    if guidance != 1 and gnet_path is None:
        raise click.BadParameter(f"--guidance={guidance:g} needs a guiding network", param_hint="--gnet")
    if guidance_interval is not None and guidance == 1:
        raise click.BadParameter("applies only with guidance: give --guidance other than 1 and --gnet",
                                 param_hint="--guidance-interval")
    if seed + num_images > MAX_SEED:  # checked now, not at the first batch past the limit hours later
        raise click.BadParameter(f"seeds {seed}..{seed + num_images - 1} go past {MAX_SEED - 1}; every seed must be "
                                 "below 2**32", param_hint="--seed")


@click.group(cls=Group, context_settings={"max_content_width": 120})
def main() -> None:
    """Calculate evaluation metrics (FID and FD_DINOv2).

    Examples:

    \b
    # Reference statistics of a dataset (all its images)
    python calculate_metrics.py ref --data=datasets/img512.zip --dest=refs/img512.npz

    \b
    # Metrics of 50,000 images in out/ against reference statistics (ours or the release's)
    python calculate_metrics.py calc --images=out \\
        --ref=https://nvlabs-fi-cdn.nvidia.com/edm2/dataset-refs/img512.pkl

    \b
    # Metrics of a network, generating images on the fly on 8 GPUs
    torchrun --standalone --nproc_per_node=8 calculate_metrics.py gen \\
        --net=https://nvlabs-fi-cdn.nvidia.com/edm2/posthoc-reconstructions/edm2-img512-s-2147483-0.130.pkl \\
        --ref=refs/img512.npz --metrics=fid

    Statistics files: .npz (ours, '<metric>/mu' and '<metric>/sigma' in float64), the release's .pkl, or
    EDM's .npz (FID only). Detector weights are looked for in $EDM2_CACHE_DIR/detectors/ (default
    ~/.cache/edm2/detectors/) and downloaded there once from their published URLs; without internet, copy
    the files there, or point --inception and --dinov2 at local copies.
    Only the published files are loaded: each is verified by its SHA-256 before anything reads it, and any
    other file is refused (the Inception file is a program, run as it is).
    """


@main.command()
@click.option("--data", "data_path", help="Dataset: directory or ZIP of images", metavar="PATH|ZIP", required=True)
@click.option("--dest", "dest_path", help="Statistics file to write (.npz ours, .pkl the release's format)",
              metavar="NPZ|PKL", required=True)
@metric_options(batch_default=64)
@evaluation.features_option
@workers_option
@threads_option
def ref(data_path: str, dest_path: str, metrics: list[str], batch_size: int, num_workers: int,
        inception: str | None, dinov2: str | None, features: int) -> None:
    """Calculate reference statistics of all images of a dataset for 'calc' and 'gen'."""
    dest = evaluation.check_dest(dest_path)
    with distributed.session(), locks.hold_destination(dest, "calculate_metrics.py ref"):
        dataset = evaluation.open_images(data_path, "--data")
        if len(dataset) < 2:
            raise click.BadParameter(f"{data_path} holds {len(dataset)} image; statistics need at least 2",
                                     param_hint="--data")
        if distributed.is_main():
            files.remove_stale_temporaries(dest.parent, name=dest.name)  # left by a killed earlier run
        device = distributed.device()
        detectors = load_detectors(metrics, {"fid": inception, "fd_dinov2": dinov2}, device)
        batches = image_batches(dataset, evaluation.reference_order(len(dataset), features), batch_size, num_workers,
                                device)
        stats, num_images = calculate_stats(batches, detectors, device, num_batches=len(batches),
                                            keep_features=min(features, len(dataset)))
        if distributed.is_main():
            save_stats(dest, stats)
            print(f"Saved {', '.join(metrics)} statistics of {num_images} images from {data_path} to {dest_path}",
                  flush=True)
            print(json.dumps({"dest": dest_path, "num_images": num_images, "metrics": metrics}), flush=True)


@main.command()
@click.option("--images", "images_path", help=f"Images: directory or ZIP of PNG, JPEG, WebP or any format PIL reads "
              f"(a top-level {GRID_FILE} from generate.py --grid is skipped)", metavar="PATH|ZIP", required=True)
@click.option("--ref", "ref_path", help="Reference statistics", metavar="NPZ|PKL|URL", required=True)
@metric_options(batch_default=64)
@click.option("--num", "num_images", help="Number of images to use (a random subset if there are more)",
              metavar="INT", type=Integer(2, MAX_IMAGES), default=50000, show_default=True)
@click.option("--seed", help="Random seed for choosing the subset", metavar="INT", type=Integer(0, MAX_SEED_OPTION),
              default=0, show_default=True)
@workers_option
@threads_option
def calc(images_path: str, ref_path: str, metrics: list[str], batch_size: int, inception: str | None,
         dinov2: str | None, num_images: int, seed: int, num_workers: int) -> None:
    """Calculate metrics of a set of images."""
    with distributed.session():
        reference = load_reference(ref_path, metrics)
        dataset = evaluation.open_images(images_path, "--images")
        samples = sample_indices(dataset.fnames)
        if len(samples) < num_images:
            raise click.BadParameter(f"found {len(samples)} images in {images_path}, fewer than --num={num_images}; "
                                     f"pass --num={len(samples)} to use them all", param_hint="--images")
        # The release's subset: shuffle with the seed, keep the first --num, in file order.
        indices = samples[np.sort(np.random.RandomState(seed % (1 << 31)).permutation(len(samples))[:num_images])]
        device = distributed.device()
        detectors = load_detectors(metrics, {"fid": inception, "fd_dinov2": dinov2}, device)
        check_dimensions(reference, ref_path, detectors)
        batches = image_batches(dataset, indices, batch_size, num_workers, device)
        stats, count = calculate_stats(batches, detectors, device, num_batches=len(batches),
                                       keep_features=evaluation.features_to_keep(reference, metrics))
        evaluation.report(scores.metric_values(stats, reference, metrics, device), count, images_path, ref_path)


@main.command()
@config_option()
@click.option("--net", "net_path", help="Network: our snapshot or the release's .pkl", metavar="PATH|URL",
              required=True)
@click.option("--gnet", "gnet_path", help="Guiding network for --guidance, or 'self': the network's own "
              "unconditional prediction (trained with --label-dropout)", metavar="PATH|URL|self", default=None)
@click.option("--guidance", help="Guidance strength (1 = no guidance)", metavar="FLOAT", type=Guidance(), default=1.0,
              show_default=True)
@click.option("--guidance-interval", help="Guide only the steps whose sigma lies in (SIGMA_LO, SIGMA_HI], e.g. "
              "0.28,5.42 (Kynkaanniemi et al. 2024)  [default: every step]", type=SigmaInterval(), default=None)
@solver_option
@schedule_option
@click.option("--ref", "ref_path", help="Reference statistics", metavar="NPZ|PKL|URL", required=True)
@metric_options(batch_default=32)
@click.option("--num", "num_images", help="Number of images to generate", metavar="INT", type=Integer(2, MAX_IMAGES),
              default=50000, show_default=True)
@click.option("--seed", help="Seed of the first image (images use seeds seed .. seed+num-1)", metavar="INT",
              type=Integer(0, MAX_SEED_OPTION), default=0, show_default=True)
@evaluation.seed_set_options
@sampling_speed_options
@threads_option
def gen(net_path: str, gnet_path: str | None, guidance: float, guidance_interval: tuple[float, float] | None,
        solver: str, schedule: str, ref_path: str, metrics: list[str], batch_size: int, inception: str | None,
        dinov2: str | None, num_images: int, seed: int, seed_sets: int | list, results_path: Path | None,
        speed: SamplingSpeed) -> None:
    """Calculate metrics of a network with the default sampler settings, without saving images."""
    check_generation_options(gnet_path, guidance, guidance_interval, seed, num_images)
    sets = evaluation.seed_sets(seed_sets, seed, num_images)
    evaluation.check_results_path(results_path)
    with distributed.session():
        reference = load_reference(ref_path, metrics)
        device = distributed.device()
        net, encoder, metadata = distributed.main_rank_first(
            functools.partial(network_for_option, net_path, "--net", device))
        load_decoder(encoder, "--net", device)
        gnet = sweep_cli.guiding_network(gnet_path, net, metadata, device) if gnet_path is not None else None
        detectors = load_detectors(metrics, {"fid": inception, "fd_dinov2": dinov2}, device)
        check_dimensions(reference, ref_path, detectors)
        net, gnet = apply_speed(speed, net, gnet, device)
        sampler = dict(guidance=guidance, guidance_interval=guidance_interval, solver=solver, schedule=schedule)
        per_set = []
        for seeds in sets:  # one feature pass per disjoint seed set
            images = (batch for _, batch, _ in generate_images(net, encoder, seeds, gnet=gnet, batch_size=batch_size,
                                                            device=device, **sampler))
            stats, count = calculate_stats(images, detectors, device, progress=False,  # generate_images shows it
                                           keep_features=evaluation.features_to_keep(reference, metrics))
            per_set.append(scores.metric_values(stats, reference, metrics, device))
        if len(sets) == 1 and results_path is None:
            evaluation.report(per_set[0], count, net_path, ref_path)
            return
        if distributed.is_main():  # the digests read every file once more: one rank does it
            inputs = evaluation.inputs_record(ref_path, net_path, gnet_path, metadata, metrics, sampler)
            evaluation.finish_sets(inputs, sets, per_set, net_path, results_path)


@main.command(epilog=sweep_cli.EPILOG)
@config_option()
@sweep_cli.options
@metric_options(batch_default=32)
@threads_option
def sweep(indir: Path, stds: list[float], kimgs: tuple[int, ...] | None, metrics: list[str], batch_size: int,
          inception: str | None, dinov2: str | None, data_path: str | None, ref_path: str | None, num_images: int,
          seed: int, validation_loss: str, gnet_path: str | None, guidance: list[float],
          guidance_interval: tuple[float, float] | None, solver: str, schedule: str, dest: Path | None,
          save_dir: Path | None, ema_batch: int) -> None:
    """Metrics across EMA lengths (paper Figure 5) and guidance strengths (Figure 14) of a run, each network
    reconstructed in memory once and measured at every strength; resumable."""
    distances = [metric for metric in metrics if metric != "loss"]
    check_generation_options(gnet_path, max(guidance), guidance_interval, seed, num_images)
    settings = sweep_cli.check_options(metrics, num_images, seed, data_path, ref_path, gnet_path, guidance,
                                       guidance_interval, solver, schedule, validation_loss)
    plan = sweep_cli.plan(indir, kimgs, stds, dest, save_dir, settings)
    with distributed.session(), sweep_cli.held_outputs(plan):
        samples = (sweep_cli.validation_samples(data_path, plan, num_images, seed, validation_loss)
                   if "loss" in metrics else None)
        reference = load_reference(ref_path, distances) if distances else None
        device = distributed.device()
        gnet = (sweep_cli.guiding_network(gnet_path, sweep_cli.network_shape(plan.metadata), plan.metadata, device)
                if max(guidance) != 1 else None)
        detectors = load_detectors(distances, {"fid": inception, "fd_dinov2": dinov2}, device)
        if distances:
            load_decoder(plan.encoder, "--indir", device)
        if reference is not None:
            check_dimensions(reference, ref_path, detectors)
        measure = Measure(metrics, plan.encoder, range(seed, seed + num_images), batch_size, device, detectors,
                          reference, samples, gnet,
                          dict(guidance_interval=guidance_interval, solver=solver, schedule=schedule))
        main_rank = distributed.is_main()
        run_sweep(plan.times, stds, measure, plan.results if main_rank else None, ema_batch,
                  plan.save if main_rank else None, report=click.echo, guidances=guidance, recorded=measure.recorded)
        if main_rank:
            sweep_cli.finish(plan, metrics, guidance)

NEMO_GUIDANCE = "1,1.5,2,3,4,5,6"  # the strengths of NeMo's FID-CLIP curves


def load_clip(clip_path: str | None, device: torch.device) -> clip_score.ClipScore:
    """The CLIP score's detector on this rank's device; bad or missing files name --clip."""
    try:
        return distributed.main_rank_first(functools.partial(clip_score.ClipScore, clip_path, device))
    except (DetectorError, files.DownloadError) as e:
        raise click.BadParameter(str(e), param_hint="--clip") from None


def text_generator(net_path: str, gnet_path: str | None, text_encoder: str | None, device: torch.device,
                   sampler: dict) -> Generate:
    """The generator (seeds, prompts, guidance) -> uint8 images of the text-to-image network at net_path, guided by
    gnet_path ('self': its empty caption's branch), its prompts encoded by text_encoder (checked against the
    snapshot's record) and sampled as generate.py samples (sample_batch); a network that takes no text is refused,
    naming --net, and a missing or other text encoder naming --text-encoder."""
    net, encoder, metadata = distributed.main_rank_first(
        functools.partial(network_for_option, net_path, "--net", device))
    record = text_record(metadata)
    if record is None or not is_text_network(net):
        raise click.BadParameter(f"{net_path} records no text encoder: it is not a text-to-image network, and the "
                                 "FID-CLIP curve generates images for prompts", param_hint="--net")
    try:
        conditions = PromptConditions(distributed.main_rank_first(
            functools.partial(load_prompt_encoder, record, text_encoder)))
    except EDM2Error as e:
        raise click.BadParameter(one_line(e), param_hint="--text-encoder") from None
    load_decoder(encoder, "--net", device)
    gnet = sweep_cli.guiding_network(gnet_path, net, metadata, device) if gnet_path is not None else None

    def generate(seeds: list[int], prompts: list[str], guidance: float) -> torch.Tensor:
        guide = dict(gnet=gnet, guidance=guidance) if guidance != 1 else {}
        images, _ = sample_batch(net, encoder, seeds, None, device, conditions=conditions.of_prompts(prompts),
                                 **guide, **sampler)
        return images

    return generate


def report_point(point: dict) -> None:
    """One line per point of the FID-CLIP curve as it is done (rank 0)."""
    if distributed.is_main():
        click.echo(f"guidance {point['guidance']:g}: fid {point['fid']:.4f}  clip_score {point['clip_score']:.4f}  "
                   f"({point['num_images']} images)")


@main.command(name="fid-clip")
@click.option("--net", "net_path", help="Text-to-image network: our snapshot", metavar="PATH|URL", required=True)
@click.option("--gnet", "gnet_path", help="Guiding network for --guidance, or 'self': the network's own "
              "unconditional prediction (trained with --text-dropout)", metavar="PATH|URL|self", default=None)
@click.option("--guidance", help="Guidance strengths, one point of the curve each", type=evaluation.GuidanceList(),
              default=NEMO_GUIDANCE, show_default=True)
@click.option("--prompts", "prompts_path", help="Prompts, one a line; the image of seed s has prompt number "
              "s mod (number of prompts)", metavar="TXT", required=True)
@click.option("--text-encoder", help="The network's text encoder: the one its training data's embeddings came from "
              "(checked against the snapshot's record; by default the recorded folder, where it exists here); an ID "
              "may download", metavar="DIR|ID", default=None)
@click.option("--ref", "ref_path", help="Reference statistics (FID)", metavar="NPZ|PKL|URL", required=True)
@click.option("--dest", "dest_path", help="The curve's JSON file to write; its plot is written beside it (.png)",
              metavar="JSON", required=True)
@click.option("--num", "num_images", help="Images per guidance strength", metavar="INT",
              type=Integer(2, MAX_IMAGES), default=30000, show_default=True)
@click.option("--seed", help="Seed of the first image (images use seeds seed .. seed+num-1)", metavar="INT",
              type=Integer(0, MAX_SEED_OPTION), default=0, show_default=True)
@click.option("--batch", "batch_size", help="Images per batch and GPU", metavar="INT", type=Integer(1, MAX_BATCH),
              default=32, show_default=True)
@inception_option
@click.option("--clip", "clip_path", help="A folder with the published CLIP ViT-L/14 files (model.safetensors, "
              "vocab.json, merges.txt), each verified by its SHA-256  [default: "
              "$EDM2_CACHE_DIR/detectors/clip-vit-large-patch14/, downloaded once]", metavar="DIR", default=None)
@solver_option
@schedule_option
@threads_option
def fid_clip(net_path: str, gnet_path: str | None, guidance: list[float], prompts_path: str,
             text_encoder: str | None, ref_path: str, dest_path: str, num_images: int, seed: int, batch_size: int,
             inception: str | None, clip_path: str | None, solver: str, schedule: str) -> None:
    """The FID-CLIP curve of a text-to-image network: FID and CLIP score at each guidance strength, as a JSON file
    and a plot beside it (NeMo's protocol: the default strengths, 30k COCO-2014 prompts, CLIP ViT-L/14)."""
    dest = Path(dest_path)
    if dest.suffix != ".json":
        raise click.BadParameter(f"{dest_path}: use a .json name (the plot is written beside it as .png)",
                                 param_hint="--dest")
    evaluation.check_output_file(dest, "--dest", "the curve's JSON file")
    try:
        prompts = read_prompts(prompts_path)
    except PromptsError as e:
        raise click.BadParameter(str(e), param_hint="--prompts") from None
    check_generation_options(gnet_path, max(guidance), None, seed, num_images)
    with distributed.session(), locks.hold_destination(dest, "calculate_metrics.py fid-clip"):
        reference = load_reference(ref_path, ["fid"])
        device = distributed.device()
        sampler = dict(solver=solver, schedule=schedule)
        generate = text_generator(net_path, gnet_path, text_encoder, device, sampler)
        detectors = load_detectors(["fid"], {"fid": inception}, device)
        check_dimensions(reference, ref_path, detectors)
        clip = load_clip(clip_path, device)
        seeds = range(seed, seed + num_images)
        points = fid_clip_curve(guidance, prompt_source(generate, prompts, seeds, batch_size), detectors["fid"],
                                clip, reference, device, report=report_point)
        if distributed.is_main():
            settings = dict(net=net_path, gnet=gnet_path, text_encoder=text_encoder, prompts=prompts_path,
                            num_prompts=len(prompts),
                            prompt_of_seed="prompts[seed % len(prompts)]", seeds=f"{seeds.start}-{seeds.stop - 1}",
                            ref=ref_path, sampler=sampler,
                            detectors=dict(fid=dict(url=PUBLISHED["fid"].url, sha256=PUBLISHED["fid"].sha256),
                                           clip_score={name: dict(url=f.url, sha256=f.sha256) for name, f in
                                                       clip_score.VIT_L14.files().items()}))
            record = dict(points=points, settings=settings)
            evaluation.write_results(dest, record)
            save_png(fid_clip_figure(points), dest.with_suffix(".png"))
            click.echo(f"Saved {dest} and {dest.with_suffix('.png')}")
            click.echo(json.dumps(record))


main.add_command(tensor_sweep.command)
if __name__ == "__main__":
    main(prog_name="calculate_metrics.py")
