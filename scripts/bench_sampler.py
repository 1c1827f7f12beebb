"""Benchmark the EDM sampler: images/s at 32 steps of a solver (--solver, Heun by default) without and with guidance
and their achieved TFLOP/s and model-FLOP utilization (over the peak a training measures against,
edm2.runtime.utilization.peak_tflops); the last line printed is JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout: use its edm2, not an installed one
from cli.solver import solver_option
from edm2.eval import benchmark
from edm2.networks import Precond
from edm2.runtime.speed import PRECISIONS, SamplingSpeed
from edm2.runtime.utilization import peak_tflops, utilization
from training.run.benchmark import preset_network

SIZES = ("xs", "s", "m", "l", "xl", "xxl")


def networks(size: str | None, resolution: int, img_channels: int, channels: int, gnet_channels: int | None,
             classes: int) -> tuple[Precond, Precond]:
    """(net, unconditional gnet): EDM2 img512 of a size (guided by XS, as the release's autoguidance presets), or
    the small custom U-Net of the other options."""
    torch.manual_seed(0)
    if size is not None:
        return preset_network(f"edm2-img512-{size}"), preset_network("edm2-img512-xs", label_dim=0)
    arch = dict(channel_mult=[1, 2, 2], num_blocks=2, attn_resolutions=[resolution // 4], channels_per_head=16)
    net = Precond(resolution, img_channels, classes, model_channels=channels, **arch)
    return net, Precond(resolution, img_channels, 0, model_channels=gnet_channels or channels, **arch)


@click.command(epilog="""\b
Examples:
  python scripts/bench_sampler.py --resolution=16 --channels=32 --batch=8
  python scripts/bench_sampler.py --size=s --batch=64 --precision=bf16
""")
@click.option("--size", type=click.Choice(SIZES), help="EDM2 img512 network size (64x64x4, 1000 classes) instead of "
              "the small U-Net below; guided by XS")
@click.option("--resolution", type=click.IntRange(min=4), default=16, show_default=True, help="Image resolution")
@click.option("--img_channels", type=click.IntRange(min=1), default=4, show_default=True, help="Image channels")
@click.option("--channels", type=click.IntRange(min=8), default=32, show_default=True, help="model_channels of the main net")
@click.option("--gnet_channels", type=click.IntRange(min=8), default=None, help="model_channels of the unconditional guiding net [default: same]")
@click.option("--classes", type=click.IntRange(min=0), default=1000, show_default=True, help="label_dim of the main net")
@click.option("--batch", "batch_size", type=click.IntRange(min=1), default=8, show_default=True, help="Images per batch")
@click.option("--steps", "num_steps", type=click.IntRange(min=2), default=32, show_default=True, help="Sampling steps")
@click.option("--repeats", type=click.IntRange(min=1), default=2, show_default=True, help="Timed batches (best is reported)")
@click.option("--device", default="cuda" if torch.cuda.is_available() else "cpu", show_default=True, help="torch device")
@click.option("--precision", type=click.Choice(PRECISIONS), default="fp16", show_default=True,
              help="Network activations on CUDA (and with --cpu-16bit on the CPU)")
@click.option("--compile/--no-compile", "compile_", default=None, help="torch.compile  [default: on CUDA only]")
@click.option("--channels-last/--no-channels-last", default=None, help="NHWC convolutions  [default: on CUDA only]")
@click.option("--cpu-16bit", is_flag=True, help="Compute in --precision on the CPU too")
@solver_option
def main(size, resolution, img_channels, channels, gnet_channels, classes, batch_size, num_steps, repeats, device,
         precision, compile_, channels_last, cpu_16bit, solver):
    """Print images/s for the sampler without and with guidance (Heun: 2 x 31 + 1 = 63 evaluations per net)."""
    device = torch.device(device)
    net, gnet = networks(size, resolution, img_channels, channels, gnet_channels, classes)
    speed = SamplingSpeed(compile=compile_, channels_last=channels_last, precision=precision, cpu_16bit=cpu_16bit)
    flops = {1.0: benchmark.sampling_flops_per_image(net, None, num_steps, solver),
             1.4: benchmark.sampling_flops_per_image(net, gnet, num_steps, solver)}
    net, gnet = (speed.apply(n.eval().requires_grad_(False).to(device), device) for n in (net, gnet))
    print(f"device {device}, {net.img_resolution}x{net.img_resolution}x{net.img_channels}, batch {batch_size}, "
          f"{num_steps} steps, computing in {net.compute_dtype(device)}, compile {speed.compiles(device)}, "
          f"channels-last {speed.uses_channels_last(device)}")
    peak = peak_tflops(device, net.compute_dtype(device))[0]
    result = dict(size=size, batch=batch_size, steps=num_steps, solver=solver, device=str(device), precision=precision,
                  compile=speed.compiles(device), channels_last=speed.uses_channels_last(device), peak_tflops=peak)
    for key, label, g, w in (("", "no guidance", None, 1.0), ("_guided", "guidance 1.4", gnet, 1.4)):
        rate = benchmark.sampling_images_per_s(net, g, w, batch_size, num_steps, repeats, device, solver)
        speed_row = utilization(flops[w], rate, peak, 1)
        result.update({f"images_per_s{key}": rate, f"tflops{key}": speed_row["tflops"], f"mfu{key}": speed_row["mfu"]})
        mfu = f", MFU {result['mfu' + key]:.1%}" if peak else ""
        print(f"{label:>13}: {rate:8.2f} images/s, {result['tflops' + key]:.2f} TFLOP/s{mfu}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
