"""Feature detectors: DINOv2 ViT against an independent forward pass, official parameter layout, and loading of
the published files alone (verified by SHA-256 before anything parses them)."""

import hashlib
import io
import math
import os
import re
import socket
import struct
import zipfile

import PIL.Image
import pytest
import torch
from click.testing import CliRunner

import calculate_metrics
from edm2.eval import detectors
from edm2.runtime import files, pinned_files
from tests.helpers import (FileWritingInception, TinyInceptionStandIn, assert_one_error_line, assert_refused,
                           official_dinov2_shapes, pin_detector_file, random_dinov2_state_dict, run_within_memory)


# A tiny DINOv2 (2 heads of 64 channels) with the official names; grid 5 forces position-embedding resampling.
TINY = dict(width=128, depth=2, patch=14, grid=5, mlp=256)
# Round-off of one float32 pass through TINY, relative to the largest feature: about 16 reductions in sequence
# (patch embedding, then per block two layer norms, qkv, attention scores and sums, projection, two MLP layers),
# each off by <= sqrt(K) eps32 for the longest, K = 3 * 14 * 14 = 588 terms (the patch embedding).
FLOAT32_PASS = 16 * math.sqrt(588) * torch.finfo(torch.float32).eps


def reference_dinov2(state, images_uint8, heads):
    """DINOv2 forward written from the architecture description, sharing no code with edm2.eval.detectors."""
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


def test_dinov2_from_official_names_gives_reference_class_token(tmp_path, monkeypatch):
    state = random_dinov2_state_dict(**TINY)
    path = tmp_path / "tiny_dinov2.pth"
    torch.save(state, path)
    pin_detector_file(monkeypatch, "fd_dinov2", path)
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
def test_dinov2_loading_is_strict(tmp_path, monkeypatch, change):
    # Behind the digest, as a second line of defence: a pinned file that does not fit the layout is refused.
    state = random_dinov2_state_dict(**TINY)
    if change == "missing":
        del state["blocks.1.ls2.gamma"]
    elif change == "extra":
        state["head.weight"] = torch.zeros(10, 128)
    else:
        state["blocks.0.attn.qkv_proj.weight"] = state.pop("blocks.0.attn.qkv.weight")
    torch.save(state, tmp_path / "bad.pth")
    pin_detector_file(monkeypatch, "fd_dinov2", tmp_path / "bad.pth")
    with pytest.raises(detectors.DetectorError, match="bad.pth"):
        detectors.DINOv2(tmp_path / "bad.pth")


class _RunsCode:
    def __init__(self, call, arg):
        self.call, self.arg = call, arg

    def __reduce__(self):
        return self.call, (self.arg,)


@pytest.mark.parametrize("pinned", [False, True], ids=["any file", "even with the pinned digest"])
def test_dinov2_file_carrying_code_is_refused_in_one_line(tmp_path, monkeypatch, pinned):
    # Unpinned, the digest refuses it unread; pinned, torch's weights_only unpickler refuses the global, and its
    # message (several lines inviting weights_only=False) becomes one line naming the global.
    marker = tmp_path / "ran"
    state = random_dinov2_state_dict(**TINY)
    state["payload"] = _RunsCode(os.system, f"touch {marker}")
    torch.save(state, tmp_path / "evil.pth")
    if pinned:
        pin_detector_file(monkeypatch, "fd_dinov2", tmp_path / "evil.pth")
    with pytest.raises(detectors.DetectorError) as info:
        detectors.DINOv2(tmp_path / "evil.pth")
    message = str(info.value)
    assert "\n" not in message and "evil.pth" in message
    assert ("names posix.system" if pinned else "SHA-256") in message
    assert not marker.exists()


def test_inception_loads_torchscript_and_returns_features(tmp_path, monkeypatch):
    module = TinyInceptionStandIn()
    torch.jit.save(torch.jit.script(module), tmp_path / "inception.pt")
    pin_detector_file(monkeypatch, "fid", tmp_path / "inception.pt")
    detector = detectors.load_detector("fid", (tmp_path / "inception.pt").as_uri())
    assert detector.feature_dim == 12
    images = torch.randint(0, 256, (5, 3, 24, 20), dtype=torch.uint8)
    # The same float32 operations, scripted and eager: torch's float32 defaults (rtol 1.3e-6 ~ 11 eps32, atol 1e-5)
    # cover kernels that order the sums (at most 4 * 7 * 7 = 196 terms) differently.
    torch.testing.assert_close(detector(images), module(images, return_features=True))


def test_inception_rejects_missing_or_non_torchscript_files(tmp_path, monkeypatch):
    with pytest.raises(detectors.DetectorError, match="not found"):
        detectors.InceptionV3(tmp_path / "absent.pt")
    torch.save({"w": torch.zeros(1)}, tmp_path / "plain.pt")
    pin_detector_file(monkeypatch, "fid", tmp_path / "plain.pt")
    with pytest.raises(detectors.DetectorError, match="plain.pt.*TorchScript") as info:
        detectors.InceptionV3(tmp_path / "plain.pt")
    assert "\n" not in str(info.value)


def refuse_parsing(*args, **kwargs):
    raise AssertionError("a file that is not the published one must be refused before anything parses it")


@pytest.mark.bad_input
@pytest.mark.parametrize("metric", ["fid", "fd_dinov2"])
def test_files_other_than_the_published_one_are_refused_before_parsing(tmp_path, monkeypatch, metric):
    # Well-formed detector files, as good as the tests' own stand-ins, yet not the published file.
    torch.jit.save(torch.jit.script(TinyInceptionStandIn()), tmp_path / "other.pt")
    torch.save(random_dinov2_state_dict(**TINY), tmp_path / "other.pth")
    path = tmp_path / ("other.pt" if metric == "fid" else "other.pth")
    monkeypatch.setattr(torch.jit, "load", refuse_parsing)
    monkeypatch.setattr(torch, "load", refuse_parsing)
    with pytest.raises(detectors.DetectorError) as info:
        detectors.load_detector(metric, path)
    published = detectors.PUBLISHED[metric]
    assert str(info.value) == (f"{path} is not the published {published.what}: its SHA-256 is "
                               f"{hashlib.sha256(path.read_bytes()).hexdigest()}, not {published.sha256}; "
                               f"only the published file is accepted: {published.url}")


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """A private cache folder and no network: every name lookup and connection fails at once."""
    monkeypatch.setenv("EDM2_CACHE_DIR", str(tmp_path / "cache"))

    def unreachable(*args, **kwargs):
        raise OSError("network unreachable (blocked by the test)")

    monkeypatch.setattr(socket, "getaddrinfo", unreachable)
    monkeypatch.setattr(socket.socket, "connect", unreachable)
    return tmp_path / "cache"


def test_offline_detectors_load_from_the_cache_folder(offline, monkeypatch):
    # What the README tells clusters without internet: put the published files under $EDM2_CACHE_DIR/detectors/.
    folder = offline / "detectors"
    folder.mkdir(parents=True)
    assert detectors.default_weights_path(detectors.INCEPTION_URL) == folder / "inception-2015-12-05.pt"
    assert detectors.default_weights_path(detectors.DINOV2_URL) == folder / "dinov2_vitl14_pretrain.pth"
    torch.jit.save(torch.jit.script(TinyInceptionStandIn()), folder / "inception-2015-12-05.pt")
    torch.save(random_dinov2_state_dict(**TINY), folder / "dinov2_vitl14_pretrain.pth")
    pin_detector_file(monkeypatch, "fid", folder / "inception-2015-12-05.pt")
    pin_detector_file(monkeypatch, "fd_dinov2", folder / "dinov2_vitl14_pretrain.pth")
    assert detectors.load_detector("fid").feature_dim == 12
    assert detectors.load_detector("fd_dinov2").feature_dim == TINY["width"]


def test_offline_detector_found_where_earlier_versions_downloaded_it(offline, monkeypatch):
    earlier = files.download_cache_path(detectors.INCEPTION_URL)
    earlier.parent.mkdir(parents=True)
    torch.jit.save(torch.jit.script(TinyInceptionStandIn()), earlier)
    pin_detector_file(monkeypatch, "fid", earlier)
    assert detectors.load_detector("fid").feature_dim == 12


@pytest.mark.parametrize("metric, url", [("fid", detectors.INCEPTION_URL), ("fd_dinov2", detectors.DINOV2_URL)])
def test_a_damaged_file_in_the_cache_is_named_and_to_be_deleted(offline, metric, url):
    # A damaged or tampered download, in the default place or where a URL given as the option was downloaded.
    path = detectors.default_weights_path(url)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"half a download")
    with pytest.raises(detectors.DetectorError, match=f"^{re.escape(str(path))} is not the published .*; "
                                                      f"delete {re.escape(str(path))} "):  # not 'None'
        detectors.load_detector(metric)
    mirror = "https://mirror.invalid/" + os.path.basename(url)
    downloaded = files.download_cache_path(mirror)
    downloaded.parent.mkdir(parents=True)
    downloaded.write_bytes(b"tampered")
    with pytest.raises(detectors.DetectorError, match=f"^{re.escape(mirror)} is not the published .*; "
                                                      f"delete {re.escape(str(downloaded))} "):
        detectors.load_detector(metric, mirror)


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


# ---------------------------------------------------------------------------------------------------
# What the digest stops: an archive read differently by two ZIP readers, files swapped or rewritten while read,
# and files whose mere reading would exhaust memory.

def scripted(module) -> bytes:
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(module), buffer)
    return buffer.getvalue()


def central_directory(archive: bytes) -> tuple[bytes, list[bytearray]]:
    """(the bytes before the central directory, its entries) of an archive torch.jit.save wrote (ZIP64 end)."""
    with zipfile.ZipFile(io.BytesIO(archive)) as parsed:
        start = parsed.start_dir
    directory = archive[start:archive.index(b"PK\x06\x06", start)]
    entries, at = [], 0
    while at < len(directory):
        name, extra, comment = struct.unpack_from("<3H", directory, at + 28)
        entries.append(bytearray(directory[at:at + 46 + name + extra + comment]))
        at += 46 + name + extra + comment
    return archive[:start], entries


def directory_bytes(entries: list[bytearray], size: int, shift: int) -> bytes:
    """The entries with their local header offsets moved by `shift`, the last one's comment padding them to `size`."""
    for entry in entries:
        struct.pack_into("<L", entry, 42, struct.unpack_from("<L", entry, 42)[0] + shift)
    padding = size - sum(map(len, entries))
    struct.pack_into("<H", entries[-1], 32, struct.unpack_from("<H", entries[-1], 32)[0] + padding)
    return b"".join(entries) + b" " * padding


def differential_zip(harmless: bytes, hostile: bytes) -> bytes:
    """One file, two archives: Python's zipfile reads `harmless`, torch's reader (miniz) reads `hostile`.

    Python's zipfile takes the central directory to end where the end record starts, and shifts every offset by
    how far that lies from the offset the end record gives (data prepended to an archive); miniz reads the
    directory at the offset the end record gives. So the end record gives the hostile directory's offset, and the
    harmless directory, padded to the same length, follows it with its offsets lowered by that length.
    """
    hostile_data, hostile_entries = central_directory(hostile)
    harmless_data, harmless_entries = central_directory(harmless)
    size = max(sum(map(len, hostile_entries)), sum(map(len, harmless_entries)))
    gap = b"\0" * max(0, size - len(hostile_data))  # keeps the harmless offsets non-negative
    harmless_at = len(hostile_data) + len(gap)
    directory_at = harmless_at + len(harmless_data)
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, len(hostile_entries), len(hostile_entries), size,
                      directory_at, 0)
    return (hostile_data + gap + harmless_data + directory_bytes(hostile_entries, size, 0)
            + directory_bytes(harmless_entries, size, harmless_at - size) + end)


@pytest.mark.bad_input
def test_an_archive_two_zip_readers_see_differently_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "written"
    path = tmp_path / "inception.pt"
    path.write_bytes(differential_zip(scripted(TinyInceptionStandIn()), scripted(FileWritingInception(str(marker)))))
    with zipfile.ZipFile(path) as archive:  # what a checker reading the file with Python's zipfile sees
        seen = b"".join(archive.read(name) for name in archive.namelist() if name.endswith(".py"))
    reader = torch._C.PyTorchFileReader(str(path))  # what torch.jit.load compiles
    loaded = b"".join(bytes(reader.get_record(name)) for name in reader.get_all_records() if name.endswith(".py"))
    assert b"forward" in seen and b"from_file" not in seen and b"from_file" in loaded
    (tmp_path / "images").mkdir()
    for i in range(2):
        PIL.Image.new("RGB", (8, 8)).save(tmp_path / "images" / f"img{i}.png")
    args = ["ref", "--data", str(tmp_path / "images"), "--dest", str(tmp_path / "ref.npz"), "--metrics", "fid",
            "--inception", str(path)]
    assert_refused(tmp_path, lambda: CliRunner().invoke(calculate_metrics.main, args), "--inception", str(path),
                   "is not the published Inception-v3 TorchScript file: its SHA-256 is")
    assert not marker.exists()
    # Control: loaded as before the digest, the file really writes files.
    torch.jit.load(path)(torch.zeros(1, 3, 16, 16, dtype=torch.uint8), return_features=True)
    assert marker.exists()


@pytest.mark.parametrize("change", ["replaced", "rewritten"])
def test_the_bytes_verified_are_the_bytes_returned(tmp_path, monkeypatch, change):
    # Between the hashing pass and the reading pass the file is swapped for another (rename onto its path) or
    # rewritten in place: the first still yields the verified bytes (the open file is the old one), the second
    # is refused.
    path, published = tmp_path / "weights", b"published bytes " * 4096
    path.write_bytes(published)
    hashing_pass = pinned_files.stream_sha256

    def then_changed(file):
        result = hashing_pass(file)
        if change == "replaced":
            (tmp_path / "other").write_bytes(b"other bytes " * 4096)
            os.replace(tmp_path / "other", path)
        else:
            with open(path, "r+b") as f:
                f.write(b"other")
        return result

    monkeypatch.setattr(pinned_files, "stream_sha256", then_changed)
    if change == "replaced":
        assert pinned_files.read_pinned(path, hashlib.sha256(published).hexdigest()) == published
    else:
        with pytest.raises(pinned_files.PinnedFileError, match="changed while being read"):
            pinned_files.read_pinned(path, hashlib.sha256(published).hexdigest())


@pytest.mark.bad_input
@pytest.mark.parametrize("metric, hostile", [("fid", "sparse 256 MiB"), ("fd_dinov2", "32-wide ViT")])
def test_hostile_detector_files_are_refused_within_a_memory_bound(tmp_path, metric, hostile):
    # Refused by the digest, read one chunk at a time: within 64 MiB more address space than the process uses.
    path = tmp_path / "weights"
    if hostile == "32-wide ViT":
        torch.save(random_dinov2_state_dict(**{**TINY, "width": 32}), path)
    else:
        with open(path, "wb") as f:
            f.truncate(256 << 20)  # sparse: costs no disk, reads as zeros; four times the memory allowed
    done = run_within_memory("from edm2.eval import detectors", "detectors.load_detector(sys.argv[1], sys.argv[2])",
                             64 << 20, metric, str(path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"refused: {path} is not the published") and "SHA-256" in done.stdout


def test_a_dinov2_width_without_whole_heads_is_refused(tmp_path, monkeypatch):
    # Behind the digest: 32 channels make no 64-channel attention head (zero heads would divide by zero later).
    torch.save(random_dinov2_state_dict(**{**TINY, "width": 32}), tmp_path / "narrow.pth")
    pin_detector_file(monkeypatch, "fd_dinov2", tmp_path / "narrow.pth")
    with pytest.raises(detectors.DetectorError, match="narrow.pth: width 32 is not a multiple of 64"):
        detectors.DINOv2(tmp_path / "narrow.pth")
