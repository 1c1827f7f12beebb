"""EDM2Loss against paper Eq. 15/16/21."""

import numpy as np
import torch

from edm2.loss import EDM2Loss
from tests.helpers import tiny_precond


class AffineDenoiser(torch.nn.Module):
    """D(x; sigma) = a(sigma) * x and u(sigma) = b * ln(sigma): outputs known in closed form."""

    def forward(self, x, sigma, class_labels=None, return_logvar=False):
        sigma = sigma.reshape(-1, 1, 1, 1)
        assert return_logvar
        return x / (1 + sigma), 0.3 * sigma.log()


def test_loss_equals_eq21_for_given_sigma_and_noise():
    torch.manual_seed(0)
    y = torch.randn(4, 3, 5, 5, dtype=torch.float64)
    n = torch.randn_like(y)
    sigma = torch.tensor([0.01, 0.4, 2.0, 60.0], dtype=torch.float64).reshape(-1, 1, 1, 1)
    got = EDM2Loss(P_mean=-0.4, P_std=1.0, sigma_data=0.5)(AffineDenoiser(), y, None, sigma=sigma, noise=n)

    # Independent float64 evaluation in NumPy: x = y + sigma n (Eq. 13), lambda of Eq. 15, Eq. 21.
    y_, n_, s_ = y.numpy(), n.numpy(), sigma.numpy()
    x = y_ + s_ * n_
    denoised, u = x / (1 + s_), 0.3 * np.log(s_)
    lam = (s_**2 + 0.25) / (s_ * 0.5) ** 2
    want = lam / np.exp(u) * (denoised - y_) ** 2 + u
    # float64 throughout: a few operations per element, each within an ulp or two (exp and log may come from
    # different libraries), and no cancellation at these sigmas; 1e-12 is thousands of ulps.
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12)
    assert got.shape == y.shape


def test_random_draws_follow_eq16_in_a_fixed_order():
    loss_fn = EDM2Loss(P_mean=-0.8, P_std=1.6)
    y = torch.randn(6, 3, 4, 4)
    torch.manual_seed(5)
    got = loss_fn(AffineDenoiser(), y)
    # The same seed replayed by hand: ln(sigma) ~ N(P_mean, P_std^2) first, then unit noise.
    torch.manual_seed(5)
    sigma = (torch.randn(6, 1, 1, 1) * 1.6 - 0.8).exp()
    noise = torch.randn_like(y)
    torch.testing.assert_close(got, loss_fn(AffineDenoiser(), y, sigma=sigma, noise=noise), rtol=0, atol=0)

    # 200,000 seeded draws: standard errors 1.6 / sqrt(2e5) = 0.0036 (mean) and 1.6 / sqrt(4e5) = 0.0025 (std),
    # so the bounds are about 3 and 4 of them; another CPU's kernels move the draws by ulps, not the statistics.
    torch.manual_seed(1)
    log_sigma = loss_fn.sample_sigma(200_000).log().flatten().double()
    assert abs(log_sigma.mean().item() + 0.8) < 0.01 and abs(log_sigma.std().item() - 1.6) < 0.01


def test_weighted_error_is_one_at_initialization():
    # At initialization the U-Net's output gain is 0, so D = c_skip x and lambda(sigma) L(D; sigma) = 1
    # in expectation over data of std sigma_data (the property that motivates Eq. 15).
    torch.manual_seed(0)
    net = tiny_precond(label_dim=0, use_fp16=False)
    y = 0.5 * torch.randn(512, 3, 8, 8)
    sigma = torch.logspace(-2, 1.5, 512).reshape(-1, 1, 1, 1)
    with torch.no_grad():
        loss = EDM2Loss()(net, y, None, sigma=sigma)
        _, u = net(y, sigma, return_logvar=True)
    weighted_mse = (loss - u) * u.exp()
    # A seeded sample of 512 images x 192 elements: the statistical error of the mean is a few thousandths.
    assert abs(weighted_mse.mean().item() - 1) < 0.02


def test_gradient_reaches_the_logvar_head():
    torch.manual_seed(0)
    net = tiny_precond(label_dim=2, use_fp16=False)
    loss = EDM2Loss()(net, torch.randn(4, 3, 8, 8), torch.eye(2)[[0, 1, 0, 1]])
    loss.sum().backward()
    assert net.logvar_linear.weight.grad.abs().sum() > 0
    assert net.unet.out_gain.grad.abs() > 0
