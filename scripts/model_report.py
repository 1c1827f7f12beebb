"""Print the paper's Table 6 columns (parameters, gigaflops = MACs per evaluation) for each size."""

import click
import torch

from edm2.networks import Precond, count_macs, count_parameters

SIZES = {"xs": 128, "s": 192, "m": 256, "l": 320, "xl": 384, "xxl": 448}


@click.command()
@click.option("--dataset", type=click.Choice(["img512", "img64"]), default="img512", show_default=True)
def main(dataset: str) -> None:
    """Report Mparams and GMACs of every EDM2 size, built on the meta device (no memory used).

    Example: python scripts/model_report.py --dataset=img512
    """
    channels, label_dim = (4, 1000) if dataset == "img512" else (3, 1000)
    print(f"{'size':<5} {'channels':>8} {'Mparams':>9} {'GMACs':>8}")
    for size, mc in SIZES.items():
        with torch.device("meta"):
            net = Precond(64, channels, label_dim, model_channels=mc)
        print(f"{size:<5} {mc:>8} {count_parameters(net) / 1e6:>9.1f} {count_macs(net) / 1e9:>8.1f}")


if __name__ == "__main__":
    main()
