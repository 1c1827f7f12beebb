"""The measurements of scripts/gpu_check.py, one function per section, each given a Probe (the device and its
clocks and memory counters: the one boundary the CPU tests replace) and a Config (what to measure).

Every section reports through `record(key, value)` as it goes, so a section stopped at its time limit still
leaves what it measured; it checks probe.time_left() between measurements and skips what no longer fits.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from edm2.data.toy_shapes import SHAPES, toy_image
from edm2.eval import benchmark
from edm2.layers import force_weight_normalization
from edm2.loss import EDM2Loss
from edm2.networks import Precond
from edm2.runtime import bounded_json
from edm2.runtime.speed import PRECISIONS, SamplingSpeed, set_precision
from edm2.runtime.utilization import peak_tflops, training_flops_per_image, utilization
from training.run.benchmark import preset_network, synthetic_step, with_unit_gains
from training.step import training_step

REPO = Path(__file__).resolve().parents[1]
Record = Callable[[str, object], None]
SIZES = ("xs", "s", "m", "l", "xl", "xxl")


@dataclasses.dataclass(frozen=True)
class Config:
    """What each section measures; the defaults are the GPU check's, the CPU tests pass tiny ones."""

    preset: str = "edm2-img512-s"  # (a), (c), (d): EDM2-S img512 (64x64x4 latents, 1000 classes)
    reference_batch: int = 4  # (a)
    toy_preset: str = "toy-small"  # (b)
    toy_steps: int = 150  # 300 steps of the three precisions ran past 60 s on an H100 (eager, launch-bound)
    toy_batch: int = 64
    train_batches: tuple[int, ...] = (32, 64)  # (c)
    train_steps: int = 10
    train_warmup: int = 3  # the first step compiles
    release: tuple = (("precision", "fp16"), ("compile", False), ("channels_last", False))  # as the release trains
    # The fastest that fits the section: compiling EDM2-S's training step ran past 2 minutes on an H100 (torch
    # 2.11, the first step unfinished after 125 s), so the compiled step is timed by scripts/bench_train.py instead.
    fastest: tuple = (("precision", "bf16"), ("compile", False), ("channels_last", True))
    sample_batch: int = 64  # (d)
    sample_steps: int = 32
    guide_preset: str = "edm2-img512-xs"  # the release's autoguidance presets guide with XS
    memory_presets: tuple[str, ...] = tuple(f"edm2-img512-{size}" for size in SIZES)  # (e)
    memory_batch: int = 16
    torchrun_duration: str = "2Ki"  # (f)
    generate_seeds: int = 16


class Probe:
    """The CUDA device as the sections see it: clocks, memory counters and the data-sheet peak."""

    def __init__(self, deadline: float):
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.name = torch.cuda.get_device_name(self.device)
        self.deadline = deadline

    def time_left(self) -> float:
        """Seconds until this section's deadline."""
        return self.deadline - time.monotonic()

    def reset_peak_memory(self) -> None:
        """Start a new peak-memory window."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_memory_gb(self) -> float:
        """Peak allocated memory since reset_peak_memory."""
        return torch.cuda.max_memory_allocated(self.device) / 2**30

    def peak_tflops(self) -> float | None:
        """The MFU denominator, as training's: the device's 16-bit data-sheet peak (None for an unlisted GPU)."""
        return peak_tflops(self.device, torch.bfloat16)[0]

    def is_out_of_memory(self, error: BaseException) -> bool:
        """Whether an error is CUDA running out of memory."""
        return isinstance(error, torch.cuda.OutOfMemoryError)


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """||value - reference|| / ||reference|| in float64."""
    reference = reference.double()
    return float((value.double() - reference).norm() / reference.norm())


def loss_and_grads(net: Precond, images, labels, sigma, noise) -> tuple[torch.Tensor, torch.Tensor]:
    """The denoiser output and the gradient of the Eq. 21 loss summed per image and averaged over the batch (the scale
    of training_step's gradients, which 16-bit backward passes need), all parameters flattened into one vector, after
    the forced weight normalization (Eq. 66) as a training step applies it."""
    net.zero_grad(set_to_none=True)
    force_weight_normalization(net)
    denoised = net(images + noise * sigma, sigma, labels)
    EDM2Loss()(net, images, labels, sigma=sigma, noise=noise).sum().div(len(images)).backward()
    return denoised.detach(), torch.cat([p.grad.flatten() for p in net.parameters()])


def section_precision(probe: Probe, config: Config, record: Record) -> None:
    """(a) Forward and backward of the network in fp32, fp16 and bf16 against float64: relative error per path."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # true fp32, as training
    torch.manual_seed(0)
    net = with_unit_gains(preset_network(config.preset)).to(probe.device).train()
    n = config.reference_batch
    images = torch.randn(n, net.img_channels, net.img_resolution, net.img_resolution, device=probe.device)
    labels = torch.eye(net.label_dim, device=probe.device)[torch.arange(n) % net.label_dim]
    sigma = torch.logspace(-1, 1, n, device=probe.device).reshape(-1, 1, 1, 1)  # 0.1 .. 10
    noise = torch.randn_like(images)
    reference = copy.deepcopy(net).double()
    want = loss_and_grads(reference, images.double(), labels.double(), sigma.double(), noise.double())
    for precision in PRECISIONS:
        # A copy per path: the forced weight normalization rewrites the weights in place.
        path = set_precision(copy.deepcopy(net), precision, cpu_16bit=True)
        got = loss_and_grads(path, images, labels, sigma, noise)
        record(precision, dict(output=relative_error(got[0], want[0]), gradient=relative_error(got[1], want[1])))


def toy_batches(resolution: int, batch: int, classes: int, seed: int = 0):
    """Endless batches of toy shapes (uint8 NCHW images, one-hot labels), cycling over 16 batches."""
    rng = np.random.default_rng(seed)
    names = list(SHAPES)[:classes]
    pool = []
    for _ in range(16):
        idx = rng.integers(0, classes, batch)
        images = np.stack([toy_image(names[i], resolution, rng) for i in idx]).transpose(0, 3, 1, 2)
        pool.append((torch.from_numpy(images), torch.eye(classes)[idx]))
    while True:
        yield from pool


def section_toy_training(probe: Probe, config: Config, record: Record) -> None:
    """(b) Toy training with each precision: the loss goes down, and the 16-bit runs follow the fp32 run (fp32
    first); each precision is recorded as it finishes."""
    tail = slice(-max(config.toy_steps // 3, 1), None)
    reference = None
    for precision in PRECISIONS:
        step = synthetic_step(config.toy_preset, config.toy_batch, probe.device, precision=precision, compile=False,
                              cpu_16bit=True)
        step = dataclasses.replace(step, batches=toy_batches(16, config.toy_batch, 6))
        step.state.cur_nimg = 0  # from the start of the recipe, learning-rate ramp-up included
        losses = np.array(torch.stack([training_step(step) for _ in range(config.toy_steps)]).tolist())
        reference = losses if reference is None else reference
        # Both runs draw the same noise; their last-third means differ by round-off grown through training, which
        # the 3 standard errors of the fp32 mean (the spread from the sampled noise levels) allow for.
        allowed = 3 * reference[tail].std() / math.sqrt(len(reference[tail]))
        record(precision, dict(
            first10=float(losses[:10].mean()), last_third=float(losses[tail].mean()),
            decreasing=bool(losses[tail].mean() < losses[:10].mean()), finite=bool(np.isfinite(losses).all()),
            follows_fp32=bool(abs(losses[tail].mean() - reference[tail].mean()) <= allowed)))


def training_rate(probe: Probe, config: Config, batch: int, settings: dict, peak: float | None) -> dict:
    """images/s, ms/step, TFLOP/s, MFU and peak memory of the preset's training step at a batch per GPU."""
    step = synthetic_step(config.preset, batch, probe.device, **settings)
    flops = training_flops_per_image(step.state.net)
    probe.reset_peak_memory()
    seconds = benchmark.seconds_per_call(lambda: training_step(step), config.train_steps, config.train_warmup,
                                         probe.device)
    rate = batch / seconds
    return dict(images_per_s=rate, ms_per_step=1000 * seconds, **utilization(flops, rate, peak, 1),
                peak_memory_gb=probe.peak_memory_gb())


def section_training_speed(probe: Probe, config: Config, record: Record) -> None:
    """(c) Training throughput at each batch per GPU: the release's configuration against config.fastest."""
    torch.backends.cudnn.benchmark = True
    peak = probe.peak_tflops()
    record("peak_tflops", peak)
    for batch in config.train_batches:
        rates = {}
        for name, settings in (("release", dict(config.release)), ("fastest", dict(config.fastest))):
            rates[name] = training_rate(probe, config, batch, settings, peak)
            record(f"batch{batch}_{name}", dict(settings=settings, **rates[name]))
        record(f"batch{batch}_speedup", rates["fastest"]["images_per_s"] / rates["release"]["images_per_s"])


def section_sampling_speed(probe: Probe, config: Config, record: Record) -> None:
    """(d) Sampling throughput without and with guidance (by the XS unconditional network), eager as released and
    with the sampling defaults (compiled, channels-last)."""
    peak = probe.peak_tflops()
    torch.manual_seed(0)
    net, gnet = preset_network(config.preset), preset_network(config.guide_preset, label_dim=0)
    flops = {1.0: benchmark.sampling_flops_per_image(net, None, config.sample_steps),
             1.4: benchmark.sampling_flops_per_image(net, gnet, config.sample_steps)}
    for name, speed in (("release", SamplingSpeed(compile=False, channels_last=False)), ("default", SamplingSpeed())):
        nets = [speed.apply(copy.deepcopy(n).eval().requires_grad_(False).to(probe.device), probe.device)
                for n in (net, gnet)]
        for guidance in (1.0, 1.4):
            rate = benchmark.sampling_images_per_s(nets[0], nets[1] if guidance != 1 else None, guidance,
                                                   config.sample_batch, config.sample_steps, 1, probe.device)
            record(f"{name}_guidance{guidance:g}", dict(
                images_per_s=rate, **utilization(flops[guidance], rate, peak, 1)))


def section_memory(probe: Probe, config: Config, record: Record) -> None:
    """(e) Peak memory of a training step for each network size at a fixed batch per GPU, with and without
    activation checkpointing (eager, so that no compile time counts against the section)."""
    for preset in config.memory_presets:
        for checkpointing in (False, True):
            if probe.time_left() < 10:
                record(f"{preset}_checkpoint{int(checkpointing)}", "skipped: out of time")
                continue
            try:
                step = synthetic_step(preset, config.memory_batch, probe.device, compile=False,
                                      checkpoint_activations=checkpointing)
                probe.reset_peak_memory()
                for _ in range(2):  # the first step creates Adam's state
                    training_step(step)
                value = probe.peak_memory_gb()
            except Exception as e:  # noqa: BLE001 (an out-of-memory size is a result, not a failure)
                if not probe.is_out_of_memory(e):
                    raise
                value = "out of memory"
            finally:
                step = None
            record(f"{preset}_checkpoint{int(checkpointing)}", value)


def torchrun_commands(out: Path, duration: str) -> dict[str, list[str]]:
    """The training commands of (f): a toy dataset, then one process of train_edm2.py through torchrun (NCCL on
    CUDA), sampling its grid and measuring the validation loss at its snapshot."""
    data, run = out / "toy16.zip", out / "run"
    return {
        "dataset_tool.py toy": [sys.executable, str(REPO / "dataset_tool.py"), "toy", f"--dest={data}",
                                "--resolution=16", "--num=512"],
        "torchrun train_edm2.py": [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
            str(REPO / "train_edm2.py"), "--preset=toy-tiny", f"--data={data}", f"--outdir={run}",
            f"--duration={duration}", "--status=512", f"--snapshot={duration}", f"--checkpoint={duration}",
            "--metrics=loss", "--metrics-num=256"],
    }


def generate_command(out: Path, snapshots: list[str], seeds: int) -> list[str]:
    """The sampling command of (f): generate.py from the run's last snapshot, guided (Eq. 152) by its first, so that
    both networks and the guided sampler run on CUDA."""
    return [sys.executable, str(REPO / "generate.py"), f"--net={out / 'run' / snapshots[-1]}",
            f"--gnet={out / 'run' / snapshots[0]}", "--guidance=1.4", f"--seeds=0-{seeds - 1}", "--grid",
            f"--outdir={out / 'images'}"]


def section_torchrun(probe: Probe, config: Config, record: Record, out: Path,
                     run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> None:
    """(f) train_edm2.py as one process under torchrun must finish and write its stats, snapshots and state; then
    generate.py must sample from them, guided, as a user would next."""

    def check(name: str, command: list[str]) -> None:
        result = run(command, capture_output=True, text=True, timeout=max(probe.time_left() - 5, 1))
        if result.returncode != 0:
            raise RuntimeError(f"{name} exited {result.returncode}: {(result.stderr or result.stdout).strip()[-2000:]}")

    for name, command in torchrun_commands(out, config.torchrun_duration).items():
        check(name, command)
    stats = out / "run" / "stats.jsonl"
    rows = [bounded_json.parse(line, str(stats)) for line in stats.read_text().splitlines()]
    status = [row for row in rows if "images_per_s" in row]  # the metrics' rows have none
    record("stats_rows", len(status))
    record("images_per_s", status[-1]["images_per_s"])
    record("metrics", [row["metrics"] for row in rows if "metrics" in row])
    record("grids", sorted(p.name for p in (out / "run" / "samples").glob("grid-*.png")))
    snapshots = sorted(p.name for p in (out / "run").glob("network-snapshot-*.safetensors"))
    record("snapshots", snapshots)
    record("training_states", sorted(p.name for p in (out / "run").glob("training-state-*.pt")))
    check("generate.py", generate_command(out, snapshots, config.generate_seeds))
    record("generated_images", len([p for p in (out / "images").glob("*.png") if p.name != "grid.png"]))
    record("grid", (out / "images" / "grid.png").is_file())
