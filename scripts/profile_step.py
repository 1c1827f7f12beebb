"""Where a training step's time goes, by torch.profiler: the step's phases (data, weight normalization, forward,
backward: the rest of the step, Adam, EMA) and, within them, the kinds of operator (convolutions, attention,
normalization, elementwise, casts, optimizer and EMA updates); and the kinds of operator of a sampling step (one Heun
step of edm_sampler, two evaluations of the network). Prints tables per precision; the last line is JSON.

With --compiled the graphs are compiled with inductor's Python wrapper, not the C++ one our CPU compiles use
(edm2.runtime.inductor_options.device_options): the C++ wrapper calls the convolutions and other library functions
past torch.profiler, which would then count them in no kind. The steps profiled take 3-4% longer than the shipped
ones for it.

    python scripts/profile_step.py --preset=toy-small --resolution=32 --threads=2
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import sys
from pathlib import Path
from typing import Callable

import click
import torch
import torch._inductor.config
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout: use its packages
import training.step  # noqa: E402
from edm2.runtime import host_memory, inductor_options  # noqa: E402
from edm2.runtime.speed import SamplingSpeed  # noqa: E402
from edm2.sampler import edm_sampler  # noqa: E402
from training.run.benchmark import synthetic_step  # noqa: E402

PHASES = ("data", "weight normalization", "forward", "backward", "Adam", "EMA")
# Operator kinds by name: the first whose fragment occurs in the aten operator's name wins.
KINDS = (
    ("convolution", ("convolution", "conv2d", "mkldnn_conv")),
    ("attention", ("scaled_dot_product", "_efficient_attention", "_flash_attention", "bmm", "softmax", "baddbmm")),
    ("matmul", ("mm", "addmm", "matmul", "linear")),
    ("normalization", ("norm", "rsqrt", "sqrt")),
    ("casts and copies", ("_to_copy", "copy_", "::to", "contiguous", "clone")),
    ("optimizer and EMA (foreach)", ("_foreach",)),
    ("elementwise", ("mul", "add", "sub", "div", "silu", "sigmoid", "exp", "log", "cos", "sin", "lerp", "where",
                     "clamp", "pow", "neg", "cat", "mean", "sum", "fill_", "zero_", "randn", "normal_", "empty")),
)
# torch.compile's generated CPU kernels (named graph_<n>_cpp_fused_<ops>_<n> with the kernel profile on): the
# elementwise work, normalizations and softmax between the convolutions, fused.
COMPILED = "compiled fused kernels"


def kind_of(name: str) -> str:
    """The operator kind of an aten operator's or a compiled kernel's name (KINDS, COMPILED), 'other' for the rest."""
    if name.startswith("graph_") and "_cpp_fused_" in name:
        return COMPILED
    return next((kind for kind, fragments in KINDS if any(f in name for f in fragments)), "other")


@contextlib.contextmanager
def phases_recorded():
    """Wrap the step's phases in record_function ranges named by PHASES, for the profiler."""
    module = training.step
    original = module.force_weight_normalization

    def labelled(label: str, fn: Callable) -> Callable:
        def call(*args, **kwargs):
            with record_function(label):
                return fn(*args, **kwargs)
        return call

    module.force_weight_normalization = labelled("weight normalization", original)
    try:
        yield labelled
    finally:
        module.force_weight_normalization = original


def profile_steps(preset: str, batch: int, resolution: int, precision: str, steps: int, compiled: bool) -> dict:
    """Self CPU time (ms per step) of each phase and of each operator kind."""
    step = synthetic_step(preset, batch, torch.device("cpu"), resolution=resolution, precision=precision,
                          cpu_16bit=precision != "fp32", compile=compiled, channels_last=compiled)
    with phases_recorded() as labelled:
        batches, ema_update = step.batches, step.state.ema.update
        step.state.ema.update = labelled("EMA", ema_update)
        step = dataclasses.replace(step, batches=iter(labelled("data", lambda: next(batches)), None),
                                   loss_fn=labelled("forward", step.loss_fn),
                                   update=labelled("Adam", step.update))
        whole = labelled("step", lambda: float(training.step.training_step(step)))
        for _ in range(training.step.WARMUP_STEPS):  # warm-up: compiling
            whole()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                whole()
    events = prof.key_averages()
    totals = {e.key: e.cpu_time_total / 1e3 / steps for e in events if e.key in (*PHASES, "step")}
    # The backward pass runs in the autograd engine, outside the ranges: the rest of the step.
    phases = {name: totals.get(name, 0.0) for name in PHASES if name != "backward"}
    phases["backward"] = totals["step"] - sum(phases.values())
    return dict(phases=phases, kinds=operator_kinds(events, steps))


def operator_kinds(events, steps: int) -> dict[str, float]:
    """Self CPU time (ms per step) of each operator kind among the profiled aten operators and compiled kernels,
    largest first."""
    kinds: dict[str, float] = collections.defaultdict(float)
    for e in events:
        kind = kind_of(e.key)
        if e.key.startswith("aten::") or kind == COMPILED:
            kinds[kind] += e.self_cpu_time_total / 1e3 / steps
    return dict(sorted(kinds.items(), key=lambda kv: -kv[1]))


def profile_sampling(preset: str, batch: int, resolution: int, precision: str, steps: int, compiled: bool) -> dict:
    """Wall time and self CPU time of each operator kind (ms per Heun step) of edm_sampler, as generate.py samples:
    the network in evaluation mode, its weights normalized once per run."""
    net = synthetic_step(preset, 1, torch.device("cpu"), resolution=resolution).state.net.eval().requires_grad_(False)
    net = SamplingSpeed(precision=precision, cpu_16bit=precision != "fp32", compile=compiled,
                        channels_last=compiled).apply(net, torch.device("cpu"))
    noise = torch.randn(batch, net.img_channels, resolution, resolution)
    labels = torch.eye(net.label_dim)[torch.arange(batch) % net.label_dim] if net.label_dim else None
    edm_sampler(net, noise, labels, num_steps=2)  # warm-up
    # steps + 1 sampler steps, timed per step: every step but the sampler's last adds Heun's second evaluation, so
    # even --steps=1 times one.
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("sampling"):
            edm_sampler(net, noise, labels, num_steps=steps + 1)
    events = prof.key_averages()
    total = next(e.cpu_time_total for e in events if e.key == "sampling") / 1e3 / (steps + 1)
    return dict(ms_per_step=total, kinds=operator_kinds(events, steps + 1))


def print_kinds(kinds: dict[str, float]) -> None:
    """The markdown table of operator kinds."""
    ops = sum(kinds.values())
    click.echo("| operator kind (self time) | ms/step | share |\n|---|---:|---:|")
    for kind, ms in kinds.items():
        click.echo(f"| {kind} | {ms:.1f} | {ms / ops:.0%} |")


@click.command()
@click.option("--preset", default="toy-small", show_default=True)
@click.option("--batch", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--resolution", type=click.IntRange(min=8), default=32, show_default=True)
@click.option("--precisions", default="fp32,bf16", show_default=True, help="Precisions to profile (bf16: --cpu-16bit)")
@click.option("--steps", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--threads", type=click.IntRange(min=1), help="PyTorch CPU threads  [default: PyTorch's]")
@click.option("--compiled", is_flag=True, help="With --compile --channels-last (the warm-up compiles)")
def main(preset: str, batch: int, resolution: int, precisions: str, steps: int, threads: int | None,
         compiled: bool) -> None:
    """Profile the training step and the sampling step on the CPU."""
    if threads:
        torch.set_num_threads(threads)
    host_memory.keep_freed_memory()  # as the command lines do
    # The generated kernels appear in the profile by name only with inductor's kernel profile on.
    torch._inductor.config.cpp.enable_kernel_profile = compiled
    inductor_options.device_options = lambda device: {}  # the Python wrapper (see above)
    report = {}
    setting = " compiled, channels-last" if compiled else ""
    for precision in precisions.split(","):
        heading = f"\n{preset} {resolution}px batch {batch}, {precision}{setting}, {torch.get_num_threads()} threads:"
        sampling = profile_sampling(preset, batch, resolution, precision, steps, compiled)
        click.echo(f"{heading} {sampling['ms_per_step']:.1f} ms per sampling step")
        print_kinds(sampling["kinds"])
        result = report[precision] = profile_steps(preset, batch, resolution, precision, steps, compiled)
        result["sampling"] = sampling
        total = sum(result["phases"].values())  # the whole step
        click.echo(f"{heading} {total:.1f} ms per training step")
        click.echo("| phase | ms/step | share |\n|---|---:|---:|")
        for name in PHASES:
            ms = result["phases"].get(name, 0.0)
            click.echo(f"| {name} | {ms:.1f} | {ms / total:.0%} |")
        print_kinds(result["kinds"])
    click.echo(json.dumps(report))


if __name__ == "__main__":
    main()
