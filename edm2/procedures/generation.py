"""Generating images for a set of seeds across processes: each image depends on its seed alone.

The seeds are held as ranges (SeedRanges), each process takes its share of them batch by batch
(distributed.rank_batches), and every image gets its own random generator (SeededRandom).
"""

from __future__ import annotations

import bisect
import itertools
import json
import os
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import torch
import tqdm

from edm2.data.dataset import DatasetError
from edm2.data.dataset_json import is_class, parse_labels
from edm2.errors import EDM2Error
from edm2.formats.snapshot import load_network
from edm2.procedures.prompts import is_text_network
from edm2.runtime import bounded_json, distributed, files
from edm2.sampler import SELF, edm_sampler

# Seeds lie in [0, 2**32): the release seeds each image's generator with seed % 2**32
# (StackedRandomGenerator in its generate_images.py), so only these seeds give the release's images.
MAX_SEED = 2**32
# The class of every image generate.py writes, in the release's dataset.json format.
LABELS_FILE = "labels.json"
# The overview image generate.py --grid writes beside its samples; it is not a sample.
GRID_FILE = "grid.png"


class GenerationError(EDM2Error):
    """Seeds, a class or a guiding network that cannot be used to generate images."""


class SeedRanges(Sequence[int]):
    """Distinct seeds in the order first given, held as ranges, so a billion seeds cost a few integers.

    Built from ranges that may overlap; a seed that appears again later is left out, as from a list
    with its duplicates removed.
    """

    def __init__(self, ranges: Iterable[range]):
        self.ranges: list[range] = []
        taken_starts: list[int] = []  # seeds already present, as sorted disjoint [start, stop) intervals
        taken_stops: list[int] = []
        for r in ranges:
            if r.step != 1 or (len(r) and not 0 <= r.start < r.stop <= MAX_SEED):
                raise GenerationError(f"seeds must be consecutive integers in [0, {MAX_SEED}); got {r}")
            if not r:
                continue
            first = bisect.bisect_right(taken_stops, r.start)  # first interval that ends after r starts
            last = bisect.bisect_left(taken_starts, r.stop)  # intervals from here on start after r ends
            cursor = r.start
            for start, stop in zip(taken_starts[first:last], taken_stops[first:last]):
                self._append(range(cursor, start))
                cursor = max(cursor, stop)
            self._append(range(cursor, r.stop))
            merged_start = min([r.start, *taken_starts[first:last]])
            merged_stop = max([r.stop, *taken_stops[first:last]])
            taken_starts[first:last], taken_stops[first:last] = [merged_start], [merged_stop]
        self._offsets = [0, *itertools.accumulate(len(r) for r in self.ranges)]

    def _append(self, r: range) -> None:
        """Add the new seeds r, joining them to the previous range when they continue it."""
        if not r:
            return
        if self.ranges and self.ranges[-1].stop == r.start:
            self.ranges[-1] = range(self.ranges[-1].start, r.stop)
        else:
            self.ranges.append(r)

    def __len__(self) -> int:
        return self._offsets[-1]

    def __getitem__(self, index):
        """The seed at an index; a slice with step 1 is again a SeedRanges, other slices are lists."""
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            if start >= stop:
                return SeedRanges([])
            first, last = self._locate(start), self._locate(stop - 1)
            pieces = [self.ranges[k] for k in range(first, last + 1)]
            pieces[-1] = pieces[-1][: stop - self._offsets[last]]
            pieces[0] = pieces[0][start - self._offsets[first] :]
            return SeedRanges(pieces)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("seed index out of range")
        k = self._locate(index)
        return self.ranges[k][index - self._offsets[k]]

    def _locate(self, index: int) -> int:
        """Which range holds position `index`."""
        return bisect.bisect_right(self._offsets, index) - 1

    def __iter__(self) -> Iterator[int]:
        return itertools.chain.from_iterable(self.ranges)

    def __contains__(self, seed: object) -> bool:
        return any(seed in r for r in self.ranges)

    def __repr__(self) -> str:
        parts = (f"{r.start}" if len(r) == 1 else f"{r.start}-{r.stop - 1}" for r in self.ranges)
        return f"SeedRanges('{','.join(parts)}')"


class SeededRandom:
    """One torch.Generator per image, seeded by that image's seed; draws stack along the batch axis."""

    def __init__(self, seeds: Sequence[int], device: torch.device | str = "cpu"):
        bad = [seed for seed in seeds if not 0 <= int(seed) < MAX_SEED]
        if bad:
            raise GenerationError(f"seed {bad[0]} is outside [0, {MAX_SEED})")
        self.generators = [torch.Generator(device).manual_seed(int(seed)) for seed in seeds]
        self.device = torch.device(device)

    def randn(self, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Normal noise of shape [len(seeds), *shape]; row i comes from seed i's generator."""
        return torch.stack([torch.randn(tuple(shape), generator=g, device=self.device, dtype=dtype) for g in self.generators])

    def randint(self, high: int) -> torch.Tensor:
        """One integer in [0, high) per image, from that image's generator."""
        return torch.cat([torch.randint(high, (1,), generator=g, device=self.device) for g in self.generators])

    def randn_like(self, x: torch.Tensor) -> torch.Tensor:
        """Drop-in for torch.randn_like that keeps each image on its own generator."""
        return self.randn(x.shape[1:], dtype=x.dtype)


def seeded_inputs(
    seeds: Sequence[int],
    img_channels: int,
    img_resolution: int,
    label_dim: int,
    class_idx: int | Sequence[int] | None = None,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor | None, Callable[[torch.Tensor], torch.Tensor]]:
    """Initial unit noise, one-hot class labels (random per seed unless class_idx, one class for all or one per
    seed) and a per-seed randn_like."""
    rnd = SeededRandom(seeds, device)
    noise = rnd.randn([img_channels, img_resolution, img_resolution])
    labels = None
    if label_dim > 0:
        # Draw the random class even when class_idx overrides it, so churn noise does not depend on class_idx.
        classes = rnd.randint(label_dim)
        if class_idx is not None:
            classes = torch.as_tensor(class_idx, dtype=classes.dtype, device=classes.device).expand_as(classes)
        labels = torch.nn.functional.one_hot(classes, label_dim).to(torch.float32)
    return noise, labels, rnd.randn_like


def check_guidance_pair(net: torch.nn.Module, gnet: torch.nn.Module) -> None:
    """Raise GenerationError unless gnet can guide net: Eq. 152 blends their outputs pixel by pixel."""
    shape, gshape = (net.img_resolution, net.img_channels), (gnet.img_resolution, gnet.img_channels)
    if shape != gshape:
        raise GenerationError(
            f"the guiding network has resolution {gshape[0]} with {gshape[1]} channels "
            f"but the main network has resolution {shape[0]} with {shape[1]}"
        )
    if gnet.label_dim not in (0, net.label_dim):
        raise GenerationError(f"the guiding network has {gnet.label_dim} classes but the main network has {net.label_dim}")


def dropout_rate(metadata: dict, name: str) -> float:
    """The dropout `name` (label_dropout, text_dropout) a snapshot's network was trained with (its training
    options); 0 when they hold none."""
    options = metadata.get("training_options")
    p = options.get(name, 0) if isinstance(options, dict) else 0
    # A number in (0, 1) or nothing: metadata is read from a file, so anything else counts as none.
    return float(p) if type(p) in (int, float) and 0 < p < 1 else 0.0


def check_self_guidance(net, metadata: dict) -> None:
    """Raise GenerationError unless net can guide itself (metadata is its snapshot's): a text network trained with
    text dropout, so that its prediction for the empty caption is an unconditional one, or a class-conditional
    network trained with label dropout, so that its prediction for the all-zero label is."""
    if is_text_network(net):
        if not dropout_rate(metadata, "text_dropout"):
            raise GenerationError("self-guidance needs a text network trained with text dropout (train_edm2.py "
                                  "--text-dropout=P); this one's snapshot records none, so its empty caption was "
                                  "never trained")
        return
    if not net.label_dim:
        raise GenerationError("self-guidance needs a class-conditional network; this one is unconditional")
    if not dropout_rate(metadata, "label_dropout"):
        raise GenerationError("self-guidance needs a network trained with label dropout (train_edm2.py "
                              "--label-dropout=P); this one's snapshot records none, so its all-zero label was "
                              "never trained")


def check_guide(net, metadata: dict, gnet) -> None:
    """Raise GenerationError unless gnet can guide net (whose snapshot's metadata is given): check_self_guidance
    for gnet=SELF, else check_guidance_pair."""
    if gnet == SELF:
        check_self_guidance(net, metadata)
    else:
        check_guidance_pair(net, gnet)


def load_guide(gnet_path: str, net, metadata: dict) -> torch.nn.Module | str:
    """The guiding network gnet_path names, checked by check_guide to guide net (whose snapshot's metadata is
    given): SELF for gnet_path 'self', else the loaded network on the CPU."""
    gnet = SELF if gnet_path == SELF else load_network(gnet_path)[0]
    check_guide(net, metadata, gnet)
    return gnet


class ClassSeeds(Sequence[tuple[int, int]]):
    """Every seed in each class, class by class, as (class, seed) pairs computed when asked for."""

    def __init__(self, classes: Sequence[int], seeds: Sequence[int]):
        self.classes, self.seeds = classes, seeds

    def __len__(self) -> int:
        return len(self.classes) * len(self.seeds)

    def __getitem__(self, index):
        """The (class, seed) pair at an index (a slice gives a list of them)."""
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("index out of range")
        row, column = divmod(index, len(self.seeds))
        return int(self.classes[row]), int(self.seeds[column])


def generate_images(
    net: torch.nn.Module,
    encoder,
    seeds: Sequence[int],
    class_idx: int | Sequence[int] | None = None,
    gnet: torch.nn.Module | str | None = None,
    guidance: float = 1.0,
    batch_size: int = 32,
    device: torch.device | str | None = None,
    sampler: Callable[..., torch.Tensor] | None = None,
    conditions: Callable[[list[int]], torch.Tensor] | None = None,
    **sampler_kwargs,
) -> Iterator[tuple[list[int], torch.Tensor, list[int] | None]]:
    """Sample this rank's share of `seeds`; yield (batch seeds, uint8 NCHW images decoded by `encoder`, the class
    of every image or None for an unconditional network).

    `seeds` may be any sequence (a range, a SeedRanges): only one batch of it is ever a list. A sequence of classes
    as class_idx samples every seed in each class, class by class, the batches filled across classes (each image
    depends on its seed and class alone). sampler_kwargs go to the sampler: edm_sampler when None (num_steps, sigma_min,
    ..., guidance_interval), or edm2.consistency_sampler.consistency_sample for a consistency model (steps, t_mid,
    sigma_max; no gnet or guidance). gnet=SELF guides net by its own unconditional prediction (check_self_guidance tells whether
    it has one). A text network takes conditions: a batch's seeds -> their conditions [N, 1 + L, D + 1]
    (edm2.procedures.prompts.PromptConditions.of_seeds).
    """
    device = torch.device(device) if device is not None else distributed.device()
    several = class_idx is not None and not isinstance(class_idx, int)
    for c in (class_idx if several else [] if class_idx is None else [class_idx]):
        if not 0 <= c < net.label_dim:
            raise GenerationError(f"class {c} is out of range for a network with {net.label_dim} classes")
    if gnet not in (None, SELF) and guidance != 1:
        check_guidance_pair(net, gnet)
    # Only a guided run hands gnet and guidance on: a sampler without guidance (a consistency model's) takes neither.
    guide = {} if gnet is None and guidance == 1 else dict(gnet=gnet, guidance=guidance)
    jobs = ClassSeeds(class_idx, seeds) if several else None
    # Batches of job indices: RankBatches hands out ints, and each index names one (class, seed) pair.
    batches = distributed.rank_batches(range(len(jobs)) if several else seeds, batch_size, distributed.get_rank(),
                                       distributed.get_world_size(), skip_empty=True)
    # A context, so that closing this generator (the caller failed) ends the progress bar's line at once.
    with tqdm.tqdm(batches, unit="batch", disable=not distributed.is_main()) as progress:
        for batch in progress:
            pairs = [jobs[j] for j in batch] if several else None
            batch_seeds = [seed for _, seed in pairs] if several else batch
            batch_classes = [c for c, _ in pairs] if several else class_idx
            text = None if conditions is None else conditions(list(batch_seeds))
            images, classes = sample_batch(net, encoder, batch_seeds, batch_classes, device, sampler=sampler,
                                           conditions=text, **guide, **sampler_kwargs)
            yield batch_seeds, images, classes


def sample_batch(net: torch.nn.Module, encoder, seeds: Sequence[int], class_idx: int | Sequence[int] | None,
                 device: torch.device, sampler: Callable[..., torch.Tensor] | None = None,
                 conditions: torch.Tensor | None = None, **sampler_kwargs) -> tuple[torch.Tensor, list[int] | None]:
    """(uint8 NCHW images decoded by `encoder`, the class of every image or None) for one batch of seeds, on this
    process alone, a text network's conditioned on conditions [N, 1 + L, D + 1] (one per seed); sampler_kwargs go
    to the sampler (edm_sampler when None: gnet, guidance, num_steps, ...)."""
    noise, labels, randn_like = seeded_inputs(seeds, net.img_channels, net.img_resolution, net.label_dim, class_idx,
                                              device)
    if conditions is not None:
        labels = conditions.to(device)
    with torch.no_grad():
        latents = (sampler or edm_sampler)(net, noise, labels, randn_like=randn_like, **sampler_kwargs)
        images = encoder.decode(latents)
    return images, None if labels is None or conditions is not None else labels.argmax(dim=1).tolist()


def read_generated_labels(path: str | os.PathLike) -> dict[str, int]:
    """{image name: class} of an existing labels file ({} when there is none); GenerationError if it is not one."""
    path = Path(path)
    if not path.exists():
        return {}
    try:
        with files.open_input(path) as f:
            labels = parse_labels(f.read(bounded_json.MAX_BYTES + 1), path) or {}  # more is refused by its parse
    except (OSError, DatasetError) as e:
        raise GenerationError(f"{path} exists but is not a readable labels file ({e}); move it away") from None
    wrong = [v for v in labels.values() if not is_class(v)]
    if wrong:
        raise GenerationError(f"{path} exists but holds the label {json.dumps(wrong[0])}, not a class; move it away")
    return labels


def save_generated_labels(path: str | os.PathLike, labels: dict[str, int]) -> None:
    """Write {"labels": [[image name, class], ...]} sorted by name, atomically (the release's dataset.json format)."""
    rows = ",\n".join(json.dumps([name, labels[name]]) for name in sorted(labels))
    with files.atomic_path(path) as tmp:
        tmp.write_text(f'{{"labels": [\n{rows}\n]}}\n')
