"""edm2.procedures.anyema: post-hoc EMA of a plain nn.Module (not an EDM2 network) trained by its own loop."""

import json

import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch

from edm2 import phema
from edm2.errors import EDM2Error
from edm2.procedures import posthoc
from edm2.procedures.anyema import AnyEMAError, PostHocEMA, file_name, synthesize

STEPS, SAVE_EVERY, STDS, TARGET = 240, 20, (0.05, 0.10), 0.075


def mlp() -> torch.nn.Module:
    """A small regression network with BatchNorm, whose running statistics are buffers."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def flat(tensors) -> np.ndarray:
    return np.concatenate([t.detach().double().reshape(-1).numpy() for t in tensors])


@pytest.fixture(scope="module")
def training(tmp_path_factory):
    """Train with PostHocEMA saving STDS every SAVE_EVERY steps and TARGET tracked directly alongside;
    returns the folder, the directly tracked parameters at the middle and the end, every step's parameters
    and the model."""
    return train(tmp_path_factory.mktemp("ema"))


def train(folder):
    """The training of the fixture `training`."""
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ema = PostHocEMA(model, stds=STDS)
    direct = phema.PowerFunctionEMA(model, stds=(TARGET,))
    gen = torch.Generator().manual_seed(1)
    trajectory, direct_at = [], {}
    for step in range(1, STEPS + 1):
        x = torch.randn(32, 3, generator=gen)
        loss = (model(x) - torch.sin(x.sum(1, keepdim=True))).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ema.update(step)
        direct.update(step, 1)
        trajectory.append(flat(model.parameters()))
        if step % SAVE_EVERY == 0:
            ema.save(folder)
        if step in (STEPS // 2, STEPS):
            direct_at[step] = flat(direct.get()[0][0].parameters())
    return folder, direct_at, np.stack(trajectory), model


@pytest.mark.parametrize("step", [STEPS // 2, STEPS])
def test_synthesized_ema_matches_a_directly_tracked_one(training, step):
    folder, direct_at, trajectory, model = training
    state = synthesize(folder, TARGET, step=None if step == STEPS else step)
    names = [name for name, _ in model.named_parameters()]
    got = flat(state[name] for name in names)
    # Bound. The tracker's Eq. 127 decays give step s the weight (s^(g+1) - (s-1)^(g+1)) / T^(g+1), exactly the
    # integral of the profile p_{T,g} over (s-1, s]: every EMA here is the integral of its profile against the
    # piecewise constant weights theta(tau) = theta_s on (s-1, s]. The synthesized profile p^ (coefficients summing
    # to 1) and the target p_r both integrate to 1, so their difference e integrates to 0 and, by Cauchy-Schwarz
    # per coordinate, |synthesized - direct| <= ||e||_2 * ||theta - mean theta||_2, with ||e||_2^2 the relative
    # profile error (Eq. 134) times <p_r, p_r>.
    in_t = np.repeat(np.arange(SAVE_EVERY, step + 1, SAVE_EVERY), len(STDS))
    in_std = np.tile(STDS, len(in_t) // len(STDS))
    coefs = phema.solve_posthoc_coefficients(in_t, in_std, step, TARGET)
    error = phema.reconstruction_error(in_t, in_std, step, TARGET, coefs)[0]
    profile_norm = np.sqrt(error * phema.power_function_inner(step, TARGET, step, TARGET))
    path = trajectory[:step]
    bound = profile_norm * np.sqrt(np.square(path - path.mean(axis=0)).sum())
    # Plus float32 rounding: each of the step lerps of a track (and the sums of combine) errs by at most two
    # units of float32 roundoff of the largest weight; the synthesis adds the inputs' errors weighted by |coefs|.
    rounding = (np.abs(coefs).sum() + 1) * (step + len(in_t)) * 2 * np.finfo(np.float32).eps * np.abs(path).max()
    bound += rounding * np.sqrt(path.shape[1])
    assert np.linalg.norm(got - direct_at[step]) <= bound
    # The bound is tight enough to tell the target from either tracked length, whose distances it must undercut.
    for std in STDS:
        tracked = flat(synthesize(folder, std, step)[name] for name in names)
        assert np.linalg.norm(tracked - direct_at[step]) > bound


def test_files_hold_the_state_dict_and_metadata(training):
    folder, _, _, model = training
    names = sorted(p.name for p in folder.iterdir())
    assert names == sorted(file_name("ema", s, std) for s in range(SAVE_EVERY, STEPS + 1, SAVE_EVERY) for std in STDS)
    with safetensors.safe_open(str(folder / file_name("ema", STEPS, 0.05)), framework="pt") as f:
        meta = json.loads(f.metadata()["edm2-ema"])
        assert set(f.keys()) == set(model.state_dict())
        assert all(f.get_tensor(k).dtype == model.state_dict()[k].dtype for k in f.keys())
    assert (meta["step"], meta["std"], meta["stds"]) == (STEPS, 0.05, list(STDS))
    assert meta["buffers"] == ["1.num_batches_tracked", "1.running_mean", "1.running_var"]


def test_buffers_are_the_newest_inputs(training):
    folder, _, _, model = training
    state = synthesize(folder, TARGET)
    for name, buffer in model.named_buffers():
        assert torch.equal(state[name], buffer), name  # copied at the last save, the end of the training
    assert int(state["1.num_batches_tracked"]) == STEPS


def test_state_dict_resumes_tracking_exactly():
    model = mlp()
    ema = PostHocEMA(model, stds=STDS)
    for step in (1, 2, 5):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * step)
        ema.update(step)
        if step == 2:
            resumed = PostHocEMA(model, stds=STDS)
            resumed.load_state_dict(ema.state_dict())
    resumed.update(5)  # the same weights after steps 3..5 as the uninterrupted tracker saw at step 5
    for (a, _), (b, _) in zip(ema.get(), resumed.get()):
        assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_save_in_half_precision_synthesizes_float32(tmp_path):
    model = mlp()
    ema = PostHocEMA(model, stds=STDS)
    ema.update(1)
    ema.save(tmp_path, prefix="half", dtype=torch.float16)
    stored = safetensors.torch.load_file(str(tmp_path / file_name("half", 1, 0.10)))
    assert stored["0.weight"].dtype == torch.float16 and stored["1.num_batches_tracked"].dtype == torch.int64
    state = synthesize(tmp_path, 0.07, prefix="half")
    # At step 1 every profile is the step's weights: the float16 copies, read back as float32 (buffers too).
    assert torch.equal(state["0.weight"], model[0].weight.detach().half().float())
    assert torch.equal(state["1.running_var"], model[1].running_var.half().float())


@pytest.mark.bad_input
def test_tracking_refuses_bad_steps_and_stds(tmp_path):
    ema = PostHocEMA(mlp(), stds=STDS)
    with pytest.raises(AnyEMAError, match="nothing to save"):
        ema.save(tmp_path / "unused")
    ema.update(3)
    with pytest.raises(AnyEMAError, match="dtype must be one of float16, bfloat16, float32, float64"):
        ema.save(tmp_path / "unused", dtype=torch.int8)
    assert not (tmp_path / "unused").exists()
    for step in (3, 2, 2.5, True):
        with pytest.raises(AnyEMAError, match=r"after the previous update \(3\)"):
            ema.update(step)
    with pytest.raises(AnyEMAError, match="distinct"):
        PostHocEMA(mlp(), stds=(0.05, 0.0501))
    with pytest.raises(phema.EMAError, match="sigma_rel"):
        PostHocEMA(mlp(), stds=(0.3,))


def save_one(folder, module=None, step=4):
    ema = PostHocEMA(module or mlp(), stds=(0.05,))
    ema.update(step)
    return ema.save(folder)[0]


def rewrite(path, tensors=None, raw=None, **meta_changes):
    """Replace a stored track's tensors and/or metadata entries (None removes one), or its metadata by raw text."""
    with safetensors.safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["edm2-ema"])
        old = {k: f.get_tensor(k) for k in f.keys()}
    meta.update(meta_changes)
    text = raw if raw is not None else json.dumps({k: v for k, v in meta.items() if v is not None})
    safetensors.torch.save_file(old if tensors is None else tensors, str(path), metadata={"edm2-ema": text})


@pytest.mark.bad_input
@pytest.mark.parametrize("damage, message", [
    (lambda p: p.write_bytes(p.read_bytes()[:100]), "cannot read"),
    (lambda p: rewrite(p, raw="[" * 100_000), "metadata"),
    (lambda p: rewrite(p, raw='{"format_version": 1, "step": 4'), "not valid JSON"),
    (lambda p: rewrite(p, step=True), "'step' must be an integer"),
    (lambda p: rewrite(p, step=2**60), "'step' must be an integer"),
    (lambda p: rewrite(p, std=0.5), "'std' must be a sigma_rel"),
    (lambda p: rewrite(p, buffers="1.running_mean"), "'buffers' must be a list"),
    (lambda p: rewrite(p, buffers=["nonexistent"]), "names buffers the file does not hold"),
    (lambda p: rewrite(p, format_version=None), "format_version"),
    (lambda p: rewrite(p, tensors={"0.weight": torch.full((2,), float("nan"))}, buffers=[]), "not finite"),
    (lambda p: rewrite(p, tensors={"0.weight": torch.zeros(2, dtype=torch.int8)}, buffers=["0.weight"]), "int8, not a"),
    (lambda p: rewrite(p, tensors={"0.weight": torch.zeros(2, dtype=torch.int64)}, buffers=[]), "not floating"),
    (lambda p: rewrite(p, tensors={"a": torch.zeros(2), "a.b": torch.zeros(2)}, buffers=[]), "does not fit a module"),
    (lambda p: rewrite(p, tensors={"a..b": torch.zeros(2)}, buffers=[]), "does not fit a module"),
])
def test_synthesize_refuses_a_damaged_file(tmp_path, damage, message):
    damage(save_one(tmp_path))
    with pytest.raises(EDM2Error, match=message) as info:
        synthesize(tmp_path, 0.07)
    assert "\n" not in str(info.value)


@pytest.mark.bad_input
def test_synthesize_refuses_tracks_that_do_not_combine(tmp_path):
    with pytest.raises(AnyEMAError, match="not a directory"):
        synthesize(tmp_path / "missing", 0.07)
    with pytest.raises(AnyEMAError, match="no ema-STEP-STD.safetensors"):
        synthesize(tmp_path, 0.07)
    save_one(tmp_path)
    with pytest.raises(AnyEMAError, match=r"no track saved at step 3; saved steps: \[4\]"):
        synthesize(tmp_path, 0.07, step=3)
    with pytest.raises(phema.EMAError, match="sigma_rel"):
        synthesize(tmp_path, 0.0)
    save_one(tmp_path, torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 2)),
             step=8)
    with pytest.raises(posthoc.PosthocError, match="architecture differs"):
        synthesize(tmp_path, 0.07)
    save_one(tmp_path, torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Linear(16, 1)), step=12)
    with pytest.raises(AnyEMAError, match="buffers differ"):
        synthesize(tmp_path, 0.07)


def test_synthesis_is_algorithm_3_over_the_saved_tracks(training):
    # The same sum (Eq. 129), in float32 and the same order, over the files and Algorithm 3's weights.
    folder, _, _, _ = training
    paths = sorted(folder.iterdir(), key=lambda p: (int(p.name.split("-")[1]), p.name))
    times = [int(p.name.split("-")[1]) for p in paths]
    stds = [float(p.name.split("-")[2].removesuffix(".safetensors")) for p in paths]
    coefs = phema.solve_posthoc_coefficients(times, stds, STEPS, TARGET)[:, 0]
    expected = torch.zeros_like(synthesize(folder, TARGET)["3.weight"])
    for path, coef in zip(paths, coefs):
        expected.add_(safetensors.torch.load_file(str(path))["3.weight"], alpha=float(coef))
    assert torch.equal(synthesize(folder, TARGET)["3.weight"], expected)


def test_tied_weights_are_saved_and_synthesized(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model[1].weight = model[0].weight  # one tensor under two names: safetensors refuses shared storage
    ema = PostHocEMA(model, stds=STDS)
    ema.update(1)
    ema.save(tmp_path)
    state = synthesize(tmp_path, 0.07)
    assert torch.equal(state["0.weight"], model[0].weight.detach()) and torch.equal(state["1.weight"], state["0.weight"])


def test_per_tensor_lengths_change_only_their_tensors(training):
    # Issue 28, Must show 2 (paper Figure 5b). Every tensor at the global length is the global synthesis bit for bit:
    # combine_per_tensor copies each parameter from combine's output for its own length, solved alone. Moving one
    # tensor's length leaves every other tensor bit for bit as it was, and that tensor is the whole-network synthesis
    # at its length, bit for bit, for the same reason.
    folder, _, _, model = training
    names = [name for name, _ in model.named_parameters()]
    whole = synthesize(folder, TARGET)
    same = synthesize(folder, TARGET, tensor_stds=dict.fromkeys(names, TARGET))
    assert all(torch.equal(same[name], whole[name]) for name in whole)
    moved = synthesize(folder, TARGET, tensor_stds={"3.weight": 0.15})
    at_moved = synthesize(folder, 0.15)
    assert torch.equal(moved["3.weight"], at_moved["3.weight"])
    assert not torch.equal(moved["3.weight"], whole["3.weight"])
    assert all(torch.equal(moved[name], whole[name]) for name in whole if name != "3.weight")


@pytest.mark.bad_input
def test_a_per_tensor_length_for_a_tensor_the_network_lacks_is_one_line(training):
    folder, _, _, _ = training
    with pytest.raises(AnyEMAError, match=r"no parameter 'enc\.conv\.weight' \(its parameters are named like '0\.weight'"):
        synthesize(folder, TARGET, tensor_stds={"enc.conv.weight": 0.1})
    with pytest.raises(AnyEMAError, match="no parameter '1.running_mean'"):  # a buffer is not averaged
        synthesize(folder, TARGET, tensor_stds={"1.running_mean": 0.1})
