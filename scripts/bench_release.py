"""Training step and sampling side by side with the release (a checkout of NVlabs/edm2) in one process, on the CPU.

For each toy network (toy-tiny, toy-small) at --resolution, it times, alternately so that both sides see the same
machine: the release's float32 training step (its EDM2Loss, backward, Adam, its PowerFunctionEMA update), ours in
float32, in bfloat16 (--cpu-16bit) and in bfloat16 compiled and channels-last (--compile --channels-last), and
32-step Heun sampling with the release's edm_sampler and ours in the same settings. Then, in processes of their own,
ours in 16 bits as torchrun runs it on a CPU: --processes processes of one thread (training.run.data_parallel_speed;
the release's loop starts several processes on NCCL only, so not on a CPU). It prints
images/s, each side's speed-up over the release's float32 and its share of this CPU's float32 and bfloat16
peaks (the rate of the training step's counted FLOPs, 3 x 2 x multiply-accumulates); the last line is JSON.

A ceiling line gives the rate of a step that took no more time than its layers' convolutions and linear maps alone,
each shape timed on its own in bfloat16 channels-last with oneDNN (forward and backward): no setting of the step
can go much past it (the separate timings hold each call's Python overhead, so scripts/profile_step.py puts the
convolutions 5-10% faster within a compiled step), and its share of the bfloat16 peak bounds the step's about as
closely. On 2 cores of a Xeon with AMX the toy networks' narrow layers (16 and 32 channels) run at about a sixth
(toy-tiny) and a quarter (toy-small) of that peak, which a channels-last convolution of 256 channels sets.

    git clone https://github.com/NVlabs/edm2 ../edm2-release   # its training loop also imports psutil
    python scripts/bench_release.py --release=../edm2-release --threads=2
"""

from __future__ import annotations

import collections
import copy
import importlib.util
import json
import sys
from pathlib import Path
from typing import Callable

import click
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout: use its packages
from edm2.eval.benchmark import seconds_per_call  # noqa: E402
from edm2.layers import conv_or_linear, mpconvs  # noqa: E402
from edm2.runtime import host_memory  # noqa: E402
from edm2.runtime.speed import SamplingSpeed  # noqa: E402
from edm2.sampler import edm_sampler  # noqa: E402
from edm2.runtime.utilization import measure_cpu_tflops, training_flops_per_image, utilization  # noqa: E402
from training.presets import PRESETS  # noqa: E402
from training.run.benchmark import synthetic_step  # noqa: E402
from training.run.data_parallel_speed import data_parallel_speed  # noqa: E402
from training.step import WARMUP_STEPS, training_step  # noqa: E402

LABELS = 6  # the toy presets' classes
# Our settings measured: float32 as the release computes; bfloat16 (--precision=bf16 --cpu-16bit); and that with
# --compile --channels-last, whose first calls (untimed, WARMUP_STEPS of them) compile the loss and Adam's update.
OURS = {
    "fp32": dict(precision="fp32", cpu_16bit=False, compile=False, channels_last=False),
    "bf16": dict(precision="bf16", cpu_16bit=True, compile=False, channels_last=False),
    "bf16 compiled": dict(precision="bf16", cpu_16bit=True, compile=True, channels_last=True),
}
CPU = torch.device("cpu")
# The rate of a step that took only its layers' time alone (layer_seconds): no setting of the step gets much past it.
CEILING = "ceiling: its layers alone, bf16"
# Timings of each peak kernel and size: a run's start takes three (and keeps the best over runs); in one measurement,
# three left the bfloat16 peak up to a quarter short (2.8-3.3 against 3.6 TFLOP/s on an AMX Xeon), ten held it.
PEAK_REPEATS = 10


def our_settings(compiled: bool) -> dict[str, dict]:
    """The settings of OURS measured: all, or with compiled False those that do not compile."""
    return {name: settings for name, settings in OURS.items() if compiled or not settings["compile"]}


def layer_seconds(net: torch.nn.Module, batch: int, resolution: int, steps: int, rounds: int) -> float:
    """Seconds per step of batch images that net's MPConv layers (its convolutions and linear layers) take alone in
    bfloat16, channels-last, forward and backward (input and weight gradients): each distinct shape of a forward
    pass timed on its own, the best of `rounds` windows of `steps` calls. Nearly a floor under the 16-bit training
    step's time, which computes these and more (each separate call also pays its Python overhead, and the first
    layer an input gradient the step skips); so the counted FLOPs over it nearly bound the step's share of the
    peak."""
    shapes = collections.Counter()
    hooks = [layer.register_forward_hook(lambda layer, args, out: shapes.update([(args[0].shape, layer.weight.shape)]))
             for layer in mpconvs(net)]
    with torch.no_grad():
        net(torch.randn(batch, net.img_channels, resolution, resolution), torch.ones(batch),
            torch.eye(net.label_dim)[torch.arange(batch) % net.label_dim])
    for hook in hooks:
        hook.remove()
    total = 0.0
    for (x_shape, w_shape), count in shapes.items():
        x = torch.randn(x_shape, dtype=torch.bfloat16)
        x = (x.to(memory_format=torch.channels_last) if x.ndim == 4 else x).requires_grad_()
        w = torch.randn(w_shape, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(conv_or_linear(x, w).shape, dtype=torch.bfloat16)
        seconds = min(seconds_per_call(lambda: conv_or_linear(x, w).backward(grad), steps, warmup=1, device=CPU)
                      for _ in range(rounds))
        total += count * seconds
    return total


def release_module(release: Path, relative: str, name: str):
    """A module of the release checkout loaded under its own name (the release's training/ would shadow ours);
    its imports of dnnlib and torch_utils resolve in the checkout."""
    if str(release) not in sys.path:
        sys.path.append(str(release))
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, release / relative)
        sys.modules[name] = importlib.util.module_from_spec(spec)  # its persistence decorator looks itself up there
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def release_network(networks, preset: str, resolution: int) -> torch.nn.Module:
    """The release's Precond with the preset's U-Net (channels, levels, blocks, attention) for RGB data."""
    recipe = PRESETS[preset]
    unet = {k: list(v) if isinstance(v, tuple) else v for k, v in recipe.network.items()}
    torch.manual_seed(0)
    return networks.Precond(resolution, 3, LABELS, use_fp16=False, model_channels=recipe.channels, **unet).train()


def release_step(net: torch.nn.Module, loss_fn, ema, batch: int, resolution: int) -> Callable[[], None]:
    """One training step as the release's loop takes it: loss, backward, Adam, EMA."""
    images = torch.randn(batch, 3, resolution, resolution)
    labels = torch.eye(LABELS)[torch.arange(batch) % LABELS]
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-4, betas=(0.9, 0.99), eps=1e-8)
    nimg = [0]

    def step() -> None:
        loss = loss_fn(net=net, images=images, labels=labels)
        loss.sum().mul(1 / batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        nimg[0] += batch
        ema.update(cur_nimg=nimg[0], batch_size=batch)
    return step


def images_per_s(step: Callable[[], None], batch: int, steps: int, warmup: int = 1) -> float:
    """Images per second of `steps` calls after `warmup` untimed ones."""
    return batch / seconds_per_call(step, steps, warmup=warmup, device=CPU)


def best_of(rounds: int, measures: dict[str, Callable[[], float]]) -> dict[str, float]:
    """The best of `rounds` measurements of each, taken in turn (A B C, A B C, ...) so drift hits every side."""
    best = dict.fromkeys(measures, 0.0)
    for _ in range(rounds):
        for name, measure in measures.items():
            best[name] = max(best[name], measure())
    return best


def training_rates(release: Path, preset: str, resolution: int, batch: int, steps: int, rounds: int,
                   compiled: bool, processes: int) -> dict:
    """images/s of the release's float32 step and of ours in our_settings(compiled), the 16-bit ones also as
    `processes` processes of one thread (torchrun's way; the release's loop runs several processes on NCCL only)."""
    networks = release_module(release, "training/networks_edm2.py", "release_networks_edm2")
    loop = release_module(release, "training/training_loop.py", "release_training_loop")
    phema = release_module(release, "training/phema.py", "release_phema")
    net = release_network(networks, preset, resolution)
    recipe = PRESETS[preset]
    theirs = release_step(net, loop.EDM2Loss(P_mean=recipe.P_mean, P_std=recipe.P_std), phema.PowerFunctionEMA(net),
                          batch, resolution)
    ours = {name: synthetic_step(preset, batch, CPU, resolution=resolution, **settings)
            for name, settings in our_settings(compiled).items()}
    flops = training_flops_per_image(ours["fp32"].state.net)
    rates = best_of(rounds, {
        "release fp32": lambda: images_per_s(theirs, batch, steps),
        **{f"ours {name}": (lambda s=s: images_per_s(lambda: float(training_step(s)), batch, steps, WARMUP_STEPS))
           for name, s in ours.items()},
    })
    rates[CEILING] = batch / layer_seconds(ours["fp32"].state.net, batch, resolution, steps, rounds)
    if processes > 1:
        for name, settings in our_settings(compiled).items():
            if settings["cpu_16bit"]:
                rates[f"ours {name}, {processes} processes"] = data_parallel_speed(
                    preset, batch, processes, steps=steps, rounds=rounds, resolution=resolution, **settings,
                ).images_per_s
    return dict(rates=rates, flops_per_image=flops)


def sampling_rates(release: Path, preset: str, resolution: int, batch: int, rounds: int, compiled: bool) -> dict:
    """images/s of 32-step Heun sampling, the release's edm_sampler and ours in our_settings(compiled)."""
    networks = release_module(release, "training/networks_edm2.py", "release_networks_edm2")
    generate = release_module(release, "generate_images.py", "release_generate_images")
    theirs = release_network(networks, preset, resolution).eval().requires_grad_(False)
    net = synthetic_step(preset, 1, CPU, resolution=resolution).state.net.eval()
    ours = {name: SamplingSpeed(**settings).apply(copy.deepcopy(net), CPU)
            for name, settings in our_settings(compiled).items()}
    noise = torch.randn(batch, 3, resolution, resolution)
    labels = torch.eye(LABELS)[torch.arange(batch) % LABELS]

    def ours_as(name: str) -> Callable[[], None]:
        return lambda: edm_sampler(ours[name], noise, labels, num_steps=32)

    return dict(rates=best_of(rounds, {
        "release fp32": lambda: images_per_s(lambda: generate.edm_sampler(theirs, noise, labels, num_steps=32), batch,
                                             1),
        **{f"ours {name}": (lambda name=name: images_per_s(ours_as(name), batch, 1)) for name in ours},
    }))


@click.command()
@click.option("--release", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True,
              help="A checkout of NVlabs/edm2")
@click.option("--presets", default="toy-tiny,toy-small", show_default=True, help="Networks to measure")
@click.option("--resolution", type=click.IntRange(min=8), default=32, show_default=True)
@click.option("--batch", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--steps", type=click.IntRange(min=1), default=4, show_default=True, help="Timed steps per round")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True, help="Rounds; the best counts")
@click.option("--threads", type=click.IntRange(min=1), help="PyTorch CPU threads  [default: PyTorch's]")
@click.option("--compiled/--no-compiled", default=True, show_default=True,
              help="Also measure ours compiled (--compile --channels-last; about a minute of compiling per network)")
@click.option("--processes", type=click.IntRange(min=1),
              help="Also measure ours in 16 bits as this many processes of one thread, after the rest  [default: "
                   "the threads; 1: not]")
def main(release: Path, presets: str, resolution: int, batch: int, steps: int, rounds: int,
         threads: int | None, compiled: bool, processes: int | None) -> None:
    """Time the release and this project side by side on this CPU."""
    if threads:
        torch.set_num_threads(threads)
    host_memory.keep_freed_memory()  # as the command lines do, for both sides: they share this process
    processes = processes or torch.get_num_threads()
    peaks = {p: measure_cpu_tflops(dtype, repeats=PEAK_REPEATS)
             for p, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    click.echo(f"{torch.get_num_threads()} threads; peak (matmul or 3x3 convolution, either layout) fp32 "
               f"{peaks['fp32'] * 1e3:.1f} GFLOP/s, bf16 {peaks['bf16'] * 1e3:.1f} GFLOP/s; "
               f"{host_memory.describe()}")
    report = dict(threads=torch.get_num_threads(), peak_tflops=peaks, presets={})
    for preset in presets.split(","):
        train = training_rates(release, preset, resolution, batch, steps, rounds, compiled, processes)
        sample = sampling_rates(release, preset, resolution, batch, rounds, compiled)
        report["presets"][preset] = dict(training=train, sampling=sample)
        base = train["rates"]["release fp32"]
        for name, rate in train["rates"].items():
            achieved = utilization(train["flops_per_image"], rate, None, 1)["tflops"]
            click.echo(f"{preset} {resolution}px train  {name:32s} {rate:8.1f} img/s  {rate / base:5.2f}x  "
                       f"{achieved / peaks['fp32']:6.1%} of fp32 peak  {achieved / peaks['bf16']:6.1%} of bf16 peak")
        for name, rate in sample["rates"].items():
            click.echo(f"{preset} {resolution}px sample {name:32s} {rate:8.2f} img/s  "
                       f"{rate / sample['rates']['release fp32']:5.2f}x")
    click.echo(json.dumps(report))


if __name__ == "__main__":
    main()
