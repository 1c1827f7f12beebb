"""dataset_tool.py preview: a grid of the first images of each class from any dataset training reads, and its
counts."""

import numpy as np
import PIL.Image
import pytest

from edm2.data.dataset import ImageFolderDataset
from tests.helpers import assert_refused, run_dataset_tool as run



@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """A toy ZIP of 7 images of 8x8 in 3 classes (image i is class i % 3: 3, 2 and 2 images) and its shards."""
    root = tmp_path_factory.mktemp("preview")
    assert run("toy", "--dest", root / "toy.zip", "--resolution=8", "--num=7", "--classes=3").exit_code == 0
    assert run("convert", "--source", root / "toy.zip", "--dest", root / "toy.shards").exit_code == 0
    return root


def read_png(path):
    with PIL.Image.open(path) as image:
        return np.asarray(image)


@pytest.mark.parametrize("name", ["toy.zip", "toy.shards"])
def test_a_preview_has_a_row_per_class_of_its_first_images_and_says_the_counts(toy, tmp_path, name):
    result = run("preview", "--data", toy / name, "--dest", tmp_path / "p.png", "--per-class=3")
    assert result.exit_code == 0, result.output
    assert "  class 0: 3 images\n  class 1: 2 images\n  class 2: 2 images\n" in result.output
    grid, images = read_png(tmp_path / "p.png"), ImageFolderDataset(toy / "toy.zip")
    assert grid.shape == (3 * 9 - 1, 3 * 9 - 1, 3)
    for c in range(3):
        indices = [i for i in range(7) if i % 3 == c]
        for k in range(3):
            tile = grid[c * 9:c * 9 + 8, k * 9:k * 9 + 8]
            expected = images[indices[k]][0].transpose(1, 2, 0) if k < len(indices) else np.full((8, 8, 3), 255)
            np.testing.assert_array_equal(tile, expected)


def test_a_blend_and_unlabeled_data_preview_too(toy, tmp_path):
    blend = f"{toy / 'toy.zip'}:1,{toy / 'toy.shards'}:3"
    result = run("preview", "--data", blend, "--dest", tmp_path / "b.png", "--per-class=2")
    assert result.exit_code == 0, result.output
    assert read_png(tmp_path / "b.png").shape == (3 * 9 - 1, 2 * 9 - 1, 3)
    # An unlabeled dataset (a folder of the toy's images without dataset.json) is one row.
    folder = tmp_path / "plain"
    assert run("convert", "--source", toy / "toy.zip", "--dest", folder).exit_code == 0
    (folder / "dataset.json").unlink()
    result = run("preview", "--data", folder, "--dest", tmp_path / "u.png", "--per-class=4")
    assert result.exit_code == 0, result.output
    assert "  all: 7 images" in result.output and read_png(tmp_path / "u.png").shape == (8, 4 * 9 - 1, 3)


@pytest.mark.bad_input
@pytest.mark.parametrize("args, option, words", [
    (["--data", "{toy}/missing.zip", "--dest", "{out}/p.png"], "--data", "missing.zip"),
    (["--data", "{toy}/toy.zip", "--dest", "{out}/p.jpg"], "--dest", "no .png file name"),
    (["--data", "{toy}/toy.zip", "--dest", "{out}/p.png", "--per-class=0"], "--per-class", ""),
])
def test_bad_preview_input_is_one_line_and_writes_nothing(toy, tmp_path, args, option, words):
    args = [arg.format(toy=toy, out=tmp_path) for arg in args]
    assert_refused([tmp_path, toy], lambda: run("preview", *args), option, words)


def test_latents_preview_as_their_recorded_vae_decodes_their_means(toy, tmp_path):
    import torch

    from edm2.encoders import StabilityVAEEncoder
    from tests.helpers import save_tiny_vae

    vae = save_tiny_vae(tmp_path / "vae")
    assert run("encode", "--source", toy / "toy.zip", "--dest", tmp_path / "latents.zip", "--vae", vae,
               "--workers=0").exit_code == 0
    result = run("preview", "--data", tmp_path / "latents.zip", "--dest", tmp_path / "p.png", "--per-class=1")
    assert result.exit_code == 0, result.output
    latents = ImageFolderDataset(tmp_path / "latents.zip")
    means = torch.from_numpy(np.stack([latents[c][0][:4] for c in range(3)]))  # images 0, 1, 2: classes 0, 1, 2
    expected = StabilityVAEEncoder(str(vae)).decode_raw(means).permute(0, 2, 3, 1).numpy()
    side = expected.shape[1]  # the tiny VAE's 2x of the latents' 4x4
    grid = read_png(tmp_path / "p.png")
    assert grid.shape == (3 * (side + 1) - 1, side, 3)
    for c in range(3):
        np.testing.assert_array_equal(grid[c * (side + 1):c * (side + 1) + side], expected[c])
