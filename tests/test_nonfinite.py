"""A training whose numbers go non-finite stops with one line and writes nothing non-finite; a training state holding
NaN, infinity or an impossible Adam moment is skipped on resume; --P_mean/--P_std are bounded where Eq. 16's noise
levels stay within float32 (issue 26, items 1 and 2)."""

import hashlib
import json
import math
import re
import shutil

import numpy as np
import pytest
import safetensors.torch
import torch
from click.testing import CliRunner

import train_edm2
import training.run.loop
import training.step
from edm2.loss import EDM2Loss
from edm2.runtime.sharded_ema import ShardedPowerFunctionEMA
from training.options import MAX_LN_SIGMA, MAX_NORMAL_DRAW, OptionsError
from training.run import checkpoint
from training.state import TrainingState
from tests.helpers import assert_one_error_line, toy_tiny_options

# Four steps of 32 images: a status line every step, snapshots and training states at 64 and 128 images.
SHORT = ["--preset=toy-tiny", "--workers=0", "--grid=0", "--duration=128", "--status=32", "--snapshot=64",
         "--checkpoint=64"]
STOPPED = re.compile(r"Error: training stopped at kimg [\d.]+ \((\d+) images\): (.*); nothing more is written")


def train(data, outdir, *args):
    """train_edm2.py with SHORT in-process; without the dashboard, whose figures would take most of the time."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(training.run.loop, "_dashboard", lambda *args: None)
        return CliRunner().invoke(train_edm2.main, [*SHORT, f"--data={data}", f"--outdir={outdir}", *map(str, args)])


def stopped(result) -> tuple[int, str]:
    """The image count and the reason of a training's one 'training stopped' error line."""
    [match] = STOPPED.findall(assert_one_error_line(result))
    return int(match[0]), match[1]


def digests(outdir) -> dict[str, str]:
    """SHA-256 of every snapshot and training state of a run."""
    files = [*outdir.glob("network-snapshot-*"), *outdir.glob("training-state-*")]
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def assert_all_finite(outdir) -> None:
    """Every tensor of every snapshot and training state under outdir is finite (Adam's second moments >= 0)."""
    for path in outdir.rglob("network-snapshot-*.safetensors"):
        assert all(torch.isfinite(t).all() for t in safetensors.torch.load_file(str(path)).values()), path
    for path in outdir.rglob("training-state-*.pt"):
        state = torch.load(path, weights_only=True)
        tensors = [*state["net"].values(), *(t for ema in state["ema"]["emas"] for t in ema.values())]
        moments = state["optimizer"]["state"].values()
        assert all(torch.isfinite(t).all() for t in [*tensors, *(t for m in moments for t in m.values())]), path
        assert all((m["exp_avg_sq"] >= 0).all() for m in moments), path


@pytest.fixture(scope="module")
def good_run(train_data, tmp_path_factory):
    """A finished 128-image run: snapshots and training states at 64 and 128 images."""
    outdir = tmp_path_factory.mktemp("good") / "run"
    result = train(train_data, outdir)
    assert result.exit_code == 0, result.output
    assert len(list(outdir.glob("training-state-*.pt"))) == 2
    return outdir


@pytest.mark.parametrize("precision", [[], ["--precision=bf16", "--cpu-16bit"]], ids=["float32", "bf16"])
def test_a_learning_rate_of_1e30_stops_at_a_status_line_with_nothing_non_finite_written(precision, train_data,
                                                                                        tmp_path):
    # Before: the run went on, writing NaN snapshots and training states that generate.py then refused. The first
    # step's learning rate is 0 (the ramp-up of Eq. 67): the run stops at the loss's status line, or where the
    # weights' EMA, finite in float32, would overflow the snapshot's float16.
    result = train(train_data, tmp_path / "run", "--lr=1e30", *precision)
    nimg, reason = stopped(result)
    assert nimg < 128 and re.fullmatch(r"the training loss since the last status line is (nan|inf)|EMA track sigma_rel "
                                       r"0\.050: [\w.]+ holds NaN or infinity or a magnitude float16 overflows on", reason), reason
    assert_all_finite(tmp_path)


def test_finite_latents_of_magnitude_1e30_stop_the_run(tmp_path):
    # Finite data the loader accepts: 1e30 squared is infinite in float32, in the loss and in Adam's moments.
    data = tmp_path / "latents"
    (data / "00000").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(8):
        latent = np.concatenate([rng.standard_normal((4, 8, 8)) * 1e30, np.ones((4, 8, 8))]).astype(np.float32)
        np.save(data / f"00000/img{i:08d}.npy", latent)
    (data / "dataset.json").write_text(json.dumps({"labels": [[f"00000/img{i:08d}.npy", i % 2] for i in range(8)]}))
    nimg, reason = stopped(train(data, tmp_path / "run", "--batch=8"))
    assert nimg == 32 and reason == "the training loss since the last status line is inf"
    assert not list(tmp_path.rglob("network-snapshot-*")) and not list(tmp_path.rglob("training-state-*"))


def test_a_loss_that_turns_non_finite_stops_and_leaves_the_last_good_files_untouched(good_run, train_data, tmp_path,
                                                                                     monkeypatch):
    # Issue 26, Must show 2: a run that has written good snapshots and states meets data of magnitude 1e30 from 128
    # images on (its loss and Adam's moments overflow): it stops at the next status line, and every file it wrote
    # before is as it was, all of them finite.
    outdir = tmp_path / "run"
    shutil.copytree(good_run, outdir)
    before = digests(outdir)
    make_loss = training.step.training_loss
    monkeypatch.setattr(training.step, "training_loss", lambda *args: (
        lambda net, images, labels: make_loss(*args)(net, images * 1e30, labels)))
    assert stopped(train(train_data, outdir, "--duration=256")) == (
        160, "the training loss since the last status line is inf")
    assert digests(outdir) == before
    assert_all_finite(outdir)
    monkeypatch.undo()
    # A poisoned newest state is skipped with a line; the run resumes from the previous good one.
    newest = outdir / "training-state-0000000-128.pt"
    state = torch.load(newest, weights_only=True)
    state["ema"]["emas"][0][WEIGHT][0] = math.nan
    torch.save(state, newest)
    result = train(train_data, outdir)
    assert result.exit_code == 0, result.output
    assert [line for line in result.output.splitlines() if line.startswith("Skipping")] == [
        f"Skipping training state {newest}: EMA track sigma_rel 0.050: {WEIGHT} holds NaN or infinity"]
    assert "Resuming from training-state-0000000-64.pt at 64 images" in result.output
    assert_same_training(outdir / "training-state-0000000-128.1.pt", good_run / "training-state-0000000-128.pt")


def assert_same_training(path, reference) -> None:
    """Two training states hold the same weights and EMA tracks bit for bit (exact resume)."""
    ours, theirs = checkpoint.load_state(path), checkpoint.load_state(reference)
    pairs = [(ours["net"], theirs["net"]), *zip(ours["ema"]["emas"], theirs["ema"]["emas"])]
    assert all(torch.equal(a[k], b[k]) for a, b in pairs for k in b)


WEIGHT = "unet.out_conv.weight"


def poison(state: dict, case: str) -> str:
    """Make a 128-image training state hold what case says; returns why a run skips it."""
    moment = state["optimizer"]["state"][0]
    if case == "an EMA track holds NaN":
        state["ema"]["emas"][1][WEIGHT].view(-1)[3] = math.nan
        return f"EMA track sigma_rel 0.100: {WEIGHT} holds NaN or infinity"
    if case == "a weight holds infinity":
        state["net"][WEIGHT].view(-1)[0] = math.inf
        return f"weight {WEIGHT} holds NaN or infinity"
    if case == "Adam's second moment is negative":
        moment["exp_avg_sq"].view(-1)[0] = -1e-6
        return f"Adam's exp_avg_sq of {FIRST_PARAM} holds NaN or infinity or a negative value (impossible there)"
    assert case == "Adam's first moment is infinite"
    moment["exp_avg"].view(-1)[0] = -math.inf
    return f"Adam's exp_avg of {FIRST_PARAM} holds NaN or infinity"


FIRST_PARAM = "unet.out_gain"  # the network's first parameter: Adam's state 0


@pytest.mark.parametrize("case", ["an EMA track holds NaN", "a weight holds infinity", "Adam's second moment is negative",
                                  "Adam's first moment is infinite"])
def test_a_state_holding_non_finite_values_or_impossible_moments_is_skipped(case, good_run, train_data, tmp_path):
    outdir = tmp_path / "run"
    shutil.copytree(good_run, outdir)
    newest = outdir / "training-state-0000000-128.pt"
    state = torch.load(newest, weights_only=True)
    reason = poison(state, case)
    torch.save(state, newest)
    refused = newest.read_bytes()
    result = train(train_data, outdir)
    assert result.exit_code == 0, result.output
    assert [line for line in result.output.splitlines() if line.startswith("Skipping")] == [
        f"Skipping training state {newest}: {reason}"]
    assert "Resuming from training-state-0000000-64.pt at 64 images" in result.output
    assert newest.read_bytes() == refused
    assert_same_training(outdir / "training-state-0000000-128.1.pt", good_run / "training-state-0000000-128.pt")


def poisoner(case: str, at_nimg: int):
    """A training_step that, once the run reaches at_nimg images, makes the state hold what case says."""
    step = training.run.loop.training_step

    def poisoned(s):
        loss = step(s)
        if s.state.cur_nimg == at_nimg:
            with torch.no_grad():
                if case == "EMA track":
                    next(s.state.ema.emas[0].parameters()).view(-1)[0] = math.nan
                else:
                    first = next(iter(s.state.optimizer.state.values()))
                    first["exp_avg_sq"].view(-1)[0] = -1.0
        return loss

    return poisoned


@pytest.mark.parametrize("case, reason", [
    ("EMA track", f"EMA track sigma_rel 0.050: {FIRST_PARAM} holds NaN or infinity"),
    ("Adam", f"Adam's exp_avg_sq of {FIRST_PARAM} holds NaN or infinity or a negative value (impossible there)"),
])
def test_a_state_going_non_finite_with_a_finite_loss_is_never_written(case, reason, good_run, train_data, tmp_path,
                                                                     monkeypatch):
    # The loss stays finite: the check of the weights, EMA tracks and Adam before any file of a step is written
    # stops the run at the snapshot and training state of 192 images.
    outdir = tmp_path / "run"
    shutil.copytree(good_run, outdir)
    before = digests(outdir)
    monkeypatch.setattr(training.run.loop, "training_step", poisoner(case, 192))
    assert stopped(train(train_data, outdir, "--duration=256", "--status=0")) == (192, reason)
    assert digests(outdir) == before
    assert_all_finite(outdir)


def test_a_sharded_ema_reports_its_own_part():
    state = TrainingState.create(toy_tiny_options(ema_stds=(0.05, 0.1)), 3, torch.device("cpu"))
    state.ema = ShardedPowerFunctionEMA(state.net, (0.05, 0.1), rank=0, world_size=1)
    assert state.nonfinite() is None
    state.ema.shards[1][7] = math.inf
    assert state.nonfinite() == "EMA track sigma_rel 0.100: (this process's part) holds NaN or infinity"


@pytest.mark.bad_input
@pytest.mark.parametrize("args, shown", [(["--P_mean=1000"], "--P_mean=1000.0 with --P_std=1.6"),
                                         (["--P_std=1000"], "--P_mean=-0.8 with --P_std=1000.0"),
                                         (["--P_mean=-26.4", "--P_std=1.6"], "--P_mean=-26.4 with --P_std=1.6")])
def test_noise_levels_beyond_float32_are_refused_before_any_work(args, shown, train_data, tmp_path):
    # Before: --P_mean=1000 trained on NaN, wrote snapshots, then the dashboard raised an OverflowError.
    line = assert_one_error_line(train(train_data, tmp_path / "run", *args))
    assert shown in line and "|P_mean| + 8.57 * P_std <= 40" in line
    assert not (tmp_path / "run").exists()


def test_the_noise_level_bound_keeps_eq_15_finite_in_float32():
    # At the bound's edge the most extreme draws give finite, positive sigma**2 and lambda(sigma) in float32; just
    # beyond it, the options are refused.
    for P_mean, P_std in [(MAX_LN_SIGMA - 2 * MAX_NORMAL_DRAW, 2.0), (2 * MAX_NORMAL_DRAW - MAX_LN_SIGMA, 2.0),
                          (0.0, MAX_LN_SIGMA / MAX_NORMAL_DRAW)]:
        toy_tiny_options(P_mean=P_mean, P_std=P_std)
        for ln_sigma in (P_mean - MAX_NORMAL_DRAW * P_std, P_mean + MAX_NORMAL_DRAW * P_std):
            sigma = torch.tensor(ln_sigma, dtype=torch.float64).exp().to(torch.float32)
            weight = EDM2Loss(P_mean, P_std, sigma_data=0.5).weight(sigma)
            assert torch.isfinite(sigma.square()) and sigma.square() > 0 and torch.isfinite(weight) and weight > 0
        with pytest.raises(OptionsError, match="--P_mean"):
            toy_tiny_options(P_mean=P_mean, P_std=P_std * 1.001)
    # The draws' bound holds for torch's generators (53-bit uniforms at most): a million draws stay within it.
    assert torch.randn(10**6, generator=torch.Generator().manual_seed(0)).abs().max() < MAX_NORMAL_DRAW
