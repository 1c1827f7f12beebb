"""Feature detectors: DINOv2 ViT against an independent forward pass, official parameter layout, safe loading."""

import math
import pathlib
import re
import socket

import PIL.Image
import pytest
import torch
from click.testing import CliRunner

import calculate_metrics
from edm2 import detectors, files
from tests.helpers import (TinyInceptionStandIn, assert_one_error_line, official_dinov2_shapes,
                           random_dinov2_state_dict)


# A tiny DINOv2 (2 heads of 64 channels) with the official names; grid 5 forces position-embedding resampling.
TINY = dict(width=128, depth=2, patch=14, grid=5, mlp=256)
# Round-off of one float32 pass through TINY, relative to the largest feature: about 16 reductions in sequence
# (patch embedding, then per block two layer norms, qkv, attention scores and sums, projection, two MLP layers),
# each off by <= sqrt(K) eps32 for the longest, K = 3 * 14 * 14 = 588 terms (the patch embedding).
FLOAT32_PASS = 16 * math.sqrt(588) * torch.finfo(torch.float32).eps


def reference_dinov2(state, images_uint8, heads):
    """DINOv2 forward written from the architecture description, sharing no code with edm2.detectors."""
    x = torch.nn.functional.interpolate(images_uint8.double(), size=(224, 224), mode="bicubic", antialias=True) / 255
    x = (x - torch.tensor([0.485, 0.456, 0.406], dtype=torch.float64)[:, None, None]) / \
        torch.tensor([0.229, 0.224, 0.225], dtype=torch.float64)[:, None, None]
    s = {k: v.double() for k, v in state.items()}
    w = s["patch_embed.proj.weight"]
    width, _, p, _ = w.shape
    patches = x.unfold(2, p, p).unfold(3, p, p)  # [N, C, rows, cols, p, p]
    n, _, rows, cols = patches.shape[:4]
    tokens = torch.einsum("ncijyx,dcyx->nijd", patches, w).reshape(n, rows * cols, width) + s["patch_embed.proj.bias"]
    grid = math.isqrt(s["pos_embed"].shape[1] - 1)
    pos = s["pos_embed"][0, 1:].T.reshape(1, width, grid, grid)
    pos = torch.nn.functional.interpolate(pos, scale_factor=((rows + 0.1) / grid, (cols + 0.1) / grid), mode="bicubic")
    pos = torch.cat([s["pos_embed"][0, :1], pos.reshape(width, rows * cols).T])
    h = torch.cat([s["cls_token"].expand(n, 1, width), tokens], 1) + pos

    def layer_norm(v, prefix):
        mean, var = v.mean(-1, keepdim=True), v.var(-1, unbiased=False, keepdim=True)
        return (v - mean) / torch.sqrt(var + 1e-6) * s[prefix + ".weight"] + s[prefix + ".bias"]

    depth = len({k.split(".")[1] for k in s if k.startswith("blocks.")})
    for i in range(depth):
        b = f"blocks.{i}."
        qkv = layer_norm(h, b + "norm1") @ s[b + "attn.qkv.weight"].T + s[b + "attn.qkv.bias"]
        q, k, v = qkv.reshape(n, -1, 3, heads, width // heads).unbind(2)
        weights = torch.softmax(torch.einsum("nqhd,nkhd->nhqk", q, k) / math.sqrt(width // heads), -1)
        attn = torch.einsum("nhqk,nkhd->nqhd", weights, v).reshape(n, -1, width)
        h = h + s[b + "ls1.gamma"] * (attn @ s[b + "attn.proj.weight"].T + s[b + "attn.proj.bias"])
        hidden = layer_norm(h, b + "norm2") @ s[b + "mlp.fc1.weight"].T + s[b + "mlp.fc1.bias"]
        hidden = 0.5 * hidden * (1 + torch.erf(hidden / math.sqrt(2)))
        h = h + s[b + "ls2.gamma"] * (hidden @ s[b + "mlp.fc2.weight"].T + s[b + "mlp.fc2.bias"])
    return layer_norm(h, "norm")[:, 0]


def test_default_dinov2_has_the_official_vitl14_layout():
    with torch.device("meta"):
        net = detectors.DINOv2ViT()
    got = {name: tuple(t.shape) for name, t in net.state_dict().items()}
    assert got == official_dinov2_shapes()
    assert sum(math.prod(shape) for shape in got.values()) == 304_368_640  # DINOv2 ViT-L/14: 304M parameters
    assert net.blocks[0].attn.num_heads == 16


def test_dinov2_from_official_names_gives_reference_class_token(tmp_path):
    state = random_dinov2_state_dict(**TINY)
    path = tmp_path / "tiny_dinov2.pth"
    torch.save(state, path)
    detector = detectors.load_detector("fd_dinov2", path)
    assert detector.feature_dim == 128
    images = torch.randint(0, 256, (3, 3, 40, 56), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    features = detector(images)
    expected = reference_dinov2(state, images, heads=2)
    assert features.dtype == torch.float32 and features.shape == (3, 128)
    scale = expected.abs().max().item()
    # float32 against a float64 reference: one float32 pass of round-off.
    torch.testing.assert_close(features.double(), expected, rtol=0, atol=FLOAT32_PASS * scale)
    # Each image's class token depends on that image only; another batch size may order sums differently
    # (two float32 passes), while a token mixing images would be off by the feature scale itself.
    torch.testing.assert_close(detector(images[1:2]), features[1:2], rtol=0, atol=2 * FLOAT32_PASS * scale)


def test_dinov2_position_embedding_at_native_grid_is_the_learned_one():
    net = detectors.DINOv2ViT.from_state_dict(random_dinov2_state_dict(**TINY))
    assert net.position_embedding(5, 5) is net.pos_embed
    resampled = net.position_embedding(16, 16)
    assert resampled.shape == (1, 1 + 256, 128)
    torch.testing.assert_close(resampled[:, 0], net.pos_embed[:, 0])


@pytest.mark.parametrize("change", ["missing", "extra", "renamed"])
def test_dinov2_loading_is_strict(tmp_path, change):
    state = random_dinov2_state_dict(**TINY)
    if change == "missing":
        del state["blocks.1.ls2.gamma"]
    elif change == "extra":
        state["head.weight"] = torch.zeros(10, 128)
    else:
        state["blocks.0.attn.qkv_proj.weight"] = state.pop("blocks.0.attn.qkv.weight")
    torch.save(state, tmp_path / "bad.pth")
    with pytest.raises(detectors.DetectorError, match="bad.pth"):
        detectors.DINOv2(tmp_path / "bad.pth")


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.marker),)


def test_dinov2_file_carrying_code_is_refused(tmp_path):
    marker = tmp_path / "ran"
    state = random_dinov2_state_dict(**TINY)
    state["payload"] = _RunsCode(marker)
    torch.save(state, tmp_path / "evil.pth")
    with pytest.raises(detectors.DetectorError, match="evil.pth"):
        detectors.DINOv2(tmp_path / "evil.pth")
    assert not marker.exists()


def test_inception_loads_torchscript_and_returns_features(tmp_path):
    module = TinyInceptionStandIn()
    torch.jit.save(torch.jit.script(module), tmp_path / "inception.pt")
    detector = detectors.load_detector("fid", (tmp_path / "inception.pt").as_uri())
    assert detector.feature_dim == 12
    images = torch.randint(0, 256, (5, 3, 24, 20), dtype=torch.uint8)
    # The same float32 operations, scripted and eager: torch's float32 defaults (rtol 1.3e-6 ~ 11 eps32, atol 1e-5)
    # cover kernels that order the sums (at most 4 * 7 * 7 = 196 terms) differently.
    torch.testing.assert_close(detector(images), module(images, return_features=True))


def test_inception_rejects_missing_or_non_torchscript_files(tmp_path):
    with pytest.raises(detectors.DetectorError, match="not found"):
        detectors.InceptionV3(tmp_path / "absent.pt")
    torch.save({"w": torch.zeros(1)}, tmp_path / "plain.pt")
    with pytest.raises(detectors.DetectorError, match="plain.pt.*TorchScript"):
        detectors.InceptionV3(tmp_path / "plain.pt")


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """A private cache folder and no network: every name lookup and connection fails at once."""
    monkeypatch.setenv("EDM2_CACHE_DIR", str(tmp_path / "cache"))

    def unreachable(*args, **kwargs):
        raise OSError("network unreachable (blocked by the test)")

    monkeypatch.setattr(socket, "getaddrinfo", unreachable)
    monkeypatch.setattr(socket.socket, "connect", unreachable)
    return tmp_path / "cache"


def test_offline_detectors_load_from_the_cache_folder(offline):
    # What the README tells clusters without internet: put the published files under $EDM2_CACHE_DIR/detectors/.
    folder = offline / "detectors"
    folder.mkdir(parents=True)
    assert detectors.default_weights_path(detectors.INCEPTION_URL) == folder / "inception-2015-12-05.pt"
    assert detectors.default_weights_path(detectors.DINOV2_URL) == folder / "dinov2_vitl14_pretrain.pth"
    torch.jit.save(torch.jit.script(TinyInceptionStandIn()), folder / "inception-2015-12-05.pt")
    torch.save(random_dinov2_state_dict(**TINY), folder / "dinov2_vitl14_pretrain.pth")
    assert detectors.load_detector("fid").feature_dim == 12
    assert detectors.load_detector("fd_dinov2").feature_dim == TINY["width"]


def test_offline_detector_found_where_earlier_versions_downloaded_it(offline):
    earlier = files.download_cache_path(detectors.INCEPTION_URL)
    earlier.parent.mkdir(parents=True)
    torch.jit.save(torch.jit.script(TinyInceptionStandIn()), earlier)
    assert detectors.load_detector("fid").feature_dim == 12


@pytest.mark.parametrize("metric, url", [("fid", detectors.INCEPTION_URL), ("fd_dinov2", detectors.DINOV2_URL)])
def test_a_damaged_file_in_the_default_place_is_named_by_its_path(offline, metric, url):
    path = detectors.default_weights_path(url)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"half a download")
    with pytest.raises(detectors.DetectorError, match=f"{re.escape(str(path))}(:| is not a )"):  # not 'None'
        detectors.load_detector(metric)


@pytest.mark.bad_input
@pytest.mark.parametrize("metric, option, url, name", [
    ("fid", "--inception", detectors.INCEPTION_URL, "inception-2015-12-05.pt"),
    ("fd_dinov2", "--dinov2", detectors.DINOV2_URL, "dinov2_vitl14_pretrain.pth"),
])
def test_offline_without_the_file_the_error_says_where_to_put_it(offline, tmp_path, metric, option, url, name):
    (tmp_path / "images").mkdir()
    for i in range(2):
        PIL.Image.new("RGB", (8, 8)).save(tmp_path / "images" / f"img{i}.png")
    result = CliRunner().invoke(calculate_metrics.main, ["ref", "--data", str(tmp_path / "images"), "--dest",
                                                         str(tmp_path / "ref.npz"), "--metrics", metric])
    assert_one_error_line(result, option, url, f"copy it to {offline / 'detectors' / name}")
    assert not (offline / "detectors").exists() or not list((offline / "detectors").iterdir())
    assert not (tmp_path / "ref.npz").exists()
