"""The run dashboard and the magnitude probe: what training records under RUN/plots/, checked against independent
computations; the figures plot exactly the recorded numbers; plot_run.py redraws a run from its files alone."""

import gc
import json
import math
import shutil
import weakref

import matplotlib.colors
import numpy as np
import PIL.Image
import pytest
import torch
from click.testing import CliRunner

import plot_run
from edm2.data.dataset import ImageFolderDataset
from edm2.encoders import StandardRGBEncoder
from edm2.layers import MPConv
from edm2.plots.run import dashboard_figure, magnitudes_figure
from edm2.eval.validation import sigma_grid
from training.run.dashboard import LOSS_MEAN_TAG, PROBE_IMAGES, Dashboard, snapshot_numbers
from training.options import TrainingOptions
from tests.helpers import REPO, assert_refused, randomized, tiny_precond

TOY_TINY = dict(P_mean=-0.8, P_std=1.6)  # training/presets.py's toy-tiny row, typed in again


def plotted_lines(figure) -> dict[str, list[tuple[np.ndarray, np.ndarray]]]:
    """{axes title: [(x, y) of every line with data]} of a figure."""
    return {ax.get_title(): [(np.asarray(line.get_xdata(), float), np.asarray(line.get_ydata(), float))
                             for line in ax.get_lines() if len(line.get_xdata())] for ax in figure.axes}


def stats_columns(run) -> dict[str, list[float]]:
    rows = [json.loads(line) for line in (run / "stats.jsonl").read_text().splitlines()]
    return {key: [row.get(key) for row in rows] for key in ("kimg", "loss", "lr", "images_per_s", "mfu")}


def test_training_records_and_draws_the_dashboard(reference_run):
    plots = reference_run / "plots"
    # magnitudes.png is drawn at the run's last snapshot, as redraw() (plot_run.py) draws it.
    assert sorted(p.name for p in plots.iterdir()) == ["magnitudes.json", "magnitudes.png", "training.json",
                                                       "training.png"]
    with PIL.Image.open(plots / "training.png") as image:
        assert image.format == "PNG" and image.size == (880, 520)
    with PIL.Image.open(plots / "magnitudes.png") as image:
        assert image.format == "PNG" and image.size == (1100, 450)
    training = json.loads((plots / "training.json").read_text())
    assert training["stats"] == stats_columns(reference_run)
    # Eq. 16's bulk, P_mean +- 2.5 P_std, in 11 steps even in ln(sigma).
    expected_sigma = [math.exp(TOY_TINY["P_mean"] + TOY_TINY["P_std"] * (-2.5 + 0.5 * k)) for k in range(11)]
    np.testing.assert_allclose(training["sigma"], expected_sigma, rtol=1e-14)  # exp of float64 grid points
    assert [row["nimg"] for row in training["noise_levels"]] == [1024, 2048]  # one row per snapshot
    assert training["ema_std"] == 0.05 and training["probe"]["indices"] == [i * 48 // 8 for i in range(8)]
    newest = training["noise_levels"][-1]
    assert all(len(newest[key]) == 11 and all(map(math.isfinite, newest[key])) for key in ("weighted_error", "u"))

    # The figure plots the recorded numbers, nothing else: the curves and Eq. 21's halves of the newest row.
    lines = plotted_lines(dashboard_figure(training))
    stats = training["stats"]
    for title, key in (("training loss (Eq. 21)", "loss"), ("learning rate (Eq. 67)", "lr"), ("images/s", "images_per_s")):
        [(x, y)] = lines[title]
        assert x.tolist() == stats["kimg"] and y.tolist() == stats[key]
    error, u = np.array(newest["weighted_error"]), np.array(newest["u"])
    [halves, fit] = [lines[t] for t in lines if "kimg 2.0" in t]
    for (x, y), expected in zip(halves, (error / np.exp(u), u, error / np.exp(u) + u)):
        assert x.tolist() == training["sigma"] and y.tolist() == expected.tolist()
    for (x, y), expected in zip(fit, (np.log(error), u)):
        assert y.tolist() == expected.tolist()

    magnitudes = json.loads((plots / "magnitudes.json").read_text())
    rows = magnitudes["rows"]
    assert [row["nimg"] for row in rows] == [1024, 2048]
    # Paper Figure 3, config G: forced weight normalization puts every raw weight back at unit RMS before each
    # step, and one Adam step moves an element by at most about lr = 0.01; the EMA averages such weights.
    assert all(abs(value - 1) < 0.01 for row in rows for value in row["weights"].values())
    assert all(0.2 < value < 10 for row in rows for value in row["activations"].values())
    lines = plotted_lines(magnitudes_figure(magnitudes))
    for key, title in (("activations", "block outputs"), ("weights", "layer weights")):
        [plotted] = [lines[t] for t in lines if t.startswith(title)]
        expected = [[row[key][name] for row in rows] for name in rows[-1][key]]
        assert [y.tolist() for _, y in plotted] == expected
        assert all(x.tolist() == [1.024, 2.048] for x, _ in plotted)


def test_status_lines_show_progress_and_eta(reference_run):
    lines = [line for line in (reference_run / "log.txt").read_text().splitlines() if line.startswith("kimg ")]
    assert [line.split()[1] for line in lines] == ["0.5/2.0", "1.0/2.0", "1.5/2.0", "2.0/2.0"]
    assert all(" ETA " in line for line in lines) and lines[-1].endswith("ETA 0h00m00s")


def block_outputs_by_hand(net, x, sigma, labels) -> dict[str, float]:
    """RMS of each U-Net block's output, walking the U-Net as Figure 22 draws it (no hooks)."""
    unet, sd = net.unet, net.sigma_data
    c_in, c_noise = 1 / (sd**2 + sigma**2).sqrt(), sigma.flatten().log() / 4
    emb = unet.emb_noise(unet.emb_fourier(c_noise))
    emb = unet.emb_label(labels * math.sqrt(labels.shape[1])).lerp(emb, 0.5) / math.sqrt(0.5)  # mp_sum, t=0.5
    emb = torch.nn.functional.silu(emb) / 0.596
    h = torch.cat([c_in * x, torch.ones_like(x[:, :1])], dim=1)
    rms, skips = {}, []
    for name, block in unet.enc.items():
        h = block(h) if name.endswith("_conv") else block(h, emb)
        skips.append(h)
        if not name.endswith("_conv"):
            rms[f"enc.{name}"] = h.double().square().mean().sqrt().item()
    for name, block in unet.dec.items():
        if "block" in name:
            skip = skips.pop()
            a, b = h.shape[1], skip.shape[1]
            h = torch.cat([h / math.sqrt(a), skip / math.sqrt(b)], dim=1) * math.sqrt((a + b) / 2)  # mp_cat, t=0.5
        h = block(h, emb)
        rms[f"dec.{name}"] = h.double().square().mean().sqrt().item()
    return rms


def update_from_a_caller(dashboard, net, nimg) -> weakref.ref:
    """dashboard.update called from a frame with a local object; returns a weak reference to that object.

    In a training, the caller's frames hold the data loader; a reference cycle through them (matplotlib's mathtext
    parser makes them: exceptions that keep their tracebacks) kept its worker processes alive past the run, and
    the interpreter waited for them at exit forever."""
    local = torch.zeros(1)
    dashboard.update(net, nimg)
    return weakref.ref(local)


def test_the_probe_equals_independent_computations(train_data, tmp_path):
    torch.manual_seed(1)
    net = randomized(tiny_precond(label_dim=4), seed=1).eval()
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, MPConv):
                m.weight.mul_(1.5)  # raw weights away from unit RMS, as in an unnormalized network
    dataset = ImageFolderDataset(train_data)
    opts = TrainingOptions.from_preset("toy-tiny", dict(resolution=8, num_channels=3, label_dim=4),
                                       StandardRGBEncoder().config(), run_dir=str(tmp_path), data=str(train_data))
    (tmp_path / "stats.jsonl").write_text(json.dumps(dict(kimg=1.024, nimg=1024, loss=1.0, lr=0.01, images_per_s=9)))
    dashboard = Dashboard(tmp_path, opts, dataset, StandardRGBEncoder(), net, torch.device("cpu"), cur_nimg=0)
    gc.disable()  # what is left only in reference cycles lives until a collection, maybe past the run's end
    try:
        caller = update_from_a_caller(dashboard, net, 1024)
        assert caller() is None  # freed on return, not by the garbage collector
    finally:
        gc.enable()
    training = json.loads((tmp_path / "plots" / "training.json").read_text())
    [row] = json.loads((tmp_path / "plots" / "magnitudes.json").read_text())["rows"]

    # The fixed batch: images evenly spaced through the dataset; sample i's generator (seed i) draws ln(sigma), then n.
    images = np.stack([np.asarray(PIL.Image.open(path)) for path in sorted(train_data.rglob("*.png"))])
    labels_of = dict(json.loads((train_data / "dataset.json").read_text())["labels"])
    names = sorted(p.relative_to(train_data).as_posix() for p in train_data.rglob("*.png"))
    indices = [i * len(images) // PROBE_IMAGES for i in range(PROBE_IMAGES)]
    y = torch.from_numpy(images[indices]).permute(0, 3, 1, 2).contiguous().float() / 127.5 - 1  # as the encoder
    labels = torch.nn.functional.one_hot(torch.tensor([labels_of[names[i]] for i in indices]), 4).float()
    draws = [torch.Generator().manual_seed(i) for i in range(PROBE_IMAGES)]
    sigma = torch.stack([(torch.randn([], generator=g, dtype=torch.float32) * 1.6 - 0.8).exp() for g in draws])
    noise = torch.stack([torch.randn([3, 8, 8], generator=g) for g in draws])
    for s, error, u in zip(training["sigma"], training["noise_levels"][0]["weighted_error"],
                           training["noise_levels"][0]["u"]):
        with torch.no_grad():
            denoised, logvar = net(y + s * noise, s, labels, return_logvar=True)
        lam = (s**2 + 0.25) / (s * 0.5) ** 2  # Eq. 15, sigma_data = 0.5
        # Same float32 network on the same batch; float64 means of 8 * 192 terms differ only in order (~1e-13).
        assert error == pytest.approx(lam * (denoised.double() - y.double()).square().mean().item(), rel=1e-12)
        assert u == pytest.approx(logvar[0].item(), rel=1e-12, abs=1e-12)
    x = y + sigma.reshape(-1, 1, 1, 1) * noise
    with torch.no_grad():
        expected = block_outputs_by_hand(net, x, sigma.reshape(-1, 1, 1, 1), labels)
    assert list(row["activations"]) == list(expected)
    # float32 activations summed in float64; the hand-walked U-Net applies mp_sum/mp_cat in another order:
    # a few float32 roundings per layer, ~1e-6 relative.
    assert row["activations"] == pytest.approx(expected, rel=1e-5)
    weights = {name.removeprefix("unet.").removesuffix(".weight"): np.sqrt(np.mean(np.float64(t.numpy()) ** 2))
               for name, t in net.state_dict().items() if name.endswith("weight")}
    assert row["weights"] == pytest.approx(weights, rel=1e-12)  # float64 mean of the same float32 values
    assert all(v == pytest.approx(1.5, rel=0.2) for v in row["weights"].values())

    # A run with --status=0 (or a status interval longer than the snapshot interval) has no status row yet.
    (tmp_path / "stats.jsonl").unlink()
    dashboard.update(net, 2048)
    training = json.loads((tmp_path / "plots" / "training.json").read_text())
    assert training["stats"] == {"kimg": [], "loss": [], "lr": [], "images_per_s": [], "mfu": []}
    assert [row["nimg"] for row in training["noise_levels"]] == [1024, 2048]


def copy_records(run, dest):
    """What a cluster run's records are without its snapshots and dataset: stats.jsonl and plots/*.json."""
    (dest / "plots").mkdir(parents=True)
    shutil.copy(run / "stats.jsonl", dest)
    for name in ("training.json", "magnitudes.json"):
        shutil.copy(run / "plots" / name, dest / "plots")
    return dest


def test_plot_run_redraws_from_the_records_alone(reference_run, tmp_path):
    run = copy_records(reference_run, tmp_path / "copied")
    before = json.loads((run / "plots" / "training.json").read_text())
    result = CliRunner().invoke(plot_run.main, [str(run)])
    assert result.exit_code == 0, result.output
    assert f"Saved {run / 'plots' / 'training.png'}" in result.output
    assert f"Saved {run / 'plots' / 'magnitudes.png'}" in result.output
    for name, size in (("training.png", (880, 520)), ("magnitudes.png", (1100, 450))):
        with PIL.Image.open(run / "plots" / name) as image:
            assert image.size == size
    assert json.loads((run / "plots" / "training.json").read_text()) == before
    assert sorted(p.name for p in (run / "plots").iterdir()) == [
        "magnitudes.json", "magnitudes.png", "training.json", "training.png"]


def test_plot_run_on_a_run_without_records_draws_the_curves(reference_run, tmp_path):
    # A run from before the dashboard, or one whose plots/ was not copied: stats.jsonl alone.
    (tmp_path / "old").mkdir()
    shutil.copy(reference_run / "stats.jsonl", tmp_path / "old")
    result = CliRunner().invoke(plot_run.main, [str(tmp_path / "old")])
    assert result.exit_code == 0, result.output
    assert "training.json does not exist" in result.output and "no magnitudes to draw" in result.output
    assert sorted(p.name for p in (tmp_path / "old" / "plots").iterdir()) == ["training.json", "training.png"]


def break_json(name, text):
    return lambda run: (run / "plots" / name).write_text(text)


BAD_INPUT = {
    "missing run": ("missing", lambda run: None, ["RUN", "not there, not a run directory"]),
    "run is a file": ("file", lambda run: None, ["RUN", "is a file, not a run directory"]),
    "no stats.jsonl": ("run", lambda run: (run / "stats.jsonl").unlink(), ["no stats.jsonl: not a training run"]),
    "empty stats.jsonl": ("run", lambda run: (run / "stats.jsonl").write_text("torn{\n"), ["holds no status rows"]),
    "training.json not json": ("run", break_json("training.json", "{"), ["training.json: not valid JSON"]),
    "training.json a list": ("run", break_json("training.json", "[]"), ["training.json: a JSON list, not an object"]),
    "training.json lacks sigma": ("run", break_json("training.json", '{"noise_levels": [{"kimg": 1}]}'),
                                  ["training.json: malformed records (KeyError"]),
    "magnitudes.json malformed": ("run", break_json("magnitudes.json", '{"rows": 3}'),
                                  ["magnitudes.json: malformed records"]),
    "training.json nested deep": ("run", break_json("training.json", "[" * 100_000 + "]" * 100_000),
                                  ["training.json: JSON nested 100000 levels deep"]),
    "magnitudes.json holds a huge number": ("run", break_json("magnitudes.json", '{"rows": 1' + "0" * 5000 + "}"),
                                            ["magnitudes.json: the number 1000", "has more than 20 digits"]),
    "stats.jsonl holds only a deep line": ("run", lambda run: (run / "stats.jsonl").write_text(
        "[" * 100_000 + "]" * 100_000 + "\n"), ["holds no status rows"]),
    "plots is a file": ("run", lambda run: shutil.rmtree(run / "plots") or (run / "plots").write_text("x"),
                        ["plots is a file, not a folder"]),
}


@pytest.mark.bad_input
@pytest.mark.parametrize("case", BAD_INPUT)
def test_plot_run_bad_input_is_one_line_and_writes_nothing(reference_run, tmp_path, case):
    name, prepare, fragments = BAD_INPUT[case]
    run = copy_records(reference_run, tmp_path / "run")
    (tmp_path / "file").write_text("not a run")
    prepare(tmp_path / name) if name != "run" else prepare(run)
    assert_refused(tmp_path, lambda: CliRunner().invoke(plot_run.main, [str(tmp_path / name)]), *fragments)


def top_panels(figure) -> dict:
    """The dashboard's three curve panels by title."""
    titles = ("training loss (Eq. 21)", "learning rate (Eq. 67)", "images/s")
    return {ax.get_title(): ax for ax in figure.axes if ax.get_title() in titles}


def test_curve_panels_have_y_labels_a_minimum_span_and_resume_marks():
    kimg = [0.5, 1.0, 1.5, 2.0]
    lr = [0.01, 0.01 * (1 + 2**-23), 0.01, 0.01]  # constant up to float32 rounding
    stats = dict(kimg=kimg, loss=[0.9, 0.5, 0.4, 0.35], lr=lr, images_per_s=[100.0, 101.0, 100.5, 100.0])
    figure = dashboard_figure(dict(stats=stats, resumes=[dict(nimg=1024, kimg=1.024)]))
    panels = top_panels(figure)
    assert {title: ax.get_ylabel() for title, ax in panels.items()} == {
        "training loss (Eq. 21)": "loss", "learning rate (Eq. 67)": "learning rate", "images/s": "images/s"}
    for ax in panels.values():
        marks = [line for line in ax.get_lines() if line.get_label() == "resumed"]
        assert len(marks) == 1 and list(marks[0].get_xdata()) == [1.024, 1.024]
    # Jitter of 2^-23 and of 1% is drawn on an axis spanning at least a tenth of the values, so it looks flat.
    for title, values in (("learning rate (Eq. 67)", lr), ("images/s", stats["images_per_s"])):
        low, high = panels[title].get_ylim()
        assert high - low >= 0.1 * max(values) * (1 - 1e-12) and low <= min(values) and high >= max(values)
    low, high = panels["training loss (Eq. 21)"].get_ylim()  # a real change keeps matplotlib's own range
    assert low <= 0.35 and high >= 0.9 and high - low < 0.55 * 1.2


def test_each_block_of_a_level_has_its_own_shade():
    names = ["enc.8x8_block0", "enc.8x8_block1", "enc.8x8_block2", "enc.4x4_block0", "dec.8x8_block0"]
    rows = [dict(nimg=n, kimg=n / 1000, activations={name: 1.0 for name in names}, weights={"out_conv": 1.0})
            for n in (1024, 2048)]
    figure = magnitudes_figure(dict(rows=rows, ema_std=0.05))
    [activations] = [ax for ax in figure.axes if ax.get_title().startswith("block outputs")]
    colours = [matplotlib.colors.to_rgb(line.get_color()) for line in activations.get_lines() if len(line.get_xdata())]
    assert len(colours) == len(names) == len(set(colours))
    # The three enc 8x8 blocks share the level's hue, lighter block by block (mixed towards white).
    enc8 = np.array(colours[:3])
    assert np.all(np.diff(enc8.sum(axis=1)) > 0) and np.allclose(enc8[0], matplotlib.colors.to_rgb("C0"))


def test_the_dashboard_records_where_the_run_resumed(train_data, tmp_path):
    net = tiny_precond(label_dim=4).eval()
    dataset = ImageFolderDataset(train_data)
    opts = TrainingOptions.from_preset("toy-tiny", dict(resolution=8, num_channels=3, label_dim=4),
                                       StandardRGBEncoder().config(), run_dir=str(tmp_path), data=str(train_data))

    def invocation(cur_nimg: int, snapshot_at: int) -> list[int]:
        """A training (re)started at cur_nimg that reaches a snapshot; the resumes training.json then holds."""
        Dashboard(tmp_path, opts, dataset, StandardRGBEncoder(), net, torch.device("cpu"), cur_nimg).update(
            net, snapshot_at)
        return [r["nimg"] for r in json.loads((tmp_path / "plots" / "training.json").read_text())["resumes"]]

    assert invocation(0, 1024) == []
    assert invocation(1024, 2048) == [1024]
    assert invocation(1024, 2048) == [1024]  # resumed from the same state again: one mark
    assert invocation(2048, 3072) == [1024, 2048]


def test_the_dashboards_loss_mean_is_named_apart_from_the_sweeps_validation_loss():
    # Issue 26, item 8: the dashboard's 0.555 and the sweep's 0.375 were both called "validation loss". The
    # dashboard's is an equal-weight mean over its grid of noise levels (P_mean +- 2.5 P_std in ln sigma); Eq. 14
    # weights ln sigma by its normal density (Eq. 16), which gives the grid's two outermost levels 1.8% of the
    # weight where the plain mean gives them 2/11 = 18%.
    sigma = sigma_grid(-0.8, 1.6)
    levels = dict(weighted_error=[1.0] * 2 + [0.2] * 7 + [1.0] * 2, u=[0.0] * 11)
    numbers = snapshot_numbers(sigma, levels, dict(activations={}, weights={}))
    assert "validation/loss" not in numbers and numbers[LOSS_MEAN_TAG] == pytest.approx(sum(levels["weighted_error"]) / 11)
    density = np.exp(-0.5 * np.linspace(-2.5, 2.5, 11) ** 2)
    assert density[[0, -1]].sum() / density.sum() == pytest.approx(0.018, abs=5e-4)
    readme = (REPO / "docs" / "dynamics.md").read_text()
    explained = readme[readme.index("**Three losses, three names.**"):][:900]
    assert all(name in explained for name in ("`train/loss`", f"`{LOSS_MEAN_TAG}`", "The sweep's `loss`", "Eq. 14"))
