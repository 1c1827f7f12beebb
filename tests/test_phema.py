"""Power-function EMA: sigma_rel <-> gamma and the training-time tracker against Eq. 1 in float64."""

import io

import numpy as np
import pytest
import torch

from edm2 import phema


class Toy(torch.nn.Module):
    """Two parameter tensors and a buffer, enough to exercise every code path of the tracker."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, 4))
        self.b = torch.nn.Parameter(torch.randn(5))
        self.register_buffer("freqs", torch.randn(6))


def train_steps(net, ema, nimg, batch_sizes, gen):
    """Random-walk 'optimizer steps' followed by EMA updates; returns the float64 weights after each."""
    history = []
    for batch_size in batch_sizes:
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn(p.shape, generator=gen) + 0.3)
            net.freqs.add_(1.0)
        nimg += batch_size
        ema.update(cur_nimg=nimg, batch_size=batch_size)
        history.append((nimg, [p.detach().double().clone() for p in net.parameters()]))
    return nimg, history


def test_std_exp_conversions_match_paper():
    # Section 3.1/3.2: sigma_rel 0.05 and 0.10 <-> gamma 16.97 and 6.94.
    assert phema.std_to_exp(0.05) == pytest.approx(16.97, abs=0.005)
    assert phema.std_to_exp(0.10) == pytest.approx(6.94, abs=0.005)
    stds = np.linspace(0.005, 0.285, 57).reshape(3, 19)
    exps = phema.std_to_exp(stds)
    assert exps.shape == stds.shape and np.all(exps > 0)
    # Eq. 123 computed independently as the std of Beta(gamma + 1, 1) (Appendix C.4). np.roots finds a
    # simple root of the cubic as a companion-matrix eigenvalue to within ~10 float64 ulps (~1e-15) on any
    # LAPACK; rtol=1e-12 leaves a thousandfold margin.
    a = exps + 1
    assert np.allclose(np.sqrt(a / ((a + 1) ** 2 * (a + 2))), stds, rtol=1e-12)
    assert np.allclose(phema.exp_to_std(exps), stds, rtol=1e-12)
    for bad in (0.0, -0.1, 0.2887, 0.3):
        with pytest.raises(phema.EMAError):
            phema.std_to_exp(bad)


def test_beta_is_eq_127():
    gamma = phema.std_to_exp(0.1)
    assert phema.power_function_beta(0.1, t_next=4096, t_delta=2048) == pytest.approx(0.5 ** (gamma + 1), rel=1e-12)
    assert phema.power_function_beta(0.1, t_next=2048, t_delta=2048) == 0.0


def float32_ema_bound(std, batch_sizes, max_abs):
    """Worst-case float32 error of a tracked EMA: each lerp rounds three times (difference, product, sum),
    each by at most 2^-24 of a quantity below 2 max|theta|, and Eq. 127's betas damp earlier errors:
    |e_n| <= 3 * 2^-24 * 2 max|theta| * sum_k prod_{j>k} beta_j."""
    window, t = 0.0, 0
    for batch_size in batch_sizes:
        t += batch_size
        window = window * phema.power_function_beta(std, t_next=t, t_delta=batch_size) + 1
    return 3 * 2**-24 * 2 * max_abs * window


def test_tracks_equal_eq_1_in_float64():
    # The tracker treats theta as piecewise constant, theta(tau) = theta_k for t_{k-1} < tau <= t_k
    # (Appendix C.3), so by Eq. 1 each track must equal
    #   sum_k theta_k * int_{t_{k-1}}^{t_k} tau^g dtau / int_0^{t_n} tau^g dtau.
    # Brute force: evaluate both integrals as sums of tau^g over a fine midpoint grid of every step.
    gen = torch.Generator().manual_seed(1)
    net = Toy()
    stds = (0.05, 0.10, 0.20)
    ema = phema.PowerFunctionEMA(net, stds=stds)
    batch_sizes = [8] * 40 + [3] * 5 + [8] * 14 + [5]
    _, history = train_steps(net, ema, 0, batch_sizes, gen)
    tracks = ema.get()
    assert [std for _, std in tracks] == list(stds)
    max_abs = max(float(p.abs().max()) for _, theta in history for p in theta)
    for track, std in tracks:
        gamma = float(phema.std_to_exp(std))
        num = [torch.zeros_like(p) for p in history[0][1]]
        den = 0.0
        t_prev = 0
        for t, theta in history:
            tau = t_prev + (np.arange(400) + 0.5) * (t - t_prev) / 400
            weight = float(np.sum(tau**gamma) * (t - t_prev) / 400)
            num = [n + weight * p for n, p in zip(num, theta)]
            den += weight
            t_prev = t
        # The float64 reference's own error is negligible: the midpoint rule on tau^g errs by a relative
        # g(g-1)/(24 * 400^2) < 1e-4 only on the first step, whose weight is below (8/480)^(g+1).
        bound = float32_ema_bound(std, batch_sizes, max_abs)
        for p_ema, n in zip(track.parameters(), num):
            assert p_ema.dtype == torch.float32
            torch.testing.assert_close(p_ema.double(), n / den, rtol=0, atol=bound)
        # Buffers are copied from the network, not averaged.
        assert torch.equal(track.freqs, net.freqs)
    # Sanity of the reference itself: a long EMA differs clearly from the last weights.
    assert not torch.allclose(tracks[2][0].w.double(), history[-1][1][0], atol=1e-2)


def test_resume_is_exact():
    gen = torch.Generator().manual_seed(2)
    net = Toy()
    ema = phema.PowerFunctionEMA(net)
    nimg, _ = train_steps(net, ema, 0, [16] * 30, gen)
    buf = io.BytesIO()
    torch.save({"net": net.state_dict(), "ema": ema.state_dict()}, buf)
    nimg_a, _ = train_steps(net, ema, nimg, [16] * 20, torch.Generator().manual_seed(3))

    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    net_b = Toy()
    net_b.load_state_dict(state["net"])
    ema_b = phema.PowerFunctionEMA(net_b)
    ema_b.load_state_dict(state["ema"])
    nimg_b, _ = train_steps(net_b, ema_b, nimg, [16] * 20, torch.Generator().manual_seed(3))
    assert nimg_a == nimg_b
    for (a, std_a), (b, std_b) in zip(ema.get(), ema_b.get()):
        assert std_a == std_b
        for (name, ta), tb in zip(a.state_dict().items(), b.state_dict().values()):
            assert torch.equal(ta, tb), name

    with pytest.raises(phema.EMAError, match="sigma_rel"):
        phema.PowerFunctionEMA(Toy(), stds=(0.05,)).load_state_dict(state["ema"])


def test_tracker_does_not_touch_network_or_track_grads():
    net = Toy()
    net.w.sum().backward()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    ema = phema.PowerFunctionEMA(net)
    assert all(p.grad is None for track, _ in ema.get() for p in track.parameters())
    assert not any(track.training for track, _ in ema.get())
    ema.update(cur_nimg=4, batch_size=4)
    ema.get()
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert all(not p.requires_grad for track, _ in ema.get() for p in track.parameters())
    assert all(p.requires_grad for p in net.parameters())


def test_inner_product_matches_quadrature():
    # Eq. 151 against direct numerical integration of the response functions (Eq. 144). Tolerances here
    # bound the trapezoid rule's discretization error in float64 (step h = t / 4e5, error ~ h^2 f''), which
    # no machine changes; rounding (~1e-16 per term) is orders below.
    cases = [(3.0, 0.05, 7.0, 0.10), (7.0, 0.05, 3.0, 0.10), (5.0, 0.20, 5.0, 0.03), (2.0, 0.28, 9.0, 0.01)]
    for t_a, s_a, t_b, s_b in cases:
        t = np.linspace(0, min(t_a, t_b), 400_001)
        f = phema.power_function_response(t, t_a, s_a) * phema.power_function_response(t, t_b, s_b)
        quad = np.sum((f[1:] + f[:-1]) / 2 * np.diff(t))
        assert phema.power_function_inner(t_a, s_a, t_b, s_b) == pytest.approx(quad, rel=1e-6)
    # Response functions are probability densities on [0, t].
    t = np.linspace(0, 8, 100_001)
    p = phema.power_function_response(t, 8.0, 0.07)
    assert np.sum((p[1:] + p[:-1]) / 2 * np.diff(t)) == pytest.approx(1.0, rel=1e-6)
    assert np.all(phema.power_function_response(np.linspace(-3, -1e-9, 10), 8.0, 0.07) == 0)
    assert np.all(phema.power_function_response(np.linspace(8 + 1e-9, 20, 10), 8.0, 0.07) == 0)
    # Realistic image counts with a sharp profile stay finite (the reason for the ratio form).
    big = phema.power_function_inner(2**27, 0.01, 2**31, 0.01)
    assert np.isfinite(big) and big >= 0


def test_coefficients_columns_sum_to_one_and_fit_profiles():
    ofs = np.repeat(np.arange(1, 33) * 1000.0, 2)
    std = np.tile([0.05, 0.10], 32)
    out_std = [0.02, 0.08, 0.25]
    coefs = phema.solve_posthoc_coefficients(ofs, std, 32000.0, out_std)
    assert coefs.shape == (64, 3)
    # Normalized in float64: summing 64 terms errs by at most 64 * 2^-53 * sum|c| (sum|c| ~ 28 here).
    np.testing.assert_allclose(coefs.sum(axis=0), 1.0, rtol=0, atol=64 * 2**-53 * np.abs(coefs).sum(axis=0).max())
    # The synthesized profile p* = sum_i x_i p_i (Eq. 132) fits the target in L2 (Eq. 134), and the
    # closed-form error used below agrees with quadrature.
    t = np.linspace(0, 32000, 320_001)
    stack = np.stack([phema.power_function_response(t, o, s) for o, s in zip(ofs, std)], axis=1)
    for j, s in enumerate(out_std):
        target = phema.power_function_response(t, 32000.0, s)
        sq = (stack @ coefs[:, j] - target) ** 2
        rel = np.sum((sq[1:] + sq[:-1]) / 2 * np.diff(t)) / phema.power_function_inner(32000.0, s, 32000.0, s)
        assert rel < 5e-3
        # Quadrature error of the trapezoid rule on the squared difference (h = 0.1), not rounding.
        assert rel == pytest.approx(phema.reconstruction_error(ofs, std, 32000.0, s, coefs[:, j])[0], rel=1e-3, abs=1e-12)


def synthetic_run(num_steps, batch_size, snapshot_every, snapshot_stds, direct_stds):
    """A random walk with a smooth trend, tracked by the real EMA; returns snapshots and direct tracks."""
    rng = np.random.default_rng(0)
    u = np.arange(1, num_steps + 1)[:, None] / num_steps
    theta = np.sin(2 * np.pi * u * rng.uniform(0.5, 2, 48) + rng.uniform(0, 6, 48))
    theta += np.cumsum(rng.standard_normal((num_steps, 48)), axis=0) / np.sqrt(num_steps)
    net = torch.nn.Module()
    net.p = torch.nn.Parameter(torch.zeros(48))
    snap_ema = phema.PowerFunctionEMA(net, stds=snapshot_stds)
    direct_ema = phema.PowerFunctionEMA(net, stds=direct_stds)
    snapshots = []  # (nimg, std, float64 weights)
    for k in range(num_steps):
        with torch.no_grad():
            net.p.copy_(torch.from_numpy(theta[k]))
        nimg = (k + 1) * batch_size
        snap_ema.update(nimg, batch_size)
        direct_ema.update(nimg, batch_size)
        if (k + 1) % snapshot_every == 0:
            snapshots += [(nimg, std, ema.p.double().numpy().copy()) for ema, std in snap_ema.get()]
    direct = {std: ema.p.double().numpy().copy() for ema, std in direct_ema.get()}
    return snapshots, direct


def reconstruct(snapshots, out_nimg, out_stds):
    """Post-hoc weights from snapshots (float64), with the coefficients used."""
    ofs, std, weights = (np.array(v) for v in zip(*snapshots))
    coefs = phema.solve_posthoc_coefficients(ofs, std, out_nimg, out_stds)
    return coefs.T @ weights, coefs


def test_reconstruction_matches_directly_tracked_ema_and_converges():
    # Issue 4, Must show 1: snapshots from the real tracker (0.05 and 0.10); targets never tracked.
    steps, batch, every = 2048, 8, 32
    targets = (0.03, 0.07, 0.15)
    snapshots, direct = synthetic_run(steps, batch, every, (0.05, 0.10), targets)
    scale = np.linalg.norm(direct[0.15] - direct[0.03])
    counts = (4, 8, 16, 32, 64)
    err = np.zeros((len(counts), len(targets)))
    prof = np.zeros_like(err)  # relative profile MSE
    for i, n in enumerate(counts):
        stride = steps // every // n
        subset = [s for s in snapshots if (s[0] // (batch * every)) % stride == 0]
        assert len(subset) == 2 * n
        ofs, stds = np.array([s[0] for s in subset]), np.array([s[1] for s in subset])
        rec, coefs = reconstruct(subset, steps * batch, targets)
        prof[i] = phema.reconstruction_error(ofs, stds, steps * batch, targets, coefs)
        for j, std in enumerate(targets):
            err[i, j] = np.linalg.norm(rec[j] - direct[std]) / scale
    table = f"weight error\n{err}\nprofile MSE\n{prof}"
    # The float32 tracks add about 2^-24 * max|theta| * sqrt(48) / scale ~ 4e-7 to these relative errors,
    # well below the smallest one compared (~3e-6), so the ratios below measure the method, not rounding.
    assert np.all(err[-1] < 1e-3), table
    assert np.all(np.diff(np.log(err), axis=0) < -np.log(4)), table  # at least 4x better per doubling
    # Profile MSE: the paper observes O(1/n^4); fit the slope over the densest three counts.
    slopes = np.polyfit(np.log(counts[2:]), np.log(prof[2:]), 1)[0]
    assert np.all((slopes < -3.5) & (slopes > -4.5)), f"{slopes}\n{table}"


def test_reconstructing_a_stored_track_reproduces_it():
    # Issue 4, Must show 2: 0.10 at the last snapshot time is the stored 0.10 track itself.
    snapshots, direct = synthetic_run(512, 8, 32, (0.05, 0.10), (0.10,))
    rec, coefs = reconstruct(snapshots, 512 * 8, [0.10])
    assert np.argmax(coefs[:, 0]) == len(snapshots) - 1
    # The exact answer is the last unit vector; a backward-stable float64 solve misses it by at most
    # about n * cond(A) * 2^-53 (cond(A) ~ 6e3 here).
    ofs, std = np.array([s[0] for s in snapshots]), np.array([s[1] for s in snapshots])
    gram = phema.power_function_inner(ofs[:, None], std[:, None], ofs[None, :], std[None, :])
    coef_tol = len(snapshots) * np.linalg.cond(gram) * 2**-53
    np.testing.assert_allclose(coefs[:, 0], np.eye(len(snapshots))[-1], rtol=0, atol=coef_tol)
    weights = np.stack([s[2] for s in snapshots])
    weight_tol = coef_tol * np.abs(weights).sum(axis=0).max()
    np.testing.assert_allclose(rec[0], snapshots[-1][2], rtol=0, atol=weight_tol)
    # The stored track and the direct one went through the same float32 operations.
    np.testing.assert_allclose(rec[0], direct[0.10], rtol=0, atol=weight_tol)


def test_one_snapshot_and_one_target_keep_their_shapes():
    # With one snapshot every array has one element, which np.float64() turned into a scalar on NumPy 1.x (then
    # np.linalg.solve refused a 0-d matrix; NumPy 2 keeps the array): arrays must stay arrays on both.
    coefs = phema.solve_posthoc_coefficients([100.0], [0.05], 100.0, [0.05])
    error = phema.reconstruction_error([100.0], [0.05], [100.0], [0.05], coefs)
    assert phema.power_function_inner(np.ones((1, 1)), np.full((1, 1), 0.1), 1.0, 0.1).shape == (1, 1)
    # A snapshot reconstructs its own profile alone: weight 1, no error beyond round-off.
    assert coefs.shape == (1, 1) and coefs[0, 0] == 1.0
    assert error.shape == (1,) and abs(error[0]) < 1e-12
