"""train_edm2.py under faults: two trainings on one run directory, repeated SIGKILLs during writes, a torn
stats.jsonl, image counts off the intervals, and Ctrl-C in a script."""

import json
import os
import shutil
import signal
import subprocess
import sys

from training import checkpoint
from tests.helpers import (
    REPO, TRAIN_ENV, assert_one_error_line, run_training, snapshot_contents, start_training, wait_for,
)

# Options that may differ between the invocations compared below: they change when files are written, not
# what is computed.
WHEN = ("run_dir", "workers", "duration", "status", "snapshot", "checkpoint")


def snapshots_at(outdir, tag: str) -> dict:
    """Both EMA snapshots named by an image-count tag, less the options in WHEN."""
    contents = snapshot_contents(outdir, f"network-snapshot-{tag}-0.*.safetensors", WHEN)
    assert len(contents) == 2, sorted(contents)
    return contents


def stats_images(outdir) -> list[int]:
    return [json.loads(line)["nimg"] for line in (outdir / "stats.jsonl").read_text().splitlines()]


def test_two_trainings_started_at_once_one_runs_exactly_as_alone(train_data, reference_run, tmp_path):
    outdir = tmp_path / "shared"
    procs = [start_training(train_data, outdir, "--workers=0") for _ in range(2)]
    outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    assert sorted(proc.returncode for proc in procs) == [0, 1], outputs
    winner, loser = sorted(zip(procs, outputs), key=lambda pair: pair[0].returncode)
    line = assert_one_error_line(subprocess.CompletedProcess([], 1, loser[1], ""),
                                 f"{outdir} is in use by the training process {winner[0].pid} on host")
    assert loser[1].strip() == line  # the refused start printed nothing else
    # ... and wrote nothing: one training's log lines and stats rows, the files of a solo run.
    assert (outdir / "log.txt").read_text().count("Starting at 0 images") == 1
    assert stats_images(outdir) == [512, 1024, 1536, 2048]
    assert sorted(p.name for p in outdir.iterdir()) == sorted(p.name for p in reference_run.iterdir())
    for tag in ("0000001", "0000002"):
        assert snapshots_at(outdir, tag) == snapshots_at(reference_run, tag)


# Every 128 images a snapshot pair and a training state, status every 64: a write every few steps.
FREQUENT = ["--duration=1Ki", "--snapshot=128", "--checkpoint=128", "--status=64", "--workers=0"]


def test_repeated_sigkill_during_writes_then_rerun_is_exact_and_clean(train_data, reference_run, tmp_path):
    outdir = tmp_path / "killed"
    left_behind, killed_pid, kills = set(), None, 0

    def check_cleanup(output: str) -> None:
        """A start after a kill removed the killed run's lock and the temporaries it left behind."""
        if killed_pid is not None:
            assert f"Removed the stale lock of process {killed_pid} on host" in output, output
        assert all(f"Removed {name}, left by an interrupted write." in output for name in left_behind), output

    while kills < 3 or not left_behind and kills < 8:
        proc = start_training(train_data, outdir, *FREQUENT)
        # Let each run make progress (one more training state), then kill it while it writes a file.
        wait_for(lambda: len(checkpoint.list_states(outdir)) > kills, proc, timeout=300)
        wait_for(lambda: any(p.name.endswith(".tmp") for p in outdir.iterdir()), proc, poll_s=0.0005)
        proc.kill()
        check_cleanup(proc.communicate()[0])
        killed_pid, kills = proc.pid, kills + 1
        left_behind = {p.name for p in outdir.iterdir() if p.name.endswith(".tmp")}
    assert left_behind, "no kill fell into a write"

    result = run_training(train_data, outdir, *FREQUENT)
    assert result.returncode == 0, result.stderr
    check_cleanup(result.stdout)
    # The run directory holds exactly its own files: no temporaries, no lock, no file replaced by another count.
    tags = [f"0000000-{n}" for n in range(128, 1024, 128)] + ["0000001"]
    assert sorted(p.name for p in outdir.iterdir()) == sorted(
        ["log.txt", "plots", "samples", "stats.jsonl", "training_options.json"]
        + [f"training-state-{tag}.pt" for tag in tags]
        + [f"network-snapshot-{tag}-{std}.safetensors" for tag in tags for std in ("0.050", "0.100")]
    )
    assert sorted(p.name for p in (outdir / "plots").iterdir()) == ["magnitudes.json", "training.json", "training.png"]
    assert stats_images(outdir) == list(range(64, 1025, 64))
    assert snapshots_at(outdir, "0000001") == snapshots_at(reference_run, "0000001")


def test_torn_stats_line_does_not_stop_a_resume(train_data, reference_run, tmp_path):
    outdir = tmp_path / "torn"
    shutil.copytree(reference_run, outdir)
    for path in [outdir / "training-state-0000002.pt", *outdir.glob("network-snapshot-0000002-*")]:
        path.unlink()
    rows = (outdir / "stats.jsonl").read_text().splitlines()
    (outdir / "stats.jsonl").write_text("\n".join(rows[:3]) + "\n" + rows[3][:25])  # killed in mid-append
    records = json.loads((outdir / "plots" / "training.json").read_text())
    records["noise_levels"][-1]["u"] = [0.0] * 11  # the killed run's row after the training state: not kept
    (outdir / "plots" / "training.json").write_text(json.dumps(records))

    result = run_training(train_data, outdir, "--workers=0")
    assert result.returncode == 0, result.stderr
    assert "Resuming from training-state-0000001.pt at 1024 images" in result.stdout
    assert "Dropped a torn last line" in result.stdout
    assert stats_images(outdir) == [512, 1024, 1536, 2048]
    assert snapshots_at(outdir, "0000002") == snapshots_at(reference_run, "0000002")
    # The dashboard's records: the copied row at 2048 images was dropped on resume and measured again.
    for name, key in (("training.json", "noise_levels"), ("magnitudes.json", "rows")):
        rows = [json.loads((run / "plots" / name).read_text())[key] for run in (outdir, reference_run)]
        assert rows[0] == rows[1] and [row["nimg"] for row in rows[0]] == [1024, 2048]


def test_counts_off_the_intervals_never_replace_each_other(train_data, reference_run, tmp_path):
    # A duration of 1504 images (47 steps of 32) ends between intervals: the end's snapshots and training
    # state share kimg 1 with the regular ones at 1024 and must not replace them.
    outdir = tmp_path / "off"
    result = run_training(train_data, outdir, "--workers=0", "--duration=1504")
    assert result.returncode == 0, result.stderr
    states = {path.name: checkpoint.load_state(path)["cur_nimg"] for path in checkpoint.list_states(outdir)}
    assert states == {"training-state-0000001-1504.pt": 1504, "training-state-0000001.pt": 1024}
    snapshots = {name: meta["nimg"] for name, (_, meta) in snapshot_contents(outdir, "network-snapshot-*").items()}
    assert snapshots == {
        "network-snapshot-0000001-0.050.safetensors": 1024, "network-snapshot-0000001-0.100.safetensors": 1024,
        "network-snapshot-0000001-1504-0.050.safetensors": 1504,
        "network-snapshot-0000001-1504-0.100.safetensors": 1504,
    }
    assert snapshots_at(outdir, "0000001") == snapshots_at(reference_run, "0000001")

    result = run_training(train_data, outdir, "--workers=0")  # on to 2048 images, from the newest state
    assert result.returncode == 0, result.stderr
    assert "Resuming from training-state-0000001-1504.pt at 1504 images" in result.stdout
    assert snapshots_at(outdir, "0000002") == snapshots_at(reference_run, "0000002")


def test_ctrl_c_checkpoints_then_ends_by_sigint(train_data, tmp_path):
    outdir = tmp_path / "interrupted"
    proc = start_training(train_data, outdir, "--workers=1", "--duration=64Ki")
    wait_for(lambda: (outdir / "stats.jsonl").exists(), proc)
    proc.send_signal(signal.SIGINT)
    output = proc.communicate(timeout=120)[0]
    # Killed by SIGINT (a shell reports status 130), after the checkpoint and without a traceback.
    assert proc.returncode == -signal.SIGINT, output
    assert "Received SIGINT" in output and "rerun the same command to resume" in output and "Traceback" not in output
    assert len(checkpoint.list_states(outdir)) == 1 and not (outdir / "training.lock").exists()


def test_ctrl_c_stops_the_demo(tmp_path):
    demo = tmp_path / "demo"
    env = dict(TRAIN_ENV, PY=sys.executable, DEMO_OUT=str(demo), DEMO_PRESET="toy-tiny", DEMO_NUM="48",
               DEMO_RES="8", DEMO_CLASSES="4", DEMO_DURATION="64Ki")
    proc = subprocess.Popen(["bash", "scripts/demo.sh"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    wait_for(lambda: (demo / "run" / "stats.jsonl").exists(), proc, timeout=300)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C at a terminal: the whole foreground process group
    output = proc.communicate(timeout=120)[0]
    # bash ends a script by SIGINT only when its child died of SIGINT; a child that exits 0 lets it go on.
    assert proc.returncode == -signal.SIGINT, output
    assert "Received SIGINT" in output and "== 3/4" not in output and "== done" not in output, output
    assert len(checkpoint.list_states(demo / "run")) == 1
