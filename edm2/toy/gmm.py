"""The 2-D ground truth of the autoguidance paper's toy example (Karras et al. 2024, Figure 1): a fractal mixture
of Gaussians with two classes, and its exact density and score at every noise level.

Each class is a tree of branches grown from one origin (class A towards the upper right, B towards the lower
left); each branch is 8 elongated Gaussians along its length, and splits into two thinner, shorter, lighter
branches, 7 levels deep. Diffusing the mixture by noise level sigma adds sigma^2 I to every covariance, so the
noisy density p(x; sigma), its score and samples from it are all closed-form. The parameters (seed 2, the
branch lengths, angles and widths) are the release's (toy_example.py), so the figure shows the same tree.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from edm2.errors import EDM2Error

DEPTH = 7  # levels of branching
COMPONENTS_PER_BRANCH = 8
ORIGIN = np.array([0.0030, 0.0325])
SCALE = np.array([1.3136, 1.3844])
ROOT_ANGLES = {"A": np.pi * 0.25, "B": np.pi * 1.25}


class ToyError(EDM2Error):
    """Settings the toy example cannot use (an unknown class, a network file of another kind)."""


class GaussianMixture:
    """A 2-D mixture sum_k phi_k N(mu_k, Sigma_k), evaluated as if diffused to noise level sigma."""

    def __init__(self, phi: np.ndarray, mu: np.ndarray, cov: np.ndarray, device: torch.device | str = "cpu"):
        phi = np.asarray(phi, dtype=np.float64)
        self.phi = torch.tensor(phi / phi.sum(), dtype=torch.float32, device=device)
        self.mu = torch.tensor(np.asarray(mu), dtype=torch.float32, device=device)
        # Sigma_k = Q_k diag(L_k) Q_k^T; diffusion only adds sigma^2 to the eigenvalues L_k.
        eigenvalues, eigenvectors = np.linalg.eigh(np.asarray(cov, dtype=np.float64))
        self.eigenvalues = torch.tensor(eigenvalues, dtype=torch.float32, device=device)
        self.eigenvectors = torch.tensor(eigenvectors, dtype=torch.float32, device=device)
        # Contiguous per-component columns for _terms: eigenvalues, eigenvector entries Q[i, j], means.
        self._columns = ([self.eigenvalues[:, j].contiguous() for j in range(2)],
                         [self.eigenvectors[:, i, j].contiguous() for i in range(2) for j in range(2)],
                         [self.mu[:, j].contiguous() for j in range(2)])
        self._log_phi_norm = self.phi.log() - math.log(2 * math.pi)

    def _terms(self, x: torch.Tensor, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For points x [n, 2] at noise levels sigma [n]: log(phi_k N(x; mu_k, Sigma_k + sigma^2 I)) [n, K] and
        the two coordinates of (Sigma_k + sigma^2 I)^-1 (mu_k - x), each [n, K].

        Written out in each component's eigenbasis on contiguous [n, K] tensors: batched 2x2 products, or
        operands strided over the last axis, are many times slower.
        """
        (l0, l1), (q00, q01, q10, q11), (mx, my) = self._columns
        s2 = sigma[:, None] ** 2
        v0, v1 = l0 + s2, l1 + s2  # eigenvalues of Sigma_k + sigma^2 I
        dx, dy = mx - x[:, 0:1], my - x[:, 1:2]
        u0, u1 = torch.addcmul(dx * q00, dy, q10), torch.addcmul(dx * q01, dy, q11)  # Q^T (mu - x)
        t0, t1 = u0 / v0, u1 / v1
        zx, zy = torch.addcmul(t0 * q00, t1, q01), torch.addcmul(t0 * q10, t1, q11)  # Q diag(1 / v) Q^T (mu - x)
        # log(phi_k / (2 pi sqrt(v0 v1))) - (u0 t0 + u1 t1) / 2, with the products fused where torch can.
        quad = torch.addcmul(u0 * t0, u1, t1).add_((v0 * v1).log_())
        return quad.mul_(-0.5).add_(self._log_phi_norm), zx, zy

    def _batches(self, x: torch.Tensor, sigma: float | torch.Tensor, batch: int):
        """(flat x, flat sigma) in batches of at most `batch` points: the [n, K] temporaries stay in the caches."""
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device).broadcast_to(x.shape[:-1])
        return zip(x.reshape(-1, 2).split(batch), sigma.reshape(-1).split(batch))

    def _quadratic_form(self, sigma: float) -> torch.Tensor:
        """At one noise level, log(phi_k N(x; mu_k, Sigma_k + sigma^2 I)) is a quadratic polynomial in x: its
        coefficients [6, K] for the monomials (x^2, xy, y^2, x, y, 1), in float64."""
        var = self.eigenvalues.double() + sigma**2
        q = self.eigenvectors.double()
        a, b, c = ((q[:, i, 0] * q[:, j, 0] / var[:, 0] + q[:, i, 1] * q[:, j, 1] / var[:, 1]) for i, j in
                   ((0, 0), (0, 1), (1, 1)))
        mx, my = self.mu[:, 0].double(), self.mu[:, 1].double()
        const = (self.phi.double().log() - math.log(2 * math.pi) - 0.5 * var.log().sum(-1)
                 - 0.5 * (a * mx * mx + 2 * b * mx * my + c * my * my))
        return torch.stack([-0.5 * a, -b, -0.5 * c, a * mx + b * my, b * mx + c * my, const])

    def logp(self, x: torch.Tensor, sigma: float = 0, batch: int = 1 << 13) -> torch.Tensor:
        """log p(x; sigma) for points x [..., 2] at one noise level; a log-sum-exp, so it stays finite far away.

        The per-component log densities come from one float64 matrix product with the quadratic form's
        coefficients: a density over a plot's grid costs one exp per point and component.
        """
        coefficients = self._quadratic_form(float(sigma))
        parts = []
        for xs in x.reshape(-1, 2).double().split(batch):
            px, py = xs[:, 0], xs[:, 1]
            monomials = torch.stack([px * px, px * py, py * py, px, py, torch.ones_like(px)], -1)
            parts.append((monomials @ coefficients).float().logsumexp(-1))
        return torch.cat(parts).reshape(x.shape[:-1])

    def score(self, x: torch.Tensor, sigma: float | torch.Tensor = 0, batch: int = 1 << 8) -> torch.Tensor:
        """The score grad_x log p(x; sigma): the posterior-weighted average of (Sigma_k + sigma^2 I)^-1 (mu_k - x)."""
        parts = []
        for xs, ss in self._batches(x, sigma, batch):
            log_w, zx, zy = self._terms(xs, ss)
            w = log_w.softmax(-1)
            parts.append(torch.stack([(w * zx).sum(-1), (w * zy).sum(-1)], -1))
        return torch.cat(parts).reshape(x.shape)

    def sample(self, n: int, sigma: float | torch.Tensor = 0, generator: torch.Generator | None = None) -> torch.Tensor:
        """n points drawn from p(x; sigma) [n, 2]: a component by weight, then its Gaussian widened by sigma."""
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=self.mu.device).broadcast_to([n])
        k = torch.multinomial(self.phi, n, replacement=True, generator=generator)
        std = (self.eigenvalues[k] + sigma[:, None] ** 2).sqrt()
        noise = torch.randn([n, 2], generator=generator, device=self.mu.device)
        return self.mu[k] + torch.einsum("nij,nj->ni", self.eigenvectors[k], std * noise)


def _branches(rng: np.random.RandomState, depth: int, pos: np.ndarray, angle: float, out: list) -> None:
    """Append (weight, mean, covariance) of a branch's components, then grow its two children (depth first)."""
    if depth >= DEPTH:
        return
    direction = np.array([np.cos(angle), np.sin(angle)])
    length = 0.292 * 0.8**depth * (rng.randn() * 0.2 + 1)
    thickness = 0.2 * 0.8**depth / length  # across the branch, relative to its length
    size = SCALE * length * 0.06
    along = np.outer(direction, direction)
    cov = (along + (np.eye(2) - along) * thickness**2) * np.outer(size, size)
    for t in np.linspace(0.07, 0.93, COMPONENTS_PER_BRANCH):
        out.append((length * 0.5**depth, (pos + direction * length * t) * SCALE, cov))
    for sign in (1, -1):
        turn = sign * 0.7**depth * (rng.randn() * 0.2 + 1)  # drawn before the child's subtree, as the release does
        _branches(rng, depth + 1, pos + direction * length, angle + turn, out)


@functools.lru_cache(maxsize=None)
def _components(seed: int = 2) -> dict[str, list]:
    """Each class's components; both trees draw from one random stream, class A first."""
    rng = np.random.RandomState(seed)
    components = {}
    for cls, angle in ROOT_ANGLES.items():
        components[cls] = []
        _branches(rng, 0, ORIGIN, angle, components[cls])
    return components


def ground_truth(classes: str = "A", device: torch.device | str = "cpu") -> GaussianMixture:
    """The ground-truth mixture of the given classes: 'A', 'B' or 'AB' (both: the unconditional distribution)."""
    chosen = [c for cls in ROOT_ANGLES if cls in classes for c in _components()[cls]]
    if not chosen or set(classes) - set(ROOT_ANGLES):
        raise ToyError(f"classes must be 'A', 'B' or 'AB', not {classes!r}")
    phi, mu, cov = (np.stack(values) for values in zip(*chosen))
    return GaussianMixture(phi, mu, cov, device)
