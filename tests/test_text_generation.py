"""Prompts at sampling: a text network's unconditional branch is its empty caption's, generate.py --prompt and
--prompts (seed s gets prompt s mod n, grids labelled per prompt), calculate_metrics.py fid-clip on a real text
network, train_edm2.py --cond=False on data with text; bad input."""

import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import generate
import train_edm2
from edm2.data.dataset import ImageFolderDataset
from edm2.encoders import StandardRGBEncoder
from edm2.formats.snapshot import load_generator, load_network, save_network
from edm2.procedures.generation import GenerationError, check_self_guidance, sample_batch
from edm2.procedures.image_grid import GRID_GAP_VALUE, labelled_rows
from edm2.procedures.prompts import PromptConditions, load_prompt_encoder, text_record
from edm2.sampler import SELF, conditional_and_unconditional
from edm2.text_encoders import TextEncoderMismatchError
from tests.helpers import assert_ok, assert_refused, read_pngs, run_dataset_tool, tiny_precond
from tests.text_helpers import tiny_text_encoder, tiny_text_snapshot

FAST = ["--steps=3"]
PROMPTS = ["a red circle on the left", "a blue square on the right", "a green star"]
TOKENS = 6


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    """The tiny T5 encoder, a text snapshot made with it (trained with text dropout) and one without dropout, a
    class-conditional snapshot, and a CLIP encoder (another encoder than the recorded one)."""
    root = tmp_path_factory.mktemp("text-gen")
    t5 = tiny_text_encoder(root / "t5", "t5")
    paths = dict(root=root, t5=t5, clip=tiny_text_encoder(root / "clip", "clip"),
                 net=tiny_text_snapshot(root / "text.safetensors", t5, TOKENS),
                 no_dropout=tiny_text_snapshot(root / "no-dropout.safetensors", t5, TOKENS, text_dropout=0))
    # A snapshot whose recorded encoder folder is gone (moved, or made on another machine).
    gone = tiny_text_encoder(root / "t5-gone", "t5")
    paths["gone"] = tiny_text_snapshot(root / "gone.safetensors", gone, TOKENS)
    shutil.rmtree(gone)
    torch.manual_seed(0)
    paths["class"] = root / "class.safetensors"
    save_network(paths["class"], tiny_precond(label_dim=4), {"encoder": StandardRGBEncoder().config()})
    return paths


def run_generate(text, outdir, *args):
    base = [f"--net={text['net']}", f"--outdir={outdir}", *FAST]
    return CliRunner().invoke(generate.main, [*base, *map(str, args)])


# ---------------------------------------------------------------------------------------------------------------
# The unconditional branch.

def test_a_text_networks_unconditional_branch_is_its_empty_caption(text):
    net, _, _ = load_generator(text["net"])
    encoder = load_prompt_encoder(text_record(load_network(text["net"])[1]), text["t5"])
    conditions = PromptConditions(encoder).of_prompts(PROMPTS)
    torch.testing.assert_close(net.unconditional_labels(conditions), net.unet.empty_text.expand(3, -1, -1),
                               rtol=0, atol=0)
    x, sigma = torch.randn(3, 3, 8, 8), torch.full([3], 2.0)
    with torch.no_grad():
        d, d_uncond = conditional_and_unconditional(net, x, sigma, conditions)
        # The same float32 network on half the batch: equal up to the batch's float32 sums.
        torch.testing.assert_close(d, net(x, sigma, conditions), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(d_uncond, net(x, sigma, None), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(d_uncond, net(x, sigma, torch.zeros_like(conditions)), atol=1e-3)
    class_net = tiny_precond(label_dim=4)
    labels = torch.eye(4)[[1, 2]]
    assert torch.equal(class_net.unconditional_labels(labels), torch.zeros_like(labels))


def test_self_guidance_needs_text_dropout(text):
    for name, ok in (("net", True), ("no_dropout", False)):
        net, metadata = load_network(text[name])
        if ok:
            check_self_guidance(net, metadata)
        else:
            with pytest.raises(GenerationError, match="--text-dropout"):
                check_self_guidance(net, metadata)


def test_another_text_encoder_than_the_recorded_one_is_refused(text):
    record = text_record(load_network(text["net"])[1])
    with pytest.raises(TextEncoderMismatchError, match="is not the one recorded"):
        load_prompt_encoder(record, text["clip"])


# ---------------------------------------------------------------------------------------------------------------
# generate.py with prompts.

def test_seed_s_gets_prompt_s_mod_n_and_guidance_from_the_empty_caption(text, tmp_path):
    args = ["--seeds=0-5", "--gnet=self", "--guidance=2", f"--text-encoder={text['t5']}"]
    result = run_generate(text, tmp_path / "all", *args, *[f"--prompt={p}" for p in PROMPTS])
    assert result.exit_code == 0, result.output
    images = read_pngs(tmp_path / "all")
    assert sorted(images) == [f"{s:06d}.png" for s in range(6)]
    # Each image is the sampler's for its seed's prompt alone, guided by the empty caption's prediction.
    net, encoder, metadata = load_generator(text["net"])
    conditions = PromptConditions(load_prompt_encoder(text_record(metadata), text["t5"]))
    for seed in range(6):
        expected, _ = sample_batch(net, encoder, [seed], None, torch.device("cpu"), num_steps=3, gnet=SELF,
                                   guidance=2, conditions=conditions.of_prompts([PROMPTS[seed % 3]]))
        assert np.array_equal(images[f"{seed:06d}.png"], expected[0].permute(1, 2, 0).numpy())
    # A prompts file gives the same images.
    file = tmp_path / "prompts.txt"
    file.write_text("\n".join(PROMPTS) + "\n")
    result = run_generate(text, tmp_path / "file", *args, f"--prompts={file}")
    assert result.exit_code == 0, result.output
    from_file = read_pngs(tmp_path / "file")
    assert from_file.keys() == images.keys() and all(np.array_equal(from_file[k], images[k]) for k in images)


def test_without_text_encoder_the_recorded_folder_is_used(text, tmp_path):
    given = run_generate(text, tmp_path / "given", "--seeds=0-1", f"--text-encoder={text['t5']}", "--prompt=a red circle")
    recorded = run_generate(text, tmp_path / "recorded", "--seeds=0-1", "--prompt=a red circle")
    assert given.exit_code == 0 and recorded.exit_code == 0, recorded.output
    images, again = read_pngs(tmp_path / "given"), read_pngs(tmp_path / "recorded")
    assert sorted(images) == sorted(again) == ["000000.png", "000001.png"]
    assert all(np.array_equal(images[k], again[k]) for k in images)


def test_the_grid_has_one_row_per_prompt_labelled_with_it(text, tmp_path):
    result = run_generate(text, tmp_path, "--seeds=0-6", "--grid", f"--text-encoder={text['t5']}",
                          *[f"--prompt={p}" for p in PROMPTS])
    assert result.exit_code == 0, result.output
    images = read_pngs(tmp_path)
    grid = images.pop("grid.png")
    rows = [[s for s in range(7) if s % 3 == k] for k in range(3)]  # seeds 0,3,6 / 1,4 / 2,5
    cols, side = 3, 9  # an 8x8 image and its one-pixel gap
    margin = grid.shape[1] - (cols * side - 1)
    assert grid.shape[0] == 3 * side - 1 and margin > 0
    for k, seeds in enumerate(rows):
        band = grid[k * side : k * side + 8]
        assert (band[:, :margin] != GRID_GAP_VALUE).any()  # the prompt's text is drawn
        for j in range(cols):
            cell = band[:, margin + j * side : margin + j * side + 8]
            want = images[f"{seeds[j]:06d}.png"] if j < len(seeds) else np.full_like(cell, GRID_GAP_VALUE)
            assert np.array_equal(cell, want)
    # Three prompts, three different labels.
    assert len({grid[k * side : k * side + 8, :margin].tobytes() for k in range(3)}) == 3


def test_labelled_rows_pads_short_rows_and_cuts_long_labels():
    rows = [np.zeros([3, 8, 8, 1], np.uint8), np.zeros([1, 8, 8, 1], np.uint8)]
    grid = labelled_rows(rows, ["x" * 1000, "y"])
    assert grid.shape == (17, 640 + 8 + 3 * 9 - 1, 1)
    assert (grid[9:17, -17:] == GRID_GAP_VALUE).all()  # the second row's two empty cells and their gaps


@pytest.mark.parametrize("case, fragments", [
    ("prompt on class net", ["--prompt", "class-conditional", "takes no prompts"]),
    ("class on text net", ["--class", "text-to-image network"]),
    ("empty prompts file", ["--prompts", "holds no prompt"]),
    ("prompt and prompts", ["--prompt or --prompts, not both"]),
    ("no text encoder", ["--text-encoder", "t5-gone", "no folder here"]),
    ("other text encoder", ["--text-encoder", "is not the one recorded"]),
    ("no prompt", ["--prompt=TEXT or --prompts=FILE"]),
])
def test_bad_prompt_input_is_one_line(text, tmp_path, case, fragments):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    encoder = f"--text-encoder={text['t5']}"
    args = {"prompt on class net": [f"--net={text['class']}", "--prompt=a red circle"],
            "class on text net": [encoder, "--class=1", "--prompt=a red circle"],
            "empty prompts file": [encoder, f"--prompts={empty}"],
            "prompt and prompts": [encoder, "--prompt=a", f"--prompts={empty}"],
            "no text encoder": [f"--net={text['gone']}", "--prompt=a red circle"],
            "other text encoder": [f"--text-encoder={text['clip']}", "--prompt=a red circle"],
            "no prompt": [encoder]}[case]
    outdir = tmp_path / "out"
    line = assert_refused(tmp_path, lambda: CliRunner().invoke(generate.main, [
        f"--net={text['net']}", f"--outdir={outdir}", *FAST, *args]), *fragments)
    assert not outdir.exists(), line


# ---------------------------------------------------------------------------------------------------------------
# An unconditional run on data with text (the chance-level baseline).

def test_train_edm2_cond_false_trains_an_unconditional_network_on_data_with_text(text, tmp_path):
    toy = tmp_path / "toy"
    assert_ok(run_dataset_tool("toy", "--dest", toy, "--resolution", 8, "--num", 16, "--captions"))
    data = tmp_path / "text.zip"
    assert_ok(run_dataset_tool("encode-text", "--source", toy, "--dest", data, "--text-encoder", text["t5"],
                               "--tokens", TOKENS))
    assert ImageFolderDataset(data).has_text and not ImageFolderDataset(data, use_text=False).has_text
    args = ["--preset=toy-tiny", f"--data={data}", "--duration=32", "--batch=16", "--snapshot=32", "--checkpoint=32",
            "--status=16", "--workers=0", "--no-compile"]
    for cond, outdir in (("False", tmp_path / "uncond"), ("True", tmp_path / "text")):
        result = CliRunner().invoke(train_edm2.main, [*args, f"--cond={cond}", f"--outdir={outdir}"])
        assert result.exit_code == 0, result.output
    uncond, metadata = load_network(next((tmp_path / "uncond").glob("*.safetensors")))
    assert uncond.label_dim == 0 and "text_dim" not in uncond.init_kwargs and not hasattr(uncond.unet, "empty_text")
    assert "text_encoding" not in metadata["dataset"]
    conditioned, metadata = load_network(next((tmp_path / "text").glob("*.safetensors")))
    assert conditioned.init_kwargs["text_dim"] == 16 and metadata["dataset"]["text_encoding"]["tokens"] == TOKENS
