"""train_edm2.py under faults: two trainings on one run directory, repeated SIGKILLs during writes, a torn
stats.jsonl, image counts off the intervals, Ctrl-C in a script, a signal after the console's pipe died, training
states that do not fit, and JSON files beyond bounds."""

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import threading

import pytest
import torch
from click.testing import CliRunner

import train_edm2
from edm2.data.dataset import ImageFolderDataset
from training import data_order
from training.run import checkpoint
from training.run.log_tee import Tee
from tests.helpers import (
    REPO, TRAIN_ARGS, assert_one_error_line, assert_refused, run_training, snapshot_contents, start_training,
    stopped_at, train_command, train_env, wait_for,
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
            assert f"Took over training.lock from the training process {killed_pid} on host" in output, output
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
    assert sorted(p.name for p in (outdir / "plots").iterdir()) == [
        "magnitudes.json", "magnitudes.png", "training.json", "training.png"]
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
    assert "Received SIGINT" in output and "Traceback" not in output
    # The newest training state is the stop's (on a busy machine the signal may land after a regular one).
    newest = checkpoint.list_states(outdir)[0]
    assert checkpoint.load_state(newest)["cur_nimg"] == stopped_at(output) and not (outdir / "training.lock").exists()


def test_ctrl_c_stops_the_demo(tmp_path):
    demo = tmp_path / "demo"
    env = train_env(PY=sys.executable, DEMO_OUT=str(demo), DEMO_PRESET="toy-tiny", DEMO_NUM="48",
               DEMO_RES="8", DEMO_CLASSES="4", DEMO_DURATION="64Ki")
    proc = subprocess.Popen(["bash", "scripts/demo.sh"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    wait_for(lambda: (demo / "run" / "stats.jsonl").exists(), proc, timeout=300)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C at a terminal: the whole foreground process group
    output = proc.communicate(timeout=120)[0]
    # The demo stopped, and no later step ran. bash dies by SIGINT itself when it saw the Ctrl-C while waiting for
    # the training; where it did not (SIGINT ignored where the tests were started, as in the background), set -e
    # ends it with the status of the training that died of SIGINT, 130. (A child that exits 0 lets bash go on.)
    assert proc.returncode in (-signal.SIGINT, 128 + signal.SIGINT), output
    assert "Received SIGINT" in output and "== 3/" not in output and "== done" not in output, output
    # The newest training state is where the training stopped, and the training resumes from it.
    newest, nimg = checkpoint.list_states(demo / "run")[0], stopped_at(output)
    assert checkpoint.load_state(newest)["cur_nimg"] == nimg
    rerun = subprocess.run([sys.executable, "train_edm2.py", "--preset=toy-tiny", f"--data={demo / 'toy.zip'}",
                            f"--outdir={demo / 'run'}", f"--duration={nimg + 32}"], cwd=REPO, env=train_env(),
                           capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0 and f"Resuming from {newest.name} at {nimg} images" in rerun.stdout, rerun.stdout


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_dead_pipe_then_a_signal_still_checkpoints_and_resumes_exactly(sig, train_data, reference_run, tmp_path):
    # `train_edm2.py ... 2>&1 | tee log`, then the reader dies (Ctrl-C at a terminal signals tee too) and the
    # training is signalled: every later console write fails with EPIPE.
    outdir = tmp_path / "piped"
    read_end, write_end = os.pipe()
    # One page of pipe and a reader that reads nothing: the training blocks on a console write after at most
    # 4096 / 100 status lines (one per step; each is longer than 100 bytes), so it stops well before 2048 images.
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)
    reader = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], stdin=read_end)
    proc = subprocess.Popen(train_command(train_data, outdir, "--workers=2", "--status=32"), cwd=REPO,
                            env=train_env(), stdout=write_end, stderr=write_end)
    os.close(read_end)
    os.close(write_end)
    try:
        wait_for(lambda: (outdir / "stats.jsonl").exists(), proc, timeout=300)  # at least one step done
        proc.send_signal(signal.SIGSTOP)  # no step, and no console write, until the reader is gone
        reader.kill()
        reader.wait()
        proc.send_signal(sig)
        proc.send_signal(signal.SIGCONT)
        proc.wait(timeout=120)  # a hang guard only
    finally:
        for child in (proc, reader):
            child.kill()
            child.wait()
    assert proc.returncode == (-signal.SIGINT if sig == signal.SIGINT else 0)
    states = checkpoint.list_states(outdir)
    assert len(states) == 1
    stopped_at = checkpoint.load_state(states[0])["cur_nimg"]
    assert 0 < stopped_at < 2048
    assert sorted(p.name for p in outdir.iterdir()) == sorted(["log.txt", states[0].name, "stats.jsonl",
                                                               "training_options.json"])
    text = (outdir / "log.txt").read_text()
    log = text.splitlines()
    assert f"Received {sig.name}: finishing this step and writing a checkpoint." in log and "Traceback" not in text
    assert log[-2:] == [f"Saved {states[0].name}", f"Stopped at {stopped_at} images; rerun the same command to resume."]
    assert stats_images(outdir)[-1] == stopped_at

    result = run_training(train_data, outdir, "--workers=2")
    assert result.returncode == 0, result.stderr
    assert f"Resuming from {states[0].name} at {stopped_at} images" in result.stdout
    assert snapshots_at(outdir, "0000002") == snapshots_at(reference_run, "0000002")


WEIGHT = "unet.out_conv.weight"


def altered(state: dict, case: str) -> tuple[dict, str]:
    """A training state of 2048 images made damaged or inconsistent as the case says, and the reason a run gives
    for skipping it."""
    shape = list(state["net"][WEIGHT].shape)
    if case == "holds another count":
        return dict(state, cur_nimg=5), "holds 5 images, but its name says kimg 2"
    if case == "lacks its options":
        return {k: v for k, v in state.items() if k != "options"}, "not a training state (missing options)"
    if case == "a weight of another shape":
        net = dict(state["net"], **{WEIGHT: state["net"][WEIGHT][:, :-1]})
        return dict(state, net=net), (f"net {WEIGHT} has shape {[shape[0], shape[1] - 1, *shape[2:]]}, the network's "
                                      f"has shape {shape}")
    if case == "an EMA weight of another shape":
        emas = [dict(ema, **{WEIGHT: ema[WEIGHT][:1]}) for ema in state["ema"]["emas"]]
        return dict(state, ema=dict(state["ema"], emas=emas)), (f"ema track 0 {WEIGHT} has shape {[1, *shape[1:]]}, "
                                                                 f"the network's has shape {shape}")
    assert case == "from a newer version"
    version = checkpoint.FORMAT_VERSION + 1
    return dict(state, format_version=version), (f"written by a newer version of this project (format version "
                                                 f"{version}; this one reads {checkpoint.FORMAT_VERSION})")


@pytest.mark.parametrize("case", ["holds another count", "lacks its options", "a weight of another shape",
                                  "an EMA weight of another shape", "from a newer version"])
def test_a_newest_state_that_does_not_fit_is_skipped_and_never_replaced(case, train_data, reference_run, tmp_path):
    outdir = tmp_path / "skipped"
    shutil.copytree(reference_run, outdir)
    for snapshot in outdir.glob("network-snapshot-0000002-*"):
        snapshot.unlink()
    newest = outdir / "training-state-0000002.pt"
    state, reason = altered(torch.load(newest, weights_only=True), case)
    torch.save(state, newest)
    refused = newest.read_bytes()

    result = CliRunner().invoke(train_edm2.main, [*TRAIN_ARGS, f"--data={train_data}", f"--outdir={outdir}",
                                                  "--workers=0"])
    assert result.exit_code == 0, result.output
    skips = [line for line in result.output.splitlines() if line.startswith("Skipping")]
    assert skips == [f"Skipping training state {newest}: {reason}"], result.output
    assert "Resuming from training-state-0000001.pt at 1024 images" in result.output
    # The file this run refused to read is as it was; this run's state of the same count has a name of its own.
    assert newest.read_bytes() == refused
    assert checkpoint.load_state(outdir / "training-state-0000002.1.pt")["cur_nimg"] == 2048
    assert snapshots_at(outdir, "0000002") == snapshots_at(reference_run, "0000002")
    # The next start finds this run's state first.
    result = CliRunner().invoke(train_edm2.main, [*TRAIN_ARGS, f"--data={train_data}", f"--outdir={outdir}"])
    assert result.exit_code == 0 and "Skipping" not in result.output, result.output
    assert "Training already complete (2048 >= 2048 images)" in result.output


DEEP = "[" * 100_000 + "]" * 100_000  # Python's json module recurses once per level: a RecursionError


def test_a_stats_line_nested_deep_is_dropped_on_resume(train_data, reference_run, tmp_path):
    outdir = tmp_path / "deep"
    shutil.copytree(reference_run, outdir)
    with open(outdir / "stats.jsonl", "a") as f:
        f.write(DEEP + "\n" + '{"nimg": 1' + "0" * 5000 + "}\n")
    result = CliRunner().invoke(train_edm2.main, [*TRAIN_ARGS, f"--data={train_data}", f"--outdir={outdir}"])
    assert result.exit_code == 0 and "Training already complete" in result.output, result.output
    assert stats_images(outdir) == [512, 1024, 1536, 2048]


@pytest.mark.bad_input
@pytest.mark.parametrize("text, fragment", [(DEEP, "JSON nested 100000 levels deep"),
                                            ('{"lr": 1e999}', "the number 1e999 is not finite")])
def test_training_options_out_of_bounds_are_one_line_and_change_nothing(text, fragment, train_data, tmp_path):
    outdir = tmp_path / "run"
    outdir.mkdir()
    (outdir / "training_options.json").write_text(text)
    (outdir / "network-snapshot-0000001-0.050.safetensors").write_bytes(b"a snapshot of the run")
    assert_refused(tmp_path, lambda: CliRunner().invoke(train_edm2.main, [
        *TRAIN_ARGS, f"--data={train_data}", f"--outdir={outdir}", "--workers=0"]),
        f"{outdir / 'training_options.json'}: {fragment}")
    assert (outdir / "training_options.json").read_text() == text


def test_data_loader_workers_never_run_the_training_signal_handler(train_data, tmp_path, monkeypatch):
    # A worker is forked with the main process's Python signal handler. Ctrl-C at a terminal signals every process
    # of the group: until the worker ignores the signal it must hold it, not print "Received SIGINT" as a worker.
    original = data_order._ignore_signals

    def recording(worker_id: int) -> None:
        held = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        original(worker_id)
        after = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        (tmp_path / f"worker{worker_id}.json").write_text(json.dumps([sorted(held), sorted(after)]))

    monkeypatch.setattr(data_order, "_ignore_signals", recording)
    dataset = ImageFolderDataset(train_data)
    loaded = data_order.batches(dataset, data_order.DataOrder(len(dataset), 0, 0, 1, 4, 0), 2, torch.device("cpu"))
    next(loaded)
    main_held = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    loaded.close()
    stop = sorted(data_order.STOP_SIGNALS)
    for worker in range(2):
        held, after = json.loads((tmp_path / f"worker{worker}.json").read_text())
        assert set(stop) <= set(held) and not set(stop) & set(after)
    assert not set(stop) & main_held


def test_a_worker_whose_main_process_was_killed_prints_no_traceback(monkeypatch, capfd):
    # A rank killed while its worker's resource-sharer thread handed it a batch: that thread met "Connection reset by
    # peer" and printed a traceback under the launcher's one line naming the killed rank (1 run in 8 on 2 busy cores).
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(data_order, "_ignore_signals", lambda worker_id: None)
    data_order._init_worker(0)

    def report_in_thread(error: Exception) -> None:
        """As multiprocessing.resource_sharer's serving thread reports an error: to sys.excepthook."""
        def serve() -> None:
            try:
                raise error
            except Exception:
                sys.excepthook(*sys.exc_info())
        thread = threading.Thread(target=serve)
        thread.start()
        thread.join()

    report_in_thread(ConnectionResetError(104, "Connection reset by peer"))
    report_in_thread(BrokenPipeError(32, "Broken pipe"))
    assert capfd.readouterr().err == ""
    report_in_thread(ValueError("a worker's own error"))
    assert "Traceback" in capfd.readouterr().err  # every other error still shows


def test_a_dead_console_is_dropped_and_the_log_keeps_every_line(tmp_path):
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone: every write to the pipe fails with EPIPE
    console = os.fdopen(write_end, "w")
    with open(tmp_path / "log.txt", "ab", buffering=0) as log:
        tee = Tee(console, log)
        tee.write("first\n")
        tee.write("second\n")
        tee.flush()
    console.write("later\n")  # its descriptor now leads to /dev/null: no later write or flush fails
    console.close()
    assert (tmp_path / "log.txt").read_text() == "first\nsecond\n"


def error_lines(output: str) -> list[str]:
    """The lines of output that report an error."""
    return [line for line in output.splitlines() if line.startswith("Error")]


@pytest.mark.bad_input
def test_a_full_disk_under_two_processes_is_one_line_from_the_rank_that_met_it(train_data, tmp_path):
    # Before: the rank that lost its group ended first and the launcher killed the one still printing why (no line
    # at all), or both printed, the second with Gloo's "Connection closed by peer".
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare to mount a full filesystem")
    disk = tmp_path / "disk"
    disk.mkdir()
    command = " ".join(f"'{arg}'" for arg in train_command(train_data, disk / "run", "--processes=2", "--workers=0"))
    result = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=8k tmpfs {disk} && exec {command}"],
                            cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=300)
    if "mount" in result.stderr and "No space" not in result.stderr:
        pytest.skip(f"cannot mount here: {result.stderr.strip()}")
    output = result.stdout + result.stderr
    assert result.returncode == 1 and "Traceback" not in output, output
    [line] = error_lines(output)
    assert line.startswith(f"Error: {disk / 'run'}/") and line.endswith(": No space left on device"), output


def test_ctrl_c_under_two_processes_is_said_once(train_data, tmp_path):
    outdir = tmp_path / "run"
    proc = start_training(train_data, outdir, "--processes=2", "--workers=0", "--duration=64Ki")
    wait_for(lambda: (outdir / "stats.jsonl").exists(), proc)
    proc.send_signal(signal.SIGINT)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == -signal.SIGINT and "Traceback" not in output, output
    assert output.count("Received SIGINT") == 1 and not error_lines(output), output


@pytest.mark.bad_input
def test_rank_zeros_refusal_under_two_processes_is_one_line(train_data, reference_run, tmp_path):
    # Before: every rank raised rank 0's error (distributed.on_main_rank) and printed it: the same line twice.
    run = tmp_path / "run"
    shutil.copytree(reference_run, run)
    result = subprocess.run(train_command(train_data, run, "--processes=2", "--workers=0", "--lr=0.5"), cwd=REPO,
                            env=train_env(), capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 1 and "Traceback" not in output, output
    assert error_lines(output) == [f"Error: {run}: cannot resume with different hyperparameters (lr: run has 0.01, "
                                   "now 0.5)"], output
