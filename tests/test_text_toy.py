"""scripts/text_toy.py: the pixel measures of prompt adherence, the shape classifier, and the table and JSON of a
tiny run end to end; scripts/tiny_text_encoder.py's command line."""

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from edm2.data.toy_shapes import SHAPES, caption_of, captioned_params, draw_toy
from edm2.encoders import StandardRGBEncoder
from edm2.text_encoders import OnlineConditions, load_text_encoder
from scripts import text_toy, tiny_text_encoder
from tests.helpers import assert_one_error_line, tiny_precond

pytest.importorskip("transformers")

SHAPES4 = list(SHAPES)[:4]


def drawn(num: int, resolution: int = 16, seed: int = 5) -> tuple[torch.Tensor, list[tuple[str, str, str]]]:
    """Captioned toy images [N, 3, R, R] uint8 and their (colour, shape, side) read from their captions."""
    images, targets = [], []
    for idx in range(num):
        rng = np.random.default_rng([seed, idx])
        params = captioned_params(SHAPES4[idx % 4], resolution, rng)
        images.append(draw_toy(params).transpose(2, 0, 1))
        _, colour, shape, _, _, side = caption_of(params).split(" ")
        targets.append((colour, shape, side))
    return torch.from_numpy(np.stack(images)), targets


@pytest.fixture(scope="module")
def classifier():
    return text_toy.train_shape_classifier(SHAPES4, 16, 800, 6)


def test_the_shape_classifier_names_real_toy_shapes_it_was_not_trained_on(classifier):
    net, accuracy = classifier
    images, targets = drawn(64)
    found = text_toy.predict_shapes(net, images)
    direct = float(np.mean([SHAPES4[i] == t[1] for i, t in zip(found.tolist(), targets)]))
    assert accuracy > 0.8 and direct > 0.8  # 4 classes: chance is 0.25


def test_real_toy_images_adhere_to_their_captions_and_not_to_others(classifier):
    net, _ = classifier
    images, targets = drawn(48)
    measured = text_toy.adherence(images, targets, SHAPES4, net)
    assert measured["colour"] == 1 and measured["side"] == 1  # every captioned image is measurable (toy_shapes)
    assert measured["all"] <= min(measured["colour"], measured["side"], measured["shape"])
    flipped = [(c, s, "left" if side == "right" else "right") for c, s, side in targets]
    assert text_toy.adherence(images, flipped, SHAPES4, net)["side"] == 0
    shifted = [(text_toy.COLOURS[(text_toy.COLOURS.index(c) + 3) % 6], s, side) for c, s, side in targets]
    assert text_toy.adherence(images, shifted, SHAPES4, net)["colour"] == 0


def test_a_dark_image_adheres_to_nothing(classifier):
    net, _ = classifier
    dark = torch.zeros(2, 3, 16, 16, dtype=torch.uint8)
    measured = text_toy.adherence(dark, [("red", "circle", "left")] * 2, SHAPES4, net)
    assert measured["colour"] == measured["side"] == measured["all"] == 0


def test_prompt_sets_split_seen_and_held_out_pairs():
    held = frozenset({("red", "square")})
    sets = text_toy.prompt_sets(SHAPES4, held)
    assert ("red", "square", "left") not in sets["seen"] and len(sets["seen"]) == (4 * 6 - 1) * 2
    assert sets["held-out"] == [("red", "square", "left"), ("red", "square", "right")]


def test_rows_and_table_of_untrained_networks(tmp_path, classifier):
    encoder_dir = tiny_text_encoder.tiny_text_encoder(tmp_path / "enc")
    encode = OnlineConditions(load_text_encoder(encoder_dir, tokens=text_toy.TOKENS))
    torch.manual_seed(0)
    text_net = tiny_precond(16, label_dim=0, text_dim=16, text_tokens=text_toy.TOKENS).eval()
    uncond_net = tiny_precond(16, label_dim=0).eval()
    sets = text_toy.prompt_sets(SHAPES4, frozenset({("red", "square")}))
    rows = text_toy.adherence_rows(text_net, uncond_net, StandardRGBEncoder(), encode, sets, SHAPES4,
                                   classifier[0], 3, [1, 2], 2)
    assert [(r["prompts"], r["model"], r["guidance"]) for r in rows] == [
        ("seen", "text", 1), ("seen", "text", 2), ("held-out", "text", 1), ("held-out", "text", 2),
        ("seen", "unconditional", None), ("held-out", "unconditional", None)]
    assert all(0 <= r[m] <= 1 and r["images"] == 3 for r in rows for m in text_toy.METRICS)
    lines = text_toy.table(rows, 4).splitlines()
    assert len(lines) == 2 + len(rows) + 1 and lines[-1].startswith("| chance |")
    assert lines[-1].split("|")[5:9] == [" 0.17 ", " 0.50 ", " 0.25 ", " 0.02 "]


def test_the_script_prints_a_table_and_json_last(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a relative --outdir is the caller's, though the commands it runs start elsewhere
    args = ["--outdir=out", "--resolution=8", "--num=32", "--classes=2", "--hold-out=red:circle",
            "--preset=toy-tiny", "--kimg=0.064", "--images=2", "--guidance=1,4", "--steps=2",
            "--classifier-images=32", "--classifier-epochs=1", "--processes=1"]
    result = CliRunner().invoke(text_toy.main, args)
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    record = json.loads(lines[-1])
    assert [(r["prompts"], r["model"], r["guidance"]) for r in record["rows"]] == [
        ("seen", "text", 1), ("seen", "text", 4), ("held-out", "text", 1), ("held-out", "text", 4),
        ("seen", "unconditional", None), ("held-out", "unconditional", None)]
    table_rows = [line for line in lines if line.startswith("| seen") or line.startswith("| held-out")]
    assert [float(line.split("|")[5]) for line in table_rows] == [round(r["colour"], 2) for r in record["rows"]]
    assert record["nimg"] == 64 and set(record["wall_s"]) >= {"train_text", "train_unconditional"}
    assert (tmp_path / "out" / "run-text" / "training_options.json").is_file()


@pytest.mark.bad_input
@pytest.mark.parametrize("option, value, fragment", [("--hold-out", "red:star", "no COLOUR:SHAPE pair"),
                                                      ("--guidance", "1,two", "no comma-separated list")])
def test_bad_options_are_refused_in_one_line(tmp_path, option, value, fragment):
    result = CliRunner().invoke(text_toy.main, [f"--outdir={tmp_path}", f"{option}={value}"])
    assert_one_error_line(result, option, fragment)
    assert not any(tmp_path.iterdir())


def test_the_encoder_command_writes_a_loadable_encoder_and_refuses_a_full_folder(tmp_path):
    result = CliRunner().invoke(tiny_text_encoder.main, [f"--dest={tmp_path / 'clip'}", "--kind=clip"])
    assert result.exit_code == 0, result.output
    encoder = load_text_encoder(tmp_path / "clip", tokens=8)
    pooled, _, lengths = encoder.encode(["a red circle on the left", "a blue circle on the left"])
    assert encoder.dim == 16 and lengths.tolist() == [8, 8] and not torch.equal(pooled[0], pooled[1])
    again = CliRunner().invoke(tiny_text_encoder.main, [f"--dest={tmp_path / 'clip'}"])
    assert_one_error_line(again, "--dest", "not empty")


@pytest.mark.bad_input
def test_an_odd_encoder_width_is_refused_in_one_line(tmp_path):
    result = CliRunner().invoke(tiny_text_encoder.main, [f"--dest={tmp_path / 'enc'}", "--dim=15"])
    assert_one_error_line(result, "--dim", "odd")
    assert not (tmp_path / "enc").exists()
