"""train_edm2.py --dry-run: the options on stdout; the network's size and where the run would start or resume on
stderr, matching what the training itself reports."""

import re

from click.testing import CliRunner

import train_edm2
from tests.helpers import TRAIN_ARGS, tree


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
