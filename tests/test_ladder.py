"""The paper's configurations B, C, D, E (edm2.architectures.ladder, families config-b/c/d/e) and F
(edm2.architectures.config_f), each tested for its defining change against the paper's definition (Appendix
B.2-B.6), G left as it was, their sizes against Table 1, and bad input."""

import json
import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import train_edm2
from edm2.encoders import StandardRGBEncoder
from edm2.formats.snapshot import load_network, save_network
from edm2.architectures.config_f import FBlock, FUNet
from edm2.architectures.ladder import (AffineGroupNorm, BiasedLayer, DriftingMPConv, LadderUNet, LabelEmbedding,
                                      UniformConv, ladder_blocks, rms_group_norm)
from edm2.eval.magnitudes import bucket_magnitudes
from edm2.families import UnknownFamily
from edm2.layers import MPConv, force_weight_normalization
from edm2.networks import Precond, UNet, count_parameters, unet_blocks
from tests.helpers import TRAIN_ARGS, assert_refused, count_macs, tiny_precond
from training.lr_schedule import learning_rate_schedule
from training.presets import get_preset

SMALL = dict(model_channels=16, channel_mult=(1, 2), num_blocks=1, attn_resolutions=(4,), channels_per_head=16)


def ladder(config: str, seed: int = 0, **overrides) -> Precond:
    torch.manual_seed(seed)
    return Precond(8, 3, 4, use_fp16=False, family=f"config-{config.lower()}", **{**SMALL, **overrides})


def learned_layers(net: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in net.unet.modules() if isinstance(m, (UniformConv, MPConv))]


def gn(x: torch.Tensor, norm: torch.nn.GroupNorm) -> torch.Tensor:
    """ADM's group norm in float64 by hand: zero mean and unit variance per group (eps 1e-5), per-channel affine."""
    groups = x.reshape(x.shape[0], norm.num_groups, -1)
    mean, var = groups.mean(dim=2, keepdim=True), groups.var(dim=2, unbiased=False, keepdim=True)
    y = ((groups - mean) / (var + 1e-5).sqrt()).reshape(x.shape)
    return y * norm.weight.double()[:, None, None] + norm.bias.double()[:, None, None]


def biased(x: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
    w, b = layer.weight.double(), layer.bias.double()
    if w.ndim == 2:
        return x @ w.t() + b
    return torch.nn.functional.conv2d(x, w, b, padding=w.shape[-1] // 2)


def test_config_b_is_adm_with_biases_and_zero_initialized_last_layers():
    # Appendix B.1-B.2 (NVlabs/edm's DhariwalUNet): every learned layer has a bias, weight and bias from
    # U(-1/sqrt(fan_in), 1/sqrt(fan_in)), and the last layer of each residual branch, the attention projection and
    # the output layer start at zero; group norms start at scale 1 and bias 0; class embeddings are N(0, 1).
    net = ladder("B", attn_resolutions=(8,))
    unet = net.unet
    layers = [m for m in unet.modules() if isinstance(m, BiasedLayer)]
    zero = {id(m) for b in unet.modules() if hasattr(b, "conv_res1") for m in (b.conv_res1, b.attn_proj) if m}
    zero.add(id(unet.out_conv))
    assert layers and len(zero) > 3
    for m in layers:
        bound = 1 / math.sqrt(m.weight[0].numel())
        if id(m) in zero:
            assert not m.weight.any() and not m.bias.any()
        else:
            assert m.weight.abs().max() <= bound and m.bias.abs().max() <= bound and m.bias.any()
    norms = [m for m in unet.modules() if isinstance(m, AffineGroupNorm)]
    assert norms and all(torch.equal(m.weight, torch.ones_like(m.weight)) and not m.bias.any() for m in norms)
    assert isinstance(unet.emb_label, LabelEmbedding) and not hasattr(unet.emb_label, "bias")
    # N(0, 1): over 4 x 128 = 512 draws, the mean of w^2 is within 5 standard errors (sqrt(2 / 512) = 0.0625) of 1.
    assert abs(float(unet.emb_label.weight.detach().double().square().mean()) - 1) < 5 * 0.0625
    # No constant input channel: the first convolution sees the image's 3 channels.
    assert unet.enc["8x8_conv"].weight.shape[1] == 3


def test_config_b_block_is_adms_scale_shift_block_with_dot_product_attention():
    # Float64 by hand, every parameter drawn at random (the zero-initialized ones would hide their paths): group
    # norm, SiLU, conv; scale and shift from the embedding (ADM's adaptive group norm): silu(gn(y) (1 + s) + b);
    # conv; plus the 1x1-projected input; then x + proj(attention(qkv(gn(x)))) with softmax(q k^T / sqrt(c)).
    net = ladder("B", seed=3, attn_resolutions=(4,)).double()
    block = net.unet.enc["4x4_block0"]
    assert block.num_heads == 2 and block.conv_skip is not None
    torch.manual_seed(4)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    x, emb = torch.randn(2, block.in_channels, 4, 4, dtype=torch.float64), torch.randn(2, 32, dtype=torch.float64)
    with torch.no_grad():
        got = block(x, emb)
        y = biased(silu(gn(x, block.norm0)), block.conv_res0)
        scale, shift = biased(emb, block.emb_linear)[:, :, None, None].chunk(2, dim=1)
        y = biased(silu(gn(y, block.norm1) * (1 + scale) + shift), block.conv_res1)
        h = biased(x, block.conv_skip) + y
        q, k, v = biased(gn(h, block.attn_norm), block.attn_qkv).reshape(2, 2, 16, 3, 16).unbind(3)
        weights = torch.softmax(torch.einsum("nhcq,nhck->nhqk", q, k) / math.sqrt(16), dim=3)
        a = torch.einsum("nhqk,nhck->nhcq", weights, v).reshape(2, 32, 4, 4)
        expected = h + biased(a, block.attn_proj)
    assert torch.allclose(got, expected, rtol=1e-10, atol=1e-10)


def test_config_b_embeds_timesteps_sinusoidally_and_attends_where_figure_17_does():
    # ADM's timestep embedding of c_noise (NVlabs/edm PositionalEmbedding): [cos(a f_i), sin(a f_i)],
    # f_i = 10000^(-i/(N/2)); then two linear layers with SiLU, plus the unscaled one-hot label's embedding, SiLU.
    net = ladder("B", seed=5).double()
    unet = net.unet
    seen = {}
    unet.emb_noise.register_forward_hook(lambda m, i, o: seen.update(features=i[0]))
    unet.enc["8x8_block0"].register_forward_pre_hook(lambda m, i: seen.update(emb=i[1]))
    a, labels = torch.tensor([-0.4, 0.9], dtype=torch.float64), torch.eye(4, dtype=torch.float64)[[0, 2]]
    with torch.no_grad():
        unet(torch.randn(2, 3, 8, 8, dtype=torch.float64), a, labels)
    f = 10000.0 ** -(torch.arange(8, dtype=torch.float64) / 8)
    features = torch.cat([torch.cos(a[:, None] * f), torch.sin(a[:, None] * f)], dim=1)
    assert torch.allclose(seen["features"], features, rtol=1e-6, atol=1e-7)  # f stored in float32
    emb = silu(biased(silu(biased(features, unet.emb_noise)), unet.emb_layer1) + labels @ unet.emb_label.weight.t())
    assert torch.allclose(seen["emb"], emb, rtol=1e-5, atol=1e-6)
    # Figure 17 at ImageNet-512: attention at 16x16 and 8x8 only (B removed A's 32x32), and in the lowest decoder
    # level's first block.
    with torch.device("meta"):
        img512 = Precond(64, 4, 1000, **get_preset("config-b-img512").network)
    attending = {name for name, block in ladder_blocks(img512.unet) if block.num_heads}
    names = [name for name, _ in ladder_blocks(img512.unet)]
    expected = {name for name in names if name.split(".")[1].split("_")[0] in ("16x16", "8x8")
                and name.split("_")[-1] not in ("down", "up", "in1")}
    assert attending == expected and "dec.8x8_in0" in attending and "dec.8x8_in1" not in attending


def test_config_c_has_no_biases_and_he_uniform_weights():
    # Appendix B.3: every bias removed (group norms included: they have no parameters left), every layer He-uniform
    # initialized as ADM's layers (bound 1/sqrt(fan_in)), the zero-initialized ones and the class embedding included.
    net = ladder("C")
    assert all(name.endswith(".weight") for name, _ in net.unet.named_parameters())
    layers = learned_layers(net)
    assert layers and all(type(m) is UniformConv for m in layers)
    assert sum(p.numel() for p in net.unet.parameters()) == sum(m.weight.numel() for m in layers)
    for m in layers:
        fan_in = m.weight[0].numel()
        assert m.weight.abs().max() <= 1 / math.sqrt(fan_in)
    # U(-b, b) has variance b^2 / 3; over the 9,216 weights of the 3x3 32->32 convolution, the sample mean of w^2
    # (variance of w^2: 4 b^4 / 45) lies within 5 standard errors, 5 * sqrt(4/45)/sqrt(9216) b^2 = 0.016 b^2.
    w = net.unet.dec["4x4_in0"].conv_res1.weight.double()
    assert abs(w.square().mean() * w[0].numel() - 1 / 3) < 0.016


def test_config_c_has_a_constant_channel_and_fourier_features():
    net = ladder("C")
    seen = {}
    first = net.unet.enc["8x8_conv"]
    first.register_forward_hook(lambda m, i, o: seen.update(input=i[0]))
    net.unet.emb_noise.register_forward_hook(lambda m, i, o: seen.update(features=i[0]))
    sigma = torch.tensor([0.3, 2.0, 11.0])
    net(torch.randn(3, 3, 8, 8), sigma, torch.eye(4)[:3])
    assert first.weight.shape[1] == 4 and torch.equal(seen["input"][:, 3], torch.ones(3, 8, 8))
    # Eq. 35-36: b = cos(2 pi (f a + phi)) of a = c_noise = ln(sigma) / 4, in float64 from the stored f and phi.
    fourier = net.unet.emb_fourier
    a = sigma.double().log() / 4
    expected = torch.cos(a[:, None] * fourier.freqs.double()[None] + fourier.phases.double()[None])
    assert torch.allclose(seen["features"].double(), expected, atol=1e-5)  # float32 angles of |.| < 40


def test_config_c_group_norm_has_no_mean_subtraction_or_scale():
    # Eq. 29 in float64 by hand: a / sqrt(mean over the group's pixels and channels of a^2 + eps), eps = 1e-4.
    x = torch.randn(2, 8, 4, 4, dtype=torch.float64) + 3  # an offset that a mean subtraction would remove
    groups = x.reshape(2, 2, 4, 4, 4)
    expected = (groups / (groups.square().mean(dim=(2, 3, 4), keepdim=True) + 1e-4).sqrt()).reshape(x.shape)
    got = rms_group_norm(x.float(), 2)
    assert torch.allclose(got.double(), expected, rtol=1e-6)
    assert got.mean() > 0.9  # the offset stays


def test_config_d_normalizes_every_learned_layer_on_use_and_never_forces_it():
    net = ladder("D")
    layers = learned_layers(net)
    assert layers and all(type(m) is DriftingMPConv for m in layers)
    # Eq. 47: b = (w_i / (||w_i|| + eps)) a, row by row, in float64 by hand, for a conv and a linear layer; the scale
    # of the stored weight makes no difference (up to eps).
    # (normalized() writes the same w_i / (||w_i|| + eps sqrt(N)) as w_i / (||w_i|| / sqrt(N) + eps) / sqrt(N).)
    for m in (net.unet.enc["8x8_block0"].conv_res0, net.unet.emb_layer1):
        with torch.no_grad():
            m.weight.mul_(7.0)
        shape = [2, m.weight.shape[1], *([6, 6] if m.weight.ndim == 4 else [])]
        x = torch.randn(shape)
        assert torch.allclose(m(x).double(), conv(x.double(), m), rtol=1e-5, atol=1e-5)
    # Eq. 66 is not applied: force_weight_normalization leaves D's stored weights alone, so their norms may drift.
    before = [m.weight.detach().clone() for m in layers]
    force_weight_normalization(net)
    assert all(torch.equal(m.weight, b) for m, b in zip(layers, before))


def test_config_e_forces_weight_normalization_and_decays_the_learning_rate():
    net = ladder("E")
    layers = learned_layers(net)
    assert layers and all(type(m) is MPConv for m in layers)
    with torch.no_grad():
        for m in layers:
            m.weight.mul_(torch.rand(m.weight.shape[0], *[1] * (m.weight.ndim - 1)) * 5 + 0.1)
    before = [m.weight.double().flatten(1).norm(dim=1) for m in layers]
    force_weight_normalization(net)
    for m, norm in zip(layers, before):
        # Eq. 66, every row back to norm sqrt(N_j) (N_j its fan-in), with Algorithm 1's eps on the RMS:
        # ||w|| / (||w|| / sqrt(N_j) + eps); float32 round-off.
        n = math.sqrt(m.weight[0].numel())
        assert torch.allclose(m.weight.double().flatten(1).norm(dim=1), norm / (norm / n + 1e-4), rtol=1e-5)
    # Eq. 67 with Table 1's alpha_ref 0.0100 and t_ref 70000 (iterations of 2048 images): E decays, D stays constant.
    e, d = get_preset("config-e-img512"), get_preset("config-d-img512")
    t = 280000
    assert learning_rate_schedule(t * 2048, e.batch, e.lr, e.decay, 0) == pytest.approx(0.0100 / math.sqrt(t / 70000))
    assert learning_rate_schedule(t * 2048, d.batch, d.lr, d.decay, 0) == 0.0100
    c = get_preset("config-c-img512")
    assert (c.lr, c.decay) == (0.0002, 0)


def normalized(w: torch.Tensor) -> torch.Tensor:
    """Eq. 47's weight in float64 by hand: each row w_i / (||w_i|| / sqrt(N) + eps) / sqrt(N), N its fan-in."""
    w = w.double()
    n = w[0].numel()
    rows = w.flatten(1).norm(dim=1).reshape(-1, *[1] * (w.ndim - 1))
    return w / (rows / math.sqrt(n) + 1e-4) / math.sqrt(n)


def conv(x: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
    w = normalized(layer.weight)
    return x @ w.t() if w.ndim == 2 else torch.nn.functional.conv2d(x, w, padding=w.shape[-1] // 2)


def silu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


def test_config_f_blocks_have_pixel_norm_plain_silu_and_sums_and_no_gain():
    # Appendix B.6-B.7 in float64 by hand: an encoder block moves its 1x1 convolution to the start of the main path
    # and pixel-normalizes there (Eq. 30), then adds the residual branch as it is; the SiLUs are plain (no 1/0.596,
    # Eq. 81), the conditioning carries no learned gain (Figure 21 has none), and there is no group norm.
    net = ladder("F", seed=1, attn_resolutions=(8,))
    assert type(net.unet) is FUNet and all(type(b) is FBlock for _, b in unet_blocks(net.unet))
    block = net.unet.enc["4x4_block0"]
    assert block.conv_skip is not None and block.num_heads == 0 and block.flavor == "enc"
    x, emb = torch.randn(2, block.in_channels, 4, 4, dtype=torch.float64), torch.randn(2, 32, dtype=torch.float64)
    with torch.no_grad():
        block.emb_linear.weight.normal_()  # a conditioning that matters
        got = block.double()(x, emb)
        main = conv(x, block.conv_skip)
        main = main / (1e-4 + main.norm(dim=1, keepdim=True) / math.sqrt(main.shape[1]))  # Eq. 30
        scale = conv(emb, block.emb_linear) + 1
        y = conv(silu(conv(silu(main), block.conv_res0) * scale[:, :, None, None]), block.conv_res1)
    assert torch.allclose(got, main + y, rtol=1e-10, atol=1e-10)
    assert not [name for name, _ in net.named_parameters() if "gain" in name]


def test_config_f_embedding_concatenation_and_output_are_plain():
    # B.6: one linear layer on Eq. 35's Fourier features (cos, no sqrt(2)), plus the class embedding of one-hot labels
    # times sqrt(N), then SiLU; B.6's removed output SiLU and G's absent gain: the output is the last decoder block's
    # activations through the output convolution as they are; the skips are concatenated unscaled. Float64 by hand.
    net = ladder("F", seed=2).double()
    unet = net.unet
    seen = {}
    unet.out_conv.register_forward_hook(lambda m, i, o: seen.update(out_in=i[0], out=o))
    last = list(unet.dec.values())[-1]
    last.register_forward_hook(lambda m, i, o: seen.update(last=o))
    first_dec = unet.dec["4x4_block0"]
    first_dec.register_forward_pre_hook(lambda m, i: seen.update(cat=i[0]))
    unet.dec["4x4_in1"].register_forward_hook(lambda m, i, o: seen.update(before_cat=o))
    unet.enc["4x4_block0"].register_forward_hook(lambda m, i, o: seen.update(skip=o))
    c_noise, labels = torch.tensor([-0.5, 0.7], dtype=torch.float64), torch.eye(4, dtype=torch.float64)[[1, 3]]
    with torch.no_grad():
        emb = unet.embedding(c_noise, labels)
        fourier = torch.cos(c_noise[:, None] * unet.emb_fourier.freqs.double() + unet.emb_fourier.phases.double())
        expected = silu(conv(fourier, unet.emb_noise) + conv(labels * 2, unet.emb_label))
        assert torch.allclose(emb, expected, rtol=1e-10, atol=1e-12)
        unet(torch.randn(2, 3, 8, 8, dtype=torch.float64), c_noise, labels)
    assert torch.equal(seen["out_in"], seen["last"])
    assert torch.allclose(seen["out"], conv(seen["last"], unet.out_conv), rtol=1e-10, atol=1e-12)
    assert torch.equal(seen["cat"], torch.cat([seen["before_cat"], seen["skip"]], dim=1))


def test_config_f_is_g_less_its_gains_and_keeps_e_s_schedule():
    # Same layers, names and multiply-accumulates as G (Table 1: F 280.2 Mparams and 102.1 Gflops, G 280.2 and
    # 102.2; the 0.1 are G's elementwise scalings, which count_macs leaves out); F trains with E's rates.
    f, g = ladder("F"), tiny_precond(8, 3, 4, use_fp16=False, **SMALL)
    assert set(f.state_dict()) == {k for k in g.state_dict() if not k.endswith("_gain")}
    assert count_macs(f) == count_macs(g)
    for name in ("img512", "toy"):
        fp, ep = get_preset(f"config-f-{name}"), get_preset(f"config-e-{name}")
        assert (fp.lr, fp.decay) == (ep.lr, ep.decay) and fp.network["family"] == "config-f"


def test_the_ladder_presets_keep_adms_dropout_and_b_trains_at_adms_rate():
    # ADM's 10% dropout stays until G, which could disable it (Appendix B.7); B's Adam rate is 0.0002, constant
    # (Appendix B.2, t_ref = infinity). The toy rows keep toy-small's no-dropout, to compare by the changes alone.
    for config in "bcdef":
        assert get_preset(f"config-{config}-img512").dropout == 0.10
        assert get_preset(f"config-{config}-toy").dropout == get_preset("toy-small").dropout
    assert get_preset("config-g-img512").dropout == 0
    b = get_preset("config-b-img512")
    assert (b.lr, b.decay, b.network["family"]) == (0.0002, 0, "config-b")


def test_parameter_counts_are_table_1s_and_g_is_the_unchanged_u_net():
    # Table 1's Mparams at ImageNet-512 (64x64x4 latents, 1000 classes, 192 channels): B 291.8 (the embedding's
    # shift doubles each block's embedding layer; biases and group-norm scales), C, D and E 277.8; F and G 280.2.
    for config, mparams in (("B", 291.8), ("C", 277.8), ("D", 277.8), ("E", 277.8), ("F", 280.2), (None, 280.2)):
        with torch.device("meta"):
            net = Precond(64, 4, 1000, **({"family": f"config-{config.lower()}"} if config else {}))
        assert round(count_parameters(net) / 1e6, 1) == mparams
    net = tiny_precond()
    assert type(net.unet) is UNet and net.init_kwargs["family"] == "edm2"


def test_a_ladder_snapshot_loads_as_its_configuration(tmp_path):
    net = ladder("D")
    save_network(tmp_path / "d.safetensors", net, {})
    loaded, _ = load_network(tmp_path / "d.safetensors")
    assert type(loaded.unet) is LadderUNet and loaded.init_kwargs["family"] == "config-d"
    x, sigma = torch.randn(2, 3, 8, 8), torch.tensor([0.5, 3.0])
    # The snapshot stores float16 weights: the outputs agree to float16 rounding of the weights.
    assert np.allclose(loaded(x, sigma).detach(), net(x, sigma).detach(), atol=2e-2)


@pytest.mark.bad_input
def test_a_configuration_that_does_not_exist_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnknownFamily, match=r"^unknown network family 'config-z': this edm2 knows config-b, "):
        ladder("Z")
    assert_refused(tmp_path, lambda: CliRunner().invoke(train_edm2.main, ["--preset=config-z-toy"]),
                   "--preset", "'config-z-toy' is not one of", "'config-b-toy'")


@pytest.mark.bad_input
def test_a_preset_and_init_of_different_configurations_is_one_line(train_data, tmp_path, monkeypatch):
    init = tmp_path / "g.safetensors"
    save_network(init, tiny_precond(8, 3, 4), {"encoder": StandardRGBEncoder().config()})
    monkeypatch.setattr(train_edm2, "train", lambda *args: pytest.fail("training started"))
    args = [*TRAIN_ARGS, "--preset=config-c-toy", f"--data={train_data}", f"--outdir={tmp_path / 'run'}",
            f"--init={init}"]
    assert_refused(tmp_path, lambda: CliRunner().invoke(train_edm2.main, args), "--init",
                   "--preset=config-c-toy trains the network family 'config-c', but g.safetensors is of family 'edm2'")


def test_a_ladder_preset_trains_its_configuration_unless_arch_says_otherwise(train_data, tmp_path):
    def network(*args):
        result = CliRunner().invoke(train_edm2.main, [*TRAIN_ARGS, f"--data={train_data}",
                                                      f"--outdir={tmp_path / 'run'}", "--dry-run", *args])
        assert result.exit_code == 0, result.output
        return json.loads(result.output[: result.output.rindex("}") + 1])["network"]

    toy_small = dict(channel_mult=[1, 2, 2], num_blocks=1, attn_resolutions=[8], channels_per_head=32)
    assert network("--preset=config-e-toy") == dict(toy_small, family="config-e")
    assert network("--preset=config-e-toy", "--arch=edm2") == toy_small  # the same hyperparameters, G's U-Net
    assert network("--preset=config-e-toy", "--arch=mp-resnet") == dict(family="mp-resnet")  # none of them


@pytest.mark.parametrize("config", ["B", "C", "F", "G"])
def test_bucket_magnitudes_are_appendix_a6s_without_gains_or_biases(config):
    # Appendix A.6: a weight feature is one output row of a learned weight tensor of the bucket, its magnitude Eq. 3's
    # RMS; B's biases and group-norm scales and G's scalar gains (emb_gain, out_gain) are no weight tensors and stay
    # out. By hand in float64.
    net = ladder(config) if config != "G" else tiny_precond(8, 3, 4, use_fp16=False)
    if config == "B":
        assert any(name.endswith(".bias") for name, _ in net.named_parameters())
    x, sigma, labels = torch.randn(2, 3, 8, 8), torch.tensor([0.5, 2.0]), torch.eye(4)[:2]
    got = bucket_magnitudes(net, x, sigma, labels)
    rows = torch.cat([p.detach().double().flatten(1).square().mean(1).sqrt() for name, p in net.named_parameters()
                      if name.startswith("unet.dec.4x4") and p.ndim >= 2])
    assert got["weights"]["dec 4x4"] == pytest.approx({"max": float(rows.max()), "mean": float(rows.mean())})
    assert set(got["activations"]) == set(got["weights"]) == {"enc 8x8", "enc 4x4", "dec 4x4", "dec 8x8"}
