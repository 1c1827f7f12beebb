"""The network family's switches for consistency models: the time embedding, the double-norm modulation and the
guidance embedding, each recorded in a snapshot only when not the release's default, refused when unknown, and
doing what it is for."""

import math

import pytest
import torch

from edm2.consistency import t_to_sigma
from edm2.formats.snapshot import load_network, save_network
from edm2.layers import ArchitectureError, force_weight_normalization, normalize
from edm2.networks import Block
from edm2.trigflow import consistency_model
from tests.helpers import randomized, tiny_precond

LABELS = torch.eye(10)[[2, 5]]
ENCODER = {"encoder": {"class": "StandardRGBEncoder"}}


def built(seed=0, **overrides):
    """tiny_precond(**overrides) built from torch's generator seeded with seed: equal seeds, equal initial weights."""
    torch.manual_seed(seed)
    return tiny_precond(**overrides)


def test_the_switches_at_their_defaults_leave_the_network_as_it_was():
    plain, switched = built(), built(modulation="plain", guidance_embedding=False, time_embedding="edm")
    assert switched.init_kwargs == plain.init_kwargs
    assert not {"modulation", "guidance_embedding", "time_embedding"} & set(plain.init_kwargs)
    assert list(switched.state_dict()) == list(plain.state_dict())
    randomized(plain), randomized(switched)
    x = torch.randn([2, 3, 8, 8])
    with torch.no_grad():
        assert torch.equal(switched(x, torch.tensor([0.5, 3.0]), LABELS), plain(x, torch.tensor([0.5, 3.0]), LABELS))


@pytest.mark.parametrize("switch, value", [("modulation", "double-norm"), ("guidance_embedding", True),
                                           ("time_embedding", "trigflow")])
def test_a_switch_is_recorded_and_comes_back_from_a_snapshot(tmp_path, switch, value):
    net = randomized(tiny_precond(**{switch: value}))
    assert net.init_kwargs[switch] == value
    save_network(tmp_path / "net.safetensors", net, ENCODER)
    loaded, _ = load_network(tmp_path / "net.safetensors")
    assert loaded.init_kwargs == net.init_kwargs
    assert list(loaded.state_dict()) == list(net.state_dict())


@pytest.mark.parametrize("switch, value, message", [
    ("modulation", "layer-norm", "modulation='layer-norm': expected one of plain, double-norm"),
    ("guidance_embedding", 1, "guidance_embedding=1: expected True or False"),
    ("time_embedding", "fourier", "time_embedding 'fourier' is not one of edm, trigflow"),
])
def test_an_unknown_switch_value_is_refused_in_one_line(switch, value, message):
    with pytest.raises(ArchitectureError) as e:
        tiny_precond(**{switch: value})
    assert str(e.value) == message


def test_the_trigflow_time_embeddings_derivative_is_bounded_where_edms_diverges():
    # d c_noise / dt: TrigFlow's c_noise = t has derivative 1; EDM's ln(sigma_d tan t) / 4 has 1 / (4 sin t cos t).
    t = torch.tensor([1e-6, 0.5, math.pi / 2 - 1e-6], dtype=torch.float64)
    for embedding in ("edm", "trigflow"):
        net = tiny_precond(time_embedding=embedding).double()
        _, slope = torch.func.jvp(lambda s: net.noise_labels(t_to_sigma(s, net.sigma_data)), (t,), (torch.ones_like(t),))
        expected = torch.ones_like(t) if embedding == "trigflow" else 1 / (4 * torch.sin(t) * torch.cos(t))
        torch.testing.assert_close(slope, expected, rtol=1e-6, atol=0)
    # The features of c_noise = t, cos(2 pi (f t + p)) sqrt(2), change at most by 2 pi |f| sqrt(2) per unit of t.
    net = tiny_precond(time_embedding="trigflow").double()
    _, features = torch.func.jvp(lambda s: net.unet.emb_fourier(net.noise_labels(t_to_sigma(s, 0.5))), (t,),
                                 (torch.ones_like(t),))
    assert (features.abs() <= net.unet.emb_fourier.freqs.abs() * math.sqrt(2) + 1e-9).all()


def block(modulation, gain=2.0):
    """An encoder block with the given modulation, its weights random and its conditioning gain `gain`."""
    torch.manual_seed(0)
    b = Block(16, 16, 32, modulation=modulation, clip_act=None).double()
    force_weight_normalization(b)
    with torch.no_grad():
        b.emb_gain.fill_(gain)
    return b


def test_double_norm_modulation_keeps_unit_magnitude_and_bounds_the_block_for_large_embeddings():
    emb = torch.randn([4, 32], dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    double, plain = block("double-norm"), block("plain")
    for scale in (1.0, 1e3):
        c = double.conditioning(scale * emb)
        # normalize(W emb) has unit RMS over the channels: c - 1 has RMS |emb_gain| = 2, whatever the scale (to the
        # eps = 1e-4 that normalize adds to an RMS of order one).
        torch.testing.assert_close((c - 1).square().mean(1).sqrt(), torch.full([4], 2.0, dtype=torch.float64),
                                   rtol=3e-4, atol=0)
        torch.testing.assert_close(c, 1 + 2.0 * normalize(double.emb_linear(scale * emb), dim=1))
    x = torch.randn([4, 16, 4, 4], dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        small, large = double(x, emb), double(x, 1e3 * emb)
        plain_small, plain_large = plain(x, emb), plain(x, 1e3 * emb)
    # The double norm sees only the embedding's direction, to normalize's eps: c moves by 2e-4 of |emb_gain| at the
    # scale of one, the block's output by as much of its own scale...
    torch.testing.assert_close(large, small, rtol=0, atol=1e-3 * small.abs().max().item())
    # ...where the plain modulation, c = 1 + gain W emb, grows with it: so do the block's outputs.
    assert plain_large.abs().max() > 100 * plain_small.abs().max()
    assert large.abs().max() < 10 * x.abs().max()


def test_double_norm_starts_as_the_plain_modulation():
    # Both are 1 at initialization (emb_gain = 0): a double-norm student computes its plain teacher at init.
    teacher, student = built(), built(modulation="double-norm")
    student.load_state_dict(teacher.state_dict())
    x = torch.randn([2, 3, 8, 8])
    with torch.no_grad():
        assert torch.equal(student(x, torch.tensor([0.5, 3.0]), LABELS), teacher(x, torch.tensor([0.5, 3.0]), LABELS))


def test_a_guidance_student_computes_its_teacher_at_init_and_learns_to_tell_scales_apart():
    teacher = randomized(built())
    student = built(guidance_embedding=True)
    missing, unexpected = student.load_state_dict(teacher.state_dict(), strict=False)
    assert sorted(missing) == ["unet.emb_guidance.weight", "unet.emb_guidance_fourier.freqs",
                               "unet.emb_guidance_fourier.phases", "unet.guidance_gain"] and not unexpected
    x, sigma = torch.randn([2, 3, 8, 8]), torch.tensor([0.5, 3.0])
    with torch.no_grad():
        expected = teacher(x, sigma, LABELS)
        for w in (1.0, torch.tensor([1.5, 4.0])):
            assert torch.equal(student(x, sigma, LABELS, guidance=w), expected)
        student.unet.guidance_gain.fill_(1.0)  # what training moves
        one, three = student(x, sigma, LABELS, guidance=1.0), student(x, sigma, LABELS, guidance=3.0)
        assert (one - three).abs().max() > 1e-3
        # No scale given is w = 1, no guidance; the TrigFlow view passes the scale through too.
        assert torch.equal(student(x, sigma, LABELS), one)
        t = torch.atan(sigma / 0.5)
        F = consistency_model(student, LABELS, guidance=3.0)(x, t)
        assert torch.equal(F, -student.unet(x, student.noise_labels(t_to_sigma(t, 0.5)), LABELS, guidance=3.0))


def test_a_network_without_guidance_embedding_refuses_a_scale():
    net = tiny_precond()
    with pytest.raises(ArchitectureError, match="takes no guidance scale"):
        net(torch.zeros([1, 3, 8, 8]), 1.0, LABELS[:1], guidance=2.0)
