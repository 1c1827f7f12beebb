"""training/run/checkpoint.py's Checkpoints, the one owner of a run's training states: resume is one call that finds the
newest training state that fits, checks it and loads it; save writes, stamps and prunes."""

import pytest
import torch

from training.run import checkpoint
from training.run.checkpoint import Checkpoints
from training.options import OptionsMismatch, TrainingOptions
from training.run.run_dir import RunDirectory
from training.state import TrainingState
from tests.helpers import toy_tiny_options

CPU = torch.device("cpu")


def tiny_options(run, **overrides) -> TrainingOptions:
    """toy-tiny's options for 8x8 RGB data with 4 classes, run in `run`."""
    return toy_tiny_options(run_dir=str(run), data="data", **overrides)


def trained(opts: TrainingOptions, cur_nimg: int) -> TrainingState:
    """A state whose weights differ from a new one's, at cur_nimg images."""
    state = TrainingState.create(opts, 3, CPU)
    with torch.no_grad():
        for param in state.net.parameters():
            param.add_(0.25)
    state.cur_nimg, state.elapsed_s = cur_nimg, 5.0
    return state


def test_resume_loads_the_newest_state_that_fits_and_later_saves_avoid_the_skipped(tmp_path, capsys):
    opts = tiny_options(tmp_path)
    saved, first = trained(opts, 64), Checkpoints(RunDirectory(tmp_path))
    assert first.resume(saved, opts) is None  # a new run: the state stays as it is
    first.save(saved, opts)
    contents = checkpoint.load_state(tmp_path / "training-state-0000000-64.pt")
    del contents["net"][next(iter(contents["net"]))]
    checkpoint.save_state(checkpoint.state_path(tmp_path, 128), dict(contents, cur_nimg=128))  # a tensor short
    damaged = checkpoint.state_path(tmp_path, 192)
    damaged.write_bytes(b"not a training state")

    run = RunDirectory(tmp_path)
    checkpoints, state = Checkpoints(run), TrainingState.create(opts, 3, CPU)
    assert checkpoint.weights_digest(state.net) != checkpoint.weights_digest(saved.net)
    assert checkpoints.resume(state, opts) == tmp_path / "training-state-0000000-64.pt"
    assert (state.cur_nimg, state.elapsed_s) == (64, 5.0) and run.run_id == contents["run_id"]
    assert checkpoint.weights_digest(state.net) == checkpoint.weights_digest(saved.net)
    skips = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Skipping training state")]
    assert len(skips) == 2 and "0000000-192.pt: unreadable" in skips[0] and "its net lacks" in skips[1]
    # The states it skipped are never replaced: the next save at their image count takes another name.
    state.cur_nimg = 128
    checkpoints.save(state, opts)
    assert checkpoint.load_state(tmp_path / "training-state-0000000-128.1.pt")["cur_nimg"] == 128
    assert damaged.read_bytes() == b"not a training state"


def test_a_new_run_resumes_from_nothing_and_keeps_its_states_to_keep_states(tmp_path, capsys):
    opts = tiny_options(tmp_path, keep_states=2)
    checkpoints, state = Checkpoints(RunDirectory(tmp_path)), TrainingState.create(opts, 3, CPU)
    before = checkpoint.weights_digest(state.net)
    assert checkpoints.resume(state, opts) is None and state.cur_nimg == 0
    assert checkpoint.weights_digest(state.net) == before
    for nimg in (32, 64, 96):
        state.cur_nimg = nimg
        checkpoints.save(state, opts)
    assert [p.name for p in checkpoint.list_states(tmp_path)] == ["training-state-0000000-96.pt",
                                                                 "training-state-0000000-64.pt"]
    assert "Deleted training-state-0000000-32.pt (--keep-states=2)" in capsys.readouterr().out.splitlines()



def test_keep_states_leaves_what_is_named_like_a_state_but_is_no_file_and_says_so_once(tmp_path, capsys):
    opts = tiny_options(tmp_path, keep_states=1)
    folder, link = tmp_path / "training-state-0000000-16.pt", tmp_path / "training-state-0000000-8.pt"
    folder.mkdir()
    (folder / "inside").write_text("a user's")
    link.symlink_to(folder / "inside")
    checkpoints, state = Checkpoints(RunDirectory(tmp_path)), TrainingState.create(opts, 3, CPU)
    for nimg in (32, 64):
        state.cur_nimg = nimg
        checkpoints.save(state, opts)
    assert (folder / "inside").read_text() == "a user's" and link.is_symlink()
    assert not (tmp_path / "training-state-0000000-32.pt").exists()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines if line.startswith("Leaving")] == [
        "Leaving training-state-0000000-16.pt", "Leaving training-state-0000000-8.pt"]

@pytest.mark.bad_input
def test_resume_with_other_hyperparameters_is_refused_naming_them(tmp_path):
    opts = tiny_options(tmp_path)
    Checkpoints(RunDirectory(tmp_path)).save(trained(opts, 64), opts)
    other = tiny_options(tmp_path, lr=0.5)
    state = TrainingState.create(other, 3, CPU)
    with pytest.raises(OptionsMismatch, match=f"^{tmp_path}: cannot resume with different hyperparameters "
                                              r"\(lr: run has 0\.\d+, now 0\.5\)$"):
        Checkpoints(RunDirectory(tmp_path)).resume(state, other)
    assert state.cur_nimg == 0
