"""Training throughput of a preset on synthetic data with the loop's own step: images/s, achieved
TFLOP/s and model-FLOP utilization (over the peak a training measures against, edm2.runtime.utilization.peak_tflops);
the last line printed is JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout: use its packages
from edm2.eval import benchmark
from edm2.runtime import distributed
from edm2.runtime.speed import PRECISIONS
from edm2.runtime.utilization import peak_tflops, training_flops_per_image, utilization
from training.run.benchmark import synthetic_step
from training.run.outputs import max_memory_gb
from training.presets import PRESETS
from training.step import WARMUP_STEPS, training_step


@click.command(epilog="""\b
Examples:
  python scripts/bench_train.py --preset=toy-small --precision=fp32
  python scripts/bench_train.py --preset=edm2-img512-s --precision=fp16 --no-compile --batch-gpu=32   # release
  python scripts/bench_train.py --preset=edm2-img512-s --precision=bf16 --batch-gpu=64
""")
@click.option("--preset", type=click.Choice(list(PRESETS)), default="toy-small", show_default=True,
              help="Recipe and network size")
@click.option("--precision", type=click.Choice(PRECISIONS), default="fp16", show_default=True)
@click.option("--batch-gpu", type=click.IntRange(min=1), help="Images per round  [default: the preset's batch, at most 64]")
@click.option("--rounds", type=click.IntRange(min=1), default=1, show_default=True, help="Accumulation rounds per step")
@click.option("--resolution", type=click.IntRange(min=8), help="Data resolution  [default: 64, toy presets 16]")
@click.option("--steps", type=click.IntRange(min=1), default=10, show_default=True, help="Timed optimizer steps")
@click.option("--warmup", type=click.IntRange(min=0), default=WARMUP_STEPS, show_default=True,
              help="Untimed steps first (those that compile: the loss, then on the CPU Adam's update)")
@click.option("--compile/--no-compile", "compile_", default=None, help="torch.compile  [default: on CUDA only]")
@click.option("--channels-last/--no-channels-last", default=None, help="NHWC convolutions  [default: on CUDA only]")
@click.option("--checkpoint-activations", is_flag=True, help="Recompute block activations in the backward pass")
@click.option("--cpu-16bit", is_flag=True, help="Compute in --precision on the CPU too")
def main(preset: str, precision: str, batch_gpu: int | None, rounds: int, resolution: int | None, steps: int,
         warmup: int, compile_: bool | None, channels_last: bool | None, checkpoint_activations: bool,
         cpu_16bit: bool) -> None:
    """Time full training steps (loss, backward, Adam, EMA) on one device."""
    device = distributed.device()
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    batch_gpu = batch_gpu or min(PRESETS[preset].batch, 64)
    step = synthetic_step(preset, batch_gpu, device, rounds=rounds, resolution=resolution, precision=precision,
                          compile=compile_, channels_last=channels_last, checkpoint_activations=checkpoint_activations,
                          cpu_16bit=cpu_16bit)
    opts, net = step.opts, step.state.net
    flops = training_flops_per_image(net)
    click.echo(f"{preset}: {net.img_resolution}x{net.img_resolution}x{net.img_channels} network input, {opts.batch} "
               f"images per step, precision {precision} (computing in {net.compute_dtype(device)}) on {device}, "
               f"compile {opts.compiles(device)}, channels-last {opts.uses_channels_last(device)}, "
               f"{torch.get_num_threads()} CPU thread(s)")
    seconds = benchmark.seconds_per_call(lambda: training_step(step), steps, warmup, device)
    images_per_s = opts.batch / seconds
    peak, source = peak_tflops(device, net.compute_dtype(device))
    result = dict(
        preset=preset, precision=precision, batch=opts.batch, compile=opts.compiles(device),
        channels_last=opts.uses_channels_last(device), checkpoint_activations=checkpoint_activations,
        device=str(device), images_per_s=images_per_s, ms_per_step=seconds * 1000,
        max_memory_gb=max_memory_gb(device), peak_tflops=peak,
        **utilization(flops, images_per_s, peak, 1),
    )
    mfu = f", MFU {result['mfu']:.1%} of {peak:.4g} TFLOP/s ({source})" if peak else ""
    click.echo(f"{images_per_s:.1f} images/s ({seconds * 1000:.1f} ms/step, max memory {result['max_memory_gb']:.2f} "
               f"GB), {result['tflops']:.2f} TFLOP/s{mfu}")
    click.echo(json.dumps(result))


if __name__ == "__main__":
    main()
