"""One encoding table: an encoder's settings are its constructor's arguments, recorded whether or not it says so;
dataset_tool.py takes them (--encoding-settings) and records them in dataset.json and shard indexes; shards hold any
encoding of edm2.encoders.ENCODINGS in the dtype its class stores; recorded settings that do not fit the data are
one line before training."""

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import train_edm2
from cli.run_setup import choose_encoder
from edm2 import encoders
from edm2.data.dataset import ImageFolderDataset
from edm2.data.shards import INDEX_FILE, ShardDataset, read_index
from edm2.encoders import (DiffusersVAEEncoder, Encoder, EncoderSettingsError, LinearRGBEncoder, encoder_for_dataset,
                           encoder_from_config)
from edm2.data.dataset_files import DatasetError
from tests.helpers import (TRAIN_ARGS, assert_ok, assert_one_error_line, assert_refused, run_dataset_tool as run,
                           save_tiny_vae, write_image_dataset)




class Contrast(Encoder):
    """An encoding that says nothing of its settings: no settings(), no config()."""

    encoding = "contrast"

    def __init__(self, strength: float = 1.0, pivot: tuple = (0.5, 0.5)):
        self.strength = strength


class StrongContrast(Contrast):
    encoding = "strong-contrast"

    def __init__(self, strength: float = 4.0, floor: int = 0):
        super().__init__(strength=strength * 2)


def test_an_encoder_that_defines_no_settings_still_records_them(monkeypatch):
    encoder = Contrast(strength=2.0)
    assert encoder.dataset_record() == {"encoding": "contrast",
                                        "encoding_settings": {"strength": 2.0, "pivot": [0.5, 0.5]}}
    assert encoder.config() == {"class": "Contrast", "strength": 2.0, "pivot": [0.5, 0.5]}
    # A subclass's own arguments are its settings, not those its constructor passes on to its parent's.
    assert StrongContrast(floor=3).settings() == {"strength": 4.0, "floor": 3}
    monkeypatch.setitem(encoders.ENCODINGS, "contrast", Contrast)
    rebuilt = encoder_for_dataset("contrast", json.loads(json.dumps(encoder.dataset_record()))["encoding_settings"])
    assert type(rebuilt) is Contrast and rebuilt.strength == 2.0
    assert encoder_from_config(json.loads(json.dumps(encoder.config()))).strength == 2.0
    with pytest.raises(EncoderSettingsError, match="strenght"):
        encoder_for_dataset("contrast", {"strenght": 2.0})


def test_settings_a_dataset_could_not_record_are_refused_when_the_class_is_defined():
    with pytest.raises(TypeError, match="options"):
        class Loose(Encoder):
            def __init__(self, **options):
                pass


def test_convert_records_the_settings_given_and_training_takes_them(tmp_path):
    source = write_image_dataset(tmp_path / "source", num=4)
    dest = tmp_path / "linear.zip"
    assert_ok(run("convert", "--source", source, "--dest", dest, "--encoding=linear-rgb",
                  '--encoding-settings={"gamma": 1.8}', "--workers=0"))
    dataset = ImageFolderDataset(dest)
    assert (dataset.encoding, dataset.encoding_settings) == ("linear-rgb", {"gamma": 1.8})
    encoder = choose_encoder(dataset)
    assert isinstance(encoder, LinearRGBEncoder) and encoder.gamma == 1.8


@pytest.mark.bad_input
@pytest.mark.parametrize("command, settings, words", [
    ("convert", '{"gamma": 50}', ["--encoding-settings", "gamma=50", "[0.1, 10]"]),
    ("convert", '{"gama": 2}', ["--encoding-settings", "gama", "it takes gamma"]),
    ("convert", '[2.2]', ["--encoding-settings", "JSON object"]),
    ("convert", '{"gamma": NaN}', ["--encoding-settings", "NaN"]),
    ("encode", '{"batch_size": 2}', ["--encoding-settings", "batch_size", "--batch"]),
    ("encode-diffusers", '{"latent_channels": 4}', ["--encoding-settings", "vae_name"]),
    ("encode-diffusers", '{"vae_name": "x", "latent_channels": 2, "raw_mean": [0, 0, 0], "raw_std": 1}',
     ["--encoding-settings", "raw_mean", "expected 2"]),
])
def test_bad_settings_are_one_line_naming_the_option_before_any_work(tmp_path, command, settings, words):
    source = write_image_dataset(tmp_path / "source", num=4)
    args = {"convert": ["convert", "--encoding=linear-rgb"], "encode": ["encode"],
            "encode-diffusers": ["encode", "--encoding=diffusers-vae"]}[command]
    assert_refused(tmp_path, lambda: run(*args, "--source", source, "--dest", tmp_path / "out.zip",
                                         f"--encoding-settings={settings}"), *words)


def test_shards_hold_a_registered_encoding_in_the_dtype_its_class_stores(tmp_path):
    source = write_image_dataset(tmp_path / "source", num=6)
    assert_ok(run("convert", "--source", source, "--dest", tmp_path / "linear.zip", "--encoding=linear-rgb",
                  '--encoding-settings={"gamma": 1.8}', "--workers=0"))
    shards = tmp_path / "linear.shards"
    assert_ok(run("convert", "--source", tmp_path / "linear.zip", "--dest", shards, "--shard-size=4"))
    index = read_index(shards)
    assert (index["encoding"], index["encoding_settings"], index["dtype"]) == ("linear-rgb", {"gamma": 1.8}, "uint8")
    dataset = ShardDataset(shards)
    assert choose_encoder(dataset).gamma == 1.8
    assert np.array_equal(dataset[5][0], ImageFolderDataset(tmp_path / "linear.zip")[5][0])
    # The index's dtype must be the one the encoding's class stores.
    (shards / INDEX_FILE).write_text(json.dumps(dict(index, dtype="float32")))
    with pytest.raises(DatasetError, match="dtype 'float32' is not 'uint8', what linear-rgb holds"):
        ShardDataset(shards)
    (shards / INDEX_FILE).write_text(json.dumps(dict(index, encoding_settings=[1.8])))
    with pytest.raises(DatasetError, match="encoding_settings is not an object"):
        ShardDataset(shards)


@pytest.mark.bad_input
def test_a_dataset_source_keeps_its_encoding_in_shards(tmp_path):
    source = write_image_dataset(tmp_path / "source", num=4)
    assert_refused(tmp_path, lambda: run("convert", "--source", source, "--dest", tmp_path / "s.shards",
                                         "--encoding=linear-rgb"), "--encoding", "keep the encoding it records")


def diffusers_settings(vae, channels):
    raw_mean = [0.1 * c for c in range(channels)]
    return {"vae_name": str(vae), "latent_channels": channels, "raw_mean": raw_mean, "raw_std": 1.5}


def test_a_second_vae_encodes_into_shards_that_decode_reads(tmp_path):
    vae = save_tiny_vae(tmp_path / "vae", latent_channels=6)
    assert_ok(run("toy", "--dest", tmp_path / "toy.zip", "--resolution", 16, "--num", 5, "--classes", 2))
    settings = diffusers_settings(vae, 6)
    shards = tmp_path / "v.shards"
    assert_ok(run("encode", "--source", tmp_path / "toy.zip", "--dest", shards, "--encoding=diffusers-vae",
                  f"--encoding-settings={json.dumps(settings)}", "--batch=2", "--workers=0"))
    index = read_index(shards)
    assert (index["encoding"], index["encoding_settings"]) == ("diffusers-vae", dict(settings, final_mean=0.0,
                                                                                    final_std=0.5))
    assert (index["dtype"], index["shape"]) == ("float32", [12, 8, 8])
    latents = ShardDataset(shards)
    toy = ImageFolderDataset(tmp_path / "toy.zip")
    encoder = DiffusersVAEEncoder(**settings, batch_size=2)
    pixels = torch.from_numpy(np.stack([toy[i][0] for i in range(5)]))
    expected = encoder.encode_pixels(pixels)
    assert all(np.array_equal(latents[i][0], expected[i].numpy()) for i in range(5))

    assert_ok(run("decode", "--source", shards, "--dest", tmp_path / "decoded.zip", "--batch=5"))
    decoded = ImageFolderDataset(tmp_path / "decoded.zip")
    means = expected[:, :6]
    assert all(np.array_equal(decoded[i][0], encoder.decode_raw(means)[i].numpy()) for i in range(5))


@pytest.mark.bad_input
def test_a_vae_of_other_channels_than_its_settings_is_one_line(tmp_path):
    vae = save_tiny_vae(tmp_path / "vae", latent_channels=6)
    source = write_image_dataset(tmp_path / "source", num=2, resolution=16)
    assert_refused(tmp_path, lambda: run("encode", "--source", source, "--dest", tmp_path / "v.zip",
                                         "--encoding=diffusers-vae", "--encoding-settings="
                                         + json.dumps(diffusers_settings(vae, 4)), "--workers=0"),
                   "--encoding-settings", "6 latent channels", "set for 4")


def latent_dataset(path, channels, **record):
    """A release-format dataset of 4 float32 mean/std latents of `channels` channels, with `record` in its
    dataset.json."""
    names = [f"00000/img-mean-std-{i:08d}.npy" for i in range(4)]
    for i, name in enumerate(names):
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        np.save(path / name, np.random.default_rng(i).standard_normal((channels, 8, 8)).astype(np.float32))
    (path / "dataset.json").write_text(json.dumps({"labels": None, **record}))
    return path


def train(data, outdir):
    return CliRunner().invoke(train_edm2.main, [*TRAIN_ARGS, f"--data={data}", f"--outdir={outdir}", "--cond=False",
                                                "--dry-run"])


@pytest.mark.bad_input
@pytest.mark.parametrize("settings, words", [
    ({"raw_mean": [], "raw_std": []}, ["raw_mean=[]", "one per latent channel"]),
    ({"raw_mean": [0, 0, 0], "raw_std": [1, 1, 1]}, ["8 channels", "4 latent channels", "give 3"]),
    ({"raw_mean": [0, 0, 0, 0], "raw_std": [1, 1, 0, 1]}, ["raw_std", "positive"]),
    ({"vae_name": ["x"]}, ["vae_name"]),
])
def test_recorded_settings_that_do_not_fit_the_data_are_one_line_before_training(tmp_path, settings, words):
    data = latent_dataset(tmp_path / "data", 8, encoding="stability-vae", encoding_settings=settings)
    assert_refused(tmp_path, lambda: train(data, tmp_path / "run"), "--data", "dataset.json", "stability-vae",
                   *words)


@pytest.mark.bad_input
def test_a_recorded_encoding_of_another_dtype_is_one_line(tmp_path):
    data = latent_dataset(tmp_path / "data", 3, encoding="linear-rgb")
    assert_refused(tmp_path, lambda: train(data, tmp_path / "run"), "--data", "dataset.json", "linear-rgb",
                   "stores uint8", "float32")


def test_datasets_recorded_before_and_without_a_record_still_load(tmp_path):
    # What dataset_tool.py encode wrote before settings were recorded in full: the VAE's name only.
    old = latent_dataset(tmp_path / "old", 8, encoding="stability-vae", encoding_settings={"vae_name": "some/vae"})
    encoder = choose_encoder(ImageFolderDataset(old))
    assert encoder.vae_name == "some/vae" and encoder.config() == encoders.StabilityVAEEncoder("some/vae").config()
    release = latent_dataset(tmp_path / "release", 8)
    assert choose_encoder(ImageFolderDataset(release)).config() == encoders.StabilityVAEEncoder().config()
    result = train(release, tmp_path / "run")
    assert_ok(result)
    assert "records no encoding" in result.output and "taken as stability-vae" in result.output
    assert_one_error_line(train(latent_dataset(tmp_path / "six", 6), tmp_path / "run6"), "6 channel(s)")


@pytest.mark.bad_input
@pytest.mark.parametrize("encoding, settings", [
    ("stability-vae", {"raw_mean": "abcd"}), ("stability-vae", {"raw_mean": [[1, 2, 3, 4]]}),
    ("stability-vae", {"raw_mean": [True, 0, 0, 0]}), ("stability-vae", {"final_std": 0}),
    ("stability-vae", {"batch_size": 2 ** 30}), ("stability-vae", {"vae_name": ""}), ("stability-vae", {"vae_name": 5}),
    ("stability-vae", {"raw_mean": [0.0] * 2000, "raw_std": [1.0] * 2000}),
    ("diffusers-vae", {"vae_name": "v", "latent_channels": 2.0, "raw_mean": 0, "raw_std": 1}),
    ("diffusers-vae", {"vae_name": "v", "latent_channels": 2, "raw_mean": [0], "raw_std": 1}),
    ("diffusers-vae", {"vae_name": "v", "latent_channels": 2, "raw_mean": 0, "raw_std": -1}),
    ("linear-rgb", {"gamma": "2.2"}), ("pixels", {"gamma": 2.2}),
])
def test_every_recorded_setting_is_checked_when_read(encoding, settings):
    with pytest.raises(EncoderSettingsError) as info:
        encoder_for_dataset(encoding, settings)
    assert "\n" not in str(info.value) and len(str(info.value)) < 400


def test_the_second_vae_normalizes_by_the_statistics_it_is_given():
    encoder = DiffusersVAEEncoder("unused", latent_channels=3, raw_mean=[0.1, -0.2, 0.3], raw_std=1.5)
    # As the Stability VAE's (paper Appendix B.1): scale = final_std / raw_std and bias = final_mean - raw_mean *
    # scale, in float32 (a division, then a product and a subtraction: within 3 roundings of the exact values).
    u32 = 2.0 ** -24
    assert np.allclose(encoder.scale, np.full(3, 0.5 / 1.5), rtol=u32 * 1.001, atol=0)
    assert np.allclose(encoder.bias, -np.array([0.1, -0.2, 0.3]) * 0.5 / 1.5, rtol=3 * u32 * 1.001, atol=0)
    assert encoder.out_channels(6) == 3 and encoder.stored_dtype == "float32"
    with pytest.raises(EncoderSettingsError, match="give 3"):
        encoder.out_channels(8)
