"""train_edm2.py --init: a new run whose network and EMA tracks start from a snapshot of ours or a release
pickle, its architecture and encoder taken from the snapshot; resuming it; and what contradicts the snapshot."""

import json
import math

import numpy as np
import pytest
import safetensors.torch
import torch
from click.testing import CliRunner

import train_edm2
from cli import run_setup
from edm2.data.dataset import ImageFolderDataset
from edm2.encoders import StandardRGBEncoder
from edm2.formats.snapshot import load_network, save_network
from training import architecture
from training.lr_schedule import learning_rate_schedule
from training.run import checkpoint
from tests.helpers import (RELEASE_TINY, TRAIN_ARGS, assert_one_error_line, assert_refused, random_release_tiny_net,
                           randomized, tiny_precond, write_image_dataset, write_release_pickle)

# One step of 16 images: the learning rate of step 1 is 0 (Eq. 67's ramp-up starts at 0 images), and the first EMA
# update has beta = 0 (Eq. 127 with t_delta = t_next), so the first snapshot holds the network as it entered the
# step: the init weights after the forced weight normalization (Eq. 66) of the step's forward pass.
ONE_STEP = ["--duration=16", "--batch=16", "--workers=0"]
# A U-Net unlike the toy-tiny preset's: eight channels, one level of two blocks, no attention resolutions.
INIT_UNET = dict(model_channels=8, channel_mult=(1,), num_blocks=2, attn_resolutions=(), channels_per_head=8)


def cli(*args):
    return CliRunner().invoke(train_edm2.main, [*TRAIN_ARGS, *map(str, args)])


def init_snapshot(path, seed=0, **overrides):
    """Our snapshot of a randomly weighted 8x8 RGB net of 4 classes (INIT_UNET unless overridden)."""
    net = randomized(tiny_precond(**{**dict(img_resolution=8, img_channels=3, label_dim=4), **INIT_UNET, **overrides}),
                     seed)
    save_network(path, net, {"encoder": StandardRGBEncoder().config()})
    return path


def forced_normalization(weights: dict) -> dict:
    """Each MPConv weight's rows scaled to norm sqrt(fan_in) as Eq. 66 (eps 1e-4 on the RMS), in float64; the other
    tensors (gains, Fourier buffers) as they are."""
    expected = {}
    for name, w in weights.items():
        w = w.double()
        if name.endswith(".weight") and w.ndim >= 2:
            rms = w.flatten(1).norm(dim=1) / math.sqrt(w[0].numel())
            w = w / (1e-4 + rms).reshape(-1, *[1] * (w.ndim - 1))
        expected[name] = w
    return expected


def assert_first_snapshot_is_the_init(snapshot_path, init_weights):
    # float16 storage rounds to nearest: <= 2^-11 relative (2^-25 absolute below float16's normal range); the
    # float32 normalization adds <= sqrt(fan_in <= 128 * 9) x 6e-8 relative: 1e-5 covers it.
    saved = safetensors.torch.load_file(str(snapshot_path))
    expected = forced_normalization(init_weights)
    assert sorted(saved) == sorted(expected)
    for name, value in saved.items():
        torch.testing.assert_close(value.double(), expected[name], rtol=2**-11 + 1e-5, atol=2**-25)
        if not name.endswith(".weight"):
            assert torch.equal(value, init_weights[name].to(value.dtype)), name


def test_init_from_our_snapshot_takes_its_architecture_and_weights(train_data, tmp_path):
    init = init_snapshot(tmp_path / "init.safetensors")
    result = cli(f"--data={train_data}", f"--outdir={tmp_path / 'run'}", f"--init={init}", *ONE_STEP)
    assert result.exit_code == 0, result.output
    net, meta = load_network(tmp_path / "run" / "network-snapshot-0000000-16-0.100.safetensors")
    init_net, init_meta = load_network(init)
    # The snapshot's architecture; dropout is the run's (--dropout or the preset's), not an architecture.
    assert {k: v for k, v in net.init_kwargs.items() if k != "dropout"} == init_net.init_kwargs
    assert meta["training_options"]["init"] == str(init) and meta["training_options"]["channels"] == 8
    for std in ("0.050", "0.100"):  # both EMA tracks
        assert_first_snapshot_is_the_init(tmp_path / "run" / f"network-snapshot-0000000-16-{std}.safetensors",
                                          safetensors.torch.load_file(str(init)))
    state = checkpoint.load_state(tmp_path / "run" / "training-state-0000000-16.pt")
    assert {s["step"].item() for s in state["optimizer"]["state"].values()} == {1}  # a fresh Adam, one step in
    assert json.loads((tmp_path / "run" / "training_options.json").read_text())["init"] == str(init)


def test_a_run_started_from_a_snapshot_resumes_from_its_own_states(train_data, tmp_path):
    init = init_snapshot(tmp_path / "init.safetensors")
    common = [f"--data={train_data}", f"--init={init}", "--batch=16", "--workers=0"]
    assert cli(*common, f"--outdir={tmp_path / 'straight'}", "--duration=48").exit_code == 0
    result = cli(*common, f"--outdir={tmp_path / 'resumed'}", "--duration=32")
    assert result.exit_code == 0, result.output
    init_snapshot(init, seed=5)  # other weights in the same file: a resume must not read them
    result = cli(*common, f"--outdir={tmp_path / 'resumed'}", "--duration=48")
    assert result.exit_code == 0 and "Resuming from training-state-0000000-32.pt at 32 images" in result.output
    for std in ("0.050", "0.100"):
        name = f"network-snapshot-0000000-48-{std}.safetensors"
        straight, resumed = (safetensors.torch.load_file(str(tmp_path / run / name)) for run in ("straight", "resumed"))
        assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    # The same --init must be given again: it is one of the run's hyperparameters.
    result = cli(f"--data={train_data}", "--batch=16", "--workers=0", f"--outdir={tmp_path / 'resumed'}",
                 "--duration=64")
    assert_one_error_line(result, "cannot resume with different hyperparameters", "init: run has")


def write_latent_dataset(path, num=8, classes=5):
    """8x8 mean/std latents of 4 VAE channels (8 stored), labeled, in the release's layout."""
    rng = np.random.default_rng(0)
    (path / "00000").mkdir(parents=True)
    names = []
    for i in range(num):
        name = f"00000/img-mean-std-{i:08d}.npy"
        np.save(path / name, np.abs(rng.normal(size=(8, 8, 8))).astype(np.float32))
        names.append([name, i % classes])
    (path / "dataset.json").write_text(json.dumps({"labels": names}))
    return path


def test_init_from_a_release_pickle_takes_its_weights_and_encoder(release_standins, tmp_path):
    net = random_release_tiny_net()
    write_release_pickle(tmp_path / "release.pkl", net, *release_standins)
    data = write_latent_dataset(tmp_path / "latents")
    # --grid=0: a sample grid would decode with the Stability VAE, which tests do not download.
    result = cli(f"--data={data}", f"--outdir={tmp_path / 'run'}", f"--init={tmp_path / 'release.pkl'}", *ONE_STEP,
                 "--grid=0")
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "ran").exists()  # nothing of the pickle's code ran
    weights = {k: v.half() for k, v in net.state_dict().items()}  # the release stores float16
    assert_first_snapshot_is_the_init(tmp_path / "run" / "network-snapshot-0000000-16-0.050.safetensors", weights)
    _, meta = load_network(tmp_path / "run" / "network-snapshot-0000000-16-0.050.safetensors")
    assert meta["encoder"]["class"] == "StabilityVAEEncoder" and meta["dataset"]["label_dim"] == RELEASE_TINY["label_dim"]


def test_data_holding_some_of_the_classes_fine_tunes_with_its_labels_as_they_are(tmp_path):
    # Data of classes 2 and 8 only (its highest label plus one is 9) fine-tunes a network of 10 classes.
    data = write_image_dataset(tmp_path / "data", num=16, classes=2)
    listed = json.loads((data / "dataset.json").read_text())["labels"]
    (data / "dataset.json").write_text(json.dumps({"labels": [[name, (2, 8)[label]] for name, label in listed]}))
    init = init_snapshot(tmp_path / "init.safetensors", label_dim=10)
    dataset = ImageFolderDataset(data)
    run_setup.init_options(str(init), "edm2", dataset, StandardRGBEncoder(), {})
    expected = [np.eye(10, dtype=np.float32)[(2, 8)[i % 2]] for i in range(16)]  # one-hot over the net's classes
    assert all(np.array_equal(dataset.get_label(i), expected[i]) for i in range(16))

    result = cli(f"--data={data}", f"--outdir={tmp_path / 'run'}", f"--init={init}", *ONE_STEP)
    assert result.exit_code == 0, result.output
    assert f"Starting from {init} at 0 images" in result.output
    net, meta = load_network(tmp_path / "run" / "network-snapshot-0000000-16-0.100.safetensors")
    assert net.label_dim == 10 and meta["dataset"]["label_dim"] == 10


# id -> (options beside --data/--outdir/--init, fragments of the one error line). {init} is an 8x8 RGB snapshot of
# 4 classes (the training data's), made by init_snapshot with the overrides of INIT_CASES.
INIT_BAD = {
    "missing file": (["--init={tmp}/missing.safetensors"], ["--init", "missing.safetensors: no such file"]),
    "not a snapshot": (["--init={tmp}/garbage.safetensors"], ["--init", "garbage.safetensors"]),
    "unreachable url": (["--init=http://127.0.0.1:9/edm2-img512-s-2147483-0.130.pkl"], ["--init", "127.0.0.1:9"]),
    "other resolution": (["--init={tmp}/res16.safetensors"], ["--init", "16x16 network with 3 channels",
                                                              "the data gives 8x8 with 3"]),
    "other channels": (["--init={tmp}/gray.safetensors"], ["--init", "with 1 channels", "the data gives 8x8 with 3"]),
    "labels beyond its classes": (["--init={tmp}/cls3.safetensors"], ["--init", "a network of 3 classes",
                                                                      "the data's labels go up to 3"]),
    "conditional, --cond=False": (["--init={tmp}/init.safetensors", "--cond=False"],
                                  ["--init", "a network of 4 classes", "(--cond=False)"]),
    "unconditional, --cond=True": (["--init={tmp}/uncond.safetensors"], ["--init", "an unconditional network",
                                                                        "--cond=False"]),
    "latent net, pixel data": (["--init={tmp}/release.pkl"], ["--init", "StabilityVAEEncoder data",
                                                              "StandardRGBEncoder"]),
    "no encoder": (["--init={tmp}/no-encoder.safetensors"], ["--init", "no usable encoder settings"]),
    "channels contradict": (["--init={tmp}/init.safetensors", "--channels=16"],
                            ["--init", "--channels=16 contradicts init.safetensors", "has 8"]),
    "channel-mult contradicts": (["--init={tmp}/init.safetensors", "--channel-mult=1,2"],
                                 ["--init", "--channel-mult=1,2 contradicts", "has 1"]),
    "attention contradicts": (["--init={tmp}/init.safetensors", "--attn-resolutions=4"],
                              ["--init", "--attn-resolutions=4 contradicts", "has none"]),
}


@pytest.fixture
def init_files(tmp_path, release_standins):
    init_snapshot(tmp_path / "init.safetensors")
    (tmp_path / "garbage.safetensors").write_bytes(b"not a snapshot")
    for name, overrides in (("res16", dict(img_resolution=16)), ("gray", dict(img_channels=1)),
                            ("cls3", dict(label_dim=3)), ("uncond", dict(label_dim=0))):
        net = tiny_precond(**{**dict(img_resolution=8, img_channels=3, label_dim=4), **INIT_UNET, **overrides})
        save_network(tmp_path / f"{name}.safetensors", net, {"encoder": StandardRGBEncoder().config()})
    save_network(tmp_path / "no-encoder.safetensors", tiny_precond(8, 3, 4, **INIT_UNET), {})
    write_release_pickle(tmp_path / "release.pkl", random_release_tiny_net(), *release_standins)
    return tmp_path


@pytest.mark.bad_input
@pytest.mark.parametrize("case", INIT_BAD)
def test_what_contradicts_the_init_snapshot_is_one_line_before_any_work(case, train_data, init_files, monkeypatch):
    tmp_path = init_files
    monkeypatch.setenv("EDM2_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(train_edm2, "train", lambda *args: pytest.fail("training started"))
    args, fragments = INIT_BAD[case]
    assert_refused(tmp_path, lambda: cli(f"--data={train_data}", f"--outdir={tmp_path / 'run'}",
                                         *(a.format(tmp=tmp_path) for a in args)), *fragments)


def test_the_init_snapshots_architecture_is_parsed_once_while_the_file_is_unchanged(tmp_path, monkeypatch):
    # train_edm2.py and train()'s preflight both read --init's architecture: one parse of an unchanged file, a new
    # one after the file is replaced.
    loads = []
    real = architecture.load_generator
    monkeypatch.setattr(architecture, "load_generator", lambda path: loads.append(path) or real(path))
    path = init_snapshot(tmp_path / "init.safetensors")
    first, second = architecture.read_init(str(path)), architecture.read_init(str(path))
    assert len(loads) == 1 and first.network_kwargs == second.network_kwargs
    assert first.network_kwargs is not second.network_kwargs  # each caller gets its own copy
    init_snapshot(tmp_path / "other.safetensors", model_channels=16).replace(path)
    third = architecture.read_init(str(path))
    assert len(loads) == 2 and third.channels == 16 != first.channels


def named_dataset(path, classes: dict, num=8):
    """write_image_dataset's data with dataset.json's labels renumbered into classes' values, names recorded."""
    data = write_image_dataset(path, num=num, classes=len(classes))
    labels = [[name, list(classes.values())[label]] for name, label in json.loads((data / "dataset.json").read_text())["labels"]]
    (data / "dataset.json").write_text(json.dumps({"labels": labels, "classes": classes}))
    return data


def test_init_says_whether_the_classes_line_up_and_what_it_uses(tmp_path):
    # Issue 26, item 8: two class folders converted alone became classes 0 and 1 of a 4-class network, silently.
    full = named_dataset(tmp_path / "full", {"cat": 0, "dog": 1, "eel": 2, "fox": 3})
    two_steps = ["--duration=32", "--batch=16", "--workers=0", "--snapshot=32"]
    first = cli(f"--data={full}", f"--outdir={tmp_path / 'run'}", "--label-dropout=0.1", "--lr=0.02", *two_steps)
    assert first.exit_code == 0, first.output
    snapshot = sorted((tmp_path / "run").glob("network-snapshot-*.safetensors"))[0]
    recorded = json.loads((tmp_path / "run" / "training_options.json").read_text())["dataset"]["classes"]
    assert recorded == {"cat": 0, "dog": 1, "eel": 2, "fox": 3}

    renumbered = named_dataset(tmp_path / "renumbered", {"eel": 0, "fox": 1})
    result = cli(f"--data={renumbered}", f"--outdir={tmp_path / 'ft'}", f"--init={snapshot}", *ONE_STEP)
    assert result.exit_code == 0, result.output
    assert (f"Warning: the classes do not line up: eel is class 2 of {snapshot.name} but 0 of the data; fox is "
            f"class 3 of {snapshot.name} but 1 of the data") in result.stderr
    # What it uses: this run's label dropout and learning rate (toy-tiny's 0.01), beside the snapshot run's, whose
    # second step of 16 images trained at Eq. 67's rate of image 16.
    last = learning_rate_schedule(16, 16, 0.02, 100, 0.0005)
    assert "--init: this run uses label dropout 0.0 and learning rate alpha_ref 0.01 (Eq. 67 from image 0" in result.stderr
    assert f"{snapshot.name}'s run used label dropout 0.1 and ended at learning rate {last:.4g}" in result.stderr
    assert f"Starting from {snapshot} at 0 images (label dropout 0.0, learning rate alpha_ref 0.01 " in result.output

    kept = named_dataset(tmp_path / "kept", {"eel": 2, "fox": 3})  # convert --labels kept the numbers
    lined_up = cli(f"--data={kept}", f"--outdir={tmp_path / 'ft2'}", f"--init={snapshot}", *ONE_STEP, "--dry-run")
    assert lined_up.exit_code == 0 and "do not line up" not in lined_up.stderr and "--init: this run" in lined_up.stderr


def test_init_from_a_snapshot_without_class_names_says_labels_go_by_number(tmp_path, train_data):
    init = init_snapshot(tmp_path / "init.safetensors")
    result = cli(f"--data={train_data}", f"--outdir={tmp_path / 'run'}", f"--init={init}", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "Note: init.safetensors records no class names, so the data's labels train" in result.stderr
