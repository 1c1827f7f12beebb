"""train_edm2.py --dry-run: the options on stdout; the network's size, where the run would start or resume and,
with --time-steps, its speed on stderr, matching what the training itself reports."""

import json
import os
import re
import socket

import pytest
import torch
from click.testing import CliRunner

import train_edm2
from tests.helpers import TRAIN_ARGS, assert_refused, tree
from training.run.run_dir import RunLock


def dry_run(*args: str):
    """A successful train_edm2.py --dry-run in-process."""
    result = CliRunner().invoke(train_edm2.main, [*TRAIN_ARGS, "--workers=0", *args, "--dry-run"])
    assert result.exit_code == 0, result.output
    return result


def test_parameter_count_is_the_one_training_reports(train_data, reference_run):
    logged = re.search(r"; ([\d,]+) parameters;", (reference_run / "log.txt").read_text())[1]
    result = dry_run(f"--data={train_data}", f"--outdir={reference_run}")
    assert f"Network: {logged} parameters." in result.stderr and "parameters" not in result.stdout


def test_says_whether_it_would_start_or_resume_and_from_what(train_data, reference_run, tmp_path):
    before = tree(reference_run)
    new = dry_run(f"--data={train_data}", f"--outdir={tmp_path / 'new'}")
    assert f"Would start a new run in {tmp_path / 'new'}" in new.stderr
    longer = dry_run(f"--data={train_data}", f"--outdir={reference_run}", "--duration=4Ki")
    assert (f"Would resume from {reference_run / 'training-state-0000002.pt'} at 2048 of 4096 images"
            in longer.stderr)
    done = dry_run(f"--data={train_data}", f"--outdir={reference_run}")
    assert "Would stop at once: " in done.stderr and "already holds 2048 >= 2048 images" in done.stderr
    assert tree(reference_run) == before and not (tmp_path / "new").exists()


def test_time_steps_estimates_speed_and_total_time_and_writes_nothing(train_data, tmp_path):
    result = dry_run(f"--data={train_data}", f"--outdir={tmp_path / 'run'}", "--time-steps=2", "--peak-tflops=0.5")
    line = next(line for line in result.stderr.splitlines() if line.startswith("Timed "))
    match = re.fullmatch(r"Timed 2 step\(s\) of 32 images on one cpu process after 2 warm-up steps: ([\d.]+) images/s, "
                         r"([\d.e-]+) TFLOP/s, MFU ([\d.]+)% of 0\.5 TFLOP/s \(--peak-tflops\); "
                         r"the 2048 images to go would take about (\d+)h(\d\d)m(\d\d)s\.", line)
    assert match, line
    rate, tflops, mfu, (h, m, s) = float(match[1]), float(match[2]), float(match[3]), map(int, match.groups()[3:])
    assert mfu == pytest.approx(100 * tflops / 0.5, rel=0.01, abs=0.05)  # both printed rounded
    # The estimate is the remaining images at the measured rate: hms() drops the fraction of a second, and the
    # printed rate is rounded to 0.1 (a relative error of at most 0.05 / rate).
    seconds = 2048 / rate
    assert rate > 0 and abs(h * 3600 + m * 60 + s - seconds) <= 1 + seconds * 0.05 / rate
    assert json.loads(result.stdout)["duration"] == 2048 and tree(tmp_path) == []


@pytest.mark.bad_input
@pytest.mark.parametrize("args, message", [(["--time-steps=2"], "needs --dry-run"),
                                           (["--time-steps=-1", "--dry-run"], "--time-steps"),
                                           (["--time-steps=1001", "--dry-run"], "--time-steps")])
def test_time_steps_bad_input_is_refused(train_data, tmp_path, args, message):
    run = tmp_path / "run"
    assert_refused(tmp_path, lambda: CliRunner().invoke(
        train_edm2.main, [*TRAIN_ARGS, f"--data={train_data}", f"--outdir={run}", *args]), "--time-steps", message)


def impossible_allocation(*args):
    """What the CPU allocator raises for an allocation no machine has (2**62 bytes): its RuntimeError."""
    torch.empty(2**62, dtype=torch.uint8)


def cuda_out_of_memory(*args):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")


@pytest.mark.bad_input
@pytest.mark.parametrize("fail, fragment", [(impossible_allocation, "DefaultCPUAllocator"),
                                            (cuda_out_of_memory, "CUDA out of memory")], ids=["cpu", "cuda"])
def test_time_steps_that_run_out_of_memory_say_so(train_data, tmp_path, monkeypatch, fail, fragment):
    # The CPU allocator's error was a traceback: only CUDA's was caught.
    monkeypatch.setattr(train_edm2, "timed_speed", fail)
    run = tmp_path / "run"
    assert_refused(tmp_path, lambda: CliRunner().invoke(train_edm2.main, [
        *TRAIN_ARGS, f"--data={train_data}", f"--outdir={run}", "--dry-run", "--time-steps=1", "--batch-gpu=16"]),
        "out of memory", fragment, "give a smaller --batch-gpu, --batch or --channels")


def test_dry_run_on_a_run_held_by_a_live_training_names_the_lock_and_its_holder(train_data, reference_run):
    lock = RunLock(reference_run)  # another open file of training.lock: flock treats it as another process's
    lock.acquire()
    try:
        held = dry_run(f"--data={train_data}", f"--outdir={reference_run}", "--duration=4Ki")
    finally:
        lock.release()
    assert "Would resume from" in held.stderr
    assert (f"But {reference_run} is in use now: the training process {os.getpid()} on host "
            f"{socket.gethostname()}" in held.stderr and "holds training.lock" in held.stderr)
    free = dry_run(f"--data={train_data}", f"--outdir={reference_run}", "--duration=4Ki")
    assert "in use" not in free.stderr and not (reference_run / "training.lock").exists()
