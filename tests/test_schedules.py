"""The sampler's time discretizations (edm2.schedules.SCHEDULES) against their closed forms in float64, the sampler
stepping on the chosen one, and --schedule (with --solver=euler-ancestral) through generate.py and
calculate_metrics.py gen and sweep."""

import json
import math
import re

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import calculate_metrics
import generate
from cli import sweep as sweep_cli
from edm2 import sampler, schedules
from edm2.encoders import StandardRGBEncoder
from edm2.formats.snapshot import load_network, save_network
from edm2.procedures import generation
from edm2.procedures.generation import generate_images
from tests.helpers import (TinyInceptionStandIn, assert_refused, fake_training_run, pin_detector_file, read_pngs,
                           tiny_precond)

SETTINGS = [(1, 0.002, 80.0, 7.0), (2, 0.002, 80.0, 7.0), (32, 0.002, 80.0, 7.0), (13, 0.05, 20.0, 3.0),
            (200, 1e-4, 500.0, 1.0)]
EPS = torch.finfo(torch.float64).eps


def release_sigma_steps(num_steps, sigma_min, sigma_max, rho):
    """EDM Eq. 5's levels as edm2.sampler.sigma_steps computed them before the schedules table: the pinned
    reference that the edm row must keep bit for bit."""
    i = torch.arange(num_steps, dtype=torch.float64)
    t = (sigma_max ** (1 / rho) + i / max(num_steps - 1, 1) * (sigma_min ** (1 / rho) - sigma_max ** (1 / rho))) ** rho
    return torch.cat([t, torch.zeros(1, dtype=torch.float64)])


@pytest.mark.parametrize("settings", SETTINGS)
def test_the_edm_schedule_is_the_released_sigma_steps_bitwise(settings):
    levels = schedules.SCHEDULES["edm"].levels(*settings)
    assert levels.dtype == torch.float64 and torch.equal(levels, release_sigma_steps(*settings))
    assert torch.equal(sampler.sigma_steps(*settings), levels)


@pytest.mark.parametrize("name", schedules.SCHEDULES)
@pytest.mark.parametrize("settings", SETTINGS)
def test_every_schedule_falls_from_sigma_max_to_sigma_min_then_zero(name, settings):
    num_steps, sigma_min, sigma_max, rho = settings
    levels = schedules.SCHEDULES[name].levels(*settings)
    assert levels.dtype == torch.float64 and levels.shape == (num_steps + 1,)
    assert levels[-1] == 0 and bool((levels[1:] < levels[:-1]).all())
    # The first level is sigma_max and the last nonzero one sigma_min, to the rounding of a few operations.
    assert levels[0].item() == pytest.approx(sigma_max, rel=16 * EPS)
    if num_steps > 1:
        assert levels[-2].item() == pytest.approx(sigma_min, rel=1e-12)


@pytest.mark.parametrize("settings", SETTINGS[1:])
def test_the_exponential_schedule_has_a_constant_ratio_and_is_k_diffusions(settings):
    num_steps, sigma_min, sigma_max, rho = settings
    levels = schedules.SCHEDULES["exponential"].levels(*settings)[:-1]
    # Uniform in log sigma: every neighbour's ratio is (sigma_min / sigma_max)^(1 / (N - 1)); each level rounds a
    # power and a product (a few eps), so a ratio holds to ~1e-15.
    ratio = (sigma_min / sigma_max) ** (1 / (num_steps - 1))
    np.testing.assert_allclose((levels[1:] / levels[:-1]).numpy(), ratio, rtol=1e-13, atol=0)
    # k-diffusion's get_sigmas_exponential: exp(linspace(log sigma_max, log sigma_min, n)); exp of a value up to
    # |log 1e-4| = 9.2 turns its rounding into ~9 eps relative.
    k_diffusion = torch.linspace(math.log(sigma_max), math.log(sigma_min), num_steps, dtype=torch.float64).exp()
    np.testing.assert_allclose(levels.numpy(), k_diffusion.numpy(), rtol=1e-13, atol=0)
    # rho is not one of its settings.
    assert torch.equal(schedules.SCHEDULES["exponential"].levels(num_steps, sigma_min, sigma_max, rho + 2),
                       schedules.SCHEDULES["exponential"].levels(*settings))


def vp_sigma(t, beta_d, beta_min):
    """EDM Table 1's VP noise level sigma(t) = sqrt(e^(beta_d t^2 / 2 + beta_min t) - 1), in float64."""
    return np.sqrt(np.exp(0.5 * beta_d * t**2 + beta_min * t) - 1)


def test_the_vp_schedule_is_edm_table_1s_vp_time_steps():
    # With Song et al.'s beta_d = 19.9 and beta_min = 0.1 the levels from sigma(1) to sigma(eps_s) are EDM
    # Table 1's: sigma(t_i) at t_i = 1 + i / (N - 1) (eps_s - 1).
    num_steps, eps_s = 18, 1e-3
    t = 1 + np.arange(num_steps) / (num_steps - 1) * (eps_s - 1)
    expected = vp_sigma(t, 19.9, 0.1)
    levels = schedules.SCHEDULES["vp"].levels(num_steps, vp_sigma(eps_s, 19.9, 0.1), vp_sigma(1.0, 19.9, 0.1), 7.0)
    # Fitting beta_d and beta_min back from the two ends cancels a little (b / eps_s - a): 1e-12 bounds it.
    np.testing.assert_allclose(levels[:-1].numpy(), expected, rtol=1e-12, atol=0)
    assert levels[-1] == 0


@pytest.mark.parametrize("settings", SETTINGS[1:4])
def test_the_vp_schedules_times_are_evenly_spaced_from_1_to_eps_s(settings):
    num_steps, sigma_min, sigma_max, _ = settings
    levels = schedules.SCHEDULES["vp"].levels(*settings)[:-1].numpy()
    # log(1 + sigma^2) = beta_d t^2 / 2 + beta_min t through (1, sigma_max) and (eps_s, sigma_min), solved here as
    # a linear system; each level's t is then the positive root of that quadratic.
    eps_s = schedules.VP_EPSILON_S
    beta_d, beta_min = np.linalg.solve([[0.5, 1.0], [0.5 * eps_s**2, eps_s]],
                                       [math.log1p(sigma_max**2), math.log1p(sigma_min**2)])
    t = (-beta_min + np.sqrt(beta_min**2 + 2 * beta_d * np.log1p(levels**2))) / beta_d
    np.testing.assert_allclose(t, 1 + np.arange(num_steps) / (num_steps - 1) * (eps_s - 1), rtol=0, atol=1e-10)


def test_the_sampler_steps_on_the_chosen_schedules_levels():
    noise = torch.randn([2, 1, 4, 4], generator=torch.Generator().manual_seed(0))
    outputs = {}
    for name, schedule in schedules.SCHEDULES.items():
        seen = []
        outputs[name] = sampler.edm_sampler(lambda x, sigma, labels=None: 0.5 * x / (1 + sigma.reshape(-1, 1, 1, 1)),
                                            noise, num_steps=6, schedule=name, callback=seen.append)
        assert [step["sigma"] for step in seen] == schedule.levels(6, 0.002, 80, 7).tolist()[:-1]
    assert torch.equal(outputs["edm"], sampler.edm_sampler(
        lambda x, sigma, labels=None: 0.5 * x / (1 + sigma.reshape(-1, 1, 1, 1)), noise, num_steps=6))
    assert not torch.equal(outputs["edm"], outputs["exponential"])


DEFAULTS = dict(num_steps=32, sigma_min=0.002, sigma_max=80.0, rho=7.0, guidance=1.0, S_churn=0.0, S_min=0.0,
                S_max=math.inf, S_noise=1.0)


@pytest.mark.parametrize("settings, message", [
    (dict(schedule="cosine"), "schedule='cosine': expected one of edm, exponential, vp"),
    # The VP fit through (eps_s, 10) and (1, 11) is a parabola that turns back down before t = 1.
    (dict(schedule="vp", sigma_min=10.0, sigma_max=11.0), "the noise levels of schedule vp from sigma_max=11"),
])
def test_a_schedule_that_cannot_work_is_refused(settings, message):
    with pytest.raises(sampler.SamplerError, match=re.escape(message)):
        sampler.check_settings(**{**DEFAULTS, **settings})


# ---------------------------------------------------------------------------------------------------
# The command lines.

@pytest.fixture(scope="module")
def net_path(tmp_path_factory):
    """A tiny conditional network's snapshot."""
    path = tmp_path_factory.mktemp("net") / "net.safetensors"
    torch.manual_seed(0)
    save_network(path, tiny_precond(8, 3, label_dim=5).eval(), {"encoder": StandardRGBEncoder().config()})
    return path


def generate_cli(*args):
    return CliRunner().invoke(generate.main, [str(a) for a in args])


def test_generate_samples_with_euler_ancestral_on_the_exponential_schedule(net_path, tmp_path):
    args = [f"--net={net_path}", "--seeds=0-4", "--steps=4", "--solver=euler-ancestral"]
    for name, extra in (("a", ["--schedule=exponential", "--batch=5"]), ("b", ["--schedule=exponential", "--batch=2"]),
                        ("edm", [])):
        result = generate_cli(*args, *extra, f"--outdir={tmp_path / name}")
        assert result.exit_code == 0, result.output
    [(_, images, _)] = generate_images(load_network(net_path)[0], StandardRGBEncoder(), range(5), num_steps=4,
                                       solver="euler-ancestral", schedule="exponential", batch_size=5, device="cpu")
    written = read_pngs(tmp_path / "a")
    assert list(written) == [f"{seed:06d}.png" for seed in range(5)]
    assert all(np.array_equal(image.permute(1, 2, 0).numpy(), png) for image, png in zip(images, written.values()))
    # Each seed's image whatever its batch; another schedule gives other images.
    assert all(np.array_equal(a, b) for a, b in zip(written.values(), read_pngs(tmp_path / "b").values()))
    assert any(not np.array_equal(a, b) for a, b in zip(written.values(), read_pngs(tmp_path / "edm").values()))


def test_the_help_lists_every_schedule_and_solver_from_the_tables():
    help_text = " ".join(generate_cli("--help").output.split())
    for name, schedule in schedules.SCHEDULES.items():
        assert f"{name} ({schedule.about})" in help_text
    assert "euler-ancestral (k-diffusion's sample_euler_ancestral; stochastic; N)" in help_text


@pytest.mark.bad_input
@pytest.mark.parametrize("args, fragments", [
    (["--schedule=cosine"], ["--schedule", "'cosine'", "'exponential'"]),
    (["--solver=euler-ancestral", "--S_churn=5"], ["--S_churn=5", "euler-ancestral takes no churn",
                                                   "churn needs heun or euler"]),
    (["--schedule=vp", "--sigma_min=10", "--sigma_max=11"], ["schedule vp", "not decreasing levels"]),
])
def test_generate_refuses_a_schedule_or_solver_that_cannot_work_in_one_line(net_path, tmp_path, args, fragments):
    assert_refused(tmp_path, lambda: generate_cli(f"--net={net_path}", f"--outdir={tmp_path / 'out'}", *args),
                   *fragments)


@pytest.mark.bad_input
@pytest.mark.parametrize("command", ["gen", "sweep"])
def test_calculate_metrics_refuses_an_unknown_schedule_in_one_line(net_path, tmp_path, command):
    args = ([f"--net={net_path}", f"--ref={tmp_path / 'ref.npz'}"] if command == "gen"
            else [f"--indir={tmp_path}", "--std=0.1"])
    assert_refused(tmp_path, lambda: CliRunner().invoke(calculate_metrics.main, [command, *args, "--schedule=cosine"]),
                   "--schedule", "'cosine'")


def test_a_sweep_records_only_a_schedule_other_than_the_releases():
    def settings(solver, schedule):
        return sweep_cli.check_options(["loss"], 8, 0, "data", None, None, [1.0], None, solver, schedule)

    # Results files from before --schedule (and --solver) stay resumable: the release's settings add no key.
    assert "schedule" not in settings("heun", "edm") and "solver" not in settings("heun", "edm")
    assert settings("euler-ancestral", "vp") == {**settings("heun", "edm"), "solver": "euler-ancestral",
                                                 "schedule": "vp"}


@pytest.fixture
def sampler_calls(monkeypatch):
    """Every edm_sampler call of generate_images, its keyword arguments recorded, at 4 steps."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return sampler.edm_sampler(*args, **{**kwargs, "num_steps": 4})

    monkeypatch.setattr(generation, "edm_sampler", spy)
    return calls


def test_gen_and_sweep_sample_on_the_schedule_and_record_it(train_data, tmp_path, monkeypatch, sampler_calls):
    torch.manual_seed(0)
    torch.jit.save(torch.jit.script(TinyInceptionStandIn()), tmp_path / "inception.pt")
    pin_detector_file(monkeypatch, "fid", tmp_path / "inception.pt")
    inception, ref = f"--inception={tmp_path / 'inception.pt'}", tmp_path / "ref.npz"
    run = CliRunner().invoke(calculate_metrics.main, ["ref", f"--data={train_data}", f"--dest={ref}", "--metrics=fid",
                                                      inception])
    assert run.exit_code == 0, run.output
    indir = fake_training_run(tmp_path / "run", num_snapshots=2, label_dim=4)
    for path in indir.iterdir():
        net, metadata = load_network(path)
        save_network(path, net, dict(metadata, encoder=StandardRGBEncoder().config()))
    common = ["--metrics=fid", f"--ref={ref}", inception, "--num=2", "--batch=2", "--schedule=vp",
              "--solver=euler-ancestral"]
    result = CliRunner().invoke(calculate_metrics.main, ["gen", f"--net={path}", *common,
                                                         f"--results={tmp_path / 'results.json'}"])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "results.json").read_text())["sampler"]["schedule"] == "vp"
    result = CliRunner().invoke(calculate_metrics.main, ["sweep", f"--indir={indir}", "--std=0.1",
                                                         f"--dest={tmp_path / 'out'}", *common])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "out" / "ema-sweep.json").read_text())["settings"]["schedule"] == "vp"
    assert [(call["schedule"], call["solver"]) for call in sampler_calls] == [("vp", "euler-ancestral")] * 2
