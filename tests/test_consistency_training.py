"""train_edm2.py --method=sct|scd: consistency training and distillation (edm2.consistency_loss) through the training
loop, end to end on tiny runs; the resume; post-hoc EMA of its snapshots; the loss as the step calls it against
edm2.consistency.algorithm1_loss on the same draws; its statistics; and the bad input, one line each."""

import json
import math
import shutil
import signal

import pytest
import torch
from click.testing import CliRunner

import reconstruct_phema
import train_edm2
import training.run.loop
from edm2 import consistency_loss
from edm2.consistency import algorithm1_loss, denoiser_velocity, sample_t, tangent_warmup
from edm2.consistency_loss import ConsistencyLoss, TrigFlowView, stats_row
from edm2.encoders import StandardRGBEncoder
from edm2.formats.snapshot import load_network, save_network
from edm2.layers import force_weight_normalization
from edm2.trigflow import adaptive_logvar, consistency_model, edm_denoiser
from training.presets import PRESETS
from training.run import checkpoint, dashboard
from training.run.benchmark import synthetic_step
from training.state import ADAM_BETAS
from training.step import training_step
from tests.helpers import (assert_one_error_line, assert_refused, randomized, snapshot_contents, start_training,
                           tiny_precond, wait_for)

# Two steps of 16 images with a snapshot, a training state and a status line after each; no sample grid.
SHORT = ["--workers=0", "--batch=16", "--duration=32", "--snapshot=16", "--checkpoint=16", "--status=16", "--grid=0"]
DATA = dict(img_resolution=8, img_channels=3, label_dim=4)  # the train_data fixture's


def train(data, outdir, *args):
    """train_edm2.py in-process with SHORT (later arguments win); without the dashboard, whose figures would take
    most of the time."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(training.run.loop, "_dashboard", lambda *args: None)
        return CliRunner().invoke(train_edm2.main, [*SHORT, f"--data={data}", f"--outdir={outdir}", *map(str, args)])


def teacher_snapshot(path, seed=0, metadata=None, **overrides):
    """Our snapshot of a randomly weighted toy-tiny U-Net for the train_data fixture (8x8 RGB, 4 classes)."""
    net = randomized(tiny_precond(**{**DATA, **overrides}), seed).eval()
    save_network(path, net, {"encoder": StandardRGBEncoder().config(), **(metadata or {})})
    return path


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return teacher_snapshot(tmp_path_factory.mktemp("teacher") / "teacher.safetensors")


@pytest.fixture(scope="module")
def runs(train_data, teacher, tmp_path_factory):
    """A finished sCT run from scratch and an sCD run of the teacher, 32 images each."""
    root = tmp_path_factory.mktemp("cm")
    for name, args in (("sct", ["--preset=sct-toy-tiny"]), ("scd", ["--preset=scd-toy-tiny", f"--teacher={teacher}"])):
        result = train(train_data, root / name, *args)
        assert result.exit_code == 0, result.output
    return root


def rows(outdir):
    return [json.loads(line) for line in (outdir / "stats.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("method", ["sct", "scd"])
def test_a_tiny_run_writes_consistency_snapshots_and_stats_rows(method, runs, teacher):
    outdir = runs / method
    net, meta = load_network(outdir / "network-snapshot-0000000-32-0.100.safetensors")
    record = meta["consistency"]
    assert record == dict(method=method, sigma_data=0.5, teacher=teacher.name if method == "scd" else None,
                          P_mean=-0.8, P_std=1.6, tangent_warmup_nimg=512, c=0.1, prior=True)
    options = meta["training_options"]
    assert options["method"] == method and options["adam_eps"] == 1e-11
    assert options["init"] == (str(teacher) if method == "scd" else None)
    log = (outdir / "log.txt").read_text()
    assert (f"Starting from {teacher}" in log) == (method == "scd")
    stats = rows(outdir)
    assert [row["nimg"] for row in stats] == [16, 32]
    for row in stats:
        assert row["g_norm"] > 0 and row["grad_norm"] > 0 and math.isfinite(row["loss"])
        # 16 draws in eight bins of t: the bins drawn hold u(t) of the log-variance head, finite.
        assert row["logvar_t"] and all(math.isfinite(u) for u in row["logvar_t"].values())


def test_the_student_of_scd_starts_from_the_teachers_weights(runs, teacher):
    # The first step's learning rate is 0 (Eq. 67's ramp-up starts at 0 images) and Adam moves nothing at lr 0, so
    # the first training state's network is the teacher's, as the forced weight normalization (Eq. 66) of the step's
    # forward pass leaves it.
    state = checkpoint.load_state(runs / "scd" / "training-state-0000000-16.pt")["net"]
    start, _ = load_network(teacher)
    force_weight_normalization(start)
    assert all(torch.equal(state[name], value) for name, value in start.state_dict().items())


@pytest.mark.parametrize("method", ["sct", "scd"])
def test_its_snapshots_reconstruct_post_hoc_and_load(method, runs):
    outdir = runs / method
    result = CliRunner().invoke(reconstruct_phema.main, [f"--indir={outdir}", f"--outdir={outdir / 'phema'}",
                                                         "--std=0.08", "--batch=1"])
    assert result.exit_code == 0, result.output
    [path] = (outdir / "phema").glob("*.safetensors")
    net, meta = load_network(path)
    assert meta["consistency"]["method"] == method and "phema" in meta
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(net(x, torch.tensor([80.0, 1.0]), torch.eye(4)[:2])).all()


# What differs between two runs of the same steps: their timing.
VARYING = ("images_per_s", "sec_per_kimg", "max_memory_gb", "elapsed_s", "timestamp", "tflops", "mfu")


def test_a_killed_sct_run_resumes_bit_identically(train_data, tmp_path):
    # Dropout on: the masks of the jvp and of the pass with a graph come from the round's seed, on resume too; the
    # tangent warmup r (512 images) goes on from the images the training state has seen.
    args = ["--preset=sct-toy-tiny", "--dropout=0.1", "--duration=128", "--checkpoint=16", "--snapshot=64"]
    killed = tmp_path / "killed"
    proc = start_training(train_data, killed, *SHORT, *args)
    wait_for(lambda: (killed / "training-state-0000000-16.pt").exists(), proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    newest = checkpoint.list_states(killed)[0]
    nimg = checkpoint.load_state(newest)["cur_nimg"]
    assert nimg < 128  # killed mid-run, usually before the next training state
    result = train(train_data, killed, *args)
    assert result.exit_code == 0 and f"Resuming from {newest.name} at {nimg} images" in result.output
    assert train(train_data, tmp_path / "whole", *args).exit_code == 0
    pattern, ignore = "network-snapshot-0000000-128-*.safetensors", ("run_dir", "workers")
    whole = snapshot_contents(tmp_path / "whole", pattern, ignore)
    assert len(whole) == 2 and snapshot_contents(killed, pattern, ignore) == whole
    steady = [[{k: v for k, v in row.items() if k not in VARYING} for row in rows(folder) if row["nimg"] > nimg]
              for folder in (killed, tmp_path / "whole")]
    assert steady[0] == steady[1] and all("g_norm" in row for row in steady[0])


def draws(seed, images, P_mean, P_std):
    """t, z and the dropout seed as ConsistencyLoss draws them after torch.manual_seed(seed)."""
    torch.manual_seed(seed)
    t = sample_t([images.shape[0]], P_mean, P_std, 0.5)
    z = torch.randn_like(images) * 0.5
    return t, z, int(torch.randint(1 << 62, []))


class Wrapper(torch.nn.Module):
    """A stand-in for DistributedDataParallel: forwards to its module and counts the calls."""

    def __init__(self, module):
        super().__init__()
        self.module, self.calls = module, 0

    def forward(self, *args):
        self.calls += 1
        return self.module(*args)


@pytest.mark.parametrize("method", ["sct", "scd"])
def test_the_loss_is_algorithm1_on_the_same_draws_and_its_gradient_passes_through_the_wrapper(method):
    net = randomized(tiny_precond(**DATA, dropout=0.2), 1).train()
    teacher = randomized(tiny_precond(**DATA), 2).eval().requires_grad_(False)
    images = torch.randn(6, 3, 8, 8, generator=torch.Generator().manual_seed(3)) * 0.5
    labels = torch.eye(4)[[0, 1, 2, 3, 0, 1]]
    loss_fn = ConsistencyLoss(method, -0.8, 1.6, 0.5, tangent_warmup_nimg=100,
                              teacher=teacher if method == "scd" else None)
    loss_fn.set_images(30)  # r = 0.3
    torch.manual_seed(7)
    loss = loss_fn(net, images, labels)

    t, z, seed = draws(7, images, -0.8, 1.6)
    tangent = (lambda x_t: denoiser_velocity(edm_denoiser(teacher, labels), x_t, t, 0.5)) if method == "scd" else \
        torch.cos(t)[:, None, None, None] * z - torch.sin(t)[:, None, None, None] * images
    expected, norm = algorithm1_loss(consistency_model(net, labels), adaptive_logvar(net), images, z, t, tangent,
                                     tangent_warmup(30, 100), 0.5, seed)
    assert torch.equal(loss, expected)

    # The statistics: the mean ||g|| of the draws, and u(t) per bin of width pi/16.
    totals = loss_fn.take_stats().tolist()
    row = stats_row(totals)
    assert row["g_norm"] == pytest.approx(norm.mean().item(), rel=1e-6)
    u = adaptive_logvar(net)(t).flatten()
    bins = (t / (math.pi / 16)).floor().long()
    for i in bins.unique().tolist():
        assert row["logvar_t"][f"{(i + 0.5) * math.pi / 16:.3f}"] == pytest.approx(u[bins == i].mean().item(),
                                                                                      rel=1e-6, abs=1e-6)
    assert not loss_fn.take_stats().any()  # taken, then zero

    # Through a wrapper of TrigFlowView (DistributedDataParallel's place): the same loss and gradients, the pass
    # with a graph through the wrapper's forward, the jvp on the bare network.
    expected.mean().backward()
    grads = {name: p.grad.clone() for name, p in net.named_parameters() if p.grad is not None}
    net.zero_grad(set_to_none=True)
    wrapper = Wrapper(TrigFlowView(net))
    torch.manual_seed(7)
    wrapped = loss_fn(wrapper, images, labels)
    assert wrapper.calls == 1 and torch.equal(wrapped, expected)
    wrapped.mean().backward()
    assert all(torch.equal(p.grad, grads[name]) for name, p in net.named_parameters() if name in grads)


def test_a_non_finite_tangent_stops_the_run_with_one_line(train_data, tmp_path, monkeypatch):
    monkeypatch.setattr(consistency_loss, "sct_tangent", lambda x0, z, t: torch.full_like(x0, math.nan))
    result = train(train_data, tmp_path / "run", "--preset=sct-toy-tiny")
    assert_one_error_line(result, "training stopped at kimg 0.0 (16 images)",
                          "the consistency tangent's norm ||g|| since the last status line is nan")
    assert not list((tmp_path / "run").glob("network-snapshot-*"))


@pytest.fixture(scope="module")
def misfits(tmp_path_factory, runs):
    """Teachers that do not fit the data or the preset, and a consistency model."""
    root = tmp_path_factory.mktemp("misfits")
    return {
        "res16": teacher_snapshot(root / "res16.safetensors", img_resolution=16),
        "gray": teacher_snapshot(root / "gray.safetensors", img_channels=1),
        "cls3": teacher_snapshot(root / "cls3.safetensors", label_dim=3),
        "wide": teacher_snapshot(root / "wide.safetensors", model_channels=32),
        "cm": runs / "sct" / "network-snapshot-0000000-32-0.100.safetensors",
    }


@pytest.mark.parametrize("args, fragments", [
    (["--preset=scd-toy-tiny"], ["--method=scd distils a teacher: give --teacher=SNAPSHOT"]),
    (["--method=scd"], ["--method=scd distils a teacher"]),
    (["--teacher={teacher}"], ["--teacher is for --method=sct or scd"]),
    (["--preset=sct-toy-tiny", "--teacher={teacher}", "--init={wide}"], ["--init with --teacher"]),
    (["--preset=scd-toy-tiny", "--teacher={res16}"],
     ["--teacher", "res16.safetensors is a 16x16 network with 3 channels; the data gives 8x8 with 3"]),
    (["--preset=scd-toy-tiny", "--teacher={gray}"], ["--teacher", "gray.safetensors is a 8x8 network with 1 channels"]),
    (["--preset=scd-toy-tiny", "--teacher={cls3}"], ["--teacher", "cls3.safetensors is a network of 3 classes"]),
    (["--preset=scd-toy-tiny", "--teacher={wide}"],
     ["--teacher", "--preset=scd-toy-tiny trains another network than wide.safetensors (channels 16 against 32)"]),
    (["--preset=scd-toy-tiny", "--teacher={cm}"],
     ["--teacher", "is a consistency model itself (its metadata records method 'sct')"]),
], ids=["scd-preset-no-teacher", "scd-no-teacher", "edm2-teacher", "init-and-teacher", "resolution", "channels",
        "labels", "preset-network", "consistency-teacher"])
def test_bad_input_is_one_line_before_any_work(args, fragments, train_data, teacher, misfits, tmp_path):
    paths = dict(misfits, teacher=teacher)
    args = [arg.format(**paths) for arg in args]
    assert_refused(tmp_path, lambda: train(train_data, tmp_path / "run", "--preset=toy-tiny", *args), *fragments)


def test_the_dashboard_draws_the_tangent_and_gradient_norms_and_u_per_t_bin(runs, tmp_path):
    outdir = tmp_path / "sct"
    shutil.copytree(runs / "sct", outdir)
    (outdir / "plots").mkdir(exist_ok=True)
    assert [row["nimg"] for row in dashboard.consistency_rows(outdir)] == [16, 32]
    assert dashboard.write_consistency(outdir).stat().st_size > 0
    written, _ = dashboard.redraw(outdir)
    assert outdir / "plots" / "consistency.png" in written
    # A diffusion run's rows have none of these columns: no consistency.png.
    (outdir / "stats.jsonl").write_text("".join(json.dumps({k: v for k, v in row.items() if k != "g_norm"}) + "\n"
                                                for row in rows(outdir)))
    assert dashboard.consistency_rows(outdir) == []


def test_a_consistency_runs_options_rerun_it_with_config(runs, train_data):
    # training_options.json names the teacher as --teacher and as --init (the student's start): not a contradiction.
    result = CliRunner().invoke(train_edm2.main, [f"--config={runs / 'scd' / 'training_options.json'}",
                                                  f"--data={train_data}", "--dry-run"])
    assert result.exit_code == 0, result.output
    options = json.loads(result.output[result.output.index("{\n"): result.output.rindex("}") + 1])
    assert options["method"] == "scd" and options["teacher"] == options["init"]


def test_the_step_sets_the_images_seen_before_the_loss_and_notes_the_gradient_norm():
    step = synthetic_step("sct-toy-tiny", 4, torch.device("cpu"), resolution=8)
    assert isinstance(step.loss_fn, ConsistencyLoss) and step.loss_fn.tangent_warmup_nimg == 512
    seen = []
    original = step.loss_fn.__class__.__call__
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ConsistencyLoss, "__call__", lambda self, *args: seen.append(self.nimg) or original(self, *args))
        start = step.state.cur_nimg
        training_step(step)
        training_step(step)
    # r = min(1, images seen / 512) of each step's images seen before it, which a training state records.
    assert seen == [start, start + 4]
    totals = step.loss_fn.take_stats().tolist()
    assert totals[consistency_loss.GRAD_COUNT] == 2 and totals[consistency_loss.GRAD_SUM] > 0


@pytest.mark.parametrize("size", ["xxs", "s", "xxl"])
def test_the_img512_presets_take_the_papers_hyperparameters_from_their_teachers(size):
    teacher = PRESETS[f"edm2-img512-{size}"]
    for method in ("sct", "scd"):
        preset = PRESETS[f"{method}-img512-{size}"]
        assert preset.method == method and preset.lr == pytest.approx(teacher.lr * 0.01, rel=1e-15)
        assert (preset.adam_eps, preset.P_mean, preset.P_std, preset.batch) == (1e-11, -0.8, 1.6, 2048)
        assert (preset.channels, preset.network) == (teacher.channels, teacher.network)
        assert preset.tangent_warmup_Mimg == 10000 * 2048 / 1e6
    assert ADAM_BETAS == (0.9, 0.99)
