"""The FID-CLIP curve, as NeMo reports text-to-image models: for each guidance strength, images generated for the
prompts, their FID against reference statistics and their mean CLIP score (edm2.eval.clip_score), one point each.

Images come from a source, guidance -> batches of (uint8 images, their prompts), so the curve knows nothing of how
they are made; prompt_source builds one from any generator of (seeds, prompts, guidance) -> images. Seed s is
given the prompt prompts[s % len(prompts)]: consecutive seeds walk through the prompts in file order, and a prompt
list as long as the seed range gives every prompt one image.
"""

from __future__ import annotations

import os
from typing import Callable, Iterable, Iterator, Sequence

import torch

from edm2.eval.clip_score import ScoreMean
from edm2.eval.metrics import Stats, calculate_stats, frechet_distance
from edm2.procedures.prompts import prompt_of_seed
from edm2.runtime import distributed

# (seeds, their prompts, guidance) -> uint8 NCHW images, one per seed.
Generate = Callable[[list[int], list[str], float], torch.Tensor]
# guidance -> this rank's batches of (uint8 NCHW images, their prompts).
ImageSource = Callable[[float], Iterable[tuple[torch.Tensor, list[str]]]]


def prompt_source(generate: Generate, prompts: Sequence[str], seeds: Sequence[int], batch_size: int) -> ImageSource:
    """The image source of a generator: for each guidance, this rank's batches of seeds (as generation splits
    them), each generated with its seeds' prompts."""
    def images(guidance: float) -> Iterator[tuple[torch.Tensor, list[str]]]:
        for batch in distributed.rank_batches(seeds, batch_size, distributed.get_rank(),
                                              distributed.get_world_size(), skip_empty=True):
            batch_seeds = [int(seed) for seed in batch]
            batch_prompts = [prompt_of_seed(prompts, seed) for seed in batch_seeds]
            yield generate(batch_seeds, batch_prompts, guidance), batch_prompts
    return images


def curve_point(batches: Iterable[tuple[torch.Tensor, list[str]]], fid_detector: Callable, clip: Callable,
                reference: Stats, device: torch.device | str = "cpu") -> dict:
    """{fid, clip_score, num_images} of batches of (images, prompts): each batch seen once, by both detectors."""
    scores = ScoreMean(device)

    def scored(batches):
        for images, prompts in batches:
            scores.add(clip(images, prompts))
            yield images

    stats, count = calculate_stats(scored(batches), {"fid": fid_detector}, device, progress=False)
    clip_score, _ = scores.finalize()
    ours, ref = stats["fid"], reference["fid"]
    return dict(fid=frechet_distance(ours["mu"], ours["sigma"], ref["mu"], ref["sigma"]), clip_score=clip_score,
                num_images=count)


def fid_clip_curve(guidances: Sequence[float], source: ImageSource, fid_detector: Callable, clip: Callable,
                   reference: Stats, device: torch.device | str = "cpu",
                   report: Callable[[dict], None] | None = None) -> list[dict]:
    """One point {guidance, fid, clip_score, num_images} per guidance strength, in the order given; report sees
    each point as it is done."""
    points = []
    for guidance in guidances:
        points.append(dict(guidance=guidance, **curve_point(source(guidance), fid_detector, clip, reference,
                                                             device)))
        if report is not None:
            report(points[-1])
    return points
