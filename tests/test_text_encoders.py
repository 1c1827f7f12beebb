"""Text encoders against direct transformers calls: pooling, token lengths, truncation, identity; one-line refusals."""

import hashlib
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from edm2.text_condition import unpack_condition
from edm2.text_encoders import (DEFAULT_TOKENS, OnlineConditions, TextEncoderError, TextEncoderMismatchError,
                                TokenLengthError, check_encoder_matches, folder_sha256, load_text_encoder,
                                stored_embeddings)
from tests.helpers import REPO
from tests.text_helpers import tiny_text_encoder

CAPTIONS = ["a red circle on the left", "", "blue star on the right", "the cyan ring"]
U32 = 2.0 ** -24


@pytest.fixture(scope="module")
def encoder_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("text-encoders")
    return {kind: tiny_text_encoder(root / kind, kind) for kind in ("t5", "clip")}


def direct_hidden(folder, kind, caption):
    """The model's last hidden states of one caption alone, unpadded: transformers called directly."""
    from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

    ids = AutoTokenizer.from_pretrained(folder)(caption, return_tensors="pt")["input_ids"]
    model = (CLIPTextModel if kind == "clip" else T5EncoderModel).from_pretrained(folder).eval()
    with torch.no_grad():
        out = model(input_ids=ids)
    return out.last_hidden_state[0].double(), out


def test_the_tiny_encoder_is_deterministic(encoder_dirs, tmp_path):
    for kind, folder in encoder_dirs.items():
        again = tiny_text_encoder(tmp_path / kind, kind)
        assert folder_sha256(again) == folder_sha256(folder)
        assert json.loads((folder / "config.json").read_text())["architectures"] == [
            {"t5": "T5EncoderModel", "clip": "CLIPTextModel"}[kind]]


@pytest.mark.parametrize("kind", ["t5", "clip"])
def test_tokens_and_pooled_equal_the_models_own_outputs(encoder_dirs, kind):
    encoder = load_text_encoder(encoder_dirs[kind], tokens=12)
    pooled, tokens, lengths = encoder.encode(CAPTIONS)
    assert pooled.dtype == tokens.dtype == torch.float32
    assert pooled.shape == (4, 16) and tokens.shape == (4, 12, 16)
    for i, caption in enumerate(CAPTIONS):
        hidden, _ = direct_hidden(encoder_dirs[kind], kind, caption)
        n = hidden.shape[0]
        assert lengths[i] == n == encoder.token_counts([caption])[0]
        # Padding is masked out (T5) or after the real tokens of a causal model (CLIP): the real tokens' states
        # are the unpadded run's up to float32 rounding in sums of 16 terms of values of order 1.
        assert torch.allclose(tokens[i, :n].double(), hidden, rtol=0, atol=1e-5)
        assert torch.all(tokens[i, n:] == 0)
        # T5: the mean of the n real tokens (float64 here); CLIP: its pooler output, the state at the end-of-text
        # token, the last real one.
        expected = hidden.mean(dim=0) if kind == "t5" else hidden[n - 1]
        assert torch.allclose(pooled[i].double(), expected, rtol=0, atol=1e-5)


def test_default_token_lengths_and_limits(encoder_dirs):
    assert load_text_encoder(encoder_dirs["t5"]).tokens == DEFAULT_TOKENS["t5"] == 128
    assert load_text_encoder(encoder_dirs["clip"]).tokens == DEFAULT_TOKENS["clip"] == 77
    with pytest.raises(TokenLengthError, match="takes 1 to 77 tokens"):
        load_text_encoder(encoder_dirs["clip"], tokens=78)


@pytest.mark.parametrize("kind", ["t5", "clip"])
def test_a_long_caption_is_truncated_to_the_token_length_keeping_its_end(encoder_dirs, kind):
    encoder = load_text_encoder(encoder_dirs[kind], tokens=6)
    caption = "a red circle on the left a red circle on the left"
    assert encoder.token_counts([caption])[0] > 6
    _, tokens, lengths = encoder.encode([caption])
    assert lengths.tolist() == [6]
    ids = encoder.tokenizer([caption], truncation=True, max_length=6)["input_ids"][0]
    assert len(ids) == 6 and ids[-1] == encoder.tokenizer.eos_token_id


def test_identity_is_the_sha256_of_the_folders_files(encoder_dirs, tmp_path):
    folder = encoder_dirs["t5"]
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.iterdir() if p.is_file()):  # a flat folder: names sort as paths
        digest.update(path.name.encode() + b"\0" + path.stat().st_size.to_bytes(8, "little") + path.read_bytes())
    encoder = load_text_encoder(folder)
    assert encoder.identity == {"name": str(folder), "class": "T5EncoderModel", "sha256": digest.hexdigest()}
    copy = shutil.copytree(folder, tmp_path / "copy")
    (copy / ".cache").mkdir()
    (copy / ".cache" / "lock").write_text("hub bookkeeping")  # hidden: no part of the model
    assert folder_sha256(copy) == encoder.sha256
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(dict(config, layer_norm_epsilon=1e-5)))
    assert folder_sha256(copy) != encoder.sha256


def test_check_encoder_matches_names_what_differs(encoder_dirs, tmp_path):
    t5 = load_text_encoder(encoder_dirs["t5"], tokens=10)
    check_encoder_matches(t5.record(), t5)
    moved = load_text_encoder(shutil.copytree(encoder_dirs["t5"], tmp_path / "moved"), tokens=10)
    check_encoder_matches(t5.record(), moved)  # the same files elsewhere are the same encoder
    with pytest.raises(TextEncoderMismatchError, match="class T5EncoderModel != CLIPTextModel; sha256"):
        check_encoder_matches(t5.record(), load_text_encoder(encoder_dirs["clip"], tokens=10))
    with pytest.raises(TextEncoderMismatchError, match="tokens 10 != 11"):
        check_encoder_matches(t5.record(), load_text_encoder(encoder_dirs["t5"], tokens=11))
    wider = load_text_encoder(tiny_text_encoder(tmp_path / "wide", "t5", dim=32), tokens=10)
    with pytest.raises(TextEncoderMismatchError, match="dim 16 != 32"):
        check_encoder_matches(t5.record(), wider)


def test_online_conditions_pack_the_float16_embeddings(encoder_dirs):
    encoder = load_text_encoder(encoder_dirs["clip"], tokens=9)
    conditions = OnlineConditions(encoder)(CAPTIONS)
    pooled, tokens, lengths = encoder.encode(CAPTIONS)
    assert conditions.shape == (4, 10, 17) and conditions.dtype == torch.float32
    got_pooled, got_tokens, mask = unpack_condition(conditions)
    assert torch.equal(mask.sum(dim=1), lengths)
    # float16 rounding: a relative error of at most 2^-11 (normal values; |x| >= 2^-14 here or absolute 2^-25).
    assert torch.allclose(got_pooled, pooled, rtol=2 ** -11, atol=2 ** -25)
    assert torch.allclose(got_tokens, tokens, rtol=2 ** -11, atol=2 ** -25)
    assert torch.equal(got_pooled, pooled.half().float()) and torch.equal(got_tokens, tokens.half().float())
    assert torch.equal(OnlineConditions(encoder).empty_condition(), OnlineConditions(encoder)([""])[0])


def test_embeddings_past_float16_are_refused():
    with pytest.raises(TextEncoderError, match="float16"):
        stored_embeddings(torch.full((1, 4), 7e4), torch.zeros(1, 3, 4))


def test_folders_transformers_cannot_load_are_one_line(tmp_path, encoder_dirs):
    empty = tmp_path / "empty"
    empty.mkdir()
    bad_json = tmp_path / "bad"
    bad_json.mkdir()
    (bad_json / "config.json").write_text("{not json")
    for folder in (empty, bad_json):
        with pytest.raises(TextEncoderError, match="transformers cannot load a text encoder") as info:
            load_text_encoder(folder)
        assert "\n" not in str(info.value)
    other = tmp_path / "bert"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(TextEncoderError, match="holds a bert model; text encoders are T5"):
        load_text_encoder(other)
    no_weights = shutil.copytree(encoder_dirs["t5"], tmp_path / "no-weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(TextEncoderError, match="transformers cannot load a text encoder"):
        load_text_encoder(no_weights)


def test_transformers_is_imported_only_to_load_and_its_absence_is_one_line(encoder_dirs):
    code = (
        "import sys\n"
        "import edm2.text_encoders, edm2.data.dataset, edm2.data.text_encode\n"
        "assert 'transformers' not in sys.modules, 'imported at import'\n"
        "sys.modules['transformers'] = None\n"  # what a missing package looks like to import
        "try:\n"
        "    edm2.text_encoders.load_text_encoder(sys.argv[1])\n"
        "except edm2.text_encoders.TextEncoderError as e:\n"
        "    print('refused:', e)\n")
    result = subprocess.run([sys.executable, "-c", code, str(encoder_dirs["t5"])], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ("refused: text encoders need transformers, an optional extra: "
                                     "pip install edm2[text]")


def test_encoding_is_float32_whatever_the_saved_dtype(encoder_dirs, tmp_path):
    from transformers import T5EncoderModel

    half = shutil.copytree(encoder_dirs["t5"], tmp_path / "half")
    T5EncoderModel.from_pretrained(half).half().save_pretrained(half)
    encoder = load_text_encoder(half, tokens=8)
    assert next(encoder.model.parameters()).dtype == torch.float32
    pooled, tokens, _ = encoder.encode(CAPTIONS[:1])
    assert pooled.dtype == torch.float32 and np.isfinite(tokens.numpy()).all()
