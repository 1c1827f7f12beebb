"""scripts/gpu_check.py without a GPU: the no-CUDA exit, the runner's time budget, failure isolation and reports,
and every section's measurements run on the CPU through a CPU stand-in for the CUDA probe."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from edm2.encoders import StandardRGBEncoder
from edm2.formats import snapshot
from scripts import gpu_check, gpu_check_sections as sections
from tests.helpers import REPO, tiny_precond, tree


class CPUProbe(sections.Probe):
    """The CUDA probe's boundary on the CPU: no peak-memory counter (0), a nominal 1 TFLOP/s peak."""

    def __init__(self, deadline):
        self.device, self.name, self.deadline = torch.device("cpu"), "cpu", deadline
        self.resets = 0

    def reset_peak_memory(self):
        self.resets += 1

    def peak_memory_gb(self):
        return 0.5

    def peak_tflops(self):
        return 1.0


TINY = sections.Config(
    preset="toy-tiny", reference_batch=2, toy_preset="toy-tiny", toy_steps=16, toy_batch=8, train_batches=(4, 8),
    train_steps=1, train_warmup=1, fastest=(("precision", "bf16"), ("compile", False), ("channels_last", True)), sample_batch=2,
    sample_steps=2, guide_preset="toy-tiny", memory_presets=("toy-tiny",), memory_batch=2, torchrun_duration="64",
    generate_seeds=3,
)


def run(name, tmp_path, probe=CPUProbe, config=TINY):
    status = gpu_check.run_section(name, tmp_path, 300, config, probe)
    assert status == 0, gpu_check.section_file(tmp_path, name).read_text()
    return json.loads(gpu_check.section_file(tmp_path, name).read_text())["results"]


def test_without_cuda_one_line_exit_2_and_nothing_written(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), f"--out={tmp_path / 'report'}"],
                            capture_output=True, text=True, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert result.returncode == 2
    assert result.stdout == "" and len(result.stderr.strip().splitlines()) == 1 and "no CUDA" in result.stderr
    assert tree(tmp_path) == []


def test_precision_section_errors_follow_each_formats_rounding(tmp_path):
    results = run("a_precision", tmp_path)
    # Unit round-off: fp32 2^-24, fp16 2^-11, bf16 2^-8; through a few dozen layers the error grows by about
    # sqrt(depth) ~ 10 at most. Each path must land within its own format's band, not the next one's.
    bands = {"fp32": (0, 1e-5), "fp16": (1e-5, 5e-3), "bf16": (5e-4, 4e-2)}
    for precision, (low, high) in bands.items():
        for kind in ("output", "gradient"):
            assert low < results[precision][kind] < high, (precision, kind, results[precision])


def test_toy_training_section_loss_goes_down_and_paths_agree(tmp_path):
    results = run("b_toy_training", tmp_path)
    for precision in ("fp32", "fp16", "bf16"):
        assert results[precision]["finite"] and results[precision]["follows_fp32"]
    assert results["fp32"]["decreasing"]


def test_the_probes_mfu_denominator_is_the_data_sheet_peak_a_training_uses(monkeypatch):
    probe = object.__new__(sections.Probe)
    probe.device = torch.device("cuda", 0)
    for name, peak in (("NVIDIA H200", 989.4), ("NVIDIA H100 PCIe", 756.0), ("Tesla T4", None)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, name=name: name)
        assert probe.peak_tflops() == peak


def test_speed_and_memory_sections_report_rates_mfu_and_peaks(tmp_path):
    speed = run("c_training_speed", tmp_path)
    for batch in (4, 8):
        for name, precision in (("release", "fp16"), ("fastest", "bf16")):
            row = speed[f"batch{batch}_{name}"]
            assert row["settings"]["precision"] == precision and row["images_per_s"] > 0
            # MFU is the achieved TFLOP/s over the probe's peak (1 TFLOP/s here).
            assert row["mfu"] == pytest.approx(row["tflops"]) and row["peak_memory_gb"] == 0.5
        assert speed[f"batch{batch}_speedup"] == pytest.approx(
            speed[f"batch{batch}_fastest"]["images_per_s"] / speed[f"batch{batch}_release"]["images_per_s"])
    sampling = run("d_sampling_speed", tmp_path)
    assert sorted(sampling) == ["default_guidance1", "default_guidance1.4", "device", "release_guidance1",
                                "release_guidance1.4"]
    # Guidance evaluates two networks per step: more FLOPs per image.
    assert sampling["release_guidance1.4"]["tflops"] / sampling["release_guidance1.4"]["images_per_s"] > \
        sampling["release_guidance1"]["tflops"] / sampling["release_guidance1"]["images_per_s"]
    assert run("e_memory", tmp_path) == {"device": "cpu", "toy-tiny_checkpoint0": 0.5, "toy-tiny_checkpoint1": 0.5}


def test_memory_section_records_out_of_memory_and_skips_when_out_of_time(tmp_path):
    class OOMProbe(CPUProbe):
        def peak_memory_gb(self):
            raise MemoryError("pretend")

        def is_out_of_memory(self, error):
            return isinstance(error, MemoryError)

    config = sections.Config(**{**TINY.__dict__, "memory_presets": ("toy-tiny", "toy-small")})
    assert run("e_memory", tmp_path, OOMProbe, config) == {
        "device": "cpu", **{f"{p}_checkpoint{c}": "out of memory" for p in ("toy-tiny", "toy-small") for c in (0, 1)}}
    assert gpu_check.run_section("e_memory", tmp_path, 0, config, CPUProbe) == 0  # no time left: nothing attempted
    results = json.loads(gpu_check.section_file(tmp_path, "e_memory").read_text())["results"]
    assert set(results.values()) == {"cpu", "skipped: out of time"}


def test_torchrun_section_commands_and_outputs(tmp_path):
    """The dataset and training commands are stood in for (the run they would leave: stats and two real EMA
    snapshots); generate.py then really samples from those snapshots, guided, as it would on the GPU."""
    calls = []
    names = ["network-snapshot-0000002-0.050.safetensors", "network-snapshot-0000002-0.100.safetensors"]

    def fake_run(command, **kwargs):
        calls.append(command)
        if "train_edm2.py" in " ".join(command):  # what a finished run leaves
            run_dir = tmp_path / "f_torchrun" / "run"
            run_dir.mkdir(parents=True)
            (run_dir / "samples").mkdir()
            (run_dir / "samples" / "grid-0000002.png").write_bytes(b"")
            (run_dir / "stats.jsonl").write_text('{"images_per_s": 10.0}\n{"images_per_s": 12.5}\n'
                                                 '{"kimg": 0.064, "metrics": {"loss256": 0.25}}\n')
            for seed, name in enumerate(names):
                torch.manual_seed(seed)
                snapshot.save_network(run_dir / name, tiny_precond(8, 3, 4).eval(),
                                      {"encoder": StandardRGBEncoder().config()})
        if "generate.py" in " ".join(command):
            return subprocess.run(command, **kwargs)
        return subprocess.CompletedProcess(command, 0, "", "")

    results = {}
    probe = CPUProbe(time.monotonic() + 300)  # the commands' time limit (generate.py takes seconds)
    sections.section_torchrun(probe, TINY, results.__setitem__, tmp_path / "f_torchrun", run=fake_run)
    assert calls[0][2] == "toy" and "torch.distributed.run" in calls[1] and "--nproc_per_node=1" in calls[1]
    assert "--duration=64" in calls[1] and f"--data={tmp_path / 'f_torchrun' / 'toy16.zip'}" in calls[1]
    run_dir = tmp_path / "f_torchrun" / "run"
    assert f"--net={run_dir / names[1]}" in calls[2] and f"--gnet={run_dir / names[0]}" in calls[2]
    assert "--guidance=1.4" in calls[2]
    assert "--metrics=loss" in calls[1]
    assert results == {"stats_rows": 2, "images_per_s": 12.5, "metrics": [{"loss256": 0.25}],
                       "grids": ["grid-0000002.png"], "training_states": [], "snapshots": names,
                       "generated_images": TINY.generate_seeds, "grid": True}
    failing = lambda command, **kwargs: subprocess.CompletedProcess(command, 1, "", "NCCL error: no device")  # noqa
    with pytest.raises(RuntimeError, match="dataset_tool.py toy exited 1: NCCL error"):
        sections.section_torchrun(CPUProbe(1e12), TINY, results.__setitem__, tmp_path / "f2", run=failing)


def test_a_failing_section_is_recorded_with_its_partial_results(tmp_path, monkeypatch):
    def broken(probe, config, record):
        record("first", 1.5)
        raise ValueError("kernel launch failed")

    monkeypatch.setitem(gpu_check.SECTIONS, "a_precision", ("check", 10, broken))
    assert gpu_check.run_section("a_precision", tmp_path, 10, TINY, CPUProbe) == 1
    entry = gpu_check.outcome(gpu_check.section_file(tmp_path, "a_precision"), "failed", 2.0, "")
    assert entry["status"] == "failed" and entry["results"] == {"device": "cpu", "first": 1.5}
    assert "kernel launch failed" in entry["error"]


def test_runner_budgets_time_isolates_failures_and_writes_reports(tmp_path):
    now, limits = [0.0], {}

    def launch(name, out, seconds):  # each section takes its limit; b fails, c times out and overruns by 40 s
        limits[name] = seconds
        now[0] += seconds + (40 if name == "c_training_speed" else 0)
        status = {"b_toy_training": "failed", "c_training_speed": "timeout"}.get(name, "ok")
        results = {"fp16": {"output": 1e-3, "gradient": 2e-3}} if name == "a_precision" else {"rate": 3.0}
        return dict(status=status, seconds=seconds, results=results, **({"error": "boom"} if status != "ok" else {}))

    reserve, own = gpu_check.RESERVE_S, {name: entry[1] for name, entry in gpu_check.SECTIONS.items()}
    # A total that runs out during c: a and b take their own limits, c is squeezed to what they left less 3 reserves.
    total = own["a_precision"] + own["b_toy_training"] + 3 * reserve + own["c_training_speed"] // 2
    report = gpu_check.run_all(tmp_path, launch=launch, clock=lambda: now[0], total_s=total)
    # Each section gets at most its own limit, and leaves RESERVE_S for every later one; after c's overrun, d and e
    # no longer fit (under 5 s) and f gets the remaining 5 s.
    assert limits == {"a_precision": own["a_precision"], "b_toy_training": own["b_toy_training"],
                      "c_training_speed": own["c_training_speed"] // 2, "f_torchrun": 5}
    assert [entry["status"] for entry in report["sections"].values()] == [
        "ok", "failed", "timeout", "skipped", "skipped", "ok"]
    assert report["sections"]["d_sampling_speed"]["error"] == "out of time"
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved == report and saved["seconds"] == total
    md = (tmp_path / "report.md").read_text()
    assert "| b_toy_training | toy training with each precision | failed: boom | 50 |" in md
    assert "| fp16 | 0.002 | 0.001 |" in md  # a section's table: columns gradient, output
