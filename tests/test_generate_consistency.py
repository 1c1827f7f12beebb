"""generate.py and generate_images with a consistency model's snapshot: its own sampler in 1, 2 or N steps, per-seed
noise reproducible across batch splits, the dry run's cost, and the options a consistency model does not take."""

import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import count_flops
import generate
from edm2.consistency_sampler import consistency_sample
from edm2.encoders import StandardRGBEncoder
from edm2.eval.flops import count_flops as count_flops_of
from edm2.formats import snapshot
from edm2.procedures.generation import generate_images, seeded_inputs
from tests.helpers import assert_ok, assert_refused, randomized, read_pngs, tiny_precond

RECORD = {"method": "sct", "sigma_data": 0.5, "teacher": None, "P_mean": -0.8, "P_std": 1.6,
          "tangent_warmup_nimg": 0, "c": 0.1, "prior": True}
T_MAX = math.atan(80 / 0.5)  # the first step's time at the default --sigma_max=80


@pytest.fixture(scope="module")
def nets(tmp_path_factory):
    """Snapshots of a consistency model and of a diffusion model (tiny, randomized, conditional)."""
    root = tmp_path_factory.mktemp("cm")
    paths = {}
    for name, extra, switches in (("cm", {"consistency": RECORD}, {}), ("diffusion", {}, {}),
                                  ("guided", {"consistency": dict(RECORD, method="scd")}, {"guidance_embedding": True})):
        torch.manual_seed(0)
        net = randomized(tiny_precond(8, 3, 5, time_embedding="trigflow", **switches)).eval()
        paths[name] = root / f"{name}.safetensors"
        snapshot.save_network(paths[name], net, {"encoder": StandardRGBEncoder().config(), **extra})
    return paths


def run_cli(args):
    return CliRunner().invoke(generate.main, [str(a) for a in args], catch_exceptions=False)


def test_a_consistency_models_images_depend_on_their_seeds_alone(nets):
    net = snapshot.load_network(nets["cm"])[0]
    kwargs = dict(sampler=consistency_sample, steps=3, t_mid=1.1, sigma_max=80, device="cpu")
    seeds = [5, 0, 77, 12, 3, 9, 41]
    [(_, together, _)] = generate_images(net, StandardRGBEncoder(), seeds, batch_size=7, **kwargs)
    for i, seed in enumerate(seeds):
        [(_, alone, _)] = generate_images(net, StandardRGBEncoder(), [seed], batch_size=1, **kwargs)
        assert torch.equal(alone[0], together[i])
    assert len({bytes(im.numpy()) for im in together}) == 7


def test_generate_samples_a_consistency_model_with_its_own_sampler(nets, tmp_path):
    result = run_cli(["--net", nets["cm"], "--outdir", tmp_path / "out", "--seeds=0-3", "--batch=3"])
    assert_ok(result)
    assert f"consistency model, 2 step(s) at TrigFlow times t = {T_MAX:.4g}, 1.1" in result.output
    # The images are consistency_sample's at 2 steps (the default) of each seed's noise.
    net = snapshot.load_network(nets["cm"])[0]
    noise, labels, randn_like = seeded_inputs(range(4), 3, 8, 5)
    expected = StandardRGBEncoder().decode(consistency_sample(net, noise, labels, steps=2, randn_like=randn_like))
    images = read_pngs(tmp_path / "out")
    assert len(images) == 4
    for i in range(4):
        assert np.array_equal(images[f"{i:06d}.png"], expected[i].permute(1, 2, 0).numpy())


@pytest.mark.parametrize("name, args, evaluations", [
    ("cm", [], 2), ("cm", ["--steps=1"], 1), ("cm", ["--steps=5"], 5),
    ("diffusion", [], 63), ("diffusion", ["--steps=4", "--solver=dpm2m"], 4),
])
def test_the_dry_run_counts_a_consistency_models_evaluations(nets, tmp_path, name, args, evaluations):
    result = run_cli(["--net", nets[name], "--outdir", tmp_path / "out", "--seeds=0-9", "--dry-run", *args])
    assert_ok(result)
    assert not (tmp_path / "out").exists()
    assert f"Evaluations  {evaluations} per image, {10 * evaluations} for 10 images" in result.output
    per_evaluation = count_flops_of(snapshot.load_network(nets[name])[0]).total
    assert f"Gflops       {evaluations * per_evaluation / 1e9:.4g} per image" in result.output


@pytest.mark.parametrize("name, args, fragments", [
    ("cm", ["--steps=0"], ["--steps", "0"]),
    ("cm", ["--t-mid=1.6"], [f"--t-mid=1.6: expected a time in (0, t_max) = (0, {T_MAX:.6g})"]),
    ("cm", ["--t-mid=1", "--sigma_max=0.5"], ["--t-mid=1: expected a time in (0, t_max) = (0, 0.785398)"]),
    ("cm", ["--t-mid=0"], ["--t-mid"]),
    ("diffusion", ["--t-mid=1"], ["--t-mid", "applies to consistency models only"]),
    ("cm", ["--solver=euler"], ["--solver", "a consistency model samples with its own steps"]),
    ("cm", ["--S_churn=1"], ["--S_churn", "a consistency model samples with its own steps"]),
    ("cm", ["--gnet=self"], ["--gnet", "a consistency model samples without a guiding network"]),
    ("cm", ["--guidance-interval=0.3,5", "--guidance=2", "--gnet=self"], ["--gnet"]),
    ("cm", ["--guidance=2"], ["--guidance", "this consistency model has no guidance embedding"]),
    ("diffusion", ["--guidance=2"], ["--guidance=2 needs a guiding network"]),
])
@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]], ids=["run", "dry-run"])
def test_options_a_consistency_model_does_not_take_are_one_line(nets, tmp_path, name, args, fragments, dry_run):
    assert_refused(tmp_path, lambda: run_cli(["--net", nets[name], "--outdir", tmp_path / "out", "--seeds=0-1",
                                              *args, *dry_run]), *fragments)


def test_count_flops_prices_a_consistency_models_image_in_one_and_two_steps(nets):
    result = CliRunner().invoke(count_flops.main, [str(nets["cm"])])
    assert_ok(result)
    per_evaluation = count_flops_of(snapshot.load_network(nets["cm"])[0]).total
    assert (f"{per_evaluation / 1e9:.2f} Gflops in 1 step, {2 * per_evaluation / 1e9:.2f} in 2 (a consistency model"
            in result.output)
    diffusion = CliRunner().invoke(count_flops.main, [str(nets["diffusion"])])
    assert_ok(diffusion)
    assert "Per image" not in diffusion.output


def test_a_guided_students_guidance_is_the_scale_its_embedding_takes(nets, tmp_path):
    images = {}
    for w in ("1", "2.5"):
        result = run_cli(["--net", nets["guided"], "--outdir", tmp_path / w, "--seeds=0-1", f"--guidance={w}"])
        assert_ok(result)
        images[w] = read_pngs(tmp_path / w)
    assert "guidance scale 2.5 embedded" in result.output
    net = snapshot.load_network(nets["guided"])[0]
    noise, labels, randn_like = seeded_inputs(range(2), 3, 8, 5)
    expected = StandardRGBEncoder().decode(consistency_sample(net, noise, labels, randn_like=randn_like,
                                                              guidance_scale=2.5))
    for i in range(2):
        assert np.array_equal(images["2.5"][f"{i:06d}.png"], expected[i].permute(1, 2, 0).numpy())
    assert not np.array_equal(images["1"]["000000.png"], images["2.5"]["000000.png"])
