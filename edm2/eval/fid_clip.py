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

from edm2.errors import EDM2Error
from edm2.eval.clip_score import ScoreMean
from edm2.eval.metrics import Stats, calculate_stats, frechet_distance
from edm2.runtime import distributed, files

# (seeds, their prompts, guidance) -> uint8 NCHW images, one per seed.
Generate = Callable[[list[int], list[str], float], torch.Tensor]
# guidance -> this rank's batches of (uint8 NCHW images, their prompts).
ImageSource = Callable[[float], Iterable[tuple[torch.Tensor, list[str]]]]
MAX_PROMPTS_BYTES = 1 << 28  # 256 MiB: COCO-2014's 30k captions are about 1.6 MB


class PromptsError(EDM2Error):
    """A prompts file cannot be read or holds no prompt; the message names the file."""


def read_prompts(path: str | os.PathLike) -> list[str]:
    """The prompts of a UTF-8 text file, one a line (surrounding spaces removed, blank lines skipped)."""
    try:
        with files.open_input(path) as file:
            size = os.fstat(file.fileno()).st_size
            if size > MAX_PROMPTS_BYTES:
                raise PromptsError(f"{path} is {size} bytes; a prompts file holds at most {MAX_PROMPTS_BYTES}")
            data = file.read(MAX_PROMPTS_BYTES + 1)
    except OSError as e:
        raise PromptsError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PromptsError(f"{path} is not UTF-8 text (byte {e.start}); write one prompt a line") from None
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise PromptsError(f"{path} holds no prompt; write one prompt a line")
    return prompts


def prompt_of_seed(prompts: Sequence[str], seed: int) -> str:
    """The prompt of the image of seed `seed`: prompts[seed % len(prompts)]."""
    return prompts[seed % len(prompts)]


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
