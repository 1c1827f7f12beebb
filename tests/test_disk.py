"""Disk use of a training: snapshot and training-state sizes computed from the network (start line, README table),
--keep-states deleting old training states only behind a newer readable one, even under repeated SIGKILLs."""

import random
import re
import shutil

import pytest
import torch
from click.testing import CliRunner

import train_edm2
from edm2.formats.snapshot import load_network
from training.run import checkpoint, disk
from training.options import TrainingOptions
from training.presets import PRESETS, get_preset
from training.state import init_network
from tests.helpers import (
    REPO, TRAIN_ARGS, assert_refused, run_training, snapshot_contents, start_training, toy_tiny_options, wait_for,
)

# Options that may differ between the invocations compared: when files are written and kept, not what is computed.
WHEN = ("run_dir", "workers", "duration", "status", "snapshot", "checkpoint", "keep_states")


def final_snapshots(outdir) -> dict:
    contents = snapshot_contents(outdir, "network-snapshot-0000002-0.*.safetensors", WHEN)
    assert len(contents) == 2, sorted(contents)
    return contents


def test_sizes_match_the_files_a_run_writes(reference_run):
    snapshot = reference_run / "network-snapshot-0000002-0.050.safetensors"
    net, _ = load_network(snapshot)
    tracks = len(get_preset("toy-tiny").ema_stds)
    bound = disk.overhead_bound(net, tracks)
    # Each file holds its tensors plus headers (names, shapes, options) no larger than the bound.
    for path, tensor_bytes in [(snapshot, disk.snapshot_bytes(net)),
                               (reference_run / "training-state-0000002.pt", disk.state_bytes(net, tracks))]:
        assert 0 <= path.stat().st_size - tensor_bytes <= bound, path
    # preset_sizes builds its networks on the meta device: they count as the trained one does.
    with torch.device("meta"):
        meta_net = init_network(toy_options(reference_run), 3)
    assert (disk.snapshot_bytes(meta_net), disk.state_bytes(meta_net, tracks)) == (
        disk.snapshot_bytes(net), disk.state_bytes(net, tracks))


def test_the_start_line_counts_what_the_run_writes(reference_run):
    log = (reference_run / "log.txt").read_text()
    net, _ = load_network(reference_run / "network-snapshot-0000002-0.050.safetensors")
    snapshot, state = disk.size_text(disk.snapshot_bytes(net)), disk.size_text(disk.state_bytes(net, 2))
    # TRAIN_ARGS: 2Ki images, a snapshot pair and a training state every 1Ki.
    assert f"Disk: this run writes 4 snapshot(s) of {snapshot} and 2 training state(s) of {state}: up to " in log


@pytest.mark.parametrize("start, end, interval, count", [
    (0, 2048, 1024, 2), (0, 2000, 1024, 2), (1024, 2048, 1024, 1), (0, 2048, 0, 1), (2048, 2048, 1024, 0),
    (1000, 3000, 1024, 3),
])
def test_writes_counts_each_crossed_interval_and_the_end(start, end, interval, count):
    assert disk.writes(start, end, interval) == count


def toy_options(tmp_path, **overrides) -> TrainingOptions:
    return toy_tiny_options({}, run_dir=str(tmp_path), **overrides)


def test_output_that_cannot_fit_is_warned_about(tmp_path, monkeypatch):
    opts = toy_options(tmp_path, keep_states=1, checkpoint=256)
    net = init_network(opts, 3)
    # 2 snapshot pairs; 8 training states written, of which the newest and the one being written are on disk.
    needed = 4 * disk.snapshot_bytes(net) + 2 * disk.state_bytes(net, 2)
    free = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda path: free._replace(free=needed))
    line, warning = disk.disk_report(opts, net, 0, tmp_path)
    assert "4 snapshot(s)" in line and "8 training state(s)" in line and "at most 2 on disk at once" in line
    assert f"up to {disk.size_text(needed)}; {disk.size_text(needed)} free in {tmp_path}" in line and warning is None
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda path: free._replace(free=needed - 1))
    assert f"the run's output ({disk.size_text(needed)}) does not fit" in disk.disk_report(opts, net, 0, tmp_path)[1]


@pytest.mark.bad_input
@pytest.mark.parametrize("value, message", [("-1", "-1 is not in the range 0<=x<=1000000"),
                                            ("1000001", "1000001 is not in the range 0<=x<=1000000"),
                                            ("two", "'two' is not a valid integer")])
def test_bad_keep_states_is_one_line_and_writes_nothing(value, message, train_data, tmp_path):
    assert_refused(tmp_path, lambda: CliRunner().invoke(train_edm2.main, [
        *TRAIN_ARGS, f"--data={train_data}", f"--outdir={tmp_path / 'run'}", f"--keep-states={value}"]),
        "Invalid value for '--keep-states'", message)


def state_names(outdir) -> list[str]:
    return sorted(p.name for p in checkpoint.list_states(outdir))


def test_keep_states_keeps_the_newest_and_never_a_refused_one(train_data, reference_run, tmp_path):
    outdir = tmp_path / "run"
    result = run_training(train_data, outdir, "--workers=0", "--duration=1Ki", "--checkpoint=256", "--keep-states=2")
    assert result.returncode == 0, result.stdout
    assert state_names(outdir) == ["training-state-0000000-768.pt", "training-state-0000001.pt"]
    assert "Deleted training-state-0000000-256.pt (--keep-states=2)" in result.stdout
    # A newer state this start cannot read is skipped, written around and left alone; the run's own are pruned.
    damaged = outdir / "training-state-0000001-1536.pt"
    damaged.write_bytes(b"not a training state")
    result = run_training(train_data, outdir, "--workers=0", "--checkpoint=256", "--keep-states=1")
    assert result.returncode == 0, result.stdout
    assert state_names(outdir) == ["training-state-0000001-1536.pt", "training-state-0000002.pt"]
    assert damaged.read_bytes() == b"not a training state"
    assert final_snapshots(outdir) == final_snapshots(reference_run)


def test_sigkill_at_random_moments_with_keep_states_1_resumes_exactly(train_data, reference_run, tmp_path):
    outdir, rng, most_states = tmp_path / "killed", random.Random(0), 0
    args = ("--workers=0", "--checkpoint=128", "--snapshot=1Ki", "--status=64", "--keep-states=1")

    def images_done() -> int:
        """The image count of the last stats row, the run's progress; 0 before the first."""
        text = (outdir / "stats.jsonl").read_text() if (outdir / "stats.jsonl").exists() else ""
        return max(map(int, re.findall(r'"nimg": (\d+)', text)), default=0)

    def progressed(target: int) -> bool:
        """Watch the directory: the newest state plus the one being written at most; then whether target is done."""
        nonlocal most_states
        most_states = max(most_states, len(checkpoint.list_states(outdir)))
        return images_done() >= target

    # Kill points spread over the run, each after progress, most a random few polls later (inside a write or not).
    for target in sorted(rng.sample(range(128, 2048, 64), 4)):
        proc = start_training(train_data, outdir, *args)
        wait_for(lambda: progressed(target), proc, timeout=300, poll_s=0.001)
        for _ in range(rng.randrange(50)):
            progressed(0)
        proc.kill()
        proc.communicate()
        progressed(0)
        # Whatever moment the kill fell on, a readable training state remains once one was written.
        if images_done() >= 128:
            assert checkpoint.load_newest_state(outdir)[0] is not None
    result = run_training(train_data, outdir, *args)
    assert result.returncode == 0, result.stdout
    assert most_states <= 2 and state_names(outdir) == ["training-state-0000002.pt"]
    assert final_snapshots(outdir) == final_snapshots(reference_run)


def size_table() -> str:
    """README's table of what each preset writes, from the networks."""
    rows = ["| preset | snapshot (one EMA length) | training state | snapshots of a whole run | every training "
            "state of a whole run |", "|---|---|---|---|---|"]
    for name, preset in PRESETS.items():
        snapshot, state = disk.preset_sizes(name)
        snapshots = disk.writes(0, preset.duration, preset.snapshot) * len(preset.ema_stds) * snapshot
        states = disk.writes(0, preset.duration, preset.checkpoint) * state
        rows.append(f"| `{name}` | {disk.size_text(snapshot)} | {disk.size_text(state)} | "
                    f"{disk.size_text(snapshots)} | {disk.size_text(states)} |")
    return "\n".join(rows) + "\n"


def test_readme_lists_each_presets_file_sizes():
    assert size_table() in (REPO / "docs" / "training.md").read_text()
