"""The toy example's consistency model: its sampler against the formulas, the score against a closed form, the
distillation end to end and its gain over the initialization, and toy_example.py distill / score with bad input."""

import dataclasses
import json
import math
import re

import numpy as np
import pytest
import safetensors.torch
import torch
from click.testing import CliRunner

import toy_example
from edm2.toy import gmm as toy_gmm
from edm2.toy.consistency import ToyFlow, consistency_sample, sampling_times
from edm2.toy.model import ToyDenoiser
from edm2.toy.scoring import mean_loglik, toy_samples
from edm2.toy.snapshot import load_toy, save_toy
from tests.helpers import assert_refused, randomized
from training.toy_consistency import ToyDistillation, train_toy_consistency

SIGMA_D = 0.5


def by_hand(net, x_t, t):
    """f(x_t, t) = cos t x_t - sin t sigma_d F(x_t / sigma_d, t), in float64."""
    return math.cos(t) * x_t - math.sin(t) * SIGMA_D * net(x_t / SIGMA_D, torch.full(x_t.shape[:1], t,
                                                                                      dtype=torch.float64))


@pytest.mark.parametrize("num_steps", [1, 2, 3])
def test_sampler_equals_its_formula(num_steps):
    net = randomized(ToyFlow(num_layers=2, hidden_dim=16)).double().eval()
    net.gain.data.fill_(0.7)
    noise = torch.randn(num_steps, 64, 2, dtype=torch.float64)
    t_max = math.atan(80 / SIGMA_D)
    # Three steps: t_max, then levels 0 and 1 of EDM Eq. 5's three levels sigma_d tan(1.1) ... 0.002 (rho 7), mapped
    # by arctan.
    top = SIGMA_D * math.tan(1.1)
    level_1 = (top ** (1 / 7) + 0.5 * (0.002 ** (1 / 7) - top ** (1 / 7))) ** 7
    times = {1: [t_max], 2: [t_max, 1.1], 3: [t_max, 1.1, math.atan(level_1 / SIGMA_D)]}[num_steps]
    assert sampling_times(num_steps, SIGMA_D) == pytest.approx(times, rel=1e-15)
    x0 = by_hand(net, SIGMA_D * noise[0], times[0])
    for t, z in zip(times[1:], noise[1:]):
        x0 = by_hand(net, math.cos(t) * x0 + math.sin(t) * SIGMA_D * z, t)
    torch.testing.assert_close(consistency_sample(net, noise), x0, rtol=1e-12, atol=1e-12)


def test_score_equals_the_closed_form_for_a_gaussian():
    # F = 0 makes f(x, t) = cos t x: two steps give N(0, s^2 I) with s^2 = cos^2(1.1) sigma_d^2 (cos^2(1.1)
    # cos^2(t_max) + sin^2(1.1)); under the truth N(0, v I) its expected log-likelihood is -ln(2 pi v) - s^2 / v.
    net = ToyFlow(num_layers=1, hidden_dim=8).eval()
    t_max, v = math.atan(80 / SIGMA_D), 0.05
    s2 = math.cos(1.1) ** 2 * SIGMA_D**2 * (math.cos(1.1) ** 2 * math.cos(t_max) ** 2 + math.sin(1.1) ** 2)
    truth = toy_gmm.GaussianMixture(np.ones(1), np.zeros([1, 2]), v * np.eye(2)[None])
    got = mean_loglik(truth, toy_samples(net, 2))
    # |x|^2 / s^2 is chi-square with 2 degrees of freedom (variance 4), so one log-likelihood has standard deviation
    # s^2 / v: five standard errors of a mean of 4096.
    assert abs(got - (-math.log(2 * math.pi * v) - s2 / v)) < 5 * (s2 / v) / math.sqrt(4096)
    assert toy_samples(net, 2).equal(toy_samples(net, 2))  # a fixed seed


def four_points(std=0.05):
    """Four round Gaussians at (+-0.5, +-0.5): data of standard deviation near sigma_d, cheap to score exactly."""
    mu = np.array([[0.5, 0.5], [-0.5, 0.5], [0.5, -0.5], [-0.5, -0.5]])
    return toy_gmm.GaussianMixture(np.ones(4), mu, std**2 * np.eye(2)[None].repeat(4, 0))


class ExactTeacher(torch.nn.Module):
    """A mixture's exact score as the teacher: a distillation test that no teacher's error can blur."""

    sigma_data = SIGMA_D

    def __init__(self, truth):
        super().__init__()
        self.truth = truth

    def score(self, x, sigma):
        return self.truth.score(x, sigma)


@pytest.mark.parametrize("method", ["scd", "sct"])
def test_a_short_distillation_improves_two_step_samples_over_its_initialization(method):
    opts = ToyDistillation(method=method, num_layers=2, hidden_dim=32, batch_size=256, init_iterations=32,
                           iterations=0, P_mean=-0.8, P_std=1.6)
    cpu, truth = torch.device("cpu"), four_points()
    initial = train_toy_consistency(opts, ExactTeacher(truth), truth, cpu, lambda i, n: None)
    trained = train_toy_consistency(dataclasses.replace(opts, iterations=64, warmup_iterations=16),
                                    ExactTeacher(truth), truth, cpu, lambda i, n: None)
    before, after = (mean_loglik(truth, toy_samples(net, 2)) for net in (initial, trained))
    print(method, before, after)
    assert after > before + 1.0


def run(*args):
    return CliRunner().invoke(toy_example.main, [str(a) for a in args])


@pytest.fixture
def teacher_file(tmp_path):
    """A tiny toy teacher saved as train saves one."""
    path = tmp_path / "teacher.safetensors"
    save_toy(path, randomized(ToyDenoiser(num_layers=1, hidden_dim=8)).eval(), {"training": {"classes": "A"}})
    return path


def test_distill_writes_loadable_snapshots_and_score_prints_the_lines(tmp_path, teacher_file,
                                                                    small_views):
    outdir = tmp_path / "student"
    result = run("distill", "--method", "sct", "--net", teacher_file, "--outdir", outdir, "--layers", 2, "--dim", 16,
                 "--iters", 2, "--init-iters", 1, "--warmup", 1)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in outdir.iterdir()) == ["iter0002.safetensors", "progress.png"]
    net, metadata = load_toy(outdir / "iter0002.safetensors")
    assert isinstance(net, ToyFlow) and metadata["network"] == "ToyFlow" and metadata["iteration"] == 2
    assert (net.init_kwargs["num_layers"], net.init_kwargs["hidden_dim"]) == (2, 16)
    assert metadata["consistency"] == {"method": "sct", "sigma_data": 0.5, "teacher": "teacher.safetensors",
                                       "P_mean": -2.3, "P_std": 1.5, "tangent_warmup_nimg": 4096, "c": 0.1,
                                       "prior": True}
    result = run("score", "--net", outdir / "iter0002.safetensors", "--steps", "1,2", "--plot", tmp_path / "s.png")
    assert result.exit_code == 0, result.output
    truth = toy_gmm.ground_truth("A")
    expected = [mean_loglik(truth, toy_samples(net, s)) for s in (1, 2)]
    last = result.output.splitlines()[-1]
    assert re.fullmatch(r"steps=1 loglik=\S+ steps=2 loglik=\S+", last), result.output
    assert [float(v) for v in re.findall(r"loglik=(\S+)", last)] == pytest.approx(expected, abs=1e-4)
    assert (tmp_path / "s.png").is_file()
    # A diffusion snapshot is scored by Heun's sampler.
    result = run("score", "--net", teacher_file, "--steps", "3")
    teacher = load_toy(teacher_file)[0]
    assert result.output.splitlines()[-1] == f"steps=3 loglik={mean_loglik(truth, toy_samples(teacher, 3)):.4f}"


@pytest.mark.bad_input
def test_bad_input_is_refused_in_one_line(tmp_path, teacher_file):
    student = tmp_path / "student.safetensors"
    save_toy(student, ToyFlow(num_layers=1, hidden_dim=8), {"consistency": {"method": "scd"}})
    assert_refused(tmp_path, lambda: run("score", "--net", student, "--steps", "0"), "--steps", "[1, 1024]")
    assert_refused(tmp_path, lambda: run("distill", "--method", "scd", "--net", student, "--outdir",
                                         tmp_path / "out"), "--net", "is a consistency model")
    assert_refused(tmp_path, lambda: run("score", "--net", tmp_path / "missing.safetensors"), "--net",
                   "no such file")
    assert_refused(tmp_path, lambda: run("distill", "--method", "scd", "--net", teacher_file, "--outdir",
                                         tmp_path / "out", "--dim", 0), "--dim", "1<=x<=4096")
    assert_refused(tmp_path, lambda: run("plot", "--net", student, "--gnet", teacher_file), "--net",
                   "is a consistency model")
    # Metadata that does not describe its network: an unknown kind, a consistency model without its record.
    for name, metadata in (("odd", {"network": "ToyTransformer"}), ("bare", {"network": "ToyFlow"})):
        net = ToyDenoiser(num_layers=1, hidden_dim=8)
        safetensors.torch.save_file({k: v.contiguous() for k, v in net.state_dict().items()},
                                    str(tmp_path / f"{name}.safetensors"), metadata={"edm2-toy": json.dumps(
                                        dict(metadata, format_version=1, network_kwargs=net.init_kwargs))})
    assert_refused(tmp_path, lambda: run("score", "--net", tmp_path / "odd.safetensors"), "--net",
                   "unknown toy network 'ToyTransformer'")
    assert_refused(tmp_path, lambda: run("score", "--net", tmp_path / "bare.safetensors"), "--net",
                   "a ToyFlow snapshot without consistency metadata")
