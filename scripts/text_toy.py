"""Text conditioning proved on a CPU, measured by pixels: the captioned toy ("a red circle on the left") with some
colour/shape pairs held out of training, a text network and an unconditional one of the same size trained on it,
samples for prompts seen in training and for the held-out pairs at several guidance weights, and their adherence:

- colour: the hue of the bright pixels is the prompt's colour (edm2.data.toy_shapes.measure_adherence);
- side: the bright pixels' centroid is on the prompt's side (the same);
- shape: a small classifier trained here on real toy images (its accuracy on real images it did not see is
  printed) names the prompt's shape.

Guidance contrasts the network with its own unconditional branch: the same network given the empty caption's
condition (its `empty_text` buffer), D = D_empty + w (D_caption - D_empty) (paper Eq. 152). The unconditional
model's images are scored against the same prompts: chance level (colour 1/6, side 1/2, shape 1/classes).

Steps whose output exists are skipped, so a rerun continues. The last line printed is JSON.

    python scripts/text_toy.py --outdir=text-toy
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import click
import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout: use its edm2, not an installed one
from edm2.data.toy_shapes import (COLOURS, SHAPES, HoldOutError, caption, captioned_params,  # noqa: E402
                                  draw_toy, kept_colours, measure_adherence, parse_hold_out)
from edm2.encoders import Encoder  # noqa: E402
from edm2.formats.snapshot import load_generator  # noqa: E402
from edm2.procedures.generation import sample_batch  # noqa: E402
from edm2.procedures.posthoc import Snapshot, describe_snapshot  # noqa: E402
from edm2.procedures.prompts import prompt_of_seed  # noqa: E402
from edm2.sampler import SELF  # noqa: E402
from edm2.data.dataset import ImageFolderDataset  # noqa: E402
from edm2.text_encoders import OnlineConditions, check_encoder_matches, load_text_encoder  # noqa: E402
from scripts.tiny_text_encoder import tiny_text_encoder  # noqa: E402

SIDES = ("left", "right")
# The encoder's token length: the longest toy caption, "a magenta triangle on the left", is 6 words + EOS.
TOKENS = 8
METRICS = ("colour", "side", "shape", "all")


def prompt_sets(shapes: Sequence[str], held_out: frozenset[tuple[str, str]]) -> dict[str, list[tuple[str, str, str]]]:
    """{"seen": (colour, shape, side) of every pair training shows, "held-out": those of the held-out pairs}."""
    seen = [(c, s, side) for s in shapes for c in kept_colours(s, held_out) for side in SIDES]
    held = [(c, s, side) for c, s in sorted(held_out) for side in SIDES]
    return {"seen": seen, "held-out": held}


class ShapeClassifier(torch.nn.Module):
    """A small CNN naming the shape of a toy image from its brightness (as_input), whatever its colour."""

    def __init__(self, classes: int):
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(32, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(), torch.nn.Linear(32, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [N, classes]."""
        return self.layers(x)


def real_toy(shapes: Sequence[str], resolution: int, num: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 images [N, 3, R, R], shape indices [N]) of captioned toy images in every colour, from seed."""
    images, labels = [], []
    for idx in range(num):
        rng = np.random.default_rng([seed, idx])
        label = int(rng.integers(len(shapes)))
        images.append(draw_toy(captioned_params(shapes[label], resolution, rng)).transpose(2, 0, 1))
        labels.append(label)
    return torch.from_numpy(np.stack(images)), torch.tensor(labels)


def as_input(images: torch.Tensor) -> torch.Tensor:
    """uint8 images [N, 3, R, R] as the classifier takes them: the largest channel [N, 1, R, R] in [-1, 1], where a
    shape of any colour is bright (its value is at least CAPTIONED_VALUE's 0.85)."""
    return images.amax(dim=1, keepdim=True).float() / 127.5 - 1


def train_shape_classifier(shapes: Sequence[str], resolution: int, num: int, epochs: int,
                           seed: int = 1) -> tuple[ShapeClassifier, float]:
    """A ShapeClassifier trained on num real toy images (seed), and its accuracy on num others (seed + 1)."""
    torch.manual_seed(seed)
    images, labels = real_toy(shapes, resolution, num, seed)
    classifier = ShapeClassifier(len(shapes))
    optimizer = torch.optim.Adam(classifier.parameters(), lr=3e-3)
    for _ in range(epochs):
        for batch in torch.randperm(num).split(64):
            loss = torch.nn.functional.cross_entropy(classifier(as_input(images[batch])), labels[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    test_images, test_labels = real_toy(shapes, resolution, num, seed + 1)
    classifier.eval().requires_grad_(False)
    return classifier, float((predict_shapes(classifier, test_images) == test_labels).float().mean())


def predict_shapes(classifier: ShapeClassifier, images: torch.Tensor) -> torch.Tensor:
    """Shape indices [N] the classifier reads from uint8 images [N, 3, R, R]."""
    with torch.no_grad():
        return torch.cat([classifier(as_input(batch)).argmax(1) for batch in images.split(256)])


def adherence(images: torch.Tensor, targets: Sequence[tuple[str, str, str]], shapes: Sequence[str],
              classifier: ShapeClassifier) -> dict[str, float]:
    """Fractions of uint8 images [N, 3, R, R] whose colour, side, shape and all three match their (colour, shape,
    side) targets; an image with no bright pixel matches no colour and no side."""
    found_shapes = predict_shapes(classifier, images).tolist()
    hits = {name: 0 for name in METRICS}
    for image, found_shape, (colour, shape, side) in zip(images, found_shapes, targets):
        found_colour, found_side = measure_adherence(image.permute(1, 2, 0).numpy())
        match = {"colour": found_colour == colour, "side": found_side == side, "shape": shapes[found_shape] == shape}
        match["all"] = all(match.values())
        for name in METRICS:
            hits[name] += match[name]
    return {name: hits[name] / len(images) for name in METRICS}


def sample(net: torch.nn.Module, encoder: Encoder, seeds: Sequence[int], conditions: torch.Tensor | None, guidance: float,
           steps: int, batch: int = 64) -> torch.Tensor:
    """uint8 images [N, C, R, R] of net for seeds (one each) and conditions (None: unconditional), as generate.py
    samples them (sample_batch: Heun, per-seed noise), guided by the net's own empty-caption branch (gnet=SELF) when
    guidance is not 1."""
    guide = dict(gnet=SELF, guidance=guidance) if guidance != 1 else {}
    out = []
    for start in range(0, len(seeds), batch):
        text = None if conditions is None else conditions[start:start + batch]
        images, _ = sample_batch(net, encoder, seeds[start:start + batch], None, torch.device("cpu"),
                                 conditions=text, num_steps=steps, **guide)
        out.append(images)
    return torch.cat(out)


def adherence_rows(text_net: torch.nn.Module, uncond_net: torch.nn.Module, encoder: Encoder, encode: Callable,
                   sets: dict[str, list[tuple[str, str, str]]], shapes: Sequence[str], classifier: ShapeClassifier,
                   images: int, guidance: Sequence[float], steps: int) -> list[dict]:
    """One row per prompt set and guidance (image i: seed i, prompt i modulo the set's), then one per set for the
    unconditional model's images scored against the same prompts; encoder decodes them, encode maps captions to
    conditions."""
    seeds = list(range(images))
    rows = []
    for name, prompts in sets.items():
        targets = [prompt_of_seed(prompts, seed) for seed in seeds]
        conditions = encode([caption(*t) for t in targets])
        for w in guidance:
            generated = sample(text_net, encoder, seeds, conditions, w, steps)
            rows.append({"prompts": name, "model": "text", "guidance": w, "images": images,
                         **adherence(generated, targets, shapes, classifier)})
    unconditional = sample(uncond_net, encoder, seeds, None, 1, steps)
    for name, prompts in sets.items():
        targets = [prompt_of_seed(prompts, seed) for seed in seeds]
        rows.append({"prompts": name, "model": "unconditional", "guidance": None, "images": images,
                     **adherence(unconditional, targets, shapes, classifier)})
    return rows


def table(rows: list[dict], classes: int) -> str:
    """The rows as a Markdown table, with the chance level of each measure."""
    lines = ["| prompts | model | guidance | images | colour | side | shape | all three |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        w = "-" if r["guidance"] is None else f"{r['guidance']:g}"
        lines.append(f"| {r['prompts']} | {r['model']} | {w} | {r['images']} | "
                     + " | ".join(f"{r[m]:.2f}" for m in METRICS) + " |")
    chance = [1 / len(COLOURS), 1 / len(SIDES), 1 / classes]
    lines.append("| chance | | | | " + " | ".join(f"{c:.2f}" for c in [*chance, float(np.prod(chance))]) + " |")
    return "\n".join(lines)


def run(args: list[str]) -> None:
    """Run one of the repository's command lines with this Python; stop with its message if it fails."""
    result = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        tail = (result.stderr.strip() or result.stdout.strip()).splitlines()[-1:] or ["(no output)"]
        raise click.ClickException(f"{args[0]} {args[1]} failed: {tail[0]}")


def newest_snapshot(run_dir: Path, ema: str) -> Snapshot | None:
    """The run's newest network snapshot of EMA length ema (its file and images), or None before its first."""
    found = [describe_snapshot(path) for path in run_dir.glob(f"network-snapshot-*-{ema}.safetensors")]
    return max(found, key=lambda snapshot: snapshot.nimg, default=None)


def trained(run_dir: Path, data: Path, preset: str, nimg: int, ema: str, extra: Sequence[str]) -> Path:
    """The final snapshot of a train_edm2.py run of nimg images on data (trained now unless there)."""
    snapshot = newest_snapshot(run_dir, ema)
    if snapshot is None or snapshot.nimg < nimg:
        click.echo(f"training {run_dir} ({nimg} images, {preset}) ...")
        run(["train_edm2.py", f"--preset={preset}", f"--data={data}", f"--outdir={run_dir}", f"--duration={nimg}",
             "--snapshot=0", "--checkpoint=0", "--status=0", *extra])
        snapshot = newest_snapshot(run_dir, ema)
    if snapshot is None:
        raise click.ClickException(f"{run_dir} has no snapshot of EMA length {ema} (--ema)")
    return snapshot.path


@click.command()
@click.option("--outdir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Folder for the encoder, data, runs and table (reused by a rerun).")
@click.option("--resolution", type=click.IntRange(8, 64), default=16, show_default=True, help="Image size.")
@click.option("--num", type=click.IntRange(16), default=4000, show_default=True, help="Training images.")
@click.option("--classes", type=click.IntRange(2, 6), default=4, show_default=True, help="Shapes.")
@click.option("--hold-out", default="red:square,blue:circle", show_default=True, metavar="COLOUR:SHAPE,...",
              help="Colour/shape pairs no training image shows.")
@click.option("--preset", default="toy-small", show_default=True, help="train_edm2.py preset of both networks.")
@click.option("--kimg", type=click.FloatRange(0.001), default=16.0, show_default=True,
              help="Training duration of each network in thousands of images.")
@click.option("--ema", default="0.100", show_default=True, help="EMA length of the snapshots sampled.")
@click.option("--images", type=click.IntRange(1), default=96, show_default=True,
              help="Images per prompt set and guidance (seeds 0..N-1).")
@click.option("--guidance", default="1,2,4", show_default=True, help="Guidance weights, comma-separated.")
@click.option("--steps", type=click.IntRange(2), default=32, show_default=True, help="Heun steps.")
@click.option("--classifier-images", type=click.IntRange(16), default=2000, show_default=True,
              help="Real toy images to train the shape classifier on (and as many to test it on).")
@click.option("--classifier-epochs", type=click.IntRange(1), default=6, show_default=True)
@click.option("--processes", type=click.IntRange(1), help="Training processes (train_edm2.py --processes; default "
              "its own: one per core).")
def main(outdir: Path, resolution: int, num: int, classes: int, hold_out: str, preset: str, kimg: float, ema: str,
         images: int, guidance: str, steps: int, classifier_images: int, classifier_epochs: int,
         processes: int | None) -> None:
    """Train a text and an unconditional toy network and print how well the text one follows prompts."""
    shapes = list(SHAPES)[:classes]
    try:
        held_out = parse_hold_out(hold_out, shapes)
    except HoldOutError as e:
        raise click.BadParameter(str(e), param_hint="'--hold-out'") from None
    try:
        weights = [float(w) for w in guidance.split(",")]
    except ValueError:
        raise click.BadParameter(f"{guidance!r} is no comma-separated list of numbers", param_hint="'--guidance'") from None
    nimg = max(1, round(kimg * 1000))
    outdir = outdir.resolve()  # the command lines it runs start in the checkout
    outdir.mkdir(parents=True, exist_ok=True)
    wall: dict[str, float] = {}
    begin = time.monotonic()
    encoder_dir, toy, text_data = outdir / "encoder", outdir / "toy.zip", outdir / "toy-text"
    if not (encoder_dir / "config.json").exists():
        tiny_text_encoder(encoder_dir)
    if not toy.exists():
        click.echo(f"writing the captioned toy {toy} ...")
        run(["dataset_tool.py", "toy", f"--dest={toy}", f"--resolution={resolution}", f"--num={num}",
             f"--classes={classes}", "--captions", f"--hold-out={hold_out}"])
    if not (text_data / "dataset.json").exists():
        click.echo(f"encoding its captions into {text_data} ...")
        run(["dataset_tool.py", "encode-text", f"--source={toy}", f"--dest={text_data}",
             f"--text-encoder={encoder_dir}", f"--tokens={TOKENS}"])
    wall["data"] = time.monotonic() - begin
    begin = time.monotonic()
    extra = [] if processes is None else [f"--processes={processes}"]
    text_snapshot = trained(outdir / "run-text", text_data, preset, nimg, ema, extra)
    wall["train_text"] = time.monotonic() - begin
    begin = time.monotonic()
    # The same images without their embeddings: an unconditional network of the text network's size and recipe.
    uncond_snapshot = trained(outdir / "run-unconditional", toy, preset, nimg, ema, [*extra, "--cond=False"])
    wall["train_unconditional"] = time.monotonic() - begin
    begin = time.monotonic()
    click.echo("training the shape classifier ...")
    classifier, classifier_accuracy = train_shape_classifier(shapes, resolution, classifier_images, classifier_epochs)
    wall["classifier"] = time.monotonic() - begin
    begin = time.monotonic()
    text_net, encoder, _ = load_generator(text_snapshot)
    uncond_net, _, _ = load_generator(uncond_snapshot)
    record = ImageFolderDataset(str(text_data)).text_record
    text_encoder = load_text_encoder(encoder_dir, tokens=record["tokens"])
    check_encoder_matches(record, text_encoder)  # the prompts' embeddings are those the network learned from
    conditions = OnlineConditions(text_encoder)
    click.echo(f"sampling {images} images per prompt set and guidance ({steps} Heun steps) ...")
    rows = adherence_rows(text_net, uncond_net, encoder, conditions, prompt_sets(shapes, held_out), shapes,
                          classifier, images, weights, steps)
    wall["sample_and_measure"] = time.monotonic() - begin
    click.echo(f"shape classifier: {classifier_accuracy:.3f} accuracy on {classifier_images} real toy images it "
               f"was not trained on")
    click.echo(f"networks: {text_snapshot} (text), {uncond_snapshot} (unconditional); {nimg} images each, "
               f"{preset}, {resolution}x{resolution}, held out: {hold_out}")
    click.echo(table(rows, classes))
    click.echo("wall seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in wall.items()))
    click.echo(json.dumps({"rows": rows, "classifier_accuracy": classifier_accuracy, "classes": classes,
                           "hold_out": hold_out, "preset": preset, "nimg": nimg, "resolution": resolution,
                           "steps": steps, "wall_s": {k: round(v, 1) for k, v in wall.items()}}))


if __name__ == "__main__":
    main()
