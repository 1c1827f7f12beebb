"""train_edm2.py end to end on a CPU: exact resume after SIGKILL/SIGTERM, damaged checkpoints, changed
hyperparameters, torchrun with two Gloo processes, and bad input."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import safetensors.torch
import torch
from click.testing import CliRunner

import train_edm2
from edm2.snapshot import load_network, read_metadata
from training import checkpoint
from tests.helpers import REPO, free_port

ENV = dict(os.environ, OMP_NUM_THREADS="1")  # two CPU cores shared with other processes


def write_dataset(path: Path, num=48, resolution=8, classes=4, mode="RGB", labels=True, sizes=None) -> Path:
    """A release-format dataset written with PIL: PNG files plus dataset.json."""
    rng = np.random.default_rng(0)
    path.mkdir(parents=True)
    names = []
    for i in range(num):
        res = sizes[i % len(sizes)] if sizes else resolution
        channels = {"RGB": 3, "L": 1, "RGBA": 4}[mode]
        pixels = rng.integers(0, 256, size=(res, res, channels), dtype=np.uint8)
        pixels[: res // 2, :, 0] = 40 * (i % classes)  # class-dependent content
        name = f"{i // 100:05d}/img{i:08d}.png"
        (path / name).parent.mkdir(exist_ok=True)
        PIL.Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels, mode).save(path / name)
        names.append([name, i % classes])
    (path / "dataset.json").write_text(json.dumps({"labels": names if labels else None}))
    return path


TRAIN = ["--preset=toy-tiny", "--duration=2Ki", "--snapshot=1Ki", "--checkpoint=1Ki", "--status=512"]


def train_command(data: Path, outdir: Path, *extra: str) -> list[str]:
    return [sys.executable, "train_edm2.py", *TRAIN, f"--data={data}", f"--outdir={outdir}", *extra]


def run(data: Path, outdir: Path, *extra: str) -> subprocess.CompletedProcess:
    result = subprocess.run(train_command(data, outdir, *extra), cwd=REPO, env=ENV, capture_output=True,
                            text=True, timeout=300)
    assert "Traceback" not in result.stderr, result.stderr
    return result


def start(data: Path, outdir: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(train_command(data, outdir, *extra), cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def wait_for(predicate, proc: subprocess.Popen, timeout=120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"training ended early:\n{proc.stdout.read()}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def final_snapshots(outdir: Path) -> dict[str, tuple]:
    """The final EMA snapshots' tensors as raw bytes, and their metadata less the per-invocation options."""
    contents = {}
    for path in sorted(outdir.glob("network-snapshot-0000002-*.safetensors")):
        tensors = safetensors.torch.load_file(str(path))
        meta = read_metadata(path)
        for key in ("run_dir", "workers"):
            meta["training_options"].pop(key)
        contents[path.name] = ({k: v.view(-1).view(torch.uint8).numpy().tobytes() for k, v in tensors.items()}, meta)
    assert len(contents) == 2
    return contents


def cli(args: list[str], outdir: Path):
    """Run train_edm2.py in-process; return (exit code, output)."""
    result = CliRunner().invoke(train_edm2.main, [*TRAIN, "--workers=0", f"--outdir={outdir}", *args])
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("data") / "toy")


@pytest.fixture(scope="module")
def reference_run(dataset, tmp_path_factory) -> Path:
    """An uninterrupted 2048-image run (64 steps of 32 over 48 images: checkpoints fall mid-epoch)."""
    outdir = tmp_path_factory.mktemp("runs") / "reference"
    result = run(dataset, outdir, "--workers=0")
    assert result.returncode == 0, result.stderr
    return outdir


def test_run_directory_contents(reference_run):
    names = sorted(p.name for p in reference_run.iterdir())
    assert names == [
        "log.txt",
        "network-snapshot-0000001-0.050.safetensors", "network-snapshot-0000001-0.100.safetensors",
        "network-snapshot-0000002-0.050.safetensors", "network-snapshot-0000002-0.100.safetensors",
        "stats.jsonl", "training-state-0000001.pt", "training-state-0000002.pt", "training_options.json",
    ]
    rows = [json.loads(line) for line in (reference_run / "stats.jsonl").read_text().splitlines()]
    assert [r["nimg"] for r in rows] == [512, 1024, 1536, 2048]
    assert all(np.isfinite(r["loss"]) and r["images_per_s"] > 0 and r["max_memory_gb"] > 0 for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]
    # Eq. 67 before t_ref = 100 steps, after the 500-image ramp-up; the first row's last step was at 480.
    assert rows[0]["lr"] == pytest.approx(0.01 * 480 / 500) and rows[-1]["lr"] == pytest.approx(0.01)
    log = (reference_run / "log.txt").read_text()
    assert "computing in float32 on cpu" in log and sum(line.startswith("kimg ") for line in log.splitlines()) == 4

    net, meta = load_network(reference_run / "network-snapshot-0000002-0.100.safetensors")
    assert meta["nimg"] == 2048 and meta["ema_std"] == 0.1 and meta["preset"] == "toy-tiny"
    assert meta["encoder"] == {"class": "StandardRGBEncoder"}
    assert meta["dataset"] == {"resolution": 8, "num_channels": 3, "label_dim": 4}
    assert meta["training_options"]["lr"] == 0.01 and net.label_dim == 4
    state = checkpoint.load_state(reference_run / "training-state-0000002.pt")
    assert state["cur_nimg"] == 2048 and state["ema"]["stds"] == [0.05, 0.1]
    # Each snapshot holds its EMA track (in float16); the two tracks average differently.
    tracks = []
    for std, ema in zip(("0.050", "0.100"), state["ema"]["emas"]):
        saved = safetensors.torch.load_file(str(reference_run / f"network-snapshot-0000002-{std}.safetensors"))
        assert all(torch.equal(saved[k], v.to(saved[k].dtype)) for k, v in ema.items())
        tracks.append(ema["unet.out_conv.weight"])
    assert not torch.equal(tracks[0], tracks[1])
    assert not torch.equal(tracks[0], state["net"]["unet.out_conv.weight"])
    assert state["options_hash"] == checkpoint.options_hash(json.loads(state["options"]))


def test_sigkill_after_first_checkpoint_then_rerun_is_bit_identical(dataset, reference_run, tmp_path):
    outdir = tmp_path / "killed"
    proc = start(dataset, outdir, "--workers=1")
    wait_for(lambda: (outdir / "training-state-0000001.pt").exists(), proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    assert not (outdir / "training-state-0000002.pt").exists()

    result = run(dataset, outdir, "--workers=1")
    assert result.returncode == 0, result.stderr
    assert "Resuming from training-state-0000001.pt at 1024 images" in result.stdout
    assert final_snapshots(outdir) == final_snapshots(reference_run)
    rows = [json.loads(line)["nimg"] for line in (outdir / "stats.jsonl").read_text().splitlines()]
    assert rows == [512, 1024, 1536, 2048]  # rows the killed run wrote after its checkpoint are dropped


def test_sigterm_checkpoints_exits_zero_and_resumes_exactly(dataset, reference_run, tmp_path):
    outdir = tmp_path / "preempted"
    proc = start(dataset, outdir, "--workers=1")
    wait_for(lambda: (outdir / "stats.jsonl").exists(), proc)  # the first status line (512 images)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    assert "Received SIGTERM" in output and "rerun the same command to resume" in output
    states = list(outdir.glob("training-state-*.pt"))
    assert len(states) == 1
    stopped_at = checkpoint.load_state(states[0])["cur_nimg"]
    assert 512 <= stopped_at < 2048 and stopped_at % 32 == 0

    result = run(dataset, outdir, "--workers=0")
    assert result.returncode == 0, result.stderr
    assert f"at {stopped_at} images" in result.stdout
    assert final_snapshots(outdir) == final_snapshots(reference_run)


def test_damaged_newest_checkpoint_falls_back_and_changed_options_are_refused(dataset, reference_run, tmp_path):
    outdir = tmp_path / "damaged"
    shutil.copytree(reference_run, outdir)
    newest = outdir / "training-state-0000002.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    for snapshot in outdir.glob("network-snapshot-0000002-*"):
        snapshot.unlink()

    result = run(dataset, outdir, "--workers=0")
    assert result.returncode == 0, result.stderr
    assert "Skipping damaged checkpoint" in result.stdout and "training-state-0000002.pt: unreadable" in result.stdout
    assert "Resuming from training-state-0000001.pt at 1024 images" in result.stdout
    assert final_snapshots(outdir) == final_snapshots(reference_run)

    code, output = cli([f"--data={dataset}", "--lr=0.02", "--P_mean=-1.0", "--status=256"], outdir)
    assert code != 0
    assert [line for line in output.splitlines() if line.startswith("Error:")] == [
        f"Error: {outdir}: cannot resume with different hyperparameters "
        "(P_mean: run has -0.8, now -1.0, lr: run has 0.01, now 0.02)"
    ]
    code, output = cli([f"--data={dataset}", "--status=256"], outdir)  # intervals may change
    assert code == 0 and "Training already complete" in output


def test_torchrun_two_gloo_processes(dataset, tmp_path):
    outdir = tmp_path / "ddp"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
        "train_edm2.py", *TRAIN, "--duration=1Ki", "--batch-gpu=8", f"--data={dataset}", f"--outdir={outdir}",
        "--workers=0",
    ]
    result = subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 process(es) x 2 round(s) x 8 images" in result.stdout
    assert sorted(p.name for p in outdir.glob("network-snapshot-*")) == [
        "network-snapshot-0000001-0.050.safetensors", "network-snapshot-0000001-0.100.safetensors"
    ]
    state = checkpoint.load_state(outdir / "training-state-0000001.pt")
    assert state["cur_nimg"] == 1024
    # Each rank hashed its own weights when the checkpoint was written; both equal the saved weights.
    net = load_network(outdir / "network-snapshot-0000001-0.050.safetensors")[0]
    net.load_state_dict(state["net"])
    assert state["rank_digests"] == [checkpoint.weights_digest(net)] * 2
    ema = safetensors.torch.load_file(str(outdir / "network-snapshot-0000001-0.100.safetensors"))
    assert all(torch.isfinite(t.float()).all() for t in ema.values())


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "data: no such"),
        ("unlabeled", "--cond=True but"),
        ("mixed", "mixed resolutions"),
        ("gray", "PNG images have 1 channel(s); training needs RGB (3)"),
        ("rgba", "PNG images have 4 channel(s)"),
        ("batch", "batch 32 is not divisible by 1 process(es) x batch-gpu 5"),
        ("preset", "'toy-nope' is not one of"),
    ],
)
def test_bad_input_gives_one_error_line_and_no_run_directory(case, message, tmp_path):
    data = tmp_path / "data"
    args = {"missing": [], "batch": ["--batch-gpu=5"], "preset": ["--preset=toy-nope"]}.get(case, [])
    if case != "missing":
        write_dataset(data, num=16, labels=case != "unlabeled", sizes=[8, 16] if case == "mixed" else None,
                      mode={"gray": "L", "rgba": "RGBA"}.get(case, "RGB"))
    code, output = cli([f"--data={data}", *args], tmp_path / "run")
    assert code != 0
    errors = [line for line in output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and message in errors[0], output
    assert "Traceback" not in output
    assert not (tmp_path / "run").exists()


def test_dry_run_prints_options_and_writes_nothing(dataset, tmp_path):
    code, output = cli([f"--data={dataset}", "--dry-run", "--lr=0.003"], tmp_path / "run")
    assert code == 0, output
    options = json.loads(output[: output.rindex("}") + 1])
    assert options["lr"] == 0.003 and options["preset"] == "toy-tiny" and options["batch"] == 32
    assert not (tmp_path / "run").exists()


def test_help_shows_examples():
    result = CliRunner().invoke(train_edm2.main, ["--help"])
    assert result.exit_code == 0 and "torchrun --standalone --nproc_per_node=8 train_edm2.py" in result.output
