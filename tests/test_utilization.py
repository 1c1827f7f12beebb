"""Model-FLOPs utilization in every run: the peaks it is measured against, the CPU's measured once per machine, and
the status lines' TFLOP/s and MFU as torch.utils.flop_counter's count x the measured rate over the given peak; and
the OpenMP wait policy that keeps a shared CPU's threads from spinning."""

import ast
import json
import os
import subprocess
import sys

import pytest
import torch

from edm2.formats.snapshot import load_network
import edm2.architectures  # noqa: F401  registers the other families
from edm2.networks import Precond
from edm2.plots.run import dashboard_figure
import training.run.loop
from edm2.runtime import host_memory, speed, utilization
from tests.helpers import (ATTENTION_ROUTES, REPO, count_macs, run_training, take_attention_route, toy_tiny_options,
                           train_command, train_env)
from training.run.benchmark import preset_network
from training.run.dashboard import read_stats

COMMAND_LINES = sorted(path.name for path in REPO.glob("*.py"))


@pytest.mark.parametrize("name, dtype, peak", [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.4), ("NVIDIA H100 PCIe", torch.float16, 756.0),
    ("NVIDIA H100 NVL", torch.bfloat16, 835.0), ("NVIDIA H200", torch.bfloat16, 989.4),
    ("NVIDIA A100-SXM4-80GB", torch.float32, 156.0), ("NVIDIA L40S", torch.bfloat16, 362.05),
    ("NVIDIA GeForce RTX 4090", torch.float16, 165.2), ("Tesla T4", torch.float16, None),
])
def test_gpu_peaks_come_from_the_table_most_specific_name_first(name, dtype, peak):
    assert utilization.gpu_peak_tflops(name, dtype) == peak


def test_the_cpu_peak_keeps_the_best_measurement_per_machine_dtype_and_thread_count(monkeypatch, tmp_path):
    monkeypatch.setenv("EDM2_CACHE_DIR", str(tmp_path))
    rates = iter([0.25, 0.1, 0.5, 0.05, 0.125, 0.3])  # a busy machine measures low: the best so far is kept
    monkeypatch.setattr(utilization, "measure_cpu_tflops", lambda dtype: next(rates))
    assert [utilization.cpu_peak_tflops(torch.float32)[0] for _ in range(3)] == [0.25, 0.25, 0.5]
    assert utilization.cpu_peak_tflops(torch.bfloat16)[0] == 0.05  # another dtype, its own entry
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert utilization.cpu_peak_tflops(torch.float32)[0] == 0.125  # another thread count, its own entry
    finally:
        torch.set_num_threads(threads)
    (tmp_path / utilization.CPU_PEAK_FILE).write_text("{not json")  # a damaged cache is rewritten
    assert utilization.cpu_peak_tflops(torch.float32)[0] == 0.3
    assert json.loads((tmp_path / utilization.CPU_PEAK_FILE).read_text()) == {utilization._machine_key(torch.float32): 0.3}


def cached_peak(monkeypatch, tmp_path, cache_text: str, measured: float = 0.5) -> tuple[float, str, object]:
    """cpu_peak_tflops(float32) with the cache file holding cache_text and `measured` measured now: the peak, the
    start line's words for it, and the cache's entry for this machine afterwards."""
    monkeypatch.setenv("EDM2_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(utilization, "measure_cpu_tflops", lambda dtype: measured)
    path = tmp_path / utilization.CPU_PEAK_FILE
    path.write_text(cache_text.replace("KEY", utilization._machine_key(torch.float32)))
    peak, source = utilization.peak_tflops(torch.device("cpu"), torch.float32)
    return peak, source, json.loads(path.read_text()).get(utilization._machine_key(torch.float32))


@pytest.mark.parametrize("value", ["1e300", "1e19", "8.5", "-1", "0", "true", '"2.0"', "[2.0]", "null"])
def test_a_cached_peak_out_of_the_plausible_range_is_replaced_by_the_measurement(monkeypatch, tmp_path, value):
    # 1e300 TFLOP/s would make every MFU read 0.0%; anything over MAX_CACHED_RISE (16) times the rate measured now,
    # or no positive number, is no rate of this machine.
    peak, source, entry = cached_peak(monkeypatch, tmp_path, '{"KEY": %s}' % value)
    assert (peak, entry) == (0.5, 0.5)
    implausible_high = value in ("1e300", "1e19", "8.5")
    assert ("is replaced" in source and value in source.replace("+", "")) == implausible_high


@pytest.mark.parametrize("value", [0.5, 2.0, 8.0])
def test_a_cached_peak_within_the_plausible_range_is_kept(monkeypatch, tmp_path, value):
    # Up to 16 times the measurement (8.0 against 0.5) is what a start beside other work measures against a quiet one.
    peak, source, entry = cached_peak(monkeypatch, tmp_path, '{"KEY": %r}' % value)
    assert (peak, entry) == (value, value) and source.endswith("the best measured here")


@pytest.mark.parametrize("text", ['{"KEY": NaN}', '{"KEY": Infinity}', '{"KEY": 1e400}', "[1.0]", "", "\x00\xff"])
def test_a_cache_that_is_no_json_object_is_rewritten(monkeypatch, tmp_path, text):
    peak, source, entry = cached_peak(monkeypatch, tmp_path, text)
    assert (peak, entry) == (0.5, 0.5)


def test_another_machines_entries_are_never_used_and_only_their_rates_are_kept(monkeypatch, tmp_path):
    peak, _, _ = cached_peak(monkeypatch, tmp_path, '{"other": 1e300, "third": 2.5, "junk": "x", "less": -3, '
                                                    '"nested": {"KEY": 9.0}}')
    assert peak == 0.5
    cache = json.loads((tmp_path / utilization.CPU_PEAK_FILE).read_text())
    assert cache == {"other": 1e300, "third": 2.5, utilization._machine_key(torch.float32): 0.5}


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_cache_that_is_no_regular_file_is_not_waited_on(monkeypatch, tmp_path, kind):
    # A FIFO would wait for a writer forever; ours is replaced by a file. A folder in its place is left as it is.
    monkeypatch.setenv("EDM2_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(utilization, "measure_cpu_tflops", lambda dtype: 0.5)
    path = tmp_path / utilization.CPU_PEAK_FILE
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    assert utilization.peak_tflops(torch.device("cpu"), torch.float32)[0] == 0.5
    assert path.is_dir() if kind == "directory" else path.is_file()


def test_the_measured_peak_is_a_plausible_cpu_rate_and_leaves_the_global_random_state():
    before = torch.get_rng_state()
    rate = utilization.measure_cpu_tflops(torch.float32, repeats=2)
    assert 1e-4 < rate < 100  # TFLOP/s: above a crawl on a busy machine, below any CPU's float32 peak
    assert torch.equal(torch.get_rng_state(), before)  # a run's start draws nothing from the training's seed


@pytest.mark.parametrize("seconds, size", [(1.0, 128), (0.005, 256), (1e-6, 2048)])
def test_a_timed_kernel_grows_only_while_a_call_is_quick(seconds, size, monkeypatch):
    # A CPU emulating 16-bit matmuls took 50 s for one 2048 x 2048 product: a slow call stops the growth at once.
    sizes = []

    def kernel(n, dtype, generator):
        return (lambda: sizes.append(n)), float(n**3)

    monkeypatch.setattr(utilization, "_time", lambda call: call() or seconds * (sizes[-1] / 128) ** 3)
    rate = utilization._grown_rate(kernel, torch.float32, 2, torch.Generator())
    assert max(sizes) == size and rate == pytest.approx(128**3 / seconds / 1e12)


def test_a_timed_kernel_keeps_its_best_rate_over_the_sizes_it_grows_through(monkeypatch):
    # On AMX, a channels-last bfloat16 convolution of 256 channels ran at 3.6 TFLOP/s and one of 512 at 2.7: the
    # peak is the best size's rate, not the last one's.
    per_flop = {128: 4.0, 256: 1.0, 512: 2.0, 1024: 2.0, 2048: 3.0}  # ms per TFLOP at each size
    sizes = []

    def kernel(n, dtype, generator):
        return (lambda: sizes.append(n)), 1e12 * n / 128

    monkeypatch.setattr(utilization, "_time", lambda call: call() or per_flop[sizes[-1]] * sizes[-1] / 128 * 1e-3)
    assert utilization._grown_rate(kernel, torch.float32, 2, torch.Generator()) == pytest.approx(1e3)
    assert max(sizes) == 2048  # it grew until a call took _PEAK_SECONDS (the last, 0.048 s)


@pytest.mark.parametrize("winner", ["_matmul", "_convolution", "_channels_last_convolution"])
def test_the_peak_is_the_fastest_of_the_matmul_and_the_convolution_in_either_layout(winner, monkeypatch):
    # The step runs mostly convolutions, whose oneDNN kernels can outrun the matmul (an AVX2 EPYC in float32: 83
    # against 68 GFLOP/s; a Xeon with AMX in bfloat16, channels-last: 3.5 against 2.4 TFLOP/s): any may set the peak.
    names = ("_matmul", "_convolution", "_channels_last_convolution")
    rates = {getattr(utilization, name): 2.0 if name == winner else 0.5 + i / 8 for i, name in enumerate(names)}
    monkeypatch.setattr(utilization, "_grown_rate", lambda kernel, *args: rates[kernel])
    assert utilization.measure_cpu_tflops(torch.bfloat16) == 2.0


def test_the_kernels_count_their_flops():
    generator = torch.Generator().manual_seed(0)
    call, flops = utilization._matmul(128, torch.float64, generator)
    assert call().shape == (128, 128) and flops == 2 * 128**3
    call, flops = utilization._convolution(128, torch.float64, generator)
    out = call()  # 32 channels on 32 x 32 pixels: one multiply-add per input channel and tap, per output element
    assert out.shape == (1, 32, 32, 32) and flops == 2 * out.numel() * 32 * 9
    call, flops = utilization._channels_last_convolution(512, torch.float64, generator)
    out = call()  # 128 channels, a batch of 4
    assert out.shape == (4, 128, 32, 32) and flops == 2 * out.numel() * 128 * 9
    assert out.is_contiguous(memory_format=torch.channels_last)


def test_status_lines_and_stats_give_tflops_and_mfu_over_the_given_peak(train_data, tmp_path):
    peak = 0.5
    result = run_training(train_data, tmp_path / "run", "--workers=0", "--duration=1Ki", f"--peak-tflops={peak}")
    assert result.returncode == 0, result.stderr
    snapshot = sorted((tmp_path / "run").glob("network-snapshot-*.safetensors"))[-1]
    flops = 6 * count_macs(load_network(snapshot)[0])  # 3 passes x 2 FLOPs per multiply-accumulate
    rows = [json.loads(line) for line in (tmp_path / "run" / "stats.jsonl").read_text().splitlines()]
    assert rows
    for row in rows:
        assert row["tflops"] == pytest.approx(flops * row["images_per_s"] / 1e12, rel=1e-9)
        assert row["mfu"] == pytest.approx(row["tflops"] / peak, rel=1e-9)
    status = [line for line in result.stdout.splitlines() if line.startswith("kimg ")]
    assert len(status) == len(rows) and all(f"MFU {row['mfu']:.1%}" in line for line, row in zip(status, rows))
    assert f"against {peak:.4g} TFLOP/s per process: --peak-tflops" in result.stdout
    figure = dashboard_figure({"stats": read_stats(tmp_path / "run")})
    [speed] = [ax for ax in figure.axes if ax.get_title() == "images/s"]
    assert [text.get_text() for text in speed.texts] == [f"MFU {rows[-1]['mfu']:.1%}"]


@pytest.mark.bad_input
@pytest.mark.parametrize("value", ["0", "-1", "nan", "1e300"])
def test_an_impossible_peak_is_refused(train_data, tmp_path, value):
    result = run_training(train_data, tmp_path / "run", f"--peak-tflops={value}")  # no traceback: run_training checks
    assert result.returncode == 2 and "--peak-tflops" in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("path", COMMAND_LINES)
def test_every_command_line_sets_the_wait_policy_before_anything_loads_pytorch(path):
    body = ast.parse((REPO / path).read_text()).body
    imports = [node for node in body if isinstance(node, (ast.Import, ast.ImportFrom)) and
               not (isinstance(node, ast.ImportFrom) and node.module == "__future__")]
    assert isinstance(imports[0], ast.Import) and [a.name for a in imports[0].names] == ["cli.wait_policy"], path


@pytest.mark.parametrize("policy, user_spin, said, spin", [
    (None, None, "OpenMP wait policy PASSIVE after a spin of 30000 turns (our default", "30000"),
    (None, "500", "OpenMP wait policy PASSIVE after a spin of 500 turns (GOMP_SPINCOUNT, as set", "500"),
    ("ACTIVE", None, "OpenMP wait policy ACTIVE (OMP_WAIT_POLICY, as set)", "unset")])
def test_the_start_says_the_threads_and_the_wait_policy(train_data, tmp_path, policy, user_spin, said, spin):
    env = {k: v for k, v in train_env().items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env |= {"OMP_WAIT_POLICY": policy} if policy else {}
    env |= {"GOMP_SPINCOUNT": user_spin} if user_spin else {}
    result = subprocess.run(train_command(train_data, tmp_path / "run", "--dry-run", "--threads=1"), cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "CPU threads: 1 per process (--threads)" in result.stderr and said in result.stderr
    if host_memory.glibc():
        assert "freed memory up to 32 MiB a block kept for reuse" in result.stderr
    # GNU OpenMP reads a set GOMP_SPINCOUNT over the policy's spin: a user's policy keeps its own.
    probe = subprocess.run([sys.executable, "-c", "import cli.wait_policy, os; print(os.environ['OMP_WAIT_POLICY'], "
                            "os.environ.get('GOMP_SPINCOUNT', 'unset'))"],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert probe.stdout.split() == [policy or "PASSIVE", spin]


@pytest.mark.parametrize("threads, env, said, advice", [
    ("--threads=2", {}, "CPU threads: 2 per process (--threads)", "--processes=2 --threads=1"),
    ("--threads=1", {}, "CPU threads: 1 per process (--threads)", None),
    # As torchrun starts each of 2 processes: OMP_NUM_THREADS=1 (train_env), WORLD_SIZE (the dry run joins no group).
    (None, {"WORLD_SIZE": "2"}, "CPU threads: 1 per process (OMP_NUM_THREADS=1, as torchrun "
                                "sets it)", None),
])
def test_a_single_process_of_several_threads_is_told_that_processes_hold_up_under_load(train_data, tmp_path, threads,
                                                                                       env, said, advice):
    # Issue 31: toy-small bf16 on 2 cores beside two busy processes kept 12-17% of its speed as one process of two
    # threads and 35-47% as two processes of one thread (scripts/bench_load.py).
    result = subprocess.run(train_command(train_data, tmp_path / "run", "--dry-run", *[threads] if threads else []),
                            cwd=REPO, env=train_env(CUDA_VISIBLE_DEVICES="", **env), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert said in result.stderr
    assert ("processes of one thread each keep far more of their speed" in result.stderr) == (advice is not None)
    if advice:
        assert advice in result.stderr


@pytest.mark.parametrize("units, precision, cpu_16bit, note", [
    (None, "bf16", True, " (this CPU has no 16-bit matrix instructions: it emulates them, several times slower than "
                         "float32; leave out --cpu-16bit)"),
    ("AMX", "bf16", True, ""),
    ("AMX", "bf16", False, " (--precision=bf16 applies on CUDA; --cpu-16bit uses it on the cpu too: this CPU has AMX, "
                           "which computes bfloat16 faster than float32)"),
    (None, "bf16", False, " (--precision=bf16 applies on CUDA; --cpu-16bit uses it on the cpu too)"),
    (None, "fp32", False, ""),
])
def test_the_start_line_says_whether_this_cpu_computes_16_bit_natively(units, precision, cpu_16bit, note,
                                                                        monkeypatch):
    # Issue 31, item 4: bfloat16 on a CPU without AMX or AVX-512 BF16 trained 7x slower than float32 (an AVX2 EPYC).
    monkeypatch.setattr(training.run.loop, "cpu_16bit_units", lambda: units)
    opts = toy_tiny_options(precision=precision, cpu_16bit=cpu_16bit)
    dtype = "bfloat16" if cpu_16bit else "float32"
    assert training.run.loop._precision_note(opts, dtype, torch.device("cpu")) == note


def test_the_cpu_16bit_units_are_those_torch_reports():
    expected = "AMX" if torch.cpu._is_amx_tile_supported() else (
        "AVX-512 BF16" if torch.cpu._is_avx512_bf16_supported() else None)
    assert speed.cpu_16bit_units() == expected


@pytest.mark.parametrize("route", ATTENTION_ROUTES)
def test_forward_flops_count_two_per_multiply_accumulate_of_every_family(monkeypatch, route):
    # The MFU's FLOPs come from torch.utils.flop_counter; count_macs's module hooks count the same products by hand.
    take_attention_route(monkeypatch, route)
    with torch.device("meta"):
        nets = [preset_network(name) for name in ("toy-tiny", "edm2-img64-xs", "config-b-toy", "config-f-toy")]
        nets.append(Precond(8, 3, 0, model_channels=16, family="mp-resnet", depth=2))
    for net in nets:
        assert utilization.forward_flops(net) == 2 * count_macs(net) > 0
        assert utilization.training_flops_per_image(net) == 6 * count_macs(net)
