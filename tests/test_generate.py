"""generate.py and generate_images: per-seed reproducibility across batch sizes and processes, presets, bad input."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch
from click.testing import CliRunner

import generate
from edm2 import presets_generate, snapshot
from edm2.encoders import StandardRGBEncoder
from edm2.sampler import generate_images
from tests.helpers import REPO, assert_one_error_line, free_port, tiny_precond

FAST = ["--steps=4", "--S_churn=10", "--S_min=0.01", "--S_max=10"]


def tiny_net(label_dim, resolution=8, channels=3, seed=0):
    torch.manual_seed(seed)
    return tiny_precond(resolution, channels, label_dim).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def nets(tmp_path_factory):
    """Snapshots of a conditional net, an unconditional guiding net and two ill-fitting guiding nets."""
    root = tmp_path_factory.mktemp("nets")
    paths = {}
    for name, net in (
        ("net", tiny_net(5)),
        ("gnet", tiny_net(0, seed=1)),
        ("gnet_res16", tiny_net(0, resolution=16)),
        ("gnet_ch4", tiny_net(0, channels=4)),
    ):
        paths[name] = root / f"{name}.safetensors"
        snapshot.save_network(paths[name], net, {"encoder": StandardRGBEncoder().config()})
    return paths


def read_pngs(outdir):
    return {p.relative_to(outdir).as_posix(): np.asarray(PIL.Image.open(p)) for p in sorted(Path(outdir).rglob("*.png"))}


def run_cli(args):
    return CliRunner().invoke(generate.main, [str(a) for a in args], catch_exceptions=False)


def test_same_seed_same_image_for_batch_sizes_1_and_7(nets):
    net, gnet = snapshot.load_network(nets["net"])[0], snapshot.load_network(nets["gnet"])[0]
    kwargs = dict(gnet=gnet, guidance=1.7, num_steps=4, S_churn=10, S_max=10, device="cpu")
    seeds = [3, 14, 15, 92, 65, 35, 89]
    together = list(generate_images(net, StandardRGBEncoder(), seeds, batch_size=7, **kwargs))
    assert [s for s, _ in together] == [seeds]
    images = together[0][1]
    assert images.dtype == torch.uint8 and images.shape == (7, 3, 8, 8)
    for i, seed in enumerate(seeds):
        [(one_seed, one_image)] = generate_images(net, StandardRGBEncoder(), [seed], batch_size=1, **kwargs)
        assert one_seed == [seed] and torch.equal(one_image[0], images[i])
    assert len({bytes(im.numpy()) for im in images}) == 7


def test_one_and_two_processes_write_the_same_images(nets, tmp_path):
    args = ["--net", nets["net"], "--gnet", nets["gnet"], "--guidance=1.7", "--seeds=0-5,998-1000", *FAST]
    one = run_cli([*args, "--batch=9", "--subdirs", "--outdir", tmp_path / "one"])
    assert one.exit_code == 0, one.output
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}"]
    two = subprocess.run(
        [*torchrun, "generate.py", *map(str, args), "--batch=2", "--subdirs", "--grid", "--outdir", str(tmp_path / "two")],
        cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=120,
    )
    assert two.returncode == 0, two.stderr
    images = read_pngs(tmp_path / "one")
    assert sorted(images) == [f"000000/{s:06d}.png" for s in [0, 1, 2, 3, 4, 5, 998, 999]] + ["001000/001000.png"]
    two_images = read_pngs(tmp_path / "two")
    tiles = two_images.pop("grid.png")
    assert sorted(two_images) == sorted(images)
    assert all(np.array_equal(images[k], two_images[k]) for k in images)
    # --grid gathers every rank's images, in seed order, into one PNG.
    assert tiles.shape == (3 * 8, 3 * 8, 3)
    for i, key in enumerate(sorted(images, key=lambda k: int(Path(k).stem))):
        row, col = divmod(i, 3)
        assert np.array_equal(tiles[row * 8 : row * 8 + 8, col * 8 : col * 8 + 8], images[key])


def test_default_command_uses_the_s_guid_fid_preset(nets, tmp_path, monkeypatch):
    preset = presets_generate.PRESETS["edm2-img512-s-guid-fid"]
    base = "https://nvlabs-fi-cdn.nvidia.com/edm2/posthoc-reconstructions/"
    assert (preset.net, preset.gnet, preset.guidance) == (
        base + "edm2-img512-s-2147483-0.025.pkl", base + "edm2-img512-xs-uncond-2147483-0.025.pkl", 1.4
    )
    # Offline, so point the preset at local stand-ins; --guidance=1.4 alone must pick it and write to out/.
    stand_in = presets_generate.GeneratePreset(nets["net"].as_uri(), nets["gnet"].as_uri(), 9.0)
    monkeypatch.setitem(generate.PRESETS, "edm2-img512-s-guid-fid", stand_in)
    monkeypatch.chdir(tmp_path)
    result = run_cli(["--guidance=1.4", "--seeds=0-1", *FAST])
    assert result.exit_code == 0, result.output
    assert "guided by" in result.output and "at 1.4" in result.output
    assert sorted(read_pngs(tmp_path / "out")) == ["000000.png", "000001.png"]


def test_every_release_preset_is_there():
    presets = presets_generate.PRESETS
    sizes = ["xs", "s", "m", "l", "xl", "xxl"]
    expected = {f"edm2-img512-{s}-{k}" for s in sizes for k in ("fid", "dino", "guid-fid", "guid-dino")}
    expected |= {f"edm2-img64-{s}-fid" for s in ["s", "m", "l", "xl"]}
    expected |= {f"edm2-img{r}-{s}-autog-{m}" for r, s in [(512, "s"), (512, "xxl"), (64, "s")] for m in ("fid", "dino")}
    assert set(presets) == expected
    for name, p in presets.items():
        assert p.net.startswith(presets_generate.BASE_URL) and p.net.endswith(".pkl")
        assert (p.gnet is None) == (p.guidance == 1.0) == ("guid" not in name and "autog" not in name)
        if "guid-" in name:  # guided by the unconditional XS model with the same EMA std
            assert p.gnet == f"{presets_generate.BASE_URL}edm2-img512-xs-uncond-2147483-{p.net.rsplit('-', 1)[1]}"
    assert presets["edm2-img512-xxl-autog-dino"].gnet.endswith("edm2-img512-m-0268435-0.205.pkl")
    assert presets["edm2-img64-xl-fid"].net.endswith("edm2-img64-xl-0671088-0.040.pkl")


def test_bad_input_gets_one_clear_line(nets, tmp_path, monkeypatch):
    monkeypatch.setenv("EDM2_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "out"
    net = ["--net", nets["net"], "--outdir", out, *FAST]
    assert_one_error_line(run_cli([*net, "--guidance=1.4"]), "--guidance", "--gnet")
    assert_one_error_line(run_cli(["--preset=edm2-img512-huge-fid", "--outdir", out]), "--preset", "edm2-img512-huge-fid")
    assert_one_error_line(run_cli([*net, "--gnet", nets["gnet_res16"], "--guidance=2"]), "--gnet", "resolution 16")
    assert_one_error_line(run_cli([*net, "--gnet", nets["gnet_ch4"], "--guidance=2"]), "--gnet", "4 channels")
    url = "http://127.0.0.1:9/edm2-img512-s-2147483-0.025.pkl"
    assert_one_error_line(run_cli(["--net", url, "--outdir", out]), url, str(tmp_path / "cache"))
    assert_one_error_line(run_cli([*net, "--class=5"]), "--class", "5 classes")
    assert_one_error_line(run_cli([*net, "--seeds=3-1"]), "--seeds")
    assert_one_error_line(run_cli(["--net", tmp_path / "missing.safetensors", "--outdir", out]), "missing.safetensors")
    assert not out.exists()
