"""The loss's uncertainty u(sigma) as a choice (edm2.loss.UNCERTAINTIES): learned (Eq. 21) absorbs the weighting
lambda(sigma), off trains lambda L (Eq. 14); the choice is recorded, rebuilt from the record, refused when unknown,
and kept by a resumed run."""

import copy
import json
import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import train_edm2
from edm2 import loss as loss_module
from edm2.formats.snapshot import read_metadata
from edm2.loss import EDM2Loss, LossError, Weighting, recorded_loss
from edm2.plots.run import dashboard_figure
from training.options import OptionsError, OptionsMismatch, check_same_hyperparameters
from training.run.dashboard import snapshot_numbers
from tests.helpers import TRAIN_ARGS, assert_one_error_line, tiny_precond, toy_tiny_options

SIGMA_DATA = 0.5
# Noise levels across the training range, each shared by IMAGES images: L(sigma) is the mean error over them.
SIGMAS = (0.01, 0.05, 0.3, 1.0, 5.0, 40.0)
IMAGES = 4


def capped_min_snr(sigma: torch.Tensor, sigma_data: float) -> torch.Tensor:
    """A second weighting, typed in for this test: min(SNR, 5) / sigma_data^2 with SNR = sigma_data^2 / sigma^2."""
    return torch.clamp(sigma_data**2 / sigma**2, max=5.0) / sigma_data**2


def eq15(sigma: torch.Tensor, sigma_data: float) -> torch.Tensor:
    """Eq. 15 typed in again: lambda(sigma) = (sigma^2 + sigma_data^2) / (sigma sigma_data)^2."""
    return (sigma**2 + sigma_data**2) / (sigma * sigma_data) ** 2


class ToyDenoiser(torch.nn.Module):
    """D(x; sigma) = c_skip x + c_out conv1x1(c_in x) (EDM's preconditioning) in float64, with u(sigma) given per
    image (self.u): the denoiser is trained, u is set by the test."""

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(3)
        self.weight = torch.nn.Parameter(torch.randn([3, 3], generator=generator, dtype=torch.float64))
        self.bias = torch.nn.Parameter(torch.randn([3], generator=generator, dtype=torch.float64))
        self.u = None

    def forward(self, x, sigma, class_labels=None, return_logvar=False):
        sigma = sigma.reshape(-1, 1, 1, 1)
        c_skip = SIGMA_DATA**2 / (sigma**2 + SIGMA_DATA**2)
        c_out = sigma * SIGMA_DATA / (sigma**2 + SIGMA_DATA**2).sqrt()
        c_in = 1 / (sigma**2 + SIGMA_DATA**2).sqrt()
        f = torch.einsum("oc,nchw->nohw", self.weight, c_in * x) + self.bias.reshape(1, -1, 1, 1)
        return c_skip * x + c_out * f, self.u


def toy_batch():
    """(net, y, sigma [N,1,1,1], n): IMAGES images at each of SIGMAS, in float64."""
    generator = torch.Generator().manual_seed(0)
    y = SIGMA_DATA * torch.randn([len(SIGMAS) * IMAGES, 3, 4, 4], generator=generator, dtype=torch.float64)
    noise = torch.randn(y.shape, generator=generator, dtype=torch.float64)
    sigma = torch.tensor(SIGMAS, dtype=torch.float64).repeat_interleave(IMAGES).reshape(-1, 1, 1, 1)
    return ToyDenoiser(), y, sigma, noise


def optimal_u(net, y, sigma, noise, weight) -> torch.Tensor:
    """u(sigma) at the optimum of Eq. 21 for the denoiser as it is: ln(lambda(sigma) L(sigma)), L(sigma) the mean
    squared error of the IMAGES images at sigma, per image [N,1,1,1], in float64."""
    with torch.no_grad():
        denoised, _ = net(y + sigma * noise, sigma)
        error = (denoised - y).square().reshape(len(SIGMAS), -1).mean(1).repeat_interleave(IMAGES)
    return (weight(sigma.flatten(), SIGMA_DATA) * error).log().reshape(-1, 1, 1, 1)


def weight_gradient(net, y, sigma, noise, weighting: str, uncertainty: str, u: torch.Tensor) -> torch.Tensor:
    """The gradient of the summed per-element loss with respect to the denoiser's weights, flattened."""
    net.zero_grad(set_to_none=True)
    net.u = u
    loss = EDM2Loss(sigma_data=SIGMA_DATA, weighting=weighting, uncertainty=uncertainty)
    loss(net, y, None, sigma=sigma, noise=noise).sum().backward()
    return torch.cat([p.grad.flatten() for p in net.parameters()])


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()))


def test_the_learned_uncertainty_absorbs_the_weighting_and_off_does_not(monkeypatch):
    monkeypatch.setitem(loss_module.WEIGHTINGS, "capped-min-snr", Weighting(capped_min_snr, about="this test's"))
    net, y, sigma, noise = toy_batch()
    weightings = {"edm2": eq15, "capped-min-snr": capped_min_snr}
    # The two weightings differ in shape, not only in scale: their ratio spans orders of magnitude over SIGMAS.
    ratio = capped_min_snr(sigma.flatten(), SIGMA_DATA) / eq15(sigma.flatten(), SIGMA_DATA)
    assert float(ratio.max() / ratio.min()) > 100
    learned = [weight_gradient(net, y, sigma, noise, name, "learned", optimal_u(net, y, sigma, noise, weight))
               for name, weight in weightings.items()]
    # At u's optimum, lambda / e^u = 1 / L(sigma): both gradients are the gradient of sum over images and elements of
    # |D - y|^2 / L(sigma) (with L held fixed), whatever lambda is. In float64 each element of the two differs by the
    # rounding of lambda / exp(ln(lambda L)): a few ulps times |u| <= 30, ~1e-14 relative, so 1 - cosine is of the
    # order of that squared plus the dot product's own rounding (a sum of 12 terms, ~1e-15); 1e-12 bounds both.
    assert 1 - cosine(*learned) < 1e-12
    net.zero_grad(set_to_none=True)
    denoised, _ = net(y + sigma * noise, sigma)
    error = (denoised - y).square()
    fixed_l = error.detach().reshape(len(SIGMAS), -1).mean(1).repeat_interleave(IMAGES).reshape(-1, 1, 1, 1)
    (error / fixed_l).sum().backward()
    by_hand = torch.cat([p.grad.flatten() for p in net.parameters()])
    assert 1 - cosine(learned[0], by_hand) < 1e-12
    # Off, the gradient is that of sum lambda(sigma) |D - y|^2 (the same float64 sums in another order: 1e-12), so
    # the weighting decides it: 1 - cosine is about 1e-2 here, ten orders of magnitude above the round-off bound.
    off = [weight_gradient(net, y, sigma, noise, name, "off", torch.zeros_like(sigma)) for name in weightings]
    for gradient, weight in zip(off, weightings.values()):
        net.zero_grad(set_to_none=True)
        denoised, _ = net(y + sigma * noise, sigma)
        (weight(sigma, SIGMA_DATA) * (denoised - y).square()).sum().backward()
        torch.testing.assert_close(gradient, torch.cat([p.grad.flatten() for p in net.parameters()]), rtol=1e-12,
                                   atol=0)
    assert 1 - cosine(*off) > 1e-3


def test_off_trains_lambda_l_exactly_and_learned_is_eq21():
    net, y, sigma, noise = toy_batch()
    net.u = 0.3 * sigma.log()
    with torch.no_grad():
        denoised, _ = net(y + sigma * noise, sigma)
        off = EDM2Loss(sigma_data=SIGMA_DATA, uncertainty="off")(net, y, None, sigma=sigma, noise=noise)
        learned = EDM2Loss(sigma_data=SIGMA_DATA, uncertainty="learned")(net, y, None, sigma=sigma, noise=noise)
        default = EDM2Loss(sigma_data=SIGMA_DATA)(net, y, None, sigma=sigma, noise=noise)
    # The same float64 operations on the same numbers: lambda of Eq. 15 times the squared error, bit for bit.
    assert torch.equal(off, eq15(sigma, SIGMA_DATA) * (denoised - y).square())
    assert torch.equal(learned, default)
    # Eq. 21 in NumPy: a few float64 operations per element, each within an ulp or two; 1e-12 is thousands of ulps.
    lam, u = eq15(sigma, SIGMA_DATA).numpy(), net.u.numpy()
    np.testing.assert_allclose(learned.numpy(), lam / np.exp(u) * (denoised - y).numpy() ** 2 + u, rtol=1e-12)


def test_off_leaves_the_uncertainty_head_a_zero_gradient_and_adam_leaves_it_unchanged():
    # Zero, not None: DistributedDataParallel waits for a gradient of every parameter, and Adam moves a parameter
    # whose gradients are all zero by exactly nothing.
    torch.manual_seed(0)
    net = tiny_precond(label_dim=2, use_fp16=False)
    # The same forwards without Adam: training-mode forwards renormalize each raw weight (forced weight
    # normalization, Eq. 66), so the head of this copy is where Adam must have left the trained one's.
    untrained = copy.deepcopy(net)
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    loss_fn = EDM2Loss(uncertainty="off")
    for _ in range(2):
        y, labels = torch.randn(4, 3, 8, 8), torch.eye(2)[[0, 1, 0, 1]]
        sigma, noise = loss_fn.sample_sigma(4), torch.randn_like(y)
        loss_fn(net, y, labels, sigma=sigma, noise=noise).sum().backward()
        assert torch.count_nonzero(net.logvar_linear.weight.grad) == 0
        assert net.unet.out_gain.grad.abs() > 0
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            loss_fn(untrained, y, labels, sigma=sigma, noise=noise)
    assert torch.equal(net.logvar_linear.weight, untrained.logvar_linear.weight)
    assert not torch.equal(net.unet.out_gain, untrained.unet.out_gain)


def test_the_record_names_the_uncertainty_and_an_old_record_means_learned():
    record = EDM2Loss(P_mean=-0.8, P_std=1.6, uncertainty="off").record()
    assert record == dict(weighting="edm2", noise="log-normal", uncertainty="off", P_mean=-0.8, P_std=1.6)
    assert recorded_loss(record, 0.5).record() == record
    assert recorded_loss(dict(P_mean=-0.4, P_std=1.0), 0.5).uncertainty == "learned"
    assert recorded_loss(dict(P_mean=-0.4, P_std=1.0), 0.5).learns_u
    assert not recorded_loss(record, 0.5).learns_u


@pytest.mark.bad_input
def test_an_unknown_uncertainty_is_refused_in_one_line():
    # The command line's refusal (naming --uncertainty) and a snapshot's (naming --indir) are in
    # tests/test_extend_solver_and_loss.py, beside those of the other loss names.
    with pytest.raises(LossError, match=r"^uncertainty 'sometimes' is not registered \(known: learned, off\)$"):
        recorded_loss(dict(P_mean=-0.4, P_std=1.0, uncertainty="sometimes"), 0.5)
    with pytest.raises(LossError, match="are not all names"):
        recorded_loss(dict(P_mean=-0.4, P_std=1.0, uncertainty=1), 0.5)
    with pytest.raises(OptionsError, match="^--uncertainty='sometimes': expected one of learned, off"):
        toy_tiny_options(uncertainty="sometimes")


def test_a_run_from_before_the_uncertainty_was_an_option_learned_it():
    run = toy_tiny_options().hyperparameters()
    del run["uncertainty"]
    check_same_hyperparameters(run, toy_tiny_options().hyperparameters())
    with pytest.raises(OptionsMismatch, match="uncertainty: run has 'learned', now 'off'"):
        check_same_hyperparameters(run, toy_tiny_options(uncertainty="off").hyperparameters())


def test_a_run_without_the_uncertainty_records_it_draws_no_u_and_keeps_it_on_resume(train_data, tmp_path):
    run = tmp_path / "run"
    args = [*TRAIN_ARGS, "--workers=0", "--duration=512", "--snapshot=512", "--checkpoint=512", "--grid=0",
            f"--data={train_data}", f"--outdir={run}"]
    result = CliRunner().invoke(train_edm2.main, [*args, "--uncertainty=off"])
    assert result.exit_code == 0, result.output
    for snapshot in run.glob("network-snapshot-*.safetensors"):
        assert read_metadata(snapshot)["loss"] == dict(weighting="edm2", noise="log-normal", uncertainty="off",
                                                       P_mean=-0.8, P_std=1.6)  # toy-tiny's
    assert json.loads((run / "training_options.json").read_text())["uncertainty"] == "off"
    # The dashboard: lambda(sigma) L(sigma) per noise level, the loss of this run, and no u it never trained.
    training = json.loads((run / "plots" / "training.json").read_text())
    assert training["uncertainty"] == "off" and "weighting" not in training
    [row] = training["noise_levels"]
    assert set(row) == {"nimg", "kimg", "weighted_error"} and all(map(math.isfinite, row["weighted_error"]))
    lines = {ax.get_title(): [line.get_ydata().tolist() for line in ax.get_lines() if len(line.get_xdata())]
             for ax in dashboard_figure(training).axes}
    assert lines["training loss (λL, Eq. 14; uncertainty off)"] == [training["stats"]["loss"]]
    [levels] = [ys for title, ys in lines.items() if title.startswith("Eq. 14 per noise level")]
    assert levels == [row["weighted_error"]]
    assert not any(title.startswith(("Eq. 21", "optimum of Eq. 21")) for title in lines)
    numbers = snapshot_numbers(training["sigma"], row, dict(activations={}, weights={}))
    assert numbers and not any(tag.startswith("noise_level/u/") for tag in numbers)
    # The uncertainty is a hyperparameter: a resume with the other one is refused in one line.
    result = CliRunner().invoke(train_edm2.main, [*args, "--uncertainty=learned"])
    assert_one_error_line(result, "cannot resume with different hyperparameters",
                          "uncertainty: run has 'off', now 'learned'")
