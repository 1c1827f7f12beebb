"""Our snapshot files: safetensors weights plus JSON metadata, loaded without running code; bad files
are one line naming the file, in the library and through both command lines that read them."""

import builtins
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from click.testing import CliRunner

import generate
import reconstruct_phema
from edm2.encoders import StandardRGBEncoder
from edm2.formats.snapshot import (FORMAT_VERSION, SnapshotError, load_generator, load_network, read_metadata,
                                   save_network)
from edm2.networks import UNet
from tests.helpers import (FAKE_RUN, REPO, assert_refused, fake_training_run, tiny_precond, write_raw_snapshot)


def test_roundtrip_float16_weights_and_metadata(tmp_path):
    torch.manual_seed(0)
    net = tiny_precond(dropout=0.1)
    with torch.no_grad():
        net.unet.out_gain.fill_(0.7)  # make the output depend on the weights
    path = tmp_path / "network-snapshot-0000001-0.100.safetensors"
    save_network(path, net, {"nimg": 1024, "ema_std": 0.1, "encoder": {"class": "StandardRGBEncoder"}})
    assert [p.name for p in tmp_path.iterdir()] == [path.name]

    raw = safetensors.torch.load_file(str(path))
    assert all(t.dtype == torch.float16 for t in raw.values())
    loaded, meta = load_network(path)
    assert meta["nimg"] == 1024 and meta["ema_std"] == 0.1 and meta["format_version"] == 1
    assert meta["network_kwargs"] == json.loads(json.dumps(net.init_kwargs))
    assert not loaded.training and not any(p.requires_grad for p in loaded.parameters())
    for name, t in net.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t.to(torch.float16).to(torch.float32)), name

    # The loaded net computes exactly what the original computes with float16-rounded weights.
    rounded = tiny_precond(dropout=0.1).eval()
    rounded.load_state_dict({k: v.half().float() for k, v in net.state_dict().items()})
    x, sigma, labels = torch.randn(2, 3, 8, 8), torch.tensor([0.3, 2.0]), torch.eye(10)[:2]
    with torch.no_grad():
        got = loaded(x, sigma, labels)
        assert torch.equal(got, rounded(x, sigma, labels))
    assert not torch.equal(got, 0.25 / (sigma.reshape(-1, 1, 1, 1) ** 2 + 0.25) * x)
    assert read_metadata(path)["ema_std"] == 0.1


def test_load_generator_needs_encoder_settings(tmp_path):
    net = tiny_precond()
    save_network(tmp_path / "rgb.safetensors", net, {"encoder": {"class": "StandardRGBEncoder"}})
    save_network(tmp_path / "bare.safetensors", net, {})
    loaded, encoder, meta = load_generator(tmp_path / "rgb.safetensors")
    assert isinstance(encoder, StandardRGBEncoder) and meta["encoder"]["class"] == "StandardRGBEncoder"
    with pytest.raises(SnapshotError, match="no usable encoder settings"):
        load_generator(tmp_path / "bare.safetensors")


def snapshot_metadata(**changes) -> str:
    """The JSON metadata our writer gives a tiny training snapshot, with changes (None deletes a key)."""
    meta = dict(FAKE_RUN, nimg=9216, ema_std=0.05, format_version=FORMAT_VERSION,
                network_kwargs=tiny_precond().init_kwargs)
    meta.update(changes)
    return json.dumps({k: v for k, v in meta.items() if v is not None})


# case -> (how to make the bad file at a path, what its one error line says after the file's name)
BAD_FILES = {
    "missing": (lambda path: None, "no such file"),
    "junk": (lambda path: path.write_bytes(b"not a safetensors file"), "cannot read snapshot"),
    "truncated": (lambda path: path.write_bytes(write_raw_snapshot(path, snapshot_metadata()).read_bytes()[:-100]),
                  "cannot read snapshot"),
    "foreign": (lambda path: write_raw_snapshot(path, None), "not an EDM2 snapshot"),
    "folder": (lambda path: path.mkdir(), "is a folder"),
    "fifo": (lambda path: os.mkfifo(path), "not a regular file"),
    "metadata not json": (lambda path: write_raw_snapshot(path, "{'nimg': 9216,"), "metadata: not valid JSON"),
    "metadata nested deep": (lambda path: write_raw_snapshot(path, snapshot_metadata(preset=nested(100))),
                             "metadata: JSON nested 101 levels deep"),
    "metadata a list": (lambda path: write_raw_snapshot(path, "[9216, 0.05]"), "is a JSON list, not an object"),
    "newer format": (lambda path: write_raw_snapshot(path, snapshot_metadata(format_version=FORMAT_VERSION + 1)),
                     f"format_version {FORMAT_VERSION + 1}, but this edm2 reads up to {FORMAT_VERSION}: made by a "
                     "newer edm2; upgrade"),
    "no format": (lambda path: write_raw_snapshot(path, snapshot_metadata(format_version=None)),
                  "no valid format_version (found None)"),
    "format a string": (lambda path: write_raw_snapshot(path, snapshot_metadata(format_version="1")),
                        "no valid format_version (found '1')"),
    "no network arguments": (lambda path: write_raw_snapshot(path, snapshot_metadata(network_kwargs=None)),
                             "lacks the network's constructor arguments"),
    "impossible network": (lambda path: write_raw_snapshot(path, snapshot_metadata(
                           network_kwargs=dict(tiny_precond().init_kwargs, channels_per_head=0))),
                           "unsupported network arguments"),
    "unregistered family": (lambda path: write_raw_snapshot(path, snapshot_metadata(
                            network_kwargs=dict(tiny_precond().init_kwargs, family="dit-xl"))),
                            "its network is of a family that is not registered (unknown network family 'dit-xl'"),
    "other weights": (lambda path: write_raw_snapshot(path, snapshot_metadata(), tiny_precond(model_channels=32)),
                      "weights do not match the stored architecture"),
    # float16 weights relabelled in the header as integers of the same size: the bytes fit, the numbers do not.
    "integer weights": (lambda path: relabel(write_raw_snapshot(path, snapshot_metadata()), "F16", "I16"),
                        "is stored as int16; weights are float16, bfloat16, float32 or float64"),
    "NaN weights": (lambda path: write_raw_snapshot(path, snapshot_metadata(), filled(float("nan"))),
                    "holds NaN or infinite weights"),
    "infinite weights": (lambda path: write_raw_snapshot(path, snapshot_metadata(), filled(float("inf"))),
                         "holds NaN or infinite weights"),
    "negative image count": (lambda path: write_raw_snapshot(path, snapshot_metadata(nimg=-5)),
                             "metadata says -5 images seen; an image count is an integer in [0, 2**53)"),
    "image count past 2**53": (lambda path: write_raw_snapshot(path, snapshot_metadata(nimg=2**53)),
                               f"metadata says {2**53} images seen"),
    "image count of 31 digits": (lambda path: write_raw_snapshot(path, snapshot_metadata(nimg=10**30)),
                                 "has more than 20 digits"),
    "fractional image count": (lambda path: write_raw_snapshot(path, snapshot_metadata(nimg=9216.5)),
                               "metadata says 9216.5 images seen"),
}


def nested(depth: int) -> list:
    """A JSON value nested `depth` lists deep."""
    value = []
    for _ in range(depth - 1):
        value = [value]
    return value


def relabel(path: Path, dtype: str, as_dtype: str) -> Path:
    """Rewrite every tensor's dtype in a safetensors header (names of equal length, so no offset moves)."""
    assert len(dtype) == len(as_dtype)
    data = bytearray(path.read_bytes())
    size = int.from_bytes(data[:8], "little")
    header = bytes(data[8:8 + size]).replace(f'"dtype":"{dtype}"'.encode(), f'"dtype":"{as_dtype}"'.encode())
    assert len(header) == size and as_dtype.encode() in header
    path.write_bytes(data[:8] + header + data[8 + size:])
    return path


def filled(value: float) -> torch.nn.Module:
    """A tiny net whose first parameter is `value` everywhere (a diverged training's weights)."""
    net = tiny_precond()
    with torch.no_grad():
        next(net.parameters()).fill_(value)
    return net


def test_the_bad_files_start_from_a_valid_snapshot(tmp_path):
    # Each case below changes one thing of this file, which loads.
    net, meta = load_network(write_raw_snapshot(tmp_path / "ok.safetensors", snapshot_metadata()))
    assert meta["nimg"] == 9216 and net.init_kwargs == tiny_precond().init_kwargs


def test_a_snapshot_written_before_network_families_is_the_release_unet(tmp_path):
    earlier = {k: v for k, v in tiny_precond().init_kwargs.items() if k != "family"}
    net, _ = load_network(write_raw_snapshot(tmp_path / "old.safetensors", snapshot_metadata(network_kwargs=earlier)))
    assert type(net.unet) is UNet and net.init_kwargs == tiny_precond().init_kwargs


@pytest.mark.parametrize("case", BAD_FILES)
def test_bad_files_are_one_snapshot_error_naming_the_file(tmp_path, case):
    make, message = BAD_FILES[case]
    path = tmp_path / "network-snapshot-0000009-0.050.safetensors"
    make(path)
    with pytest.raises(SnapshotError) as info:
        load_network(path)
    assert str(info.value).startswith(f"{path}: ") and message in str(info.value) and "\n" not in str(info.value)


def run_generate(net: Path, outdir: Path):
    return CliRunner().invoke(generate.main, [f"--net={net}", f"--outdir={outdir}", "--seeds=0", "--steps=1"])


def refuse_to_open(monkeypatch, path: Path) -> None:
    """Make open() of path fail as it does for a file without read permission (root passes that check)."""
    real_open = builtins.open

    def refusing_open(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and Path(file) == path:
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", refusing_open)


def test_an_unreadable_file_is_not_reported_missing(tmp_path, monkeypatch):
    path = tmp_path / "net.safetensors"
    save_network(path, tiny_precond(), {})
    refuse_to_open(monkeypatch, path)
    for load in (load_network, read_metadata):
        with pytest.raises(SnapshotError, match=f"^{path}: cannot read: Permission denied$"):
            load(path)


@pytest.mark.bad_input
def test_generate_reports_an_unreadable_net_as_unreadable(tmp_path, monkeypatch):
    path = tmp_path / "net.safetensors"
    save_network(path, tiny_precond(), {"encoder": {"class": "StandardRGBEncoder"}})
    refuse_to_open(monkeypatch, path)
    assert_refused(tmp_path, lambda: run_generate(path, tmp_path / "out"), f"{path}: cannot read: Permission denied")


def run_without_read_permission(args: list[str], unreadable: Path) -> subprocess.CompletedProcess:
    """Run a command line in a user namespace with no mapped user: its files' owner bits then apply even
    to root, so `unreadable` (mode 000) gives a real EACCES from the kernel while the rest stays readable."""
    unreadable.chmod(0o000)
    result = subprocess.run(["unshare", "--user", sys.executable, *args], cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0 and "unshare" in result.stderr.split(":")[0]:
        pytest.skip(f"no user namespaces here: {result.stderr.strip()}")
    return result


@pytest.mark.bad_input
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare for a real EACCES")
def test_a_file_without_read_permission_is_reported_as_such(tmp_path):
    run = fake_training_run(tmp_path / "run", num_snapshots=2)
    path = run / "network-snapshot-0000001-0.100.safetensors"
    args = ["reconstruct_phema.py", f"--indir={run}", "--std=0.1"]
    assert_refused(tmp_path, lambda: run_without_read_permission(args, path), f"{path}: cannot read: Permission denied")


@pytest.mark.bad_input
@pytest.mark.parametrize("case", [c for c in BAD_FILES if c != "missing"])
def test_generate_answers_a_bad_snapshot_with_one_line(tmp_path, case):
    make, message = BAD_FILES[case]
    path = tmp_path / "network-snapshot-0000009-0.050.safetensors"
    make(path)
    assert_refused(tmp_path, lambda: run_generate(path, tmp_path / "out"), str(path), message)


# Bad files reconstruct_phema.py finds among a run's snapshots (named like one, so not skipped); those it
# never reads as a file (a folder, a FIFO) are skipped, and 'missing' cannot be among them.
# Weights of another network are caught earlier there, from the file headers.
RUN_CASES = {c: BAD_FILES[c] for c in BAD_FILES if c not in ("missing", "folder", "fifo")}
RUN_CASES["other weights"] = (BAD_FILES["other weights"][0], "network architecture differs")


@pytest.mark.bad_input
@pytest.mark.parametrize("case", RUN_CASES)
def test_reconstruct_phema_answers_a_bad_snapshot_with_one_line(tmp_path, case):
    make, message = RUN_CASES[case]
    run = fake_training_run(tmp_path / "run", num_snapshots=2)
    path = run / "network-snapshot-0000009-0.050.safetensors"
    make(path)
    assert_refused(tmp_path, lambda: CliRunner().invoke(reconstruct_phema.main, [f"--indir={run}", "--std=0.1"]),
                   str(path), message)
