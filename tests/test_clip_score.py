"""CLIP score: 100 * max(cos, 0) of CLIP's embeddings against an independent computation on a tiny random CLIP,
its preprocessing against CLIP's (PIL bicubic, centre crop, CLIP's mean and std), and the pinned files alone."""

import math
import sys

import numpy as np
import PIL.Image
import pytest
import torch

from edm2.eval import clip_score
from edm2.eval.detectors import DetectorError
from tests.clip_helpers import pin_tiny_clip, tiny_clip, tiny_clip_release

PROMPTS = ["a red circle on the left", "a blue square on the right", "green", "the left square", "a circle",
           "red red red"]
# One float32 pass through the tiny CLIP, relative to unit-length embeddings: about 12 reductions in sequence (patch
# embedding, per layer two layer norms, qkv, scores, sums, projection, two MLP layers, then the projection), each
# off by <= sqrt(K) eps32 for the longest, K = 3 * 14 * 14 = 588 terms; a cosine sums 8 products more.
FLOAT32_PASS = 12 * math.sqrt(588) * torch.finfo(torch.float32).eps


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory):
    return tiny_clip(tmp_path_factory.mktemp("clip"))


def random_images(n, height, width, seed=0):
    return torch.randint(0, 256, (n, 3, height, width), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def clip_input_by_hand(images, resolution):
    """CLIP's preprocessing written out: PIL bicubic to shorter side `resolution`, centre crop, CLIP's statistics."""
    out = []
    for image in images.permute(0, 2, 3, 1).numpy():
        h, w = image.shape[:2]
        short = min(h, w)
        size = (int(w * resolution / short), int(h * resolution / short))
        resized = np.asarray(PIL.Image.fromarray(image).resize(size, PIL.Image.BICUBIC), dtype=np.float64)
        top, left = (size[1] - resolution) // 2, (size[0] - resolution) // 2
        out.append(resized[top:top + resolution, left:left + resolution].transpose(2, 0, 1))
    mean = np.array([0.48145466, 0.4578275, 0.40821073])[:, None, None]
    std = np.array([0.26862954, 0.26130258, 0.27577711])[:, None, None]
    return torch.from_numpy((np.stack(out) / 255 - mean) / std)


def cosines_by_hand(detector, images, prompts, resolution):
    """cos(image, text) from CLIPModel's own forward (its logits_per_image are exp(logit_scale) * cosines) on the
    tokenizer's ids and CLIP's preprocessing written out."""
    tokens = detector.tokenizer(prompts, padding=True, return_tensors="pt")
    out = detector.model(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"],
                         pixel_values=clip_input_by_hand(images, resolution).to(torch.float32))
    return out.logits_per_image.diagonal().double() / detector.model.logit_scale.exp().double()


def test_default_release_is_clip_vit_l14():
    import transformers
    with torch.device("meta"):
        model = transformers.CLIPModel(transformers.CLIPConfig(**clip_score.VIT_L14.architecture))
    # openai/clip-vit-large-patch14 has 427,616,513 parameters; its float32 model.safetensors is 1,710,540,580
    # bytes, 4 per parameter plus a header of the tensors' names and shapes.
    count = sum(p.numel() for p in model.parameters())
    assert count == 427_616_513
    assert 0 < 1_710_540_580 - 4 * count < 100_000
    assert model.config.vision_config.patch_size == 14 and model.config.vision_config.image_size == 224
    assert clip_score.VIT_L14.weights.sha256 == clip_score.CLIP_WEIGHTS_SHA256


def test_preprocessing_is_clips(clip_folder, monkeypatch):
    pin_tiny_clip(monkeypatch, clip_folder)
    detector = clip_score.ClipScore(clip_folder)
    images = random_images(3, 40, 63)  # not square: the shorter side is resized, the longer cropped
    got = detector.preprocess(images)
    assert got.shape == (3, 3, 28, 28)
    # Both start from the same uint8 PIL resize; what remains is float32 rounding of (x / 255 - mean) / std.
    torch.testing.assert_close(got.double(), clip_input_by_hand(images, 28), rtol=0, atol=1e-5)


@pytest.mark.parametrize("size", [(28, 28), (45, 33)])
def test_score_is_100_times_the_positive_cosine(clip_folder, monkeypatch, size):
    pin_tiny_clip(monkeypatch, clip_folder)
    detector = clip_score.ClipScore(clip_folder)
    images = random_images(len(PROMPTS), *size, seed=2)
    scores = detector(images, PROMPTS)
    cosines = cosines_by_hand(detector, images, PROMPTS, 28)
    assert scores.dtype == torch.float32 and scores.shape == (len(PROMPTS),)
    torch.testing.assert_close(scores.double(), 100 * cosines.clamp(min=0), rtol=0, atol=100 * FLOAT32_PASS)
    assert (cosines < 0).any() and (cosines > 0).any()  # both sides of the clamp are exercised
    # A batch of one scores the same image and prompt as it scores in the batch (padding changes nothing).
    torch.testing.assert_close(detector(images[1:2], PROMPTS[1:2]), scores[1:2], rtol=0, atol=200 * FLOAT32_PASS)


def test_mean_over_batches_is_the_mean_over_images(clip_folder, monkeypatch):
    pin_tiny_clip(monkeypatch, clip_folder)
    detector = clip_score.ClipScore(clip_folder)
    images = random_images(len(PROMPTS), 28, 28, seed=3)
    mean = clip_score.ScoreMean()
    for start in (0, 4):  # uneven batches: a mean of batch means would weigh them wrongly
        mean.add(detector(images[start:start + 4], PROMPTS[start:start + 4]))
    value, count = mean.finalize()
    assert count == len(PROMPTS)
    assert value == pytest.approx(detector(images, PROMPTS).double().mean().item(), abs=200 * FLOAT32_PASS)


def test_prompts_longer_than_the_context_are_cut(clip_folder, monkeypatch):
    pin_tiny_clip(monkeypatch, clip_folder)
    detector = clip_score.ClipScore(clip_folder)
    image = random_images(1, 28, 28, seed=4)
    long = " ".join(["red"] * 40)  # 42 tokens with start and end; the tiny CLIP has 12 positions
    cut = " ".join(["red"] * 10)
    torch.testing.assert_close(detector(image, [long]), detector(image, [cut]), rtol=0, atol=0)


def test_the_published_release_refuses_without_pinned_tokenizer_digests(clip_folder):
    # The vocabulary's and merges' digests are unknown: no copy is accepted, before the weights are read.
    with pytest.raises(DetectorError, match="not pinned") as info:
        clip_score.ClipScore(clip_folder)
    assert "\n" not in str(info.value) and "vocab.json" in str(info.value)


def test_a_file_other_than_the_pinned_one_is_refused(clip_folder, tmp_path, monkeypatch):
    pin_tiny_clip(monkeypatch, clip_folder)
    other = tiny_clip(tmp_path / "other", seed=1)  # same layout, other weights
    with pytest.raises(DetectorError, match="is not the published CLIP ViT-L/14 weights"):
        clip_score.ClipScore(other)


def test_a_folder_without_a_file_names_it(clip_folder, tmp_path, monkeypatch):
    pin_tiny_clip(monkeypatch, clip_folder)
    with pytest.raises(DetectorError, match="has no vocab.json"):
        clip_score.ClipScore(tmp_path)


def test_weights_that_do_not_fit_the_architecture_are_refused(clip_folder, monkeypatch):
    release = pin_tiny_clip(monkeypatch, clip_folder)
    deeper = dict(release.architecture, text_config=dict(release.architecture["text_config"], num_hidden_layers=3))
    monkeypatch.setattr(clip_score, "VIT_L14", clip_score.ClipRelease(deeper, release.weights, release.vocab,
                                                                     release.merges))
    with pytest.raises(DetectorError, match="does not match the CLIP architecture") as info:
        clip_score.ClipScore(clip_folder)
    assert "\n" not in str(info.value)


def test_without_transformers_one_line(clip_folder, monkeypatch):
    pin_tiny_clip(monkeypatch, clip_folder)
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(DetectorError, match=r"pip install edm2\[text\]"):
        clip_score.ClipScore(clip_folder)


def test_offline_the_default_folder_in_the_cache_is_used(clip_folder, tmp_path, monkeypatch):
    monkeypatch.setenv("EDM2_CACHE_DIR", str(tmp_path / "cache"))
    folder = clip_score.default_clip_folder()
    folder.mkdir(parents=True)
    for name in clip_score.VIT_L14.files():
        (folder / name).write_bytes((clip_folder / name).read_bytes())
    pin_tiny_clip(monkeypatch, clip_folder)
    detector = clip_score.ClipScore()
    assert detector(random_images(1, 28, 28), ["a circle"]).shape == (1,)


@pytest.mark.parametrize("name, content, fragment", [("model.safetensors", b"\x08" + b"\0" * 7 + b"{}", "not a safetensors"),
                                                     ("vocab.json", b"[1, 2]", "not a vocabulary"),
                                                     ("merges.txt", "a b c\n".encode(), "not a list of BPE merges")])
def test_a_pinned_but_malformed_file_is_refused_in_one_line(clip_folder, tmp_path, monkeypatch, name, content,
                                                            fragment):
    # Behind the digest, as a second line of defence: a pinned file that is not what it should be is named.
    for other in clip_score.VIT_L14.files():
        (tmp_path / other).write_bytes(content if other == name else (clip_folder / other).read_bytes())
    monkeypatch.setattr(clip_score, "VIT_L14", tiny_clip_release(tmp_path))
    with pytest.raises(DetectorError, match=fragment) as info:
        clip_score.ClipScore(tmp_path)
    assert "\n" not in str(info.value) and name in str(info.value)
