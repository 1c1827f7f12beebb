"""Bringing your own data: README's "Your own data" walk-through at tiny scale (grayscale class folders ->
convert -> training at an unusual resolution with architecture options -> post-hoc EMA -> autoguidance from
an early snapshot -> classifier-free guidance by a --cond=False run), and what each step must show."""

import json
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
from click.testing import CliRunner

import dataset_tool
import generate
import reconstruct_phema
import train_edm2
from edm2.data.dataset import ImageFolderDataset
from edm2.formats.snapshot import load_network, read_metadata
from tests.helpers import assert_one_error_line, assert_refused

# README: --resolution=96, --preset=edm2-img64-xs --channel-mult=1,2,3,4 --attn-resolutions=24,12; here 12x12
# images and the tests' preset with three levels (12, 6, 3) and attention at 3.
ARCH = ["--channel-mult=1,2,2", "--attn-resolutions=3"]
TRAIN = ["--preset=toy-tiny", "--duration=128", "--batch=16", "--snapshot=64", "--status=64", "--workers=0"]
SAMPLE = ["--seeds=0-4", "--steps=4", "--grid"]
CLASSES = ["cats", "dogs", "mice"]


def run(command, *args):
    """Run a command line in-process; it must succeed."""
    result = CliRunner().invoke(command.main, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result


def write_gray_folders(root: Path) -> Path:
    """Grayscale JPEGs (40x30) and PNGs in one folder per class, the class setting the brightness."""
    rng = np.random.default_rng(0)
    for label, name in enumerate(CLASSES):
        (root / name).mkdir(parents=True)
        for i in range(6):
            pixels = np.clip(rng.normal(60 + 60 * label, 20, size=(30, 40)), 0, 255).astype(np.uint8)
            PIL.Image.fromarray(pixels, "L").save(root / name / f"{i}.{'jpg' if i % 2 else 'png'}")
    return root


@pytest.fixture(scope="module")
def walk(tmp_path_factory):
    """Every step of the walk-through, in order; returns the folder and each step's output."""
    return walk_through(tmp_path_factory.mktemp("own"))


def walk_through(root: Path) -> tuple[Path, dict]:
    """Run the walk-through's commands in root."""
    source, data = write_gray_folders(root / "photos"), root / "gray12.zip"
    steps = {"convert": run(dataset_tool, "convert", f"--source={source}", f"--dest={data}", "--resolution=12",
                            "--transform=center-crop", "--workers=0")}
    steps["train"] = run(train_edm2, *TRAIN, *ARCH, f"--data={data}", f"--outdir={root / 'run'}")
    steps["phema"] = run(reconstruct_phema, f"--indir={root / 'run'}", "--std=0.08")
    early = root / "run" / "network-snapshot-0000000-64-0.050.safetensors"
    final = root / "run" / "phema" / "phema-0000000-128-0.080.safetensors"
    steps["autoguided"] = run(generate, f"--net={final}", f"--gnet={early}", "--guidance=2", *SAMPLE,
                              f"--outdir={root / 'autoguided'}")
    steps["uncond"] = run(train_edm2, *TRAIN, *ARCH, "--cond=False", f"--data={data}",
                          f"--outdir={root / 'run-uncond'}")
    uncond = root / "run-uncond" / "network-snapshot-0000000-128-0.100.safetensors"
    steps["cfg"] = run(generate, f"--net={final}", f"--gnet={uncond}", "--guidance=1.5",
                       "--guidance-interval=0.28,5.42", *SAMPLE, f"--outdir={root / 'cfg'}")
    return root, steps


def test_convert_keeps_grayscale_and_prints_the_label_of_each_class_folder(walk):
    root, steps = walk
    output = steps["convert"].output
    assert "wrote 18 grayscale (1 channel) images" in output
    printed = dict(line.strip().split(": ") for line in output.splitlines() if line.startswith("  "))
    assert printed == {str(label): name for label, name in enumerate(CLASSES)}
    dataset = ImageFolderDataset(root / "gray12.zip")
    assert (len(dataset), dataset.num_channels, dataset.resolution, dataset.label_dim) == (18, 1, 12, 3)
    # dataset.json's numbers are the printed ones: image i came from the sorted source list, 6 per folder.
    assert dataset.raw_labels.tolist() == [i // 6 for i in range(18)]
    bright = [dataset[i][0].mean() for i in range(18)]
    assert all(bright[i] < bright[i + 6] for i in range(12))  # each class is brighter than the one before


def test_grayscale_data_trains_one_channel_with_the_architecture_asked_for(walk):
    root, _ = walk
    net, meta = load_network(root / "run" / "network-snapshot-0000000-128-0.100.safetensors")
    assert (net.img_channels, net.img_resolution, net.label_dim) == (1, 12, 3)
    assert meta["dataset"] == {"resolution": 12, "num_channels": 1, "label_dim": 3,
                               "classes": {"cats": 0, "dogs": 1, "mice": 2}}  # convert records the class names
    kwargs = meta["network_kwargs"]
    assert (kwargs["channel_mult"], kwargs["attn_resolutions"]) == ([1, 2, 2], [3])
    assert sorted(net.unet.enc) == ["12x12_block0", "12x12_conv", "3x3_block0", "3x3_down", "6x6_block0",
                                    "6x6_down"]
    assert net.unet.enc["3x3_block0"].num_heads == 2 and net.unet.enc["6x6_block0"].num_heads == 0
    options = json.loads((root / "run" / "training_options.json").read_text())
    assert options["network"]["channel_mult"] == [1, 2, 2] and options["init"] is None


def test_generate_writes_one_channel_pngs_a_gapped_grid_and_the_labels(walk):
    root, steps = walk
    out = root / "autoguided"
    images = {p.name: np.asarray(PIL.Image.open(p)) for p in sorted(out.glob("0*.png"))}
    assert sorted(images) == [f"{seed:06d}.png" for seed in range(5)]
    assert all(PIL.Image.open(out / name).mode == "L" and image.shape == (12, 12) for name, image in images.items())
    # Five images: three columns, two rows, a one-pixel white gap, and the sixth cell left white.
    grid = np.asarray(PIL.Image.open(out / "grid.png"))
    assert PIL.Image.open(out / "grid.png").mode == "L" and grid.shape == (2 * 12 + 1, 3 * 12 + 2)
    for i, name in enumerate(sorted(images)):
        row, col = divmod(i, 3)
        assert np.array_equal(grid[row * 13 : row * 13 + 12, col * 13 : col * 13 + 12], images[name])
    assert (grid[12] == 255).all() and (grid[:, [12, 25]] == 255).all() and (grid[13:, 26:] == 255).all()
    labels = json.loads((out / "labels.json").read_text())["labels"]
    assert [name for name, _ in labels] == sorted(images) and {c for _, c in labels} <= {0, 1, 2}
    assert "Saved 5 images, labels.json and grid.png" in steps["autoguided"].output


def test_classifier_free_guidance_by_an_unconditional_run(walk):
    root, steps = walk
    uncond, meta = load_network(root / "run-uncond" / "network-snapshot-0000000-128-0.100.safetensors")
    assert uncond.label_dim == 0 and meta["network_kwargs"]["channel_mult"] == [1, 2, 2]
    assert "at 1.5 for sigma in (0.28, 5.42]" in steps["cfg"].output
    assert len(list((root / "cfg").glob("0*.png"))) == 5
    # The same seeds and classes, with other guidance, give other images.
    assert json.loads((root / "cfg" / "labels.json").read_text()) == json.loads(
        (root / "autoguided" / "labels.json").read_text())
    assert any((np.asarray(PIL.Image.open(p)) != np.asarray(PIL.Image.open(root / "cfg" / p.name))).any()
               for p in (root / "autoguided").glob("0*.png"))


def test_a_resume_must_keep_the_architecture(walk):
    root, _ = walk
    args = [*TRAIN, "--duration=192", f"--data={root / 'gray12.zip'}", f"--outdir={root / 'run'}"]
    assert_refused(root / "run", lambda: CliRunner().invoke(train_edm2.main, args),
                   "cannot resume with different hyperparameters", "network")
    assert read_metadata(root / "run" / "network-snapshot-0000000-128-0.100.safetensors")["nimg"] == 128


# README's own training commands, at their full settings, on a 96x96 dataset: the architecture passes the checks.
README_TRAIN = [
    "--preset=edm2-img64-xs --data={data} --outdir={root}/training-runs/xrays --channel-mult=1,2,3,4 "
    "--attn-resolutions=24,12 --duration=64Mi --snapshot=2Mi",
    "--preset=edm2-img64-xs --data={data} --outdir={root}/training-runs/xrays-uncond --cond=False "
    "--channel-mult=1,2,3,4 --attn-resolutions=24,12 --duration=16Mi",
]


def test_readmes_full_size_commands_fit_96x96_data(tmp_path):
    source = tmp_path / "xrays"
    for name in CLASSES[:2]:
        (source / name).mkdir(parents=True)
        PIL.Image.fromarray(np.zeros((120, 100), np.uint8)).save(source / name / "a.png")
    data = tmp_path / "xrays96.zip"
    run(dataset_tool, "convert", f"--source={source}", f"--dest={data}", "--resolution=96", "--transform=center-crop",
        "--workers=0")
    for command in README_TRAIN:
        result = run(train_edm2, *command.format(data=data, root=tmp_path).split(), "--dry-run")
        options = json.loads(result.output[: result.output.rindex("}") + 1])
        assert options["network"] == dict(channel_mult=[1, 2, 3, 4], attn_resolutions=[24, 12])
        conditional = "cond=False" not in command  # the class names convert recorded come with the labels
        assert options["dataset"] == dict(resolution=96, num_channels=1, label_dim=2 if conditional else 0,
                                          **(dict(classes={"cats": 0, "dogs": 1}) if conditional else {}))
    # The presets' attention at 16 and 8 is no resolution of a 96x96 U-Net: asked for explicitly, it is refused.
    result = CliRunner().invoke(train_edm2.main, [*README_TRAIN[0].format(data=data, root=tmp_path).split(),
                                                  "--attn-resolutions=16,8", "--dry-run"])
    assert_one_error_line(result, "attention at 16x16, but the U-Net's levels are 96x96, 48x48, 24x24, 12x12")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["xrays", "xrays96.zip"]
