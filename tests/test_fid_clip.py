"""The FID-CLIP curve: prompts of seeds, each point against an independent computation, and calculate_metrics.py
fid-clip end to end with stand-in detectors and a stand-in generator (its JSON is its plot's points); bad input."""

import dataclasses
import json
import math
import shutil

import numpy as np
import PIL.Image
import pytest
import scipy.linalg
import torch
from click.testing import CliRunner

import calculate_metrics
from edm2.encoders import StandardRGBEncoder
from edm2.eval import clip_score, detectors, fid_clip
from edm2.eval.metrics import calculate_stats
from edm2.eval.stats_files import save_stats
from edm2.sampler import SELF
from edm2.formats.snapshot import load_generator, save_network
from tests.clip_helpers import pin_tiny_clip, tiny_clip
from edm2.procedures.generation import sample_batch
from edm2.procedures import prompts as prompt_files
from edm2.procedures.prompts import PromptConditions, load_prompt_encoder, text_record
from tests.helpers import TinyInceptionStandIn, assert_refused, pin_detector_file, tiny_precond
from tests.text_helpers import tiny_text_encoder, tiny_text_snapshot

PROMPTS = ["a red circle on the left", "a blue square on the right", "a green circle", "the right square"]
COLOURS = {"red": (200, 40, 40), "blue": (40, 40, 200), "green": (40, 200, 40), "the": (128, 128, 128)}


def standin_generate(seeds, prompts, guidance):
    """Images that depend on their seed, prompt and guidance alone: the prompt's colour, noise shrinking with
    guidance (so FID and CLIP score move along the curve)."""
    images = []
    for seed, prompt in zip(seeds, prompts):
        rng = np.random.default_rng(seed)
        colour = np.array(COLOURS[prompt.split()[1] if prompt.startswith("a ") else "the"], np.float64)
        noise = rng.normal(0, 80 / guidance, size=(3, 16, 16))
        images.append(np.clip(colour[:, None, None] + noise, 0, 255).astype(np.uint8))
    return torch.from_numpy(np.stack(images))


@pytest.fixture
def standins(tmp_path, monkeypatch):
    """The stand-in Inception and the tiny CLIP pinned as the published detectors, and reference statistics."""
    monkeypatch.setenv("EDM2_CACHE_DIR", str(tmp_path / "cache"))
    torch.manual_seed(0)
    torch.jit.save(torch.jit.script(TinyInceptionStandIn()), tmp_path / "inception.pt")
    pin_detector_file(monkeypatch, "fid", tmp_path / "inception.pt")
    clip_folder = tiny_clip(tmp_path / "clip")
    pin_tiny_clip(monkeypatch, clip_folder)
    inception = detectors.load_detector("fid", tmp_path / "inception.pt")
    rng = np.random.default_rng(7)
    reference_images = torch.from_numpy(rng.integers(0, 256, size=(40, 3, 16, 16), dtype=np.uint8))
    reference, _ = calculate_stats([reference_images], {"fid": inception}, progress=False)
    save_stats(tmp_path / "ref.npz", reference)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"{line}\n" for line in PROMPTS))
    return dict(root=tmp_path, inception=inception, clip=clip_score.ClipScore(clip_folder), reference=reference,
                clip_folder=clip_folder, ref=tmp_path / "ref.npz", prompts=prompts)


def test_read_prompts_one_a_line(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("a red circle\n\n  a blue square  \r\nthe end")
    assert prompt_files.read_prompts(path) == ["a red circle", "a blue square", "the end"]


@pytest.mark.parametrize("content, fragment", [(b"", "holds no prompt"), (b"\n \n", "holds no prompt"),
                                               (b"caf\xe9\n", "is not UTF-8 text")])
def test_unreadable_prompts_are_refused_in_one_line(tmp_path, content, fragment):
    path = tmp_path / "prompts.txt"
    path.write_bytes(content)
    with pytest.raises(prompt_files.PromptsError, match=fragment) as info:
        prompt_files.read_prompts(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_a_prompts_file_past_the_limit_is_refused_before_reading(tmp_path, monkeypatch):
    monkeypatch.setattr(prompt_files, "MAX_PROMPTS_BYTES", 10)
    path = tmp_path / "prompts.txt"
    path.write_text("a prompt longer than ten bytes\n")
    with pytest.raises(prompt_files.PromptsError, match="at most 10"):
        prompt_files.read_prompts(path)


def test_seed_s_gets_prompt_s_mod_n_and_every_seed_one_image():
    calls = []

    def generate(seeds, prompts, guidance):
        calls.append((seeds, prompts, guidance))
        return torch.zeros([len(seeds), 3, 4, 4], dtype=torch.uint8)

    source = fid_clip.prompt_source(generate, PROMPTS, range(5, 16), batch_size=4)
    batches = list(source(2.5))
    seeds = [seed for batch_seeds, _, _ in calls for seed in batch_seeds]
    assert seeds == list(range(5, 16))
    assert all(prompts == [PROMPTS[seed % 4] for seed in batch_seeds] for batch_seeds, prompts, _ in calls)
    assert {guidance for _, _, guidance in calls} == {2.5}
    assert [prompts for _, prompts in batches] == [prompts for _, prompts, _ in calls]
    assert all(len(batch_seeds) <= 4 for batch_seeds, _, _ in calls)


def frechet_by_hand(features, reference):
    """FID of float64 features against reference statistics, with NumPy's mean and covariance and scipy's sqrtm."""
    mu, sigma = features.mean(0), np.cov(features, rowvar=False)
    root = scipy.linalg.sqrtm(sigma @ reference["sigma"]).real
    return float(((mu - reference["mu"]) ** 2).sum() + np.trace(sigma + reference["sigma"] - 2 * root))


def test_each_point_is_the_fid_and_mean_clip_score_of_its_images(standins):
    seeds, batch = range(0, 22), 8
    source = fid_clip.prompt_source(standin_generate, PROMPTS, seeds, batch)
    points = fid_clip.fid_clip_curve([1.0, 3.0], source, standins["inception"], standins["clip"],
                                     standins["reference"])
    assert [p["guidance"] for p in points] == [1.0, 3.0]
    prompts = [PROMPTS[s % len(PROMPTS)] for s in seeds]
    # The same batches as the curve's (np.array_split into ceil(22 / 8) parts): the same float32 features.
    chunks = np.array_split(np.arange(len(seeds)), math.ceil(len(seeds) / batch))
    for point in points:
        images = standin_generate(list(seeds), prompts, point["guidance"])
        features = np.concatenate([standins["inception"](images[c]).double().numpy() for c in chunks])
        scores = torch.cat([standins["clip"](images[c], [prompts[i] for i in c]) for c in chunks]).double()
        assert point["num_images"] == len(seeds)
        # float64 statistics summed in another order: relative round-off of a few float64 epsilons per term.
        assert point["fid"] == pytest.approx(frechet_by_hand(features, standins["reference"]["fid"]), rel=1e-9,
                                             abs=1e-9)
        assert point["clip_score"] == pytest.approx(scores.mean().item(), rel=1e-12)
    assert points[0]["fid"] != points[1]["fid"] and points[0]["clip_score"] != points[1]["clip_score"]


def run_fid_clip(standins, *extra, prompts=None, net="net.safetensors"):
    root = standins["root"]
    args = ["fid-clip", "--net", root / net, "--prompts", prompts or standins["prompts"], "--ref", standins["ref"],
            "--clip", standins["clip_folder"], "--inception", root / "inception.pt", "--num", 10, "--batch", 4,
            *extra]
    return CliRunner().invoke(calculate_metrics.main, [str(a) for a in args])


@pytest.fixture
def standin_generator(monkeypatch):
    """calculate_metrics.py's text-to-image generator replaced by standin_generate (no text network here)."""
    seen = []

    def generator(net_path, gnet_path, text_encoder, device, sampler):
        seen.append((net_path, gnet_path, sampler))
        return standin_generate

    monkeypatch.setattr(calculate_metrics, "text_generator", generator)
    return seen


def test_the_command_writes_the_curve_and_its_json_is_its_plots_points(standins, standin_generator, monkeypatch):
    figures = plotted_figures(monkeypatch)
    dest = standins["root"] / "out" / "curve.json"
    result = run_fid_clip(standins, "--guidance", "4,1,2", "--gnet", "self", "--dest", dest)
    assert result.exit_code == 0, result.output
    record = json.loads(dest.read_text())
    assert record == json.loads(result.stdout.splitlines()[-1])
    points = record["points"]
    assert [p["guidance"] for p in points] == [1, 2, 4]  # sorted and distinct, as every guidance list
    assert all(p["num_images"] == 10 for p in points)
    settings = record["settings"]
    assert settings["num_prompts"] == len(PROMPTS) and settings["seeds"] == "0-9"
    assert settings["prompt_of_seed"] == "prompts[seed % len(prompts)]"
    assert settings["detectors"]["clip_score"]["model.safetensors"]["sha256"] == clip_score.VIT_L14.weights.sha256
    assert standin_generator == [(str(standins["root"] / "net.safetensors"), "self",
                                  {"solver": "heun", "schedule": "edm"})]
    # The figure drawn is the JSON's points: FID on x, CLIP score on y, each labelled with its guidance.
    (ax,) = figures[0].axes
    np.testing.assert_array_equal(ax.lines[0].get_xydata(), [[p["fid"], p["clip_score"]] for p in points])
    assert [t.get_text() for t in ax.texts] == ["w=1", "w=2", "w=4"]
    assert [tuple(t.xy) for t in ax.texts] == [(p["fid"], p["clip_score"]) for p in points]
    assert ax.get_xlabel() == "FID" and ax.get_ylabel().startswith("CLIP score")
    with PIL.Image.open(dest.with_suffix(".png")) as png:
        assert png.format == "PNG" and png.size[0] > 100


def test_the_points_are_those_of_the_curve_function(standins, standin_generator):
    dest = standins["root"] / "curve.json"
    result = run_fid_clip(standins, "--guidance", "1,2", "--gnet", "self", "--dest", dest)
    assert result.exit_code == 0, result.output
    source = fid_clip.prompt_source(standin_generate, PROMPTS, range(10), 4)
    expected = fid_clip.fid_clip_curve([1.0, 2.0], source, standins["inception"], standins["clip"],
                                       standins["reference"])
    assert json.loads(dest.read_text())["points"] == pytest.approx(expected)


@pytest.mark.parametrize("guidance, fragment", [("1,abc", "--guidance"), ("1,0.5", "below 1"), ("1,,2", "--guidance")])
def test_a_bad_guidance_list_is_one_line(standins, standin_generator, guidance, fragment):
    dest = standins["root"] / "out" / "curve.json"
    assert_refused(standins["root"], lambda: run_fid_clip(standins, "--guidance", guidance, "--gnet", "self",
                                                          "--dest", dest), fragment)
    assert standin_generator == []


def test_an_empty_prompts_file_is_one_line(standins, standin_generator):
    empty = standins["root"] / "empty.txt"
    empty.write_text("")
    assert_refused(standins["root"], lambda: run_fid_clip(standins, "--dest", standins["root"] / "c.json",
                                                          "--gnet", "self", prompts=empty),
                   "--prompts", "holds no prompt")


def test_a_missing_reference_is_one_line(standins, standin_generator):
    standins["ref"].unlink()
    assert_refused(standins["root"], lambda: run_fid_clip(standins, "--dest", standins["root"] / "c.json",
                                                          "--gnet", "self"), "--ref", "ref.npz")
    assert standin_generator == []


def test_guidance_without_a_guiding_network_is_one_line(standins, standin_generator):
    assert_refused(standins["root"], lambda: run_fid_clip(standins, "--dest", standins["root"] / "c.json"),
                   "--gnet", "needs a guiding network")


def test_a_dest_that_is_not_json_is_one_line(standins, standin_generator):
    assert_refused(standins["root"], lambda: run_fid_clip(standins, "--dest", standins["root"] / "curve.png",
                                                          "--gnet", "self"), "--dest", ".json")


def plotted_figures(monkeypatch) -> list:
    """The figures calculate_metrics.py draws, kept as it draws them."""
    figures, draw = [], calculate_metrics.fid_clip_figure

    def kept(points):
        figures.append(draw(points))
        return figures[-1]

    monkeypatch.setattr(calculate_metrics, "fid_clip_figure", kept)
    return figures


def test_the_curve_of_a_real_text_network_end_to_end(standins, monkeypatch):
    root = standins["root"]
    t5 = tiny_text_encoder(root / "t5", "t5")
    tiny_text_snapshot(root / "net.safetensors", t5, tokens=6)
    figures = plotted_figures(monkeypatch)
    dest = root / "curve.json"
    result = run_fid_clip(standins, "--guidance", "1,3", "--gnet", "self", "--text-encoder", t5, "--dest", dest,
                          "--solver", "euler")
    assert result.exit_code == 0, result.output
    points = json.loads(dest.read_text())["points"]
    (ax,) = figures[0].axes
    np.testing.assert_array_equal(ax.lines[0].get_xydata(), [[p["fid"], p["clip_score"]] for p in points])
    # The points are the curve of the images the sampler makes for each seed's prompt (generate.py's sample_batch),
    # guided by the network's empty-caption branch.
    net, encoder, metadata = load_generator(root / "net.safetensors")
    conditions = PromptConditions(load_prompt_encoder(text_record(metadata), t5))

    def generate(seeds, prompts, guidance):
        guide = dict(gnet=SELF, guidance=guidance) if guidance != 1 else {}
        return sample_batch(net, encoder, seeds, None, torch.device("cpu"), conditions=conditions.of_prompts(prompts),
                            solver="euler", schedule="edm", **guide)[0]

    expected = fid_clip.fid_clip_curve([1.0, 3.0], fid_clip.prompt_source(generate, PROMPTS, range(10), 4),
                                       standins["inception"], standins["clip"], standins["reference"])
    assert points == pytest.approx(expected)
    assert points[0]["clip_score"] != points[1]["clip_score"]


def test_a_text_network_without_its_text_encoder_is_refused_naming_it(standins):
    # No --text-encoder and the recorded encoder's folder is not here (moved, or made on another machine).
    root = standins["root"]
    t5 = tiny_text_encoder(root / "t5", "t5")
    tiny_text_snapshot(root / "net.safetensors", t5, tokens=6)
    shutil.rmtree(t5)
    assert_refused(root, lambda: run_fid_clip(standins, "--gnet", "self", "--dest", root / "c.json"),
                   "--text-encoder", str(t5), "no folder here")


def test_a_class_conditional_network_is_refused_naming_net(standins):
    torch.manual_seed(0)
    save_network(standins["root"] / "class.safetensors", tiny_precond(label_dim=4),
                 {"encoder": StandardRGBEncoder().config()})
    assert_refused(standins["root"], lambda: run_fid_clip(standins, "--dest", standins["root"] / "c.json",
                                                          "--gnet", "self", net="class.safetensors"),
                   "--net", "not a text-to-image network")


def test_clip_files_that_are_not_pinned_are_refused_naming_clip(standins, standin_generator, monkeypatch):
    monkeypatch.setattr(clip_score, "VIT_L14", dataclasses.replace(
        clip_score.VIT_L14, vocab=dataclasses.replace(clip_score.VIT_L14.vocab, sha256="")))
    assert_refused(standins["root"], lambda: run_fid_clip(standins, "--dest", standins["root"] / "c.json",
                                                          "--gnet", "self"), "--clip", "not pinned")
