"""The SLURM recipe (scripts/slurm/train_edm2.sbatch), run with stand-ins for srun, scancel and scontrol.

The stand-ins do what SLURM would on one node: srun runs its command as the job step, scancel signals the
step (never the batch script), scontrol names the host and records a requeue. The training inside is real
(torchrun, one Gloo process), so the test shows the command the recipe runs parses, that the signal before
the time limit leaves a training state and a requeue, and that the requeued job resumes to the end.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from edm2.runtime.distributed import free_port
from tests.helpers import REPO, TRAIN_ARGS, snapshot_contents, train_env, wait_for

SCRIPT = REPO / "scripts" / "slurm" / "train_edm2.sbatch"

STAND_INS = {
    # The job step: its pid is kept so that scancel can signal it, as SLURM signals a step's tasks.
    "srun": 'echo $$ > "$SLURM_STANDIN/step.pid"; while [ "${1#-}" != "$1" ]; do shift; done; exec "$@"',
    "scancel": 'echo "scancel $*" >> "$SLURM_STANDIN/calls"; kill -"${1#--signal=}" "$(cat "$SLURM_STANDIN/step.pid")"',
    "scontrol": 'echo "scontrol $*" >> "$SLURM_STANDIN/calls"; [ "$1" = show ] && echo localhost; true',
}


def slurm_env(tmp_path: Path) -> dict:
    """The environment of a one-node job with 1 GPU's worth of processes, the stand-ins first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in STAND_INS.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return train_env(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_STANDIN=str(tmp_path), SLURM_JOB_ID="4242",
                TMPDIR=str(tmp_path),
                SLURM_NNODES="1", SLURM_GPUS_ON_NODE="1", SLURM_JOB_NODELIST="localhost",
                PYTHON=sys.executable, EDM2_RDZV_PORT=str(free_port()))


def calls(tmp_path: Path) -> list[str]:
    """The scancel and scontrol calls the recipe made, in order."""
    path = tmp_path / "calls"
    return path.read_text().splitlines() if path.exists() else []


def test_the_recipe_is_valid_bash_with_well_formed_directives():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    directives = [line.split()[1] for line in SCRIPT.read_text().splitlines() if line.startswith("#SBATCH")]
    assert "--requeue" in directives and "--signal=B:USR1@600" in directives
    assert all(d.startswith("--") and ("=" in d or d in ("--requeue",)) for d in directives), directives


def test_the_training_command_inside_parses(train_data, tmp_path):
    result = subprocess.run(["bash", str(SCRIPT), *TRAIN_ARGS, f"--data={train_data}",
                             f"--outdir={tmp_path / 'run'}", "--dry-run"],
                            cwd=REPO, env=slurm_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert '"preset": "toy-tiny"' in result.stdout and "Dry run: nothing written." in result.stderr
    assert not (tmp_path / "run").exists() and calls(tmp_path) == ["scontrol show hostnames localhost"]


def test_signal_before_the_time_limit_checkpoints_requeues_and_the_next_job_resumes(train_data, reference_run,
                                                                                   tmp_path):
    outdir = tmp_path / "run"
    command = ["bash", str(SCRIPT), *TRAIN_ARGS, f"--data={train_data}", f"--outdir={outdir}", "--workers=1"]
    env = slurm_env(tmp_path)
    job = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(lambda: (outdir / "stats.jsonl").exists(), job, timeout=300)
    job.send_signal(signal.SIGUSR1)  # what SLURM sends the batch script 600 s before the time limit
    output = job.communicate(timeout=300)[0]
    assert job.returncode == 0, output
    # Stopped by the signal (log.txt ends 'Stopped at N images'): the job asks to requeue. On a machine so slow
    # that the signal landed after the last step, the training is complete and there is nothing to requeue.
    stopped = "Stopped at" in output
    assert calls(tmp_path)[1:] == ["scancel --signal=TERM 4242", *["scontrol requeue 4242"] * stopped], output
    assert list(outdir.glob("training-state-*.pt")), output

    # The requeued job: the same command, with nothing sent, runs to the end and asks for no requeue.
    (tmp_path / "calls").unlink()
    rerun = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert calls(tmp_path) == ["scontrol show hostnames localhost"]
    assert snapshot_contents(outdir, "*.safetensors") == snapshot_contents(reference_run, "*.safetensors")


# Stand-ins for the training (PYTHON): each ends as told when the recipe's SIGTERM reaches it.
ENDINGS = {
    "fails": ("exit 1", 1, False),
    "finishes": ("exit 0", 0, False),
    # torchrun, signalled with its workers, exits 1 however they ended: the marker alone tells.
    "stops with a state": ('echo stopped > "$EDM2_STOP_MARKER"; exit 1', 0, True),
}


@pytest.mark.parametrize("ending", ENDINGS)
def test_only_a_training_that_reports_its_stop_with_a_state_is_requeued(ending, tmp_path):
    on_term, status, requeued = ENDINGS[ending]
    training = tmp_path / "training"
    training.write_text(f'#!/usr/bin/env bash\ntrap \'{on_term}\' TERM\ntouch "$SLURM_STANDIN/started"\n'
                        "while true; do sleep 0.05; done\n")
    training.chmod(0o755)
    env = dict(slurm_env(tmp_path), PYTHON=str(training))
    job = subprocess.Popen(["bash", str(SCRIPT)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    wait_for(lambda: (tmp_path / "started").exists(), job, timeout=60)
    job.send_signal(signal.SIGUSR1)
    output = job.communicate(timeout=60)[0]
    assert job.returncode == status, output
    assert calls(tmp_path)[1:] == ["scancel --signal=TERM 4242", *["scontrol requeue 4242"] * requeued], output
    assert ("not requeueing" in output) != requeued, output
    assert not list(Path(tmp_path).glob("edm2-stopped.*"))  # the marker goes with the job
