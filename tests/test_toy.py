"""The toy example: ground truth against float64 brute force, the denoiser, the ODE against its closed form,
training, snapshots (ours and the release's pickles), and toy_example.py end to end with bad input."""

import json
import math
import os
import pickle
import re

import numpy as np
import PIL.Image
import pytest
import torch
from click.testing import CliRunner

import toy_example
from edm2.formats import snapshot
from edm2.formats.release_pickle import ReleasePickleError
from edm2.layers import ArchitectureError
from edm2.runtime.locks import FOLDER_LOCK, hold_destination
from edm2.toy import gmm as toy_gmm
from edm2.toy.model import ToyDenoiser, sample_trajectories
from edm2.toy.snapshot import load_toy, save_toy
from tests.helpers import (assert_one_error_line, assert_refused, forget_release_standins, install_release_standins,
                           randomized, run_with_memory_limit, write_raw_snapshot, write_release_toy_pickle)
from training.toy import ToyTraining, train_toy


def brute_force_logp(mixture, x, sigma):
    """float64 log sum_k phi_k N(x; mu_k, Sigma_k + sigma^2 I) from the covariance matrices, for each point."""
    q, lam = mixture.eigenvectors.double(), mixture.eigenvalues.double()
    cov = q @ torch.diag_embed(lam) @ q.transpose(1, 2) + sigma**2 * torch.eye(2, dtype=torch.float64)
    diff = x.double()[:, None, :] - mixture.mu.double()  # [n, K, 2]
    quad = torch.einsum("nki,kij,nkj->nk", diff, torch.linalg.inv(cov), diff)
    log_n = -math.log(2 * math.pi) - 0.5 * torch.logdet(cov) - 0.5 * quad
    return (mixture.phi.double().log() + log_n).logsumexp(-1)


def test_ground_truth_is_the_fractal_of_two_classes():
    a, b, ab = (toy_gmm.ground_truth(c) for c in ("A", "B", "AB"))
    # 7 levels of binary branching: 127 branches of 8 components per class.
    assert len(a.phi) == len(b.phi) == 127 * 8 and len(ab.phi) == 2 * 127 * 8
    assert torch.allclose(ab.phi.sum(), torch.tensor(1.0))
    mean_a, mean_b = (a.phi @ a.mu), (b.phi @ b.mu)
    assert (mean_a > 0.2).all() and (mean_b < -0.2).all()  # A grows to the upper right, B to the lower left
    # Deterministic: the same tree every time.
    assert torch.equal(toy_gmm.ground_truth("A").mu, a.mu)
    with pytest.raises(toy_gmm.ToyError, match="'C'"):
        toy_gmm.ground_truth("C")


@pytest.mark.parametrize("sigma", [0.0, 0.03, 0.5])
def test_density_and_score_match_float64_brute_force(sigma):
    mixture = toy_gmm.ground_truth("AB")
    x = torch.cat([mixture.sample(200, sigma, torch.Generator().manual_seed(0)), torch.rand(50, 2) * 3 - 1.5])
    expected = brute_force_logp(mixture, x, sigma)
    # float32 parameters: relative 1e-5 of the largest terms (|log p| reaches thousands far from the tree).
    torch.testing.assert_close(mixture.logp(x, sigma).double(), expected, rtol=1e-5, atol=2e-3)
    xd = x.double().requires_grad_(True)
    expected_score = torch.autograd.grad(brute_force_logp(mixture, xd, sigma).sum(), xd)[0]
    near = expected.exp() > 1e-3  # where the density is not negligible; far away both are huge and float32-noisy
    got = mixture.score(x, torch.full([len(x)], sigma)).double()
    torch.testing.assert_close(got[near], expected_score[near], rtol=2e-3, atol=2e-3 * expected_score[near].abs().max())


def test_samples_have_the_mixture_moments():
    mixture, sigma, n = toy_gmm.ground_truth("A"), 0.2, 200_000
    x = mixture.sample(n, sigma, torch.Generator().manual_seed(1)).double()
    phi, mu = mixture.phi.double(), mixture.mu.double()
    q, lam = mixture.eigenvectors.double(), mixture.eigenvalues.double()
    mean = phi @ mu
    second = torch.einsum("k,kij->ij", phi, q @ torch.diag_embed(lam + sigma**2) @ q.transpose(1, 2)
                          + mu[:, :, None] * mu[:, None, :])
    cov = second - mean[:, None] * mean[None, :]
    # Five standard errors of a mean of n draws, sqrt(var / n).
    assert ((x.mean(0) - mean).abs() < 5 * (cov.diagonal() / n).sqrt()).all()
    torch.testing.assert_close(torch.cov(x.T), cov, rtol=0.02, atol=0.0)


def test_denoiser_has_the_release_layout_and_starts_as_the_gaussian_prior():
    net = ToyDenoiser(num_layers=3, hidden_dim=16)
    assert {k: tuple(v.shape) for k, v in net.state_dict().items()} == {
        "layers.0.weight": (16, 4), "layers.2.weight": (16, 16), "layers.4.weight": (16, 16),
        "layers.6.weight": (16, 16), "gain": ()}
    # With gain 0 the model is N(0, sigma_data^2 + sigma^2): log p = -|x|^2 / 2(sd^2 + s^2), score -x / (sd^2 + s^2).
    x, sigma = torch.randn(5, 2), torch.tensor([0.01, 0.1, 0.5, 1.0, 3.0])
    var = 0.25 + sigma**2
    torch.testing.assert_close(net.logp(x, sigma), -0.5 * x.square().sum(-1) / var)
    torch.testing.assert_close(net.score(x, sigma), -x / var[:, None])


class GaussianScore:
    """The exact score of N(0, s^2 I) diffused to sigma."""

    def __init__(self, s):
        self.s = s

    def score(self, x, sigma):
        return -x / (self.s**2 + sigma[..., None] ** 2)


def test_trajectories_follow_the_closed_form_ode():
    # For N(0, s^2) the probability-flow ODE moves x along x(sigma) = x0 sqrt(s^2 + sigma^2) / sqrt(s^2 + sigma0^2).
    s, sigma_max = 0.5, 5.0
    x0 = torch.randn(64, 2, dtype=torch.float64)
    expected = x0 * s / math.sqrt(s**2 + sigma_max**2)

    def error(num_steps):
        paths = sample_trajectories(GaussianScore(s), x0, sigma_max, num_steps=num_steps)
        # The shared sampler starts from noise * sigma_max, here (x0 / sigma_max) * sigma_max: two roundings.
        assert paths.shape == (num_steps + 1, 64, 2)
        torch.testing.assert_close(paths[0], x0, rtol=2 * torch.finfo(x0.dtype).eps, atol=0)
        return ((paths[-1] - expected).abs().max() / expected.abs().max()).item()

    # Heun's method is second order: doubling the steps divides the error by about 4 (an Euler step or a wrong
    # slope would make it first order, a ratio near 2).
    assert error(32) < 0.01
    assert 3.5 < error(32) / error(64) < 5


class BlendedScore:
    """The score gnet + w (net - gnet) that guidance by weight w gives (Eq. 152, a denoiser being x + sigma^2 score)."""

    def __init__(self, net, gnet, w):
        self.net, self.gnet, self.w = net, gnet, w

    def score(self, x, sigma):
        return self.gnet.score(x, sigma) + self.w * (self.net.score(x, sigma) - self.gnet.score(x, sigma))


def test_guided_trajectories_follow_the_blended_score():
    net, gnet, x0 = GaussianScore(0.5), GaussianScore(0.2), torch.randn(64, 2, dtype=torch.float64)
    assert torch.equal(sample_trajectories(net, x0, 5.0, gnet, 1.0), sample_trajectories(net, x0, 5.0))
    guided = sample_trajectories(net, x0, 5.0, gnet, 3.0)
    # The sampler blends the denoisers, the reference the scores: each of the 63 evaluations rounds the two ways
    # apart by a few (under 8) roundings of |x|, and the ODE is linear for Gaussians, so a step carries an earlier
    # error as it carries x, the same fraction of the path's size.
    torch.testing.assert_close(guided, sample_trajectories(BlendedScore(net, gnet, 3.0), x0, 5.0), rtol=0,
                               atol=63 * 8 * torch.finfo(torch.float64).eps * guided.abs().max().item())
    assert (guided[-1] - sample_trajectories(net, x0, 5.0)[-1]).abs().max() > 0.01  # and guidance does act


def test_training_fits_the_ground_truth_score():
    opts = ToyTraining(num_layers=2, hidden_dim=32, iterations=48, batch_size=512, snapshot_iter=16)
    snapshots = []
    ema = train_toy(opts, torch.device("cpu"), lambda i, net: snapshots.append((i, net.gain.item())))
    assert [i for i, _ in snapshots] == [16, 32, 48]
    target, g = toy_gmm.ground_truth("A"), torch.Generator().manual_seed(5)
    sigma = torch.full([2048], 0.3)
    x = target.sample(2048, sigma, g)

    def error(model):
        return (model.score(x, sigma) - target.score(x, sigma)).square().sum(-1).mean().item()

    assert error(ema) < 0.7 * error(ToyDenoiser(num_layers=2, hidden_dim=32))


def test_snapshot_round_trip_and_refusals(tmp_path):
    net = randomized(ToyDenoiser(num_layers=2, hidden_dim=8)).eval()
    save_toy(tmp_path / "toy.safetensors", net, {"iteration": 7})
    loaded, metadata = load_toy(tmp_path / "toy.safetensors")
    x, sigma = torch.randn(6, 2), torch.rand(6) + 0.1
    assert torch.equal(loaded(x, sigma), net(x, sigma)) and metadata["iteration"] == 7
    # Neither kind of file passes for the other.
    with pytest.raises(snapshot.SnapshotError, match="not a toy-example snapshot"):
        load_toy(write_raw_snapshot(tmp_path / "edm2.safetensors", json.dumps({"format_version": 1})))
    with pytest.raises(snapshot.SnapshotError, match="no 'edm2' metadata"):
        snapshot.load_network(tmp_path / "toy.safetensors")


def test_release_toy_pickle_loads_without_running_its_code(tmp_path, release_standins):
    persistence, _ = release_standins
    net = randomized(ToyDenoiser(num_layers=4, hidden_dim=32, sigma_data=0.5)).eval()
    write_release_toy_pickle(tmp_path / "iter0512.pkl", net, persistence)
    forget_release_standins()
    loaded, metadata = load_toy(tmp_path / "iter0512.pkl")
    assert not (tmp_path / "ran").exists() and metadata["source"] == "release-pickle"
    assert loaded.init_kwargs == net.init_kwargs and not loaded.training
    x, sigma = torch.randn(6, 2), torch.rand(6) + 0.1
    assert torch.equal(loaded(x, sigma), net(x, sigma))


@pytest.mark.parametrize("arguments, message", [
    (dict(hidden_dim=-3), "hidden_dim=-3: expected an integer from 1 to 4096"),
    (dict(num_layers=0), "num_layers=0: expected an integer from 1 to 64"),
    (dict(in_dim=2.0), "in_dim=2.0: expected an integer from 1 to 4096"),
    (dict(sigma_data=float("inf")), "sigma_data=inf: expected a number in (0, 1000.0]"),
])
def test_bad_toy_arguments_are_refused(arguments, message):
    with pytest.raises(ArchitectureError, match=re.escape(message)):
        ToyDenoiser(**arguments)


@pytest.mark.bad_input
def test_a_snapshot_declaring_a_larger_network_than_it_holds_allocates_nothing_for_it(tmp_path):
    # 64 layers of 4096 x 4096 float32 weights would take 4 GiB; the file holds one layer of 4 x 4. Plotted with the
    # address space limited to what importing torch mapped plus 1 GiB, it is refused by its weights.
    net = ToyDenoiser(num_layers=1, hidden_dim=4)
    net.init_kwargs.update(num_layers=64, hidden_dim=4096)
    save_toy(tmp_path / "toy.safetensors", net, {})
    result = run_with_memory_limit(1 << 30, "toy_example.py", "plot", "--net", tmp_path / "toy.safetensors",
                                   "--gnet", tmp_path / "toy.safetensors", "--save", tmp_path / "fig.png")
    assert_one_error_line(result, "--net", "weights do not match the stored architecture")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["toy.safetensors"]


def test_release_edm2_pickle_is_not_a_toy_model(tmp_path, release_standins):
    persistence, _ = release_standins
    (tmp_path / "edm2.pkl").write_bytes(pickle.dumps(persistence.Persistent("Precond", {})))
    forget_release_standins()
    with pytest.raises(ReleasePickleError, match="expected ToyModel, found Precond"):
        load_toy(tmp_path / "edm2.pkl")


# ---------------------------------------------------------------------------------------------------
# toy_example.py, with the figure's grids and sample counts shrunk so that a test draws it in a second (the
# small_views fixture of tests/conftest.py).

def run(*args):
    return CliRunner().invoke(toy_example.main, [str(a) for a in args])


def test_train_then_plot(tmp_path, small_views):
    result = run("train", "--outdir", tmp_path / "main", "--dim", 16, "--layers", 2, "--iters", 2)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "main").iterdir()) == ["iter0002.safetensors", "progress.png"]
    meta = load_toy(tmp_path / "main" / "iter0002.safetensors")[1]
    assert meta["iteration"] == 2 and meta["training"]["hidden_dim"] == 16 and meta["training"]["classes"] == "A"
    result = run("train", "--outdir", tmp_path / "guide", "--dim", 8, "--layers", 2, "--iters", 1, "--viz", "false",
                 "--cls", "AB")
    assert result.exit_code == 0, result.output
    assert [p.name for p in (tmp_path / "guide").iterdir()] == ["iter0001.safetensors"]
    result = run("plot", "--net", tmp_path / "main" / "iter0002.safetensors", "--gnet",
                 tmp_path / "guide" / "iter0001.safetensors", "--guidance", 2.5, "--save", tmp_path / "fig.png")
    assert result.exit_code == 0, result.output
    with PIL.Image.open(tmp_path / "fig.png") as image:
        assert image.format == "PNG" and image.size == (1920, 1000)


@pytest.mark.bad_input
def test_a_second_training_into_an_outdir_in_use_is_refused(tmp_path):
    # Two trainings into one --outdir replaced each other's snapshots; the second is refused before it starts.
    with hold_destination(tmp_path / "out", "toy_example.py train", FOLDER_LOCK):  # a training before its first snapshot
        assert_refused(tmp_path, lambda: run("train", "--outdir", tmp_path / "out", "--iters", 1, "--viz", "false"),
                       f"{tmp_path / 'out'} is in use by the toy_example.py train process {os.getpid()} on host")


def test_help_shows_the_options_and_a_quick_cpu_example():
    result = run("--help")
    assert result.exit_code == 0 and "--iters=512" in result.output
    result = run("plot", "--help")
    assert "--guidance" in result.output and "None" not in result.output


def bad(tmp_path, kind):
    """Files for the bad-input cases."""
    if kind == "file":
        (tmp_path / "f").write_text("x")
        return tmp_path / "f"
    if kind == "toy":
        save_toy(tmp_path / "toy.safetensors", ToyDenoiser(num_layers=1, hidden_dim=4), {})
        return tmp_path / "toy.safetensors"
    if kind.startswith("hidden_dim="):  # a release toy pickle declaring this hidden_dim, holding 4 x 4 weights
        persistence, _ = install_release_standins(tmp_path)
        net = ToyDenoiser(num_layers=1, hidden_dim=4)
        net.init_kwargs["hidden_dim"] = int(kind.removeprefix("hidden_dim="))
        write_release_toy_pickle(tmp_path / "toy.pkl", net, persistence)
        forget_release_standins()
        return tmp_path / "toy.pkl"
    if kind == "used":
        (tmp_path / "used").mkdir()
        (tmp_path / "used" / "iter0256.safetensors").write_text("x")
        return tmp_path / "used"
    return write_raw_snapshot(tmp_path / "edm2.safetensors", json.dumps({"format_version": 1}))


BAD_INPUT = {
    "train cls": (lambda t: ["train", "--outdir", t / "o", "--cls", "C"], ["--cls", "'C'"]),
    "train layers": (lambda t: ["train", "--outdir", t / "o", "--layers", 0], ["--layers"]),
    "train dim": (lambda t: ["train", "--outdir", t / "o", "--dim", -1], ["--dim"]),
    "train iters": (lambda t: ["train", "--outdir", t / "o", "--iters", 0], ["--iters"]),
    "train viz": (lambda t: ["train", "--outdir", t / "o", "--viz", "maybe"], ["--viz"]),
    "train no outdir": (lambda t: ["train"], ["--outdir"]),
    "train outdir is a file": (lambda t: ["train", "--outdir", bad(t, "file")], ["is a file"]),
    "train outdir has snapshots": (lambda t: ["train", "--outdir", bad(t, "used")], ["--outdir", "iter0256"]),
    "plot net missing": (lambda t: ["plot", "--net", t / "none.safetensors", "--gnet", t / "g"], ["--net", "no such"]),
    "plot net edm2": (lambda t: ["plot", "--net", bad(t, "edm2"), "--gnet", t / "g"], ["--net", "not a toy"]),
    "plot net toy pickle hidden_dim=-3": (lambda t: ["plot", "--net", bad(t, "hidden_dim=-3"), "--gnet", t / "g"],
                                          ["--net", "hidden_dim=-3: expected an integer from 1 to 4096"]),
    "plot net toy pickle larger than its weights": (
        lambda t: ["plot", "--net", bad(t, "hidden_dim=4096"), "--gnet", t / "g"],
        ["--net", "'layers.0.weight' is [4, 4] in the file, [4096, 4] in the ToyDenoiser"]),
    "plot gnet garbage": (lambda t: ["plot", "--net", bad(t, "toy"), "--gnet", bad(t, "file")], ["--gnet"]),
    "plot guidance": (lambda t: ["plot", "--guidance", "nan", "--save", t / "x.png"], ["--guidance"]),
    "plot guidance 1e308": (lambda t: ["plot", "--guidance", "1e308", "--save", t / "x.png"],
                            ["--guidance", "1e+308: must lie within"]),
    "plot save suffix": (lambda t: ["plot", "--save", t / "x.jpg"], ["--save", ".png"]),
    "plot save under a file": (lambda t: ["plot", "--save", bad(t, "file") / "x.png"], ["is a file"]),
}


@pytest.mark.bad_input
@pytest.mark.parametrize("arguments, fragments", BAD_INPUT.values(), ids=BAD_INPUT.keys())
def test_bad_input_gives_one_line(tmp_path, monkeypatch, arguments, fragments):
    monkeypatch.setenv("EDM2_CACHE_DIR", str(tmp_path / "cache"))
    args = arguments(tmp_path)
    assert_refused(tmp_path, lambda: run(*args), *fragments)


def test_autoguidance_concentrates_samples_in_the_class():
    # Guidance by a worse model of the same class concentrates samples where the class's density is high
    # (autoguidance paper, Figure 1): with the exact score of class A as the main model and a blurrier
    # version of it as the guide, guided samples land closer to the class than unguided ones.
    target = toy_gmm.ground_truth("A")

    class Blurred:
        def score(self, x, sigma):
            return target.score(x, (sigma**2 + 0.1**2).sqrt())

    start = target.sample(128, 5.0, torch.Generator().manual_seed(3))
    plain = sample_trajectories(target, start, 5.0, num_steps=16)[-1]
    guided = sample_trajectories(target, start, 5.0, Blurred(), 2.0, num_steps=16)[-1]
    assert target.logp(guided).median() > target.logp(plain).median()
    assert np.isfinite(target.logp(guided).numpy()).all()
