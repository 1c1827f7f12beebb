"""Encoders against direct diffusers calls and the paper's normalization (Appendix B.1)."""

import json
import pickle

import numpy as np
import pytest
import torch

from edm2 import encoders
from edm2.encoders import (EncoderError, EncoderSettingsError, StabilityVAEEncoder, StandardRGBEncoder,
                           encoder_from_config)
from edm2.errors import EDM2Error

RAW_MEAN = np.array([5.81, 3.25, 0.12, -2.15])
RAW_STD = np.array([4.17, 4.62, 3.71, 3.28])
U32 = 2.0 ** -24  # unit round-off of float32: one rounding moves a value by at most this fraction of it


@pytest.fixture(scope="module")
def vae(tiny_vae_dir):
    from diffusers import AutoencoderKL  # seconds to import: not while collecting, in a process that runs no VAE test

    return AutoencoderKL.from_pretrained(tiny_vae_dir).eval()


def pixels(n, size=16, seed=0):
    return torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_rgb_encoder_maps_to_unit_range_and_back():
    enc = StandardRGBEncoder()
    x = torch.arange(256, dtype=torch.uint8).reshape(1, 1, 16, 16)
    y = enc.encode(x)
    assert y.dtype == torch.float32 and y.min() == -1 and y.max() == 1
    # Two float32 roundings (the division, the subtraction) of values <= 2 in magnitude: <= 2 * 2 * U32.
    assert torch.allclose(y.double(), x.double() / 127.5 - 1, rtol=0, atol=4 * U32)
    assert torch.equal(enc.decode(y), x)
    assert torch.equal(enc.decode(torch.tensor([-2.0, 2.0])), torch.tensor([0, 255], dtype=torch.uint8))
    assert enc.out_channels(3) == 3


def test_vae_normalization_matches_paper():
    enc = StabilityVAEEncoder("unused")
    # float32 as the release: scale rounds raw_std and the quotient (2 roundings), bias also raw_mean and the
    # product (4 in all); each moves the value by <= U32 of it.
    assert np.allclose(enc.scale, 0.5 / RAW_STD, rtol=2 * U32 * 1.001, atol=0)
    assert np.allclose(enc.bias, -RAW_MEAN * 0.5 / RAW_STD, rtol=4 * U32 * 1.001, atol=0)
    # Raw latents with the paper's per-channel statistics come out with mean 0 and std sigma_data = 0.5.
    gen = torch.Generator().manual_seed(0)
    raw = torch.tensor(RAW_MEAN).reshape(1, 4, 1, 1) + torch.tensor(RAW_STD).reshape(1, 4, 1, 1) * torch.randn(
        64, 4, 32, 32, generator=gen, dtype=torch.float64)
    final = enc.encode_latents(torch.cat([raw, torch.zeros_like(raw)], dim=1)).double()
    # n = 64 * 32 * 32 = 65536 draws per channel: the sample mean of N(0, 0.5^2) has sd 0.5 / 256 = 0.002 and
    # the sample std sd 0.5 / sqrt(2n) = 0.0014, so 0.01 is 5 and 7 of those; float32 adds ~1e-7.
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
    bad_configs = [{"class": "Other"}, {"class": "StabilityVAEEncoder", "vae_name": "x"}, {},
                   {"class": "StabilityVAEEncoder", "vae_name": "x", "scale": "abc", "bias": [0.0]},
                   {"class": "StabilityVAEEncoder", "vae_name": "x", "scale": [1.0, 2.0], "bias": [0.0]},
                   {"class": "StabilityVAEEncoder", "vae_name": "x", "scale": [1.0], "bias": [0.0], "batch_size": 0}]
    for bad in bad_configs:
        # Stored settings are read by callers that catch ValueError; every library error is an EDM2Error.
        with pytest.raises(EncoderSettingsError, match="not an encoder config") as info:
            encoder_from_config(bad)
        assert isinstance(info.value, EDM2Error) and isinstance(info.value, ValueError)
    with pytest.raises(EncoderSettingsError, match="even channel count"):
        StabilityVAEEncoder().out_channels(7)


def test_encode_pixels_equals_diffusers_in_batches(tiny_vae_dir, vae, monkeypatch):
    loads, batch_sizes = [], []
    hook = vae.encoder.register_forward_pre_hook(lambda module, args: batch_sizes.append(args[0].shape[0]))
    monkeypatch.setattr(encoders, "load_vae", lambda name: loads.append(name) or vae)
    enc = StabilityVAEEncoder(str(tiny_vae_dir), batch_size=2)
    assert loads == []  # lazy: nothing is loaded before pixels need encoding
    x = pixels(5)
    out = enc.encode_pixels(x)
    hook.remove()
    # The release feeds the VAE x / 255 in [0, 1]: k / 255 has a period-8 binary expansion, so rounding it
    # through float64 gives the same float32 as dividing in float32, and each batch of 2, 2, 1 is the same
    # computation as diffusers' own call on it: bit-identical on any machine.
    with torch.no_grad():
        dists = [vae.encode(batch.double().div(255).float()).latent_dist for batch in x.split(2)]
    assert out.dtype == torch.float32 and out.shape == (5, 8, 8, 8)  # 2x downsampling of this VAE
    assert torch.equal(out, torch.cat([torch.cat([d.mean, d.std], dim=1) for d in dists]))
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
    scale = 0.5 / torch.tensor(RAW_STD).reshape(1, 4, 1, 1)
    expected = (mean.double() + noise * std.double() - torch.tensor(RAW_MEAN).reshape(1, 4, 1, 1)) * scale
    # In float32: the draw x = mean + noise * std (2 roundings), x * scale with scale as stored (2 + 1), the bias
    # as stored (4) and the sum (1, of a value <= 2M): each moves the result by <= U32 * M, where M bounds
    # (|mean| + |noise * std|) * scale and |bias|. So 11 * U32 * M at most.
    terms = ((mean.double().abs() + (noise * std.double()).abs()) * scale).max().item()
    magnitude = max(terms, (torch.tensor(RAW_MEAN).reshape(1, 4, 1, 1) * scale).abs().max().item())
    assert out.dtype == torch.float32 and torch.allclose(out.double(), expected, rtol=0, atol=11 * U32 * magnitude)
    torch.manual_seed(8)
    assert not torch.allclose(enc.encode_latents(torch.cat([mean, std], dim=1)), out)


def test_decode_equals_diffusers(tiny_vae_dir, vae):
    enc = StabilityVAEEncoder(str(tiny_vae_dir), batch_size=3)
    final = torch.randn(3, 4, 8, 8, generator=torch.Generator().manual_seed(5))
    raw = (final.double() - torch.tensor(enc.bias).double().reshape(1, 4, 1, 1)) / torch.tensor(
        enc.scale).double().reshape(1, 4, 1, 1)
    with torch.no_grad():
        sample = vae.decode(raw.float()).sample
    expected = (sample.clamp(0, 1) * 255).to(torch.uint8)  # the release clamps, scales and truncates in float32
    # decode_raw on the same float32 latents, one batch of 3 like diffusers' call: the same computation.
    assert torch.equal(enc.decode_raw(raw.float()), expected)
    out = enc.decode(final)
    assert out.dtype == torch.uint8 and out.shape == (3, 3, 16, 16)
    # decode undoes the normalization in float32 (2 roundings) where the reference rounds a float64 result
    # once: the latents differ by <= 2 U32 relative, which moves the decoder's [0, 1] output by a float32-sized
    # amount (~1e-6 for this 2-level VAE), far below one level (1/255): truncation changes a pixel by at most
    # one level, and only where it lies within that amount of a level boundary: a fraction of about
    # 2 * 255 * 1e-6 = 5e-4, far below 1%.
    assert (out.int() - expected.int()).abs().max() <= 1 and (out == expected).float().mean() > 0.99


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


@pytest.mark.cuda
def test_vae_follows_input_device(tiny_vae_dir):
    enc = StabilityVAEEncoder(str(tiny_vae_dir))
    x = pixels(2)
    # cuDNN convolutions default to TF32 (10-bit mantissa) on recent GPUs; compare float32 with float32.
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=False, allow_tf32=False):
        on_gpu = enc.encode_pixels(x.cuda())
    on_cpu = enc.encode_pixels(x)
    assert on_gpu.device.type == "cuda"
    # Other kernels sum each of the encoder's ~10 convolutions (<= 144 products) in another order: about
    # sqrt(144) * U32 = 7e-7 relative per layer at random signs, ~1e-5 over the depth; 1e-4 of the largest
    # output leaves a factor 10 for the network's amplification.
    assert torch.allclose(on_gpu.cpu(), on_cpu, rtol=0, atol=1e-4 * on_cpu.abs().max().item())
    assert enc.decode(enc.encode(x.cuda())).device.type == "cuda"
