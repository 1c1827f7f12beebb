"""Our snapshot files: safetensors weights plus JSON metadata, loaded without running code."""

import json

import pytest
import safetensors.torch
import torch

from edm2.networks import Precond
from edm2.encoders import StandardRGBEncoder
from edm2.snapshot import SnapshotError, load_generator, load_network, read_metadata, save_network
from tests.helpers import tiny_precond


def tiny_net(**kwargs) -> Precond:
    return tiny_precond(**kwargs)


def test_roundtrip_float16_weights_and_metadata(tmp_path):
    torch.manual_seed(0)
    net = tiny_net(dropout=0.1)
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

    x, sigma, labels = torch.randn(2, 3, 8, 8), torch.tensor([0.3, 2.0]), torch.eye(10)[:2]
    with torch.no_grad():
        want = net.eval()(x, sigma, labels)
        got = loaded(x, sigma, labels)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)  # float16 weight rounding
    assert not torch.equal(got, 0.25 / (sigma.reshape(-1, 1, 1, 1) ** 2 + 0.25) * x)
    assert read_metadata(path)["ema_std"] == 0.1


def test_bad_files_are_reported(tmp_path):
    with pytest.raises(SnapshotError, match="no such file"):
        load_network(tmp_path / "missing.safetensors")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(SnapshotError, match="cannot read"):
        load_network(junk)
    foreign = tmp_path / "foreign.safetensors"
    safetensors.torch.save_file({"w": torch.zeros(2)}, str(foreign))
    with pytest.raises(SnapshotError, match="not an EDM2 snapshot"):
        load_network(foreign)


def test_load_generator_needs_encoder_settings(tmp_path):
    net = tiny_net()
    save_network(tmp_path / "rgb.safetensors", net, {"encoder": {"class": "StandardRGBEncoder"}})
    save_network(tmp_path / "bare.safetensors", net, {})
    loaded, encoder, meta = load_generator(tmp_path / "rgb.safetensors")
    assert isinstance(encoder, StandardRGBEncoder) and meta["encoder"]["class"] == "StandardRGBEncoder"
    with pytest.raises(SnapshotError, match="no usable encoder settings"):
        load_generator(tmp_path / "bare.safetensors")
