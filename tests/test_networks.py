"""The EDM2 network against the paper (Appendix B.7, Table 6) and the release's checkpoints."""

import math
import re

import pytest
import torch

from edm2 import networks
from edm2.layers import ArchitectureError, force_weight_normalization, normalize
from edm2.networks import Block, Precond, count_parameters
from edm2.network_args import unet_layout
from tests.helpers import (ATTENTION_ROUTES, DATA, IMG64_UNET_PARAMS, IMG512_PARAMS, SIZES, TABLE6_GMACS, count_macs,
                           take_attention_route, tiny_precond)


def meta_net(size: str, img_resolution=64, img_channels=4, label_dim=1000) -> Precond:
    with torch.device("meta"):
        return Precond(img_resolution, img_channels, label_dim, model_channels=SIZES[size][0])


def tiny_net(label_dim=10, **kwargs) -> Precond:
    return tiny_precond(label_dim=label_dim, **kwargs)


@pytest.mark.parametrize("size", list(IMG512_PARAMS))
def test_img512_parameter_counts(size):
    assert count_parameters(meta_net(size)) == IMG512_PARAMS[size]


@pytest.mark.parametrize("size", list(IMG64_UNET_PARAMS))
def test_img64_parameter_counts(size):
    net = meta_net(size, img_channels=3)
    assert count_parameters(net.unet) == IMG64_UNET_PARAMS[size]
    assert count_parameters(net) == IMG64_UNET_PARAMS[size] + 128


@pytest.mark.parametrize("label_dim,filename", [(1000, "official-keys-img512-xs.txt"),
                                                (0, "official-keys-img512-xs-uncond.txt")])
def test_state_dict_matches_release(label_dim, filename):
    expected = [line for line in (DATA / filename).read_text().splitlines() if line.strip()]
    net = meta_net("xs", label_dim=label_dim)
    got = [f"{name} {list(t.shape)}" for name, t in net.state_dict().items()]
    assert got == expected
    # A state dict with exactly those names and shapes loads strictly.
    state = {name: torch.zeros(t.shape) for name, t in net.state_dict().items()}
    net.to_empty(device="cpu").load_state_dict(state, strict=True)


@pytest.mark.parametrize("size", list(TABLE6_GMACS))
def test_macs_match_table6(size):
    # We count the multiply-accumulates of convolutions, linear layers and attention; Table 6 also
    # counts elementwise operations (activations, sums, normalizations), about 1% of the total.
    gmacs = count_macs(meta_net(size)) / 1e9
    assert abs(gmacs - TABLE6_GMACS[size]) / TABLE6_GMACS[size] < 0.02


def unit_rms(x: torch.Tensor) -> float:
    return x.to(torch.float64).square().mean().sqrt().item()


@pytest.mark.parametrize("flavor,mode,cin,cout", [
    ("enc", "keep", 64, 64), ("enc", "down", 64, 64), ("enc", "keep", 32, 64),
    ("dec", "keep", 128, 64), ("dec", "up", 64, 64),
])
def test_fresh_block_preserves_magnitude(flavor, mode, cin, cout):
    # With unit-normal inputs the expected output magnitude is 1 for every layer; what remains is the
    # sampling error of the random weights, which averages over 64 output channels to a few percent.
    # Attention is left out: at initialization its softmax is nearly uniform, so it averages the value
    # vectors of all tokens and shrinks its branch by design (the paper's analysis assumes
    # uncorrelated inputs, which averaging breaks); test_attention_* covers it.
    torch.manual_seed(0)
    block = Block(cin, cout, 256, flavor, mode)
    x = torch.randn(8, cin, 16, 16)
    emb = torch.randn(8, 256)
    with torch.no_grad():
        y = block(x, emb)
    assert abs(unit_rms(y) - 1) < 0.06


def test_init_output_is_skip_connection_exactly():
    torch.manual_seed(0)
    net = tiny_net()
    x = torch.randn(4, 3, 8, 8)
    sigma = torch.tensor([0.002, 0.5, 3.0, 80.0])
    with torch.no_grad():
        d = net(x, sigma, torch.eye(10)[:4])
    c_skip = 0.25 / (sigma**2 + 0.25)
    assert torch.equal(d, c_skip.reshape(-1, 1, 1, 1) * x)


def test_forced_weight_normalization_and_tangent_gradient():
    torch.manual_seed(0)
    net = tiny_net()
    with torch.no_grad():
        for p in net.parameters():
            if p.ndim > 1:
                p.mul_(3.7)  # far from the constraint, so only Eq. 66 can restore it
        net.unet.out_gain.fill_(1.0)
        for name, p in net.named_parameters():
            if name.endswith("emb_gain"):
                p.fill_(0.5)
    net.train()
    force_weight_normalization(net)  # as the training step does before every forward pass
    d, logvar = net(torch.randn(4, 3, 8, 8), torch.rand(4) + 0.1, torch.eye(10)[:4], return_logvar=True)
    (d.square().sum() + logvar.sum()).backward()
    weights = [(n, p) for n, p in net.named_parameters() if n.endswith(".weight")]
    assert len(weights) > 10
    for name, w in weights:
        rows = w.detach().flatten(1).to(torch.float64)
        fan_in = rows.shape[1]
        # After Eq. 66 every row has norm sqrt(fan_in); Algorithm 1's eps leaves a 1e-4 relative gap.
        torch.testing.assert_close(rows.norm(dim=1), torch.full_like(rows[:, 0], math.sqrt(fan_in)),
                                   rtol=2e-4, atol=0, msg=name)
        grad = w.grad.flatten(1).to(torch.float64)
        cos = (grad * rows).sum(1) / (grad.norm(dim=1) * rows.norm(dim=1) + 1e-30)
        # Eq. 59: the gradient is tangent to the weight. float32 round-off leaves |cos| ~ 1e-5; an
        # unprojected gradient would have |cos| of order 0.1 to 1.
        assert cos.abs().max() < 1e-3, name


def test_a_training_mode_forward_and_backward_never_write_the_weights():
    torch.manual_seed(0)
    net = tiny_net().train()
    with torch.no_grad():
        for p in net.parameters():
            p.mul_(3.7)  # far from the constraint: a forced normalization inside the forward would change them
    before = [p.detach().clone() for p in net.parameters()]
    d, logvar = net(torch.randn(4, 3, 8, 8), torch.rand(4) + 0.1, torch.eye(10)[:4], return_logvar=True)
    (d.square().sum() + logvar.sum()).backward()
    assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before))


def test_eval_mode_does_not_touch_weights():
    torch.manual_seed(0)
    net = tiny_net().eval()
    before = {n: p.clone() for n, p in net.named_parameters()}
    with torch.no_grad():
        for p in net.parameters():
            p.mul_(2)
        net(torch.randn(2, 3, 8, 8), torch.ones(2), torch.eye(10)[:2])
    for n, p in net.named_parameters():
        torch.testing.assert_close(p, before[n] * 2)


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last], ids=["contiguous", "channels-last"])
@pytest.mark.parametrize("route", ATTENTION_ROUTES)
def test_attention_equals_explicit_softmax_form(monkeypatch, route, layout):
    take_attention_route(monkeypatch, route)
    torch.manual_seed(0)
    block = Block(64, 64, 32, "enc", attention=True, channels_per_head=16).to(memory_format=layout)
    x = torch.randn(3, 64, 6, 6).contiguous(memory_format=layout)
    with torch.no_grad():
        got = block._attention(x)
        # Eq. 10-12 per head, with q, k, v pixel-normalized (Eq. 30-32), in float64.
        qkv = block.attn_qkv(x).to(torch.float64).reshape(3, 4, 16, 3, 36)
        heads = []
        for h in range(4):
            q, k, v = (qkv[:, h, :, i, :] for i in range(3))
            q, k, v = (t / (t.square().mean(1, keepdim=True).sqrt() + 1e-4) for t in (q, k, v))
            w = torch.einsum("nci,ncj->nij", q, k) / math.sqrt(16)
            heads.append(torch.einsum("nij,ncj->nci", w.softmax(dim=2), v))
        a = torch.stack(heads, dim=1).reshape(3, 64, 6, 6).to(torch.float32)
        want = block.attn_proj(a)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_logvar_head_and_unconditional_net():
    torch.manual_seed(0)
    net = tiny_net(label_dim=0)
    with torch.no_grad():
        d, logvar = net(torch.randn(5, 3, 8, 8), torch.linspace(0.1, 10, 5), return_logvar=True)
    assert d.shape == (5, 3, 8, 8) and logvar.shape == (5, 1, 1, 1)
    # u(sigma) is an MP linear layer on Fourier features of c_noise = ln(sigma) / 4.
    c_noise = torch.linspace(0.1, 10, 5).log() / 4
    feats = net.logvar_fourier(c_noise)
    w = normalize(net.logvar_linear.weight) / math.sqrt(128)
    torch.testing.assert_close(logvar.flatten(), (feats @ w.t()).flatten())


def test_compute_dtype_per_device():
    net = tiny_net()
    assert net.compute_dtype(torch.device("cpu")) == torch.float32
    assert net.compute_dtype(torch.device("cuda")) == torch.float16
    assert net.compute_dtype(torch.device("cuda"), force_fp32=True) == torch.float32
    assert tiny_net(use_bf16=True).compute_dtype(torch.device("cuda")) == torch.bfloat16
    assert tiny_net(use_fp16=False).compute_dtype(torch.device("cuda")) == torch.float32
    # A float64 copy is a reference computation: float64 on CUDA too, whatever its 16-bit flags (the GPU check's
    # float64 reference once ran in float16 there).
    for flags in (dict(use_fp16=True), dict(use_bf16=True)):
        net = tiny_net(**flags).double()
        assert net.compute_dtype(torch.device("cuda")) == net.compute_dtype(torch.device("cpu")) == torch.float64


def test_unknown_block_flavor_is_an_architecture_error():
    with pytest.raises(ArchitectureError, match="sideways"):
        Block(16, 16, 16, "sideways")


BAD_ARGUMENTS = {
    "model_channels=1e6": (dict(model_channels=1e6), "model_channels=1000000.0: expected an integer from 1 to 4096"),
    "model_channels=-4": (dict(model_channels=-4), "model_channels=-4: expected an integer from 1 to 4096"),
    "img_resolution=0": (dict(img_resolution=0), "img_resolution=0: expected an integer from 1 to 8192"),
    "channels_per_head=0": (dict(channels_per_head=0), "channels_per_head=0: expected an integer from 1 to 4096"),
    "no levels": (dict(channel_mult=[]), "channel_mult=[]: expected a list of 1 to 16 integers"),
    "a level of 0": (dict(channel_mult=[1, 0]), "channel_mult[1]=0: expected an integer from 1 to 64"),
    "num_blocks=True": (dict(num_blocks=True), "num_blocks=True: expected an integer from 1 to 64"),
    "400-digit label_dim": (dict(label_dim=10**400), "label_dim=<a 1329-bit integer>: expected an integer from 0 to"),
    "dropout=1.5": (dict(dropout=1.5), "dropout=1.5: expected a number in [0, 1]"),
    "sigma_data=0": (dict(sigma_data=0), "sigma_data=0: expected a number in (0, 1000.0]"),
    "sigma_data=nan": (dict(sigma_data=float("nan")), "sigma_data=nan: expected a number in (0, 1000.0]"),
    "use_fp16='yes'": (dict(use_fp16="yes"), "use_fp16='yes': expected True or False"),
    "unknown argument": (dict(mystery=1), "unknown network argument 'mystery'"),
    "resolution of 2 levels": (dict(img_resolution=9), "img_resolution=9 does not divide by 2^1, as the 2 levels"),
    # 16 x 5 = 80 channels at the 4x4 level, heads of 25: 80 // 25 = 3 heads, and 3 does not divide 80.
    "uneven heads": (dict(model_channels=16, channel_mult=[1, 5], channels_per_head=25),
                     "attention at 4x4 splits 80 channels into 3 heads of channels_per_head=25"),
}


@pytest.mark.parametrize("case", BAD_ARGUMENTS)
def test_bad_constructor_arguments_are_refused_before_anything_is_built(case, monkeypatch):
    def built(*args, **kwargs):
        raise AssertionError("a layer was built before the arguments were checked")

    monkeypatch.setattr(networks, "MPConv", built)
    monkeypatch.setattr(networks, "MPFourier", built)
    overrides, message = BAD_ARGUMENTS[case]
    with pytest.raises(ArchitectureError, match=re.escape(message)):
        tiny_precond(**overrides)


def test_arguments_at_their_bounds_build():
    with torch.device("meta"):
        # 96x96 with four levels (96, 48, 24, 12) and attention at two of them, as the README's own data does.
        net = Precond(96, 1, 0, model_channels=4096, channel_mult=[1, 2, 3, 4], attn_resolutions=[24, 12],
                      channels_per_head=4096, sigma_data=1000.0, dropout=1.0)
    assert net.unet.enc["12x12_block2"].num_heads == 4 and net.unet.enc["96x96_block0"].num_heads == 0
    assert tiny_precond(label_dim=0, channel_mult=[1], attn_resolutions=[], channels_per_head=1).init_kwargs["label_dim"] == 0


# Figure 21's layout for 8x8 RGB data, two levels of 16 and 32 channels, one block each, attention at 4x4, written
# out by hand: (side, name, in, out, resampling, attention); the decoder's blocks take the encoder's outputs as skips,
# last first (32, 16, then 16, 16).
TWO_LEVELS = [
    ("enc", "8x8_conv", 4, 16, "keep", False), ("enc", "8x8_block0", 16, 16, "keep", False),
    ("enc", "4x4_down", 16, 16, "down", False), ("enc", "4x4_block0", 16, 32, "keep", True),
    ("dec", "4x4_in0", 32, 32, "keep", True), ("dec", "4x4_in1", 32, 32, "keep", False),
    ("dec", "4x4_block0", 64, 32, "keep", True), ("dec", "4x4_block1", 48, 32, "keep", True),
    ("dec", "8x8_up", 32, 32, "up", False), ("dec", "8x8_block0", 48, 16, "keep", False),
    ("dec", "8x8_block1", 32, 16, "keep", False)]


def test_the_unet_layout_is_figure_21s_and_every_u_net_is_built_from_it():
    layout = list(unet_layout(8, 4, [16, 32], num_blocks=1, attn_resolutions=[4]))
    assert [(s.side, s.name, s.in_channels, s.out_channels, s.resample_mode, s.attention) for s in layout] == TWO_LEVELS
    assert [s.conv for s in layout] == [True] + [False] * 10
    arch = dict(model_channels=16, channel_mult=[1, 2], num_blocks=1, attn_resolutions=[4], channels_per_head=16)
    for family in ("edm2", "config-b", "config-e", "config-f"):
        unet = tiny_precond(label_dim=0, family=family, **arch).network
        built = [(side, name, m.weight.shape[1] if name.endswith("_conv") else m.in_channels, m.out_channels)
                 for side in ("enc", "dec") for name, m in getattr(unet, side).items()]
        want = [(side, name, cin, cout) for side, name, cin, cout, _, _ in TWO_LEVELS]
        if family == "config-b":  # ADM's input has no constant channel
            want[0] = ("enc", "8x8_conv", 3, 16)
        assert built == want, family
        blocks = [m for side in ("enc", "dec") for name, m in getattr(unet, side).items() if not name.endswith("_conv")]
        assert [(b.resample_mode, b.num_heads) for b in blocks] == [(r, 2 * a) for *_, r, a in TWO_LEVELS[1:]], family
