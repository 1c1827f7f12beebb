"""generate.py and generate_images: per-seed reproducibility across batch sizes and processes, the default
preset, bad input, full and read-only disks, and what killed runs left behind."""

import json
import os
import shutil
import socket
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import generate
from cli.types import SeedList
from edm2.encoders import StabilityVAEEncoder, StandardRGBEncoder
from edm2.formats import snapshot
from edm2.procedures import presets_generate
from edm2.procedures import generation
from edm2.procedures.generation import MAX_SEED, generate_images
from edm2.runtime.files import TMP_SUFFIX, temporary_name
from edm2.runtime.locks import FOLDER_LOCK, hold_destination
from edm2.runtime.distributed import free_port
from tests.helpers import (
    REPO, assert_one_error_line, assert_refused, live_process, randomized, read_pngs, tiny_precond, tree,
)

FAST = ["--steps=4", "--S_churn=10", "--S_min=0.01", "--S_max=10"]


def tiny_net(label_dim, resolution=8, channels=3, seed=0):
    torch.manual_seed(seed)
    return tiny_precond(resolution, channels, label_dim).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def nets(tmp_path_factory):
    """Snapshots of a conditional net, an unconditional guiding net, three ill-fitting guiding nets and a
    file that is no snapshot."""
    root = tmp_path_factory.mktemp("nets")
    paths = {"garbage": root / "garbage.safetensors"}
    paths["garbage"].write_bytes(b"not a snapshot at all")
    for name, net in (
        ("net", tiny_net(5)),
        ("uncond_dropout", tiny_net(0, seed=2)),
        ("gnet", tiny_net(0, seed=1)),
        ("gnet_res16", tiny_net(0, resolution=16)),
        ("gnet_ch4", tiny_net(0, channels=4)),
        ("gnet_cls3", tiny_net(3)),
    ):
        paths[name] = root / f"{name}.safetensors"
        dropout = {"training_options": {"label_dropout": 0.1}} if name == "uncond_dropout" else {}
        snapshot.save_network(paths[name], net, {"encoder": StandardRGBEncoder().config(), **dropout})
    return paths


def run_cli(args):
    return CliRunner().invoke(generate.main, [str(a) for a in args], catch_exceptions=False)


def test_same_seed_same_image_for_batch_sizes_1_and_7(nets):
    net, gnet = snapshot.load_network(nets["net"])[0], snapshot.load_network(nets["gnet"])[0]
    kwargs = dict(gnet=gnet, guidance=1.7, num_steps=4, S_churn=10, S_max=10, device="cpu")
    seeds = [3, 14, 15, 92, 65, 35, 89]
    together = list(generate_images(net, StandardRGBEncoder(), seeds, batch_size=7, **kwargs))
    assert [s for s, _, _ in together] == [seeds]
    images = together[0][1]
    assert images.dtype == torch.uint8 and images.shape == (7, 3, 8, 8)
    for i, seed in enumerate(seeds):
        [(one_seed, one_image, _)] = generate_images(net, StandardRGBEncoder(), [seed], batch_size=1, **kwargs)
        assert one_seed == [seed] and torch.equal(one_image[0], images[i])
    assert len({bytes(im.numpy()) for im in images}) == 7


@pytest.mark.parametrize("solver", ["euler", "dpm2m"])
def test_solver_reaches_the_sampler_with_guidance_and_its_interval(nets, tmp_path, solver):
    args = ["--net", nets["net"], "--gnet", nets["gnet"], "--guidance=1.7", "--guidance-interval=0.5,20", "--seeds=0-2",
            "--steps=4"]
    for name in (solver, "heun"):
        result = run_cli([*args, "--solver", name, "--outdir", tmp_path / name])
        assert result.exit_code == 0, result.output
    net, gnet = snapshot.load_network(nets["net"])[0], snapshot.load_network(nets["gnet"])[0]
    [(_, images, _)] = generate_images(net, StandardRGBEncoder(), range(3), gnet=gnet, guidance=1.7, num_steps=4,
                                    guidance_interval=(0.5, 20), solver=solver, batch_size=3, device="cpu")
    written = read_pngs(tmp_path / solver)
    assert list(written) == ["000000.png", "000001.png", "000002.png"]
    for image, png in zip(images, written.values()):
        assert np.array_equal(image.permute(1, 2, 0).numpy(), png)
    assert any(not np.array_equal(a, b) for a, b in zip(written.values(), read_pngs(tmp_path / "heun").values()))


def test_one_and_two_processes_write_the_same_images(nets, tmp_path):
    args = ["--net", nets["net"], "--gnet", nets["gnet"], "--guidance=1.7", "--seeds=0-5,998-1000", *FAST]
    one = run_cli([*args, "--batch=9", "--subdirs", "--outdir", tmp_path / "one"])
    assert one.exit_code == 0, one.output
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}"]
    two = subprocess.run(
        [*torchrun, "generate.py", *map(str, args), "--batch=2", "--subdirs", "--grid", "--outdir", str(tmp_path / "two")],
        cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300,
    )
    assert two.returncode == 0, two.stderr
    images = read_pngs(tmp_path / "one")
    assert sorted(images) == [f"000000/{s:06d}.png" for s in [0, 1, 2, 3, 4, 5, 998, 999]] + ["001000/001000.png"]
    two_images = read_pngs(tmp_path / "two")
    tiles = two_images.pop("grid.png")
    assert sorted(two_images) == sorted(images)
    assert all(np.array_equal(images[k], two_images[k]) for k in images)
    # --grid gathers every rank's images, in seed order, into one PNG, a one-pixel white gap between them.
    assert tiles.shape == (3 * 8 + 2, 3 * 8 + 2, 3)
    for i, key in enumerate(sorted(images, key=lambda k: int(Path(k).stem))):
        row, col = divmod(i, 3)
        assert np.array_equal(tiles[row * 9 : row * 9 + 8, col * 9 : col * 9 + 8], images[key])
    assert (tiles[[8, 17]] == 255).all() and (tiles[:, [8, 17]] == 255).all()
    # Both write the class of every image, gathered from every rank, under the same names.
    labels = json.loads((tmp_path / "one" / "labels.json").read_text())["labels"]
    assert labels == json.loads((tmp_path / "two" / "labels.json").read_text())["labels"]
    assert [name for name, _ in labels] == sorted(images)


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


@pytest.mark.parametrize("text, expected", [
    ("0-63", list(range(64))),
    ("5", [5]),
    ("0-3, 10,2-5, 007", [0, 1, 2, 3, 10, 4, 5, 7]),  # as before: distinct, in the order first given
    (" 9 - 11 ,9", [9, 10, 11]),
    ("4294967295", [MAX_SEED - 1]),
])
def test_seeds_option_parses_lists_and_ranges(text, expected):
    assert list(SeedList().convert(text, None, None)) == expected


def test_guidance_interval_empty_is_unguided_and_zero_to_inf_is_plain_guidance_bitwise(tmp_path):
    # Random weights: a fresh net's zero output gain would make every denoiser, guided or not, the same.
    paths = {}
    for name, label_dim, seed in (("net", 5, 0), ("gnet", 0, 1)):
        paths[name] = tmp_path / f"{name}.safetensors"
        snapshot.save_network(paths[name], randomized(tiny_net(label_dim), seed), {"encoder": StandardRGBEncoder().config()})
    guided = ["--net", paths["net"], "--gnet", paths["gnet"], "--guidance=2.5", "--seeds=0-2", *FAST]
    runs = {
        "unguided": ["--net", paths["net"], "--seeds=0-2", *FAST],
        "above sigma_max": [*guided, "--guidance-interval=100,200"],
        "guided": guided,
        "zero to inf": [*guided, "--guidance-interval=0,inf"],
        "middle": [*guided, "--guidance-interval=1,20"],  # the second of the 4 steps (levels 80, 9.72, 0.47, 0.002)
    }
    images = {}
    for name, args in runs.items():
        result = run_cli([*args, "--outdir", tmp_path / name])
        assert result.exit_code == 0, result.output
        images[name] = read_pngs(tmp_path / name)
    assert "guided by" in result.output and "for sigma in (1, 20]" in result.output
    for a, b in (("unguided", "above sigma_max"), ("guided", "zero to inf")):
        assert {k: v.tobytes() for k, v in images[a].items()} == {k: v.tobytes() for k, v in images[b].items()}
    # Guiding only the middle steps gives images that are neither.
    assert all(not np.array_equal(images["middle"][k], images[other][k]) for k in images["middle"]
               for other in ("unguided", "guided"))


def test_self_guidance_at_one_is_unguided_and_above_one_guides(tmp_path):
    path = tmp_path / "net.safetensors"
    metadata = {"encoder": StandardRGBEncoder().config(), "training_options": {"label_dropout": 0.1}}
    snapshot.save_network(path, randomized(tiny_net(5)), metadata)  # random weights: the label matters
    runs = {"unguided": [], "self at 1": ["--gnet=self", "--guidance=1"], "self at 2": ["--gnet=self", "--guidance=2"]}
    images = {}
    for name, extra in runs.items():
        result = run_cli(["--net", path, "--seeds=0-2", *FAST, *extra, "--outdir", tmp_path / name])
        assert result.exit_code == 0, result.output
        images[name] = {k: v.tobytes() for k, v in read_pngs(tmp_path / name).items()}
    assert "guided by its own unconditional prediction at 2" in result.output
    assert images["self at 1"] == images["unguided"]
    assert all(images["self at 2"][k] != images["unguided"][k] for k in images["unguided"])


def test_labels_json_holds_each_images_class_across_runs(nets, tmp_path):
    out = tmp_path / "out"
    assert run_cli(["--net", nets["net"], "--seeds=0-3", "--subdirs", *FAST, "--outdir", out]).exit_code == 0
    assert run_cli(["--net", nets["net"], "--seeds=1004,3", "--class=2", "--subdirs", *FAST,
                    "--outdir", out]).exit_code == 0
    labels = dict(json.loads((out / "labels.json").read_text())["labels"])
    # The classes each seed's own generator draws (after its noise), as generate_images draws them.
    drawn = {}
    for seed in range(4):
        generator = torch.Generator().manual_seed(seed)
        torch.randn([3, 8, 8], generator=generator)
        drawn[f"000000/{seed:06d}.png"] = int(torch.randint(5, (1,), generator=generator))
    assert labels == {**drawn, "000000/000003.png": 2, "001000/001004.png": 2}
    assert sorted(labels) == sorted(read_pngs(out))
    # An unconditional network's images have no classes: no labels file.
    assert run_cli(["--net", nets["gnet"], "--seeds=0", *FAST, "--outdir", tmp_path / "uncond"]).exit_code == 0
    assert tree(tmp_path / "uncond") == ["000000.png"]


@pytest.mark.bad_input
def test_a_second_run_into_a_folder_in_use_is_refused(nets, tmp_path):
    # Two runs with disjoint seeds into one --outdir: each wrote labels.json with its own images only.
    out = tmp_path / "out"
    assert run_cli(["--net", nets["net"], "--seeds=0-3", *FAST, "--outdir", out]).exit_code == 0
    first = (out / "labels.json").read_text()
    with hold_destination(out, "generate.py", FOLDER_LOCK):  # a run still writing
        assert_refused(tmp_path, lambda: CliRunner().invoke(generate.main, [
            "--net", str(nets["net"]), "--seeds=4-7", *FAST, "--outdir", str(out)]),
            f"{out} is in use by the generate.py process {os.getpid()} on host")
    assert (out / "labels.json").read_text() == first
    assert run_cli(["--net", nets["net"], "--seeds=4-7", *FAST, "--outdir", out]).exit_code == 0  # once it ended
    assert sorted(dict(json.loads((out / "labels.json").read_text())["labels"])) == [f"{s:06d}.png" for s in range(8)]
    assert tree(out) == sorted(["labels.json", *(f"{s:06d}.png" for s in range(8))])


@pytest.mark.bad_input
@pytest.mark.parametrize("content", ["not json", '{"labels": [["000000.png", "cat"]]}', '{"images": []}'])
def test_a_labels_json_that_is_not_ours_is_refused_before_loading(nets, tmp_path, content):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "labels.json").write_text(content)
    args = ["--net", tmp_path / "missing.safetensors", *FAST, "--outdir", tmp_path / "out"]
    assert_refused(tmp_path, lambda: run_cli(args), "--outdir", f"{tmp_path}/out/labels.json exists but")
    assert (tmp_path / "out" / "labels.json").read_text() == content


URL = "http://127.0.0.1:9/edm2-img512-s-2147483-0.025.pkl"
# One malformed input per case: the arguments and the fragments its one error line must contain. {tmp} is
# the test's folder (holding a plain file named `file`), {net} etc. the snapshots of the nets fixture.
BAD_INPUT = {
    "guidance without gnet": (["--net", "{net}", "--guidance=1.4"], ["--guidance", "--gnet"]),
    "unknown preset": (["--preset=edm2-img512-huge-fid"], ["--preset", "edm2-img512-huge-fid"]),
    "gnet resolution": (["--net", "{net}", "--gnet", "{gnet_res16}", "--guidance=2"], ["--gnet", "resolution 16"]),
    "gnet channels": (["--net", "{net}", "--gnet", "{gnet_ch4}", "--guidance=2"], ["--gnet", "4 channels"]),
    "gnet classes": (["--net", "{net}", "--gnet", "{gnet_cls3}", "--guidance=2"], ["--gnet", "3 classes"]),
    "self without label dropout": (["--net", "{net}", "--gnet=self", "--guidance=2"],
                                   ["--gnet", "trained with label dropout", "--label-dropout"]),
    "self on an unconditional net": (["--net", "{uncond_dropout}", "--gnet=self", "--guidance=2"],
                                     ["--gnet", "class-conditional", "unconditional"]),
    "unreachable url": (["--net", URL], ["--net", URL, "{tmp}/cache"]),
    "missing net": (["--net", "{tmp}/missing.safetensors"], ["--net", "missing.safetensors"]),
    "missing gnet": (["--net", "{net}", "--gnet", "{tmp}/missing.safetensors", "--guidance=2"], ["--gnet", "missing"]),
    "net not a snapshot": (["--net", "{garbage}"], ["--net", "garbage.safetensors"]),
    "class of no net": (["--net", "{net}", "--class=5"], ["--class", "5 classes"]),
    "negative class": (["--net", "{net}", "--class=-1"], ["--class"]),
    "reversed seeds": (["--net", "{net}", "--seeds=3-1"], ["--seeds", "'3-1'"]),
    "seeds past 32 bits": (["--net", "{net}", "--seeds=0-99999999999"], ["--seeds", "99999999999", "4294967296"]),
    "seed 2**32": (["--net", "{net}", "--seeds=5,4294967296"], ["--seeds", "4294967296 is not below"]),
    "thousand-digit seed": (["--net", "{net}", "--seeds=" + "9" * 5000], ["--seeds", "is not below"]),
    "thousand zeros, then 2**32": (["--net", "{net}", "--seeds=" + "0" * 5000 + "4294967296"], ["--seeds", "4294967296"]),
    "empty seed": (["--net", "{net}", "--seeds=1,,2"], ["--seeds", "0-63,100"]),
    "no seeds": (["--net", "{net}", "--seeds="], ["--seeds"]),
    "negative seed": (["--net", "{net}", "--seeds=-5"], ["--seeds"]),
    "seed words": (["--net", "{net}", "--seeds=all"], ["--seeds", "'all'"]),
    "zero batch": (["--net", "{net}", "--batch=0"], ["--batch"]),
    "zero steps": (["--net", "{net}", "--steps=0"], ["--steps"]),
    "unknown solver": (["--net", "{net}", "--solver=rk4"], ["--solver", "'rk4'", "'dpm2m'"]),
    # FAST churns: DPM-Solver++(2M) reuses the previous step's denoised image, which churn would make stale.
    "dpm2m with churn": (["--net", "{net}", "--solver=dpm2m"], ["S_churn=10", "dpm2m", "churn needs heun or euler"]),
    "sigma_max inf": (["--net", "{net}", "--sigma_max=inf"], ["--sigma_max", "not a finite number"]),
    "sigma_max nan": (["--net", "{net}", "--sigma_max=nan"], ["--sigma_max", "not a finite number"]),
    "sigma_max overflows": (["--net", "{net}", "--sigma_max=1e30"], ["sigma_max=1e+30", "float32"]),
    "sigma_min nan": (["--net", "{net}", "--sigma_min=nan"], ["--sigma_min", "not a finite number"]),
    "sigma_min zero": (["--net", "{net}", "--sigma_min=0"], ["--sigma_min"]),
    "sigma_min above max": (["--net", "{net}", "--sigma_min=100"], ["--sigma_min", "below --sigma_max"]),
    "rho inf": (["--net", "{net}", "--rho=inf"], ["--rho", "not a finite number"]),
    "rho tiny": (["--net", "{net}", "--rho=0.001"], ["rho=0.001", "not decreasing levels"]),
    "S_churn nan": (["--net", "{net}", "--S_churn=nan"], ["--S_churn", "not a finite number"]),
    "S_churn negative": (["--net", "{net}", "--S_churn=-1"], ["--S_churn"]),
    "S_min nan": (["--net", "{net}", "--S_min=nan"], ["--S_min", "not a finite number"]),
    "S_max nan": (["--net", "{net}", "--S_max=nan"], ["--S_max", "not a finite number"]),
    "S_noise nan": (["--net", "{net}", "--S_noise=nan"], ["--S_noise", "not a finite number"]),
    "S_noise inf": (["--net", "{net}", "--S_noise=inf"], ["--S_noise", "not a finite number"]),
    "guidance nan": (["--net", "{net}", "--gnet", "{gnet}", "--guidance=nan"], ["--guidance", "not a finite number"]),
    "guidance inf": (["--net", "{net}", "--gnet", "{gnet}", "--guidance=inf"], ["--guidance", "not a finite number"]),
    # Eq. 152's blend is rounding error beyond 1 / eps of float32; 1e308 overflowed mid-sampling (a traceback).
    "guidance 1e308": (["--net", "{net}", "--gnet", "{gnet}", "--guidance=1e308"],
                       ["--guidance", "1e+308: must lie within +-8.38861e+06 (1 / eps of float32)", "rounding error"]),
    "self-guidance 1e308": (["--net", "{net}", "--gnet=self", "--guidance=-1e308"], ["--guidance", "-1e+308", "float32"]),
    "guidance 2**23": (["--net", "{net}", "--gnet", "{gnet}", f"--guidance={2**23}"], ["--guidance", "8.38861e+06:"]),
    # Every image of a grid stays in memory: 2**32 seeds, or 5 classes x 10**8, were sampled until memory ran out.
    "grid of 2**32 seeds": (["--net", "{net}", "--seeds=0-4294967295", "--grid"], ["--grid", "4294967296 images"]),
    "grid of 5 classes x 10**8": (["--net", "{net}", "--class=0-4", "--seeds=0-99999999", "--grid"],
                                  ["--grid", "500000000 images", "67,108,864"]),
    "interval without guidance": (["--net", "{net}", "--guidance-interval=0.28,5.42"],
                                  ["--guidance-interval", "--guidance other than 1"]),
    "interval at guidance 1": (["--net", "{net}", "--gnet", "{gnet}", "--guidance=1", "--guidance-interval=0,inf"],
                               ["--guidance-interval", "--guidance other than 1"]),
    "interval reversed": (["--net", "{net}", "--gnet", "{gnet}", "--guidance=2", "--guidance-interval=5,0.28"],
                          ["--guidance-interval", "'5,0.28'", "SIGMA_LO < SIGMA_HI"]),
    "interval empty": (["--net", "{net}", "--gnet", "{gnet}", "--guidance=2", "--guidance-interval=1,1"],
                       ["--guidance-interval", "'1,1'"]),
    "interval negative": (["--net", "{net}", "--gnet", "{gnet}", "--guidance=2", "--guidance-interval=-1,5"],
                          ["--guidance-interval", "'-1,5'"]),
    "interval nan": (["--net", "{net}", "--gnet", "{gnet}", "--guidance=2", "--guidance-interval=nan,5"],
                     ["--guidance-interval", "'nan,5'"]),
    "interval one number": (["--net", "{net}", "--gnet", "{gnet}", "--guidance=2", "--guidance-interval=5"],
                            ["--guidance-interval", "two numbers"]),
    "interval three numbers": (["--net", "{net}", "--gnet", "{gnet}", "--guidance=2", "--guidance-interval=0,1,2"],
                               ["--guidance-interval", "two numbers"]),
    "interval words": (["--net", "{net}", "--gnet", "{gnet}", "--guidance=2", "--guidance-interval=low,high"],
                       ["--guidance-interval", "two numbers"]),
    "outdir is a file": (["--net", "{net}", "--outdir", "{tmp}/file"], ["--outdir", "is a file"]),
    # Refused before the network loads: the missing network would give another error.
    "outdir under a file": (["--net", "{tmp}/missing.safetensors", "--outdir", "{tmp}/file/out"], ["{tmp}/file", "is a file"]),
}


@pytest.mark.bad_input
@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_gets_one_clear_line(case, nets, tmp_path, monkeypatch):
    monkeypatch.setenv("EDM2_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "file").write_text("a file, not a folder")
    args, fragments = BAD_INPUT[case]
    names = {name: str(path) for name, path in nets.items()}
    fill = [text.format(tmp=tmp_path, **names) for text in args]
    assert_refused(tmp_path, lambda: run_cli([*FAST, "--outdir", tmp_path / "out", *fill]),
                   *(text.format(tmp=tmp_path, **names) for text in fragments))



def latent_snapshot(path: Path, vae: Path) -> Path:
    """A tiny latent-space snapshot (4 channels) that decodes with the VAE at `vae`."""
    snapshot.save_network(path, tiny_net(0, channels=4), {"encoder": StabilityVAEEncoder(str(vae)).config()})
    return path


def never_sample(*args, **kwargs):
    raise AssertionError("sampled before every part the command needs was loaded")


@pytest.mark.bad_input
def test_a_vae_that_cannot_load_is_refused_before_sampling(tmp_path, monkeypatch):
    # Our own latent-space snapshot whose VAE is not there (offline): refused before the first batch is sampled.
    net = latent_snapshot(tmp_path / "latent.safetensors", tmp_path / "no-vae")
    monkeypatch.setattr("edm2.procedures.generation.edm_sampler", never_sample)
    assert_refused(tmp_path, lambda: CliRunner().invoke(generate.main, [f"--net={net}", f"--outdir={tmp_path / 'out'}",
                                                                        "--seeds=0-3", "--steps=1"]),
                   "--net", "cannot load the VAE", "no-vae")


def test_a_latent_snapshot_loads_its_vae_before_sampling_and_decodes_with_it(tmp_path, tiny_vae_dir, monkeypatch):
    real_sampler = generate_images.__globals__["edm_sampler"]
    vae_loaded = []

    def sampler(net, *args, **kwargs):
        vae_loaded.append(all(encoder._vae is not None for encoder in created))
        return real_sampler(net, *args, **kwargs)

    created = []
    real_load = generate.load_generator

    def load_generator(path):
        net, encoder, metadata = real_load(path)
        created.append(encoder)
        return net, encoder, metadata

    monkeypatch.setattr(generate, "load_generator", load_generator)
    monkeypatch.setattr("edm2.procedures.generation.edm_sampler", sampler)
    net = latent_snapshot(tmp_path / "latent.safetensors", tiny_vae_dir)
    run_cli([f"--net={net}", f"--outdir={tmp_path / 'out'}", "--seeds=0", "--steps=1"])
    # The tiny VAE upsamples twice: 8x8 latents become 16x16 RGB images.
    assert vae_loaded == [True] and read_pngs(tmp_path / "out")["000000.png"].shape == (16, 16, 3)


def test_all_32_bit_seeds_start_at_once_without_listing_them(nets, tmp_path, monkeypatch):
    saved = []

    class Enough(Exception):
        pass

    def save_png(path, image):
        saved.append(path.name)
        if len(saved) == 3:
            raise Enough

    monkeypatch.setattr(generate, "save_png", save_png)
    tracemalloc.start()
    try:
        with pytest.raises(Enough):
            run_cli(["--net", nets["net"], "--seeds=0-4294967295", "--batch=2", *FAST, "--outdir", tmp_path / "out"])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert saved == ["000000.png", "000001.png", "000002.png"]
    assert peak < 50_000_000  # 2**32 seeds as one list would take over 100 GB


def dead_pid():
    """The id of a process that has exited."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_rerun_removes_what_killed_runs_left_but_not_a_live_writer(nets, tmp_path):
    out = tmp_path / "out"
    (out / "000000").mkdir(parents=True)
    host = socket.gethostname()
    stale = [out / temporary_name("", f".grid.png.{dead_pid()}@{host}."),
             out / "000000" / temporary_name("", f".000007.png.{dead_pid()}@{host}.")]
    with live_process() as writer:
        live = out / "000000" / temporary_name("", f".000008.png.{writer.pid}@{host}.")
        for path in [*stale, live]:
            path.write_bytes(b"half an image")
        # Without --subdirs only the output folder itself is cleaned.
        assert run_cli(["--net", nets["net"], "--seeds=0-1", *FAST, "--outdir", out]).exit_code == 0
        assert not stale[0].exists() and stale[1].exists()
        result = run_cli(["--net", nets["net"], "--seeds=0-1", "--subdirs", *FAST, "--outdir", out])
        assert result.exit_code == 0, result.output
        assert not stale[1].exists() and live.exists()
    assert sorted(read_pngs(out)) == ["000000.png", "000000/000000.png", "000000/000001.png", "000001.png"]


def run_in_namespace(mount: str, script: str, folder):
    """Run a shell script in a private mount namespace with `folder` mounted as tmpfs (mount options)."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare to mount a small or read-only folder")
    result = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o {mount} tmpfs {folder} && {script}"],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    if "mount:" in result.stderr or "unshare:" in result.stderr:
        pytest.skip(f"cannot mount here: {result.stderr.strip()}")
    return result


@pytest.mark.bad_input
def test_read_only_outdir_is_refused_before_loading(tmp_path):
    (tmp_path / "ro").mkdir()
    missing = tmp_path / "missing.safetensors"  # loading first would report this instead
    command = f"{sys.executable} generate.py --net {missing} --outdir {tmp_path}/ro/out --seeds=0-1"
    result = run_in_namespace("ro", command, tmp_path / "ro")
    assert_one_error_line(result, f"{tmp_path}/ro/out", "Read-only file system")
    assert tree(tmp_path) == ["ro"]


@pytest.mark.bad_input
def test_full_disk_is_one_line_and_leaves_nothing_half_written(nets, tmp_path):
    (tmp_path / "small").mkdir()
    command = (f"dd if=/dev/zero of={tmp_path}/small/fill bs=4k 2>/dev/null; "
               f"{sys.executable} generate.py --net {nets['net']} --outdir {tmp_path}/small/out --seeds=0-3 {' '.join(FAST)}; "
               f"status=$?; ls -A {tmp_path}/small/out; exit $status")
    result = run_in_namespace("size=64k", command, tmp_path / "small")
    assert_one_error_line(result, f"{tmp_path}/small/out/000000.png: No space left on device")
    # The listing of out/ (the last lines of stdout) holds neither an image nor a temporary.
    assert "Generating 4 images" in result.stdout
    assert not [name for name in result.stdout.split() if name.endswith((".png", TMP_SUFFIX))], result.stdout


def test_class_lists_sample_every_seed_in_each_class_and_grid_rows_are_classes(nets, tmp_path):
    out, single = tmp_path / "out", tmp_path / "single"
    assert run_cli(["--net", nets["net"], "--seeds=0-1", "--class=1-3", "--grid", *FAST, "--outdir", out]).exit_code == 0
    images = read_pngs(out)
    names = [f"{seed:06d}-c{c:04d}.png" for c in (1, 2, 3) for seed in (0, 1)]
    assert sorted(images) == sorted([*names, "grid.png"])
    assert dict(json.loads((out / "labels.json").read_text())["labels"]) == {n: int(n[-6:-4]) for n in names}
    # One class per row, seeds across: 3 rows and 2 columns of 8x8 images with one-pixel gaps.
    grid = images["grid.png"]
    assert grid.shape == (3 * 9 - 1, 2 * 9 - 1, 3)
    for row, c in enumerate((1, 2, 3)):
        for col, seed in enumerate((0, 1)):
            tile = grid[row * 9:row * 9 + 8, col * 9:col * 9 + 8]
            np.testing.assert_array_equal(tile, images[f"{seed:06d}-c{c:04d}.png"])
    # The same images as a run for that one class.
    assert run_cli(["--net", nets["net"], "--seeds=0-1", "--class=2", *FAST, "--outdir", single]).exit_code == 0
    np.testing.assert_array_equal(read_pngs(single)["000001.png"], images["000001-c0002.png"])


def test_several_classes_share_batches_and_give_each_class_runs_images(nets, tmp_path, monkeypatch):
    # --class=0-4 with 2 seeds is 10 images: one batch of 10, not five of 2, each file bitwise a one-class run's.
    sizes = []
    sample = generation.sample_batch
    monkeypatch.setattr(generation, "sample_batch", lambda net, enc, seeds, *a, **k: sizes.append(len(seeds))
                        or sample(net, enc, seeds, *a, **k))
    out = tmp_path / "out"
    assert run_cli(["--net", nets["net"], "--seeds=5-6", "--class=0-4", *FAST, "--outdir", out]).exit_code == 0
    assert sizes == [10]
    images = read_pngs(out)
    for c in range(5):
        single = tmp_path / f"single{c}"
        assert run_cli(["--net", nets["net"], "--seeds=5-6", f"--class={c}", *FAST, "--outdir", single]).exit_code == 0
        for seed, image in read_pngs(single).items():
            np.testing.assert_array_equal(images[f"{seed[:-4]}-c{c:04d}.png"], image)
    assert sizes == [10] + [2] * 5


def test_class_seeds_are_every_seed_in_each_class_in_order():
    # ClassSeeds is every seed in each class, class by class, computed pair by pair.
    pairs = generation.ClassSeeds(SeedList().convert("3,7-8", None, None), range(10, 12))
    assert len(pairs) == 6 and pairs[:] == [(3, 10), (3, 11), (7, 10), (7, 11), (8, 10), (8, 11)]
    assert pairs[-1] == (8, 11) and pairs[2:4] == [(7, 10), (7, 11)]
    with pytest.raises(IndexError):
        pairs[6]


@pytest.mark.bad_input
@pytest.mark.parametrize("classes, message", [("0-9", "9 is not a class of this network (5 classes)"),
                                              ("3-1", "'3-1': a range must not end before it starts"),
                                              ("1,x", "expected numbers and ranges")])
def test_class_lists_out_of_range_are_refused(nets, tmp_path, classes, message):
    out = tmp_path / "out"
    assert_refused(tmp_path, lambda: run_cli(["--net", nets["net"], f"--class={classes}", *FAST, "--outdir", out]),
                   "--class", message)
