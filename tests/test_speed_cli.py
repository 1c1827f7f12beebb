"""The speed options on the command lines: a run resumes bit for bit across them, generate.py computes in the
precision asked for, bad values get one line, and the benchmark scripts end with a JSON line."""

import json
import subprocess
import sys

import numpy as np
import PIL.Image
import pytest
import safetensors.torch
import torch
from click.testing import CliRunner

import calculate_metrics
import generate
import train_edm2
from edm2.encoders import StandardRGBEncoder
from edm2.formats import snapshot
from tests.helpers import (REPO, assert_one_error_line, randomized, run_training, tiny_precond, train_env,
                           tree)

FAST = ["--steps=4", "--seeds=0-3", "--batch=2"]


def final_tensors(outdir):
    return {p.name: safetensors.torch.load_file(str(p)) for p in sorted(outdir.glob("network-snapshot-0000002-*"))}


def test_a_run_resumes_bit_for_bit_across_the_speed_options(train_data, reference_run, tmp_path):
    outdir = tmp_path / "switched"
    # The first half recomputes its activations (and saves its options so); the second half does not.
    first = run_training(train_data, outdir, "--workers=0", "--duration=1Ki", "--checkpoint-activations",
                         "--no-compile", "--no-channels-last")
    assert first.returncode == 0, first.stderr
    assert json.loads((outdir / "training_options.json").read_text())["checkpoint_activations"] is True
    second = run_training(train_data, outdir, "--workers=0")
    assert second.returncode == 0 and "Resuming from training-state-0000001.pt" in second.stdout, second.stderr
    # Checkpointed blocks replay the same kernels: the run ends exactly where the uninterrupted reference does.
    got, want = final_tensors(outdir), final_tensors(reference_run)
    assert list(got) == list(want) and len(got) == 2
    assert all(torch.equal(got[name][k], v) for name in want for k, v in want[name].items())


@pytest.fixture(scope="module")
def net_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("net") / "net.safetensors"
    net = randomized(tiny_precond(label_dim=0)).eval()
    snapshot.save_network(path, net, {"encoder": StandardRGBEncoder().config()})
    return path


def generate_pngs(net_path, outdir, *extra):
    result = CliRunner().invoke(generate.main, ["--net", str(net_path), "--outdir", str(outdir), *FAST, *extra],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return {p.name: np.asarray(PIL.Image.open(p), dtype=np.int16) for p in sorted(outdir.glob("*.png"))}


def test_generate_computes_in_the_precision_asked_for(net_path, tmp_path):
    default = generate_pngs(net_path, tmp_path / "default")
    # On the CPU the snapshot's fp16 means float32, as before: the same bits with fp32 asked for, or channels-last
    # with the evaluation weight cache (conv kernels differ by float32 round-off, far below one uint8 step mostly).
    assert all(np.array_equal(a, b) for a, b in zip(generate_pngs(net_path, tmp_path / "fp32", "--precision=fp32")
                                                    .values(), default.values()))
    nhwc = generate_pngs(net_path, tmp_path / "nhwc", "--channels-last", "--no-compile")
    assert max(np.abs(a - b).max() for a, b in zip(nhwc.values(), default.values())) <= 1
    bf16 = generate_pngs(net_path, tmp_path / "bf16", "--precision=bf16", "--cpu-16bit", "--no-compile")
    differences = np.concatenate([np.abs(a - b).ravel() for a, b in zip(bf16.values(), default.values())])
    # bfloat16 (8 significant bits) moves pixels by a few uint8 steps: it did compute in 16 bits, and the images are
    # still the same images (most pixels within a step).
    assert differences.max() > 0 and np.median(differences) <= 1 and differences.max() < 64


BAD_SPEED = {
    "generate precision": (generate.main, ["--net", "{net}", "--outdir", "{tmp}/out", "--precision=fp8"],
                           ["--precision", "fp8"]),
    "generate compile value": (generate.main, ["--net", "{net}", "--outdir", "{tmp}/out", "--compile=yes"],
                               ["--compile", "does not take a value"]),
    "train compile value": (train_edm2.main, ["--preset=toy-tiny", "--outdir", "{tmp}/out", "--compile=1"],
                            ["--compile", "does not take a value"]),
    "train cpu-16bit value": (train_edm2.main, ["--preset=toy-tiny", "--outdir", "{tmp}/out", "--cpu-16bit=bf16"],
                              ["--cpu-16bit", "does not take a value"]),
    "metrics precision": (calculate_metrics.main, ["gen", "--net", "{net}", "--ref", "{tmp}/ref.npz",
                                                   "--precision=half"], ["--precision", "half"]),
}


@pytest.mark.bad_input
@pytest.mark.parametrize("case", BAD_SPEED)
def test_bad_speed_option_values_get_one_line(case, net_path, tmp_path):
    command, args, fragments = BAD_SPEED[case]
    result = CliRunner().invoke(command, [a.format(tmp=tmp_path, net=net_path) for a in args], catch_exceptions=False)
    assert_one_error_line(result, *fragments)
    assert tree(tmp_path) == []


def last_json_line(script, *args):
    result = subprocess.run([sys.executable, f"scripts/{script}", *args], cwd=REPO, env=train_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_benchmarks_end_with_a_json_line():
    train = last_json_line("bench_train.py", "--preset=toy-tiny", "--batch-gpu=4", "--resolution=8", "--steps=1",
                           "--warmup=0", "--precision=fp32")
    assert train["images_per_s"] > 0 and train["batch"] == 4 and train["compile"] is False
    # On the CPU as a training reports it: TFLOP/s from the counted FLOPs, MFU over the CPU's measured peak.
    assert train["tflops"] > 0 and train["peak_tflops"] > 0
    assert train["mfu"] == pytest.approx(train["tflops"] / train["peak_tflops"], rel=1e-12)
    sampler = last_json_line("bench_sampler.py", "--resolution=8", "--channels=16", "--batch=2", "--steps=2",
                             "--repeats=1", "--classes=0")
    assert sampler["images_per_s"] > 0 and sampler["images_per_s_guided"] > 0
    # Guidance evaluates both networks: twice the FLOPs per image for a guiding net of the same size.
    assert sampler["tflops_guided"] / sampler["images_per_s_guided"] == pytest.approx(
        2 * sampler["tflops"] / sampler["images_per_s"])
    assert sampler["mfu"] == pytest.approx(sampler["tflops"] / sampler["peak_tflops"], rel=1e-12)


def test_the_profile_tables_cover_the_training_and_the_sampling_step():
    from scripts import profile_step

    result = CliRunner().invoke(profile_step.main, ["--preset=toy-tiny", "--resolution=8", "--batch=2", "--steps=1",
                                                    "--precisions=fp32"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output.strip().splitlines()[-1])["fp32"]
    # Every phase of the training step was seen, and the operators fall into the kinds the tables name.
    assert set(report["phases"]) == set(profile_step.PHASES)
    assert all(report["phases"][name] > 0 for name in ("forward", "backward", "Adam", "EMA"))
    for kinds in (report["kinds"], report["sampling"]["kinds"]):
        assert kinds["convolution"] > 0 and kinds["attention"] > 0
    assert report["kinds"]["optimizer and EMA (foreach)"] > 0  # Adam and the EMA: training only
    assert "optimizer and EMA (foreach)" not in report["sampling"]["kinds"]
    # The sampling step's self times add up to no more than its wall time (one thread, nothing overlaps).
    assert 0 < sum(report["sampling"]["kinds"].values()) <= report["sampling"]["ms_per_step"] * 1.01
    assert "ms per sampling step" in result.output and "ms per training step" in result.output
