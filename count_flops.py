"""Count an EDM2 network's parameters and flops per evaluation as the release counts them (paper Table 6).

The counting is edm2.eval.flops's; this command line finds the network (a snapshot of ours, a release pickle, a URL,
or a preset name, built on the meta device without weights) and prints the numbers.
"""

from __future__ import annotations

import cli.wait_policy  # noqa: F401  first: PyTorch's OpenMP reads its wait policy once, when it loads
import os
import re

import click
import torch

from cli.command import Command
from edm2.consistency_sampler import is_consistency_model
from edm2.eval import flops
from edm2.formats.snapshot import load_network
from edm2.networks import Precond
from edm2.procedures import presets_generate
from training import presets

# The data of the release's training presets: (resolution, channels, classes) of what the network sees,
# 64x64x4 Stable Diffusion latents of ImageNet-512 and 64x64 RGB ImageNet-64 pixels.
RELEASE_DATA = {presets.IMG512: (64, 4, 1000), presets.IMG64: (64, 3, 1000)}
# The release's published file names: edm2-{dataset}-{size}[-uncond]-{kimg}-{sigma_rel}.pkl.
RELEASE_FILE = re.compile(r"(?P<preset>edm2-img\d+-[a-z]+)(?P<uncond>-uncond)?-\d+-\d+\.\d+\.pkl")


def preset_network(name: str, cond: bool = True) -> Precond:
    """The network of a training preset, on the meta device (no weights, no memory)."""
    preset = presets.PRESETS[name]
    if preset.data not in RELEASE_DATA:
        raise click.BadParameter(f"the preset {name} trains on a dataset of your choosing, which sets the network's "
                                 "resolution and classes: count a snapshot of such a run instead", param_hint="NET")
    resolution, channels, classes = RELEASE_DATA[preset.data]
    with torch.device("meta"):
        return Precond(resolution, channels, classes if cond else 0, model_channels=preset.channels,
                       dropout=preset.dropout, **preset.network)


def published_network(url: str) -> Precond:
    """The architecture of one of the release's published files, from its name, on the meta device."""
    match = RELEASE_FILE.fullmatch(os.path.basename(url))
    if match is None or match["preset"] not in presets.PRESETS:
        raise click.BadParameter(f"cannot tell the architecture of {url} from its name", param_hint="NET")
    return preset_network(match["preset"], cond=match["uncond"] is None)


def networks_of(net: str) -> list[tuple[str, Precond, dict]]:
    """(description, network, its snapshot's metadata or {}) of each network NET names: one, or a generation preset's
    main and guiding networks."""
    if net in presets.PRESETS:
        return [(f"{net} (training preset, built without weights)", preset_network(net), {})]
    if net in presets_generate.PRESETS:
        preset = presets_generate.PRESETS[net]
        urls = [("main network", preset.net)] + ([("guiding network", preset.gnet)] if preset.gnet else [])
        return [(f"{net} {role} {url} (built without weights)", published_network(url), {}) for role, url in urls]
    if "://" not in net and not os.path.exists(net):
        raise click.BadParameter(f"{net!r} is no file, URL or preset name (a name of train_edm2.py --preset or "
                                 "generate.py --preset, e.g. edm2-img512-s)", param_hint="NET")
    return [(net, *load_network(net))]


def report(description: str, net: Precond, verbose: bool, metadata: dict) -> None:
    """Print the parameters, flops (and on CUDA the memory) of one network, and for a consistency model (its
    snapshot's metadata tells) those of an image in 1 and 2 steps; with verbose, per part and op."""
    count = flops.count_flops(net)
    by_op = count.by_op()
    macs = sum(by_op[op] for op in flops.MAC_OPS)
    print(f"{'Network':<12}{description}")
    print(f"{'Parameters':<12}{count.parameters / 1e6:.2f} M ({count.parameters:,})")
    print(f"{'Gflops':<12}{count.total / 1e9:.2f} per evaluation of one sample ({count.total:,} flops, "
          f"{macs / count.total:.1%} in convolutions and matrix products)")
    if is_consistency_model(metadata):
        one, two = (flops.sampling_evaluations(metadata, steps, "heun") * count.total for steps in (1, 2))
        print(f"{'Per image':<12}{one / 1e9:.2f} Gflops in 1 step, {two / 1e9:.2f} in 2 (a consistency model: one "
              "evaluation per step)")
    if torch.cuda.is_available():
        device = torch.device("cuda")
        net = net.to_empty(device=device) if next(net.parameters()).is_meta else net.to(device)
        print(f"{'GPU memory':<12}{flops.memory_per_sample(net, device) / 2**30:.3f} GB per sample")
    if verbose:
        print(f"\n{'Part':<24}{'Gflops':>10}{'Share':>9}")
        for name, cost in count.parts.items():
            part = sum(cost.values())
            print(f"{name:<24}{part / 1e9:>10.4f}{part / count.total:>9.2%}")
        print(f"\n{'Op':<24}{'Gflops':>10}{'Share':>9}")
        for op, value in by_op.most_common():
            print(f"{op:<24}{value / 1e9:>10.4f}{value / count.total:>9.2%}")
    print()


@click.command(cls=Command, epilog="""\b
Examples:
  # Table 6's EDM2-XXL, without downloading it
  python count_flops.py edm2-img512-xxl
\b
  # A snapshot of ours, per block and op
  python count_flops.py training-runs/00000-toy/network-snapshot-0000032-0.100.safetensors --verbose
\b
  # A release pickle, as the release's count_flops.py takes it
  python count_flops.py https://nvlabs-fi-cdn.nvidia.com/edm2/posthoc-reconstructions/edm2-img512-s-2147483-0.130.pkl
""")
@click.argument("net", metavar="NET")
@click.option("--verbose", is_flag=True, help="Also print the flops of every block and op")
def main(net: str, verbose: bool) -> None:
    """Parameters and Gflops of one evaluation of an EDM2 network for one sample, counted as the release counts
    them (paper Table 6; elementwise operations included), and on CUDA the memory per sample.

    NET is a snapshot of ours (.safetensors), a release pickle (.pkl), a URL of either, or a preset name:
    a training preset (edm2-img512-s) or a generation preset (edm2-img512-s-autog-fid: its main and guiding
    networks), both counted without downloading any weights.
    """
    for description, network, metadata in networks_of(net):
        report(description, network, verbose, metadata)


if __name__ == "__main__":
    main()
