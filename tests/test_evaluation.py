"""Evaluation as papers report it (calculate_metrics.py): feature metrics from the one feature pass with the
reference's kept features, disjoint seed sets with every digest, sweeps over guidance and EMA length, bad input."""

import functools
import hashlib
import json
import statistics
import zipfile

import numpy as np
import PIL.Image
import pytest
import torch
from click.testing import CliRunner

import calculate_metrics
from cli import evaluation
from edm2.encoders import StandardRGBEncoder
from edm2.eval import detectors, metrics, prdc, sweep as sweep_lib
from edm2.eval.stats_files import MAX_KEPT_FEATURES, StatsError, load_stats, save_stats
from edm2.formats.snapshot import save_network
from edm2.plots.sweep import ema_guidance_figure, guidance_figure
from edm2.procedures import generation
from edm2.sampler import edm_sampler
from tests.helpers import TinyInceptionStandIn, assert_refused, pin_detector_file, randomized, tiny_precond


def run(*args):
    return CliRunner().invoke(calculate_metrics.main, [str(a) for a in args])


def last_json(result):
    assert result.exit_code == 0, result.output
    return json.loads(result.output.strip().splitlines()[-1])


@pytest.fixture
def few_steps(monkeypatch):
    """Sample with 4 steps, not 32: the tests compare commands with each other, not with the paper's samples."""
    monkeypatch.setattr(generation, "edm_sampler", functools.partial(edm_sampler, num_steps=4))


@pytest.fixture
def inception(tmp_path, monkeypatch):
    """The tiny stand-in detector as the published Inception file (tests/helpers.py)."""
    torch.manual_seed(0)
    path = tmp_path / "inception.pt"
    torch.jit.save(torch.jit.script(TinyInceptionStandIn()), path)
    pin_detector_file(monkeypatch, "fid", path)
    monkeypatch.setenv("EDM2_CACHE_DIR", str(tmp_path / "cache"))
    return f"--inception={path}"


def write_pngs(folder, num, seed, brightness):
    rng = np.random.default_rng(seed)
    folder.mkdir()
    for i in range(num):
        pixels = np.clip(rng.normal(brightness, 60, size=(8, 8, 3)), 0, 255).astype(np.uint8)
        PIL.Image.fromarray(pixels).save(folder / f"img{i:04d}.png")
    return folder


def pixels(folder, order):
    paths = sorted(folder.glob("*.png"))
    return torch.from_numpy(np.stack([np.asarray(PIL.Image.open(paths[i])).transpose(2, 0, 1) for i in order]))


def test_feature_metrics_come_from_the_kept_features_of_one_pass(tmp_path, inception):
    # Issue 30, Must show 1 end to end: ref keeps the features of a seeded subset; calc's kid, precision, recall,
    # density and coverage equal edm2.eval.prdc on the detector's features of those images, computed here.
    real, fake = write_pngs(tmp_path / "real", 20, 1, 100), write_pngs(tmp_path / "fake", 16, 2, 130)
    assert run("ref", f"--data={real}", f"--dest={tmp_path / 'ref.npz'}", "--metrics=fid", "--features=10",
               inception).exit_code == 0
    kept = load_stats(tmp_path / "ref.npz")["fid"]["features"]
    order = evaluation.reference_order(20, 10)
    assert sorted(order[:10]) == list(order[:10]) and sorted(order) == list(range(20))
    detector = detectors.load_detector("fid", inception.split("=", 1)[1])
    # The same images, in the same order; float32 features, whose sums another thread count may order otherwise:
    # a few float32 steps of the largest feature (tests/test_calculate_metrics.py FLOAT32_PASS).
    direct = detector(pixels(real, order)).numpy()[:10]
    assert np.abs(kept - direct).max() <= 1e-5 * np.abs(direct).max()
    names = "fid,kid,precision,recall,density,coverage"
    values = last_json(run("calc", f"--images={fake}", f"--ref={tmp_path / 'ref.npz'}", f"--metrics={names}",
                           "--num=16", inception))["results"]
    ours = detector(pixels(fake, range(16))).double()[:10]  # as many generated features as the reference keeps
    want = dict(kid=prdc.kernel_inception_distance(torch.from_numpy(kept), ours),
                **prdc.precision_recall_density_coverage(torch.from_numpy(kept), ours))
    # Counts of points in balls are exact unless a float32 step moves a point across a radius (probability ~0);
    # KID is a smooth function of features a few float32 steps apart.
    assert {k: values[k] for k in want} == pytest.approx(want, rel=1e-4, abs=1e-12)
    assert 0 <= values["precision"] <= 1 and values["kid"] > 0


def test_kept_features_round_trip_and_are_bounded(tmp_path):
    rng = np.random.default_rng(0)
    stats = {"fid": {"mu": rng.normal(size=4), "sigma": np.eye(4), "features": rng.normal(size=(6, 4))}}
    save_stats(tmp_path / "s.npz", stats)
    loaded = load_stats(tmp_path / "s.npz")["fid"]
    assert loaded["features"].dtype == np.float32
    assert np.array_equal(loaded["features"], stats["fid"]["features"].astype(np.float32))
    for bad, message in [(rng.normal(size=(6, 5)), "expected [N, 4]"), (np.full((6, 4), np.nan), "not finite")]:
        save_stats(tmp_path / "bad.npz", {"fid": dict(stats["fid"], features=bad)})
        with pytest.raises(StatsError, match=message.replace("[", r"\[")):
            load_stats(tmp_path / "bad.npz")
    # A header declaring more rows than any reference keeps is refused before a byte of it is allocated.
    with open(tmp_path / "big.npz", "wb") as f:
        np.savez(f, **{"fid/mu": np.zeros(4), "fid/sigma": np.eye(4)})
    header = np.lib.format.header_data_from_array_1_0(np.zeros((MAX_KEPT_FEATURES + 1, 4), np.float32))
    with zipfile.ZipFile(tmp_path / "big.npz", "a") as archive, archive.open("fid/features.npy", "w") as member:
        np.lib.format.write_array_header_1_0(member, header)
    with pytest.raises(StatsError, match="declares shape"):
        load_stats(tmp_path / "big.npz")


def snapshot(path, seed, label_dropout=0.0, ema_std=0.1):
    torch.manual_seed(seed)
    save_network(path, randomized(tiny_precond(label_dim=0), seed),
                 {"encoder": StandardRGBEncoder().config(), "ema_std": ema_std, "nimg": 4096,
                  "training_options": {"label_dropout": label_dropout}})
    return path


def test_three_seed_sets_report_each_value_mean_std_min_and_every_digest(tmp_path, inception, few_steps):
    # Issue 30, Must show 4: three disjoint seed sets, each value equal to gen over that set alone; their mean,
    # std and minimum; the results file with the digest of every input.
    real = write_pngs(tmp_path / "real", 12, 1, 100)
    ref = tmp_path / "ref.npz"
    assert run("ref", f"--data={real}", f"--dest={ref}", "--metrics=fid", inception).exit_code == 0
    net, gnet = snapshot(tmp_path / "net.safetensors", 1), snapshot(tmp_path / "gnet.safetensors", 2)
    common = [f"--net={net}", f"--ref={ref}", "--metrics=fid,kid,recall", "--num=6", "--batch=6", inception,
              f"--gnet={gnet}", "--guidance=1.5"]
    record = last_json(run("gen", *common, "--seed=3", "--seed-sets=3", f"--results={tmp_path / 'results.json'}"))
    assert record == json.loads((tmp_path / "results.json").read_text())
    assert record["seed_sets"] == ["3-8", "9-14", "15-20"]
    assert record["values"][1] == last_json(run("gen", *common, "--seed=9"))["results"]  # bit for bit
    for metric in ("fid", "kid", "recall"):
        got = [values[metric] for values in record["values"]]
        assert record["summary"][metric] == pytest.approx(dict(mean=statistics.fmean(got), std=statistics.stdev(got),
                                                               min=min(got)), rel=1e-12)
    digest = {path: hashlib.sha256(path.read_bytes()).hexdigest() for path in (ref, net, gnet)}
    assert record["ref"] == {"path": str(ref), "sha256": digest[ref]}
    assert record["net"] == {"path": str(net), "sha256": digest[net], "nimg": 4096, "ema_std": 0.1}
    assert record["gnet"] == {"path": str(gnet), "sha256": digest[gnet]}
    assert record["sampler"] == {"guidance": 1.5, "guidance_interval": None, "solver": "heun", "schedule": "edm",
                                 "num_steps": 32}
    assert record["detectors"] == {"fid": {"url": detectors.INCEPTION_URL, "sha256": detectors.PUBLISHED["fid"].sha256}}
    explicit = last_json(run("gen", *common, "--seed-sets=15-20,9-14"))
    assert explicit["values"] == record["values"][:0:-1]


def test_sweep_over_guidance_and_ema_length_draws_both_plots(reference_run, tmp_path, inception, monkeypatch,
                                                             few_steps):
    # Issue 30, Must show 3: 3 guidance strengths x 4 EMA lengths, autoguidance by the run's early snapshot; one
    # feature pass per point, the loss once per EMA length; each row equal to a sweep at that strength alone.
    passes = []
    calculate = metrics.calculate_stats
    monkeypatch.setattr(sweep_lib, "calculate_stats", lambda *a, **k: passes.append(1) or calculate(*a, **k))
    data = tmp_path / "data"
    write_pngs(data, 12, 1, 100)
    assert run("ref", f"--data={data}", f"--dest={tmp_path / 'ref.npz'}", "--metrics=fid", inception).exit_code == 0
    gnet = reference_run / "network-snapshot-0000001-0.050.safetensors"
    common = [f"--indir={reference_run}", "--std=0.05,0.1,0.15,0.2", "--metrics=fid,kid",
              f"--ref={tmp_path / 'ref.npz'}", "--num=4", "--batch=4", inception, f"--gnet={gnet}"]
    result = run("sweep", *common, "--guidance=1,1.5,2.5", f"--dest={tmp_path / 'grid'}")
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "grid" / sweep_lib.SWEEP_JSON).read_text())["rows"]
    assert sorted((row["std"], row["guidance"]) for row in rows) == [(s, g) for s in (0.05, 0.1, 0.15, 0.2)
                                                                     for g in (1, 1.5, 2.5)]
    assert len(passes) == 12
    for name in (sweep_lib.SWEEP_PNG, sweep_lib.EMA_GUIDANCE_PNG, sweep_lib.GUIDANCE_PNG):
        with PIL.Image.open(tmp_path / "grid" / name) as image:
            assert image.format == "PNG"
    table = (tmp_path / "grid" / sweep_lib.SWEEP_CSV).read_text().splitlines()
    assert table[0] == "kimg,std,guidance,fid,kid,profile_error" and len(table) == 13
    ax = ema_guidance_figure(rows, ["fid"]).axes[0]
    curves = [line for line in ax.get_lines() if len(line.get_xdata()) > 1]
    assert [list(line.get_xdata()) for line in curves] == [[0.05, 0.1, 0.15, 0.2]] * 3
    assert [list(line.get_ydata()) for line in curves] == [
        [row["fid"] for row in sorted(rows, key=lambda r: r["std"]) if row["guidance"] == g] for g in (1, 1.5, 2.5)]
    ax = guidance_figure(rows, ["kid"]).axes[0]
    assert [list(line.get_xdata()) for line in ax.get_lines() if len(line.get_xdata()) > 1] == [[1, 1.5, 2.5]] * 4
    alone = run("sweep", *common[:1], "--std=0.1", *common[2:], "--guidance=2.5", f"--dest={tmp_path / 'alone'}")
    assert alone.exit_code == 0, alone.output
    [row] = json.loads((tmp_path / "alone" / sweep_lib.SWEEP_JSON).read_text())["rows"]
    [same] = [r for r in rows if r["std"] == 0.1 and r["guidance"] == 2.5]
    assert (row["fid"], row["kid"]) == (same["fid"], same["kid"])


@pytest.mark.bad_input
@pytest.mark.parametrize("args, fragments", [
    (["gen", "--seed=4294967290", "--num=4", "--seed-sets=3"], ["--seed-sets", "past 4294967295"]),
    (["gen", "--seed-sets=0-9,5-14"], ["--seed-sets", "overlap"]),
    (["gen", "--seed-sets=0"], ["--seed-sets", "count of seed sets"]),
    (["gen", "--metrics=fid,precision"], ["--ref", "keeps none fid features", "--features=10000"]),
    (["gen", "--results=."], ["--results", "is a folder"]),
    (["ref", "--features=2"], ["--features", "no k-NN balls"]),
    (["sweep", "--guidance=0.5,2"], ["--guidance", "0.5 is below 1"]),
])
def test_bad_evaluation_input_is_one_line(tmp_path, inception, args, fragments, monkeypatch):
    monkeypatch.chdir(tmp_path)
    stats = {"fid": {"mu": np.zeros(12), "sigma": np.eye(12)}}
    save_stats(tmp_path / "nofeatures.npz", stats)
    net = snapshot(tmp_path / "net.safetensors", 1)
    given = {"gen": [f"--net={net}", f"--ref={tmp_path / 'nofeatures.npz'}", "--metrics=fid", "--num=4", inception],
             "ref": [f"--data={tmp_path}", f"--dest={tmp_path / 'out.npz'}", inception],
             "sweep": [f"--indir={tmp_path}", "--std=0.1", f"--ref={tmp_path / 'nofeatures.npz'}", "--metrics=fid",
                       f"--gnet={net}", inception]}[args[0]]
    assert_refused(tmp_path, lambda: run(args[0], *given, *args[1:]), *fragments)


def test_the_best_of_precision_and_the_like_is_the_highest():
    rows = [dict(nimg=2048, std=s, guidance=g, fid=f, recall=r)
            for s, g, f, r in [(0.05, 1, 3.0, 0.5), (0.1, 1, 2.0, 0.4), (0.05, 2, 1.0, 0.7), (0.1, 2, 4.0, 0.9)]]
    assert sweep_lib.best_rows(rows[:2], "fid")[2048]["std"] == 0.1
    assert sweep_lib.best_rows(rows[:2], "recall")[2048]["std"] == 0.05
    table = sweep_lib.table_text(rows, "recall", [1, 2]).splitlines()
    assert table[1:] == ["     0.050      0.5000*     0.7000 ", "     0.100      0.4000      0.9000*"]
