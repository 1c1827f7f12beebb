"""Encoders against direct diffusers calls and the paper's normalization (Appendix B.1)."""

import json
import pickle

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL

from edm2 import encoders
from edm2.encoders import (EncoderError, StabilityVAEEncoder, StandardRGBEncoder, encoder_from_config)

RAW_MEAN = np.array([5.81, 3.25, 0.12, -2.15])
RAW_STD = np.array([4.17, 4.62, 3.71, 3.28])


@pytest.fixture(scope="module")
def vae(tiny_vae_dir):
    return AutoencoderKL.from_pretrained(tiny_vae_dir).eval()


def pixels(n, size=16, seed=0):
    return torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_rgb_encoder_maps_to_unit_range_and_back():
    enc = StandardRGBEncoder()
    x = torch.arange(256, dtype=torch.uint8).reshape(1, 1, 16, 16)
    y = enc.encode(x)
    assert y.dtype == torch.float32 and y.min() == -1 and y.max() == 1
    assert torch.allclose(y.double(), x.double() / 127.5 - 1, rtol=0, atol=1e-6)
    assert torch.equal(enc.decode(y), x)
    assert torch.equal(enc.decode(torch.tensor([-2.0, 2.0])), torch.tensor([0, 255], dtype=torch.uint8))
    assert enc.out_channels(3) == 3


def test_vae_normalization_matches_paper():
    enc = StabilityVAEEncoder("unused")
    assert np.allclose(enc.scale, 0.5 / RAW_STD, rtol=1e-6, atol=0)
    assert np.allclose(enc.bias, -RAW_MEAN * 0.5 / RAW_STD, rtol=1e-6, atol=0)
    # Raw latents with the paper's per-channel statistics come out with mean 0 and std sigma_data = 0.5.
    gen = torch.Generator().manual_seed(0)
    raw = torch.tensor(RAW_MEAN).reshape(1, 4, 1, 1) + torch.tensor(RAW_STD).reshape(1, 4, 1, 1) * torch.randn(
        64, 4, 32, 32, generator=gen, dtype=torch.float64)
    final = enc.encode_latents(torch.cat([raw, torch.zeros_like(raw)], dim=1)).double()
    assert torch.allclose(final.mean(dim=(0, 2, 3)), torch.zeros(4, dtype=torch.float64), atol=0.01)
    assert torch.allclose(final.std(dim=(0, 2, 3)), torch.full((4,), 0.5, dtype=torch.float64), atol=0.01)
    assert enc.out_channels(8) == 4


def test_scale_bias_keep_release_float32_values_through_config():
    # The release stores float32 scale = final_std / raw_std and bias = final_mean - raw_mean * scale.
    scale = np.float32(0.5) / RAW_STD.astype(np.float32)
    bias = np.float32(0) - RAW_MEAN.astype(np.float32) * scale
    default = StabilityVAEEncoder()
    imported = StabilityVAEEncoder.from_scale_bias("stabilityai/sd-vae-ft-mse", scale, bias, batch_size=4)
    for enc in [default, imported, encoder_from_config(json.loads(json.dumps(imported.config())))]:
        assert enc.scale.dtype == np.float32 and enc.scale.tobytes() == scale.tobytes()
        assert enc.bias.dtype == np.float32 and enc.bias.tobytes() == bias.tobytes()
    restored = encoder_from_config(json.loads(json.dumps(imported.config())))
    assert restored.config() == imported.config() and restored.config()["class"] == "StabilityVAEEncoder"
    assert (restored.vae_name, restored.batch_size) == ("stabilityai/sd-vae-ft-mse", 4)
    rgb = encoder_from_config(json.loads(json.dumps(StandardRGBEncoder().config())))
    assert isinstance(rgb, StandardRGBEncoder) and rgb.config() == {"class": "StandardRGBEncoder"}
    for bad in [{"class": "Other"}, {"class": "StabilityVAEEncoder", "vae_name": "x"}, {}]:
        with pytest.raises(ValueError):
            encoder_from_config(bad)


def test_encode_pixels_equals_diffusers_in_batches(tiny_vae_dir, vae, monkeypatch):
    loads, batch_sizes = [], []
    hook = vae.encoder.register_forward_pre_hook(lambda module, args: batch_sizes.append(args[0].shape[0]))
    monkeypatch.setattr(encoders, "load_vae", lambda name: loads.append(name) or vae)
    enc = StabilityVAEEncoder(str(tiny_vae_dir), batch_size=2)
    assert loads == []  # lazy: nothing is loaded before pixels need encoding
    x = pixels(5)
    out = enc.encode_pixels(x)
    hook.remove()
    with torch.no_grad():
        dist = vae.encode(x.double().div(255).float()).latent_dist
    assert out.dtype == torch.float32 and out.shape == (5, 8, 8, 8)  # 2x downsampling of this VAE
    assert torch.allclose(out, torch.cat([dist.mean, dist.std], dim=1), atol=1e-5)
    assert batch_sizes == [2, 2, 1] and loads == [str(tiny_vae_dir)]
    enc.encode_pixels(x)
    assert loads == [str(tiny_vae_dir)]  # loaded once
    assert not out.requires_grad


def test_encode_latents_draws_from_global_rng(tiny_vae_dir):
    enc = StabilityVAEEncoder(str(tiny_vae_dir))
    gen = torch.Generator().manual_seed(3)
    mean, std = torch.randn(2, 4, 8, 8, generator=gen), torch.rand(2, 4, 8, 8, generator=gen)
    torch.manual_seed(7)
    out = enc.encode_latents(torch.cat([mean, std], dim=1))
    torch.manual_seed(7)
    noise = torch.randn(2, 4, 8, 8).double()
    expected = (mean.double() + noise * std.double() - torch.tensor(RAW_MEAN).reshape(1, 4, 1, 1)) * (
        0.5 / torch.tensor(RAW_STD).reshape(1, 4, 1, 1))
    assert out.dtype == torch.float32 and torch.allclose(out.double(), expected, atol=1e-5)
    torch.manual_seed(8)
    assert not torch.allclose(enc.encode_latents(torch.cat([mean, std], dim=1)), out)


def test_decode_equals_diffusers(tiny_vae_dir, vae):
    enc = StabilityVAEEncoder(str(tiny_vae_dir), batch_size=3)
    final = torch.randn(3, 4, 8, 8, generator=torch.Generator().manual_seed(5))
    raw = (final.double() - torch.tensor(enc.bias).double().reshape(1, 4, 1, 1)) / torch.tensor(
        enc.scale).double().reshape(1, 4, 1, 1)
    with torch.no_grad():
        sample = vae.decode(raw.float()).sample.double()
    expected = (sample.clamp(0, 1) * 255).to(torch.uint8)  # the release truncates
    out = enc.decode(final)
    assert out.dtype == torch.uint8 and out.shape == (3, 3, 16, 16)
    assert (out.int() - expected.int()).abs().max() <= 1 and (out == expected).float().mean() > 0.99
    assert torch.equal(enc.decode_raw(raw.float()), out)


def test_pickle_drops_the_vae(tiny_vae_dir):
    enc = StabilityVAEEncoder(str(tiny_vae_dir), batch_size=4)
    first = enc.encode_pixels(pixels(2))
    data = pickle.dumps(enc)
    assert len(data) < 2000  # settings only, no weights
    assert torch.equal(pickle.loads(data).encode_pixels(pixels(2)), first)


def test_vae_that_cannot_load_names_it(tmp_path):
    for name in [str(tmp_path / "no-such-vae"), str(tmp_path)]:
        enc = StabilityVAEEncoder(name)  # construction never loads
        with pytest.raises(EncoderError) as info:
            enc.encode_pixels(pixels(1))
        assert name in str(info.value) and "\n" not in str(info.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_vae_follows_input_device(tiny_vae_dir):
    enc = StabilityVAEEncoder(str(tiny_vae_dir))
    x = pixels(2)
    on_gpu = enc.encode_pixels(x.cuda())
    assert on_gpu.device.type == "cuda"
    assert torch.allclose(on_gpu.cpu(), enc.encode_pixels(x), atol=1e-4)
    assert enc.decode(enc.encode(x.cuda())).device.type == "cuda"
