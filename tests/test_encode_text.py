"""dataset_tool.py encode-text: the cached embeddings equal the encoder's, resume and two processes give the same
dataset, datasets read them back as conditions; one-line refusals that write nothing."""

import json
import os
import shutil
import subprocess
import sys
import zipfile

import numpy as np
import pytest
import torch

from edm2.data.dataset import DatasetError, ImageFolderDataset
from edm2.data.text_data import TEXT_EMPTY_FILE, text_fname
from edm2.runtime.distributed import free_port
from edm2.text_condition import pack_condition
from edm2.text_encoders import (OnlineConditions, TextEncoder, TextEncoderMismatchError, check_encoder_matches,
                                load_text_encoder, stored_embeddings)
from tests.helpers import REPO, assert_ok, assert_one_error_line, assert_refused, run_dataset_tool as run
from tests.text_helpers import tiny_text_encoder

CAPTIONS = ["a red circle on the left", "", "blue star on the right", "the cyan ring on the left",
            "a green square", "magenta cross on the right on the right on the right on the right", "a yellow diamond"]
TOKENS, BATCH = 10, 3


def zip_contents(path):
    with zipfile.ZipFile(path) as archive:
        return {name: archive.read(name) for name in archive.namelist()}


def folder_contents(path):
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def add_captions(dataset, captions):
    record = json.loads((dataset / "dataset.json").read_text())
    record["captions"] = [[name, text] for (name, _), text in zip(record["labels"], captions)]
    (dataset / "dataset.json").write_text(json.dumps(record))
    return dataset


@pytest.fixture(scope="module")
def text_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("encode-text")
    assert_ok(run("toy", "--dest", root / "toy", "--resolution", 8, "--num", len(CAPTIONS), "--classes", 3))
    add_captions(root / "toy", CAPTIONS)
    encoder_dir = tiny_text_encoder(root / "t5", "t5")
    reference = root / "reference.zip"
    result = run("encode-text", "--source", root / "toy", "--dest", reference, "--text-encoder", encoder_dir,
                 "--tokens", TOKENS, "--batch", BATCH)
    assert_ok(result)
    return root, encoder_dir, reference, result.output


def test_encode_text_stores_the_encoders_embeddings_beside_a_copy_of_the_dataset(text_setup):
    root, encoder_dir, reference, output = text_setup
    encoder = load_text_encoder(encoder_dir, tokens=TOKENS)
    contents = zip_contents(reference)
    source = folder_contents(root / "toy")
    names = [f"00000/img{i:08d}.png" for i in range(len(CAPTIONS))]
    assert sorted(contents) == sorted(names + [text_fname(n) for n in names] + [TEXT_EMPTY_FILE, "dataset.json"])
    assert all(contents[name] == source[name] for name in names)
    lengths = []
    for start in range(0, len(CAPTIONS), BATCH):  # in the command's blocks: the same computation, bit for bit
        pooled, tokens, n = encoder.encode(CAPTIONS[start:start + BATCH])
        expected = stored_embeddings(pooled, tokens)
        for i, embeddings in enumerate(expected):
            stored = np.load(zipfile.ZipFile(reference).open(text_fname(names[start + i])))
            assert stored.dtype == np.float16 and stored.shape == (1 + TOKENS, 16)
            assert np.array_equal(stored, embeddings)
        lengths += n.tolist()
    pooled, tokens, n = encoder.encode([""])
    assert np.array_equal(np.load(zipfile.ZipFile(reference).open(TEXT_EMPTY_FILE)), stored_embeddings(pooled,
                                                                                                       tokens)[0])
    record = json.loads(contents["dataset.json"])
    source_record = json.loads(source["dataset.json"])
    assert record == {**source_record, "text_encoding": encoder.record(),
                      "text_lengths": [[name, k] for name, k in zip(names, lengths)], "text_empty_length": int(n[0])}
    assert record["labels"] == [[name, i % 3] for i, name in enumerate(names)]
    assert record["text_encoding"]["encoder"]["sha256"] == encoder.sha256 and record["text_encoding"]["dim"] == 16


def test_truncation_is_said_once_with_the_count(text_setup):
    root, encoder_dir, _, output = text_setup
    encoder = load_text_encoder(encoder_dir, tokens=TOKENS)
    long = int((encoder.token_counts(CAPTIONS) > TOKENS).sum())
    assert long == 1
    assert output.count("truncated") == 1  # the output also holds tqdm's bars, which end in no newline
    assert (f"1 of {len(CAPTIONS)} captions were longer than {TOKENS} tokens and were truncated to their first "
            f"{TOKENS} (--tokens)\n") in output


def test_the_dataset_gives_conditions_as_labels(text_setup):
    root, encoder_dir, reference, _ = text_setup
    encoder = load_text_encoder(encoder_dir, tokens=TOKENS)
    dataset = ImageFolderDataset(reference)
    source = ImageFolderDataset(root / "toy")
    assert len(dataset) == len(CAPTIONS) and dataset.has_text and dataset.has_captions
    assert dataset.text_record == encoder.record()
    check_encoder_matches(dataset.text_record, encoder)
    record = json.loads(zip_contents(reference)["dataset.json"])
    for i, caption in enumerate(CAPTIONS):
        image, label = dataset[i]
        assert np.array_equal(image, source[i][0]) and dataset.get_caption(i) == caption
        stored = torch.from_numpy(np.load(zipfile.ZipFile(reference).open(text_fname(dataset.fnames[i]))).astype(
            np.float32))
        expected = pack_condition(stored[0], stored[1:], record["text_lengths"][i][1]).numpy()
        assert label.dtype == np.float32 and label.shape == (1 + TOKENS, 17) and np.array_equal(label, expected)
        assert np.array_equal(dataset.get_condition(i), expected)
    empty = dataset.empty_condition()
    assert empty.shape == (1 + TOKENS, 17) and empty[:, -1].sum() == 1 + record["text_empty_length"]
    plain = ImageFolderDataset(reference, use_text=False)
    assert np.array_equal(plain[4][1], np.eye(3, dtype=np.float32)[4 % 3])
    subset = ImageFolderDataset(reference, max_size=3)
    for i in range(3):
        assert np.array_equal(subset[i][1], dataset.get_condition(int(subset.fnames[i][-12:-4])))


def test_online_and_cached_conditions_are_equal(text_setup):
    """Online conditions round through float16 as the cache does: equal up to the batch's float32 sums, which is
    float16 rounding at most (the same captions in the same blocks: bit for bit)."""
    root, encoder_dir, reference, _ = text_setup
    dataset = ImageFolderDataset(reference)
    online = OnlineConditions(load_text_encoder(encoder_dir, tokens=TOKENS))
    for start in range(0, len(CAPTIONS), BATCH):
        cached = np.stack([dataset.get_condition(i) for i in range(start, min(start + BATCH, len(CAPTIONS)))])
        assert np.array_equal(online(CAPTIONS[start:start + BATCH]).numpy(), cached)
    shuffled = online(CAPTIONS[::-1]).numpy()[::-1]  # other batch company: float16 rounding apart at most
    cached = np.stack([dataset.get_condition(i) for i in range(len(CAPTIONS))])
    assert np.allclose(shuffled, cached, rtol=2 ** -10, atol=2 ** -24)
    assert np.array_equal(online.empty_condition().numpy(), dataset.empty_condition())


def test_a_folder_destination_equals_the_zip(text_setup):
    root, encoder_dir, reference, _ = text_setup
    dest = root / "folder"
    assert_ok(run("encode-text", "--source", root / "toy", "--dest", dest, "--text-encoder", encoder_dir,
                  "--tokens", TOKENS, "--batch", BATCH))
    assert folder_contents(dest) == zip_contents(reference) and not (root / "folder.partial").exists()


def test_an_interrupted_encode_text_resumes_to_the_same_dataset(text_setup, monkeypatch):
    root, encoder_dir, reference, _ = text_setup
    dest = root / "resumed.zip"
    args = ["encode-text", "--source", root / "toy", "--dest", dest, "--text-encoder", encoder_dir,
            "--tokens", TOKENS, "--batch", BATCH]
    original = TextEncoder.encode
    calls = []

    def interrupt_second_batch(self, captions):
        calls.append(len(captions))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return original(self, captions)

    monkeypatch.setattr(TextEncoder, "encode", interrupt_second_batch)
    assert run(*args).exit_code != 0
    partial = root / "resumed.zip.partial"
    assert not dest.exists() and len(list(partial.glob("*/txt*.npy"))) == BATCH
    monkeypatch.setattr(TextEncoder, "encode", original)
    assert_one_error_line(run(*args[:-4], "--tokens", TOKENS + 1, "--batch", BATCH), "resumed.zip.partial",
                          f"tokens {TOKENS} -> {TOKENS + 1}")
    result = run(*args)
    assert_ok(result)
    assert f"{BATCH} of {len(CAPTIONS)} captions already encoded" in result.output
    assert dest.read_bytes() == reference.read_bytes() and not partial.exists()


def test_torchrun_two_processes_equal_one(text_setup):
    root, encoder_dir, reference, _ = text_setup
    dest = root / "two-processes"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
               "dataset_tool.py", "encode-text", "--source", str(root / "toy"), "--dest", str(dest),
               "--text-encoder", str(encoder_dir), "--tokens", str(TOKENS), "--batch", str(BATCH)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert folder_contents(dest) == zip_contents(reference)
    assert result.stdout.count("truncated") == 1


def test_stored_embeddings_of_another_shape_are_refused_before_use(text_setup, tmp_path):
    root, _, reference, _ = text_setup
    dataset_dir = tmp_path / "d"
    with zipfile.ZipFile(reference) as archive:
        archive.extractall(dataset_dir)
    np.save(dataset_dir / "00000/txt00000002.npy", np.zeros((1 + TOKENS, 8), np.float16))
    np.save(dataset_dir / "00000/txt00000003.npy", np.zeros((1 + TOKENS, 16), np.float32))
    dataset = ImageFolderDataset(dataset_dir)
    with pytest.raises(DatasetError, match=r"txt00000002.npy holds float16 \(11, 8\).*says float16 \(11, 16\)"):
        dataset[2]
    with pytest.raises(DatasetError, match=r"txt00000003.npy holds float32 \(11, 16\)"):
        dataset.get_condition(3)
    record = json.loads((dataset_dir / "dataset.json").read_text())
    for change, message in [({"tokens": 10 ** 9}, "tokens\": L in"), ({"dim": "16"}, "\"dim\": D in")]:
        (dataset_dir / "dataset.json").write_text(json.dumps(dict(record, text_encoding=dict(
            record["text_encoding"], **change))))
        with pytest.raises(DatasetError, match=message):
            ImageFolderDataset(dataset_dir)
    (dataset_dir / "dataset.json").write_text(json.dumps(dict(record, text_lengths=record["text_lengths"][1:])))
    with pytest.raises(DatasetError, match="no text length for 00000/img00000000.png"):
        ImageFolderDataset(dataset_dir)
    no_captions = dict(record)
    del no_captions["captions"], no_captions["text_encoding"]
    (dataset_dir / "dataset.json").write_text(json.dumps(no_captions))
    plain = ImageFolderDataset(dataset_dir)
    assert len(plain) == len(CAPTIONS) and not plain.has_text and not plain.has_captions  # txt files are no images
    with pytest.raises(DatasetError, match="has no captions"):
        plain.get_caption(0)
    with pytest.raises(DatasetError, match="holds no text embeddings; dataset_tool.py encode-text"):
        plain.empty_condition()


def test_generation_refuses_another_encoder_than_the_datasets(text_setup, tmp_path):
    _, _, reference, _ = text_setup
    clip = load_text_encoder(tiny_text_encoder(tmp_path / "clip", "clip"), tokens=TOKENS)
    with pytest.raises(TextEncoderMismatchError, match="is not the one recorded"):
        check_encoder_matches(ImageFolderDataset(reference).text_record, clip)


def bad_inputs(root, encoder_dir, tmp_path):
    no_captions = tmp_path / "no-captions"
    shutil.copytree(root / "toy", no_captions)
    record = json.loads((no_captions / "dataset.json").read_text())
    del record["captions"]
    (no_captions / "dataset.json").write_text(json.dumps(record))
    unloadable = tmp_path / "unloadable"
    unloadable.mkdir()
    (unloadable / "config.json").write_text("{}")
    clip = tiny_text_encoder(tmp_path / "clip", "clip")
    exists = tmp_path / "exists.zip"
    exists.write_bytes(b"")
    source, encoder = str(root / "toy"), str(encoder_dir)
    return {
        "no captions": (["--source", no_captions, "--dest", tmp_path / "o.zip", "--text-encoder", encoder],
                        ["--source", "has no captions"]),
        "unloadable encoder": (["--source", source, "--dest", tmp_path / "o.zip", "--text-encoder", unloadable],
                               ["--text-encoder", "transformers cannot load a text encoder"]),
        "too many CLIP tokens": (["--source", source, "--dest", tmp_path / "o.zip", "--text-encoder", clip,
                                  "--tokens", 78], ["--tokens", "takes 1 to 77 tokens"]),
        "shard destination": (["--source", source, "--dest", tmp_path / "o.shards", "--text-encoder", encoder],
                              ["--dest", "shard datasets hold no text embeddings"]),
        "existing destination": (["--source", source, "--dest", exists, "--text-encoder", encoder],
                                 ["--dest", "already exists"]),
    }


@pytest.mark.parametrize("case", ["no captions", "unloadable encoder", "too many CLIP tokens", "shard destination",
                                  "existing destination"])
def test_bad_input_is_one_line_and_writes_nothing(text_setup, tmp_path, case):
    root, encoder_dir, _, _ = text_setup
    args, fragments = bad_inputs(root, encoder_dir, tmp_path)[case]
    assert_refused(tmp_path, lambda: run("encode-text", *args), *fragments)


def test_missing_transformers_is_one_line(text_setup, tmp_path):
    root, encoder_dir, _, _ = text_setup
    code = ("import sys, runpy\nsys.modules['transformers'] = None\nsys.argv = ['dataset_tool.py', *sys.argv[1:]]\n"
            "runpy.run_path('dataset_tool.py', run_name='__main__')\n")
    result = subprocess.run([sys.executable, "-c", code, "encode-text", "--source", str(root / "toy"), "--dest",
                             str(tmp_path / "o.zip"), "--text-encoder", str(encoder_dir)], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert_one_error_line(result, "--text-encoder", "pip install edm2[text]")
    assert not (tmp_path / "o.zip").exists() and not (tmp_path / "o.zip.partial").exists()


def test_blends_of_text_datasets_share_their_text_encoding(text_setup, tmp_path):
    from edm2.data.blend import BlendError
    from edm2.data.sources import open_data

    root, encoder_dir, reference, _ = text_setup
    blend = open_data(f"{reference}:1,{reference}:1")
    assert blend.has_text and blend.text_record == ImageFolderDataset(reference).text_record
    assert np.array_equal(blend[len(CAPTIONS) + 2][1], ImageFolderDataset(reference).get_condition(2))
    assert np.array_equal(blend.empty_condition(), ImageFolderDataset(reference).empty_condition())
    with pytest.raises(BlendError, match="share their text_encoding"):
        open_data(f"{reference}:1,{root / 'toy'}:1")
    other = tmp_path / "clip.zip"
    assert_ok(run("encode-text", "--source", root / "toy", "--dest", other, "--text-encoder",
                  tiny_text_encoder(tmp_path / "clip", "clip"), "--tokens", TOKENS))
    with pytest.raises(BlendError, match="share their text_encoding"):
        open_data(f"{reference}:1,{other}:1")


def test_latent_datasets_get_embeddings_beside_their_latents(text_setup, tmp_path):
    from edm2.data.dataset import latent_fname
    from edm2.data.dataset_writer import labels_json

    root, encoder_dir, reference, _ = text_setup
    latents = tmp_path / "latents"
    names = [latent_fname(i) for i in range(len(CAPTIONS))]
    rng = np.random.default_rng(0)
    for name in names:
        (latents / name).parent.mkdir(parents=True, exist_ok=True)
        np.save(latents / name, rng.standard_normal((8, 2, 2)).astype(np.float32))
    record = json.loads(labels_json({name: i % 3 for i, name in enumerate(names)}, encoding={
        "encoding": "stability-vae"}))
    (latents / "dataset.json").write_text(json.dumps(dict(record, captions=[list(e) for e in zip(names, CAPTIONS)])))
    dest = tmp_path / "latents-text.zip"
    assert_ok(run("encode-text", "--source", latents, "--dest", dest, "--text-encoder", encoder_dir,
                  "--tokens", TOKENS, "--batch", BATCH))
    dataset, cached = ImageFolderDataset(dest), ImageFolderDataset(reference)
    assert dataset.encoding == "stability-vae" and dataset.fnames == names
    for i in range(len(CAPTIONS)):
        image, condition = dataset[i]
        assert np.array_equal(image, np.load(latents / names[i])) and np.array_equal(condition, cached[i][1])
