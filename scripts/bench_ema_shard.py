"""What train_edm2.py --ema-shard saves: the memory of the float32 EMA tracks on each rank, whole and sharded.

Two tables. Computed: per preset, the parameters (counted on the meta device, nothing allocated) x 4 bytes x the
preset's EMA tracks, against one rank's share of them sharded over --ranks processes. Measured: two Gloo processes
on the CPU each build --preset's network and sum the storage bytes its EMA tracker holds, whole
(edm2.phema.PowerFunctionEMA) and sharded (edm2.runtime.sharded_ema), after one update; rank 0 also checks that the
gathered tracks equal the whole ones bit for bit. Example:

    python scripts/bench_ema_shard.py --preset=toy-small
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from edm2.networks import count_parameters  # noqa: E402
from edm2.phema import PowerFunctionEMA  # noqa: E402
from edm2.runtime import distributed  # noqa: E402
from edm2.runtime.sharded_ema import ShardedPowerFunctionEMA  # noqa: E402
from training.run.disk import PRESET_DATA, size_text  # noqa: E402
from training.options import TrainingOptions  # noqa: E402
from training.presets import get_preset  # noqa: E402
from training.state import init_network  # noqa: E402

PRESETS = ("edm2-img512-xs", "edm2-img512-s", "edm2-img512-m", "edm2-img512-l", "edm2-img512-xl", "edm2-img512-xxl",
           "edm2-img64-s", "edm2-img64-m", "edm2-img64-l", "edm2-img64-xl")
MEASURED_RANKS = 2


def preset_network(preset: str) -> tuple[torch.nn.Module, int]:
    """The network of a preset trained on its default data (built on the current default device) and its number
    of EMA tracks."""
    resolution, stored, img_channels, labels = PRESET_DATA[get_preset(preset).data]
    opts = TrainingOptions.from_preset(preset, dict(resolution=resolution, num_channels=stored, label_dim=labels), {})
    return init_network(opts, img_channels), len(opts.ema_stds)


def computed_table(ranks: int) -> dict:
    """Print each preset's EMA tracks' bytes whole and per rank sharded over ranks processes; return them by preset."""
    print(f"Computed: float32 EMA tracks per rank, whole and sharded over {ranks} ranks")
    print(f"| preset | parameters | tracks | whole, per rank | sharded 1/{ranks}, per rank | saved per rank |")
    print("|---|---|---|---|---|---|")
    rows = {}
    for preset in PRESETS:
        with torch.device("meta"):
            net, tracks = preset_network(preset)
        params = count_parameters(net)
        whole, sharded = params * 4 * tracks, -(-params // ranks) * 4 * tracks
        print(f"| {preset} | {params:,} | {tracks} | {size_text(whole)} | {size_text(sharded)} | "
              f"{size_text(whole - sharded)} |")
        rows[preset] = dict(parameters=params, whole_bytes=whole, sharded_bytes=sharded)
    return dict(ranks=ranks, presets=rows)


def held_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind tensors."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def measure_rank(rank: int, port: int, preset: str, computed: dict) -> None:
    """One Gloo process: build the trackers, update both once, gather, and (rank 0) print the table and, last, the
    JSON line of both tables."""
    distributed.describe_local_launch(rank, MEASURED_RANKS, port)
    torch.set_num_threads(1)
    with distributed.session():
        torch.manual_seed(0)
        net, tracks = preset_network(preset)
        stds = get_preset(preset).ema_stds
        whole, sharded = PowerFunctionEMA(net, stds), ShardedPowerFunctionEMA(net, stds)
        with torch.no_grad():
            for p in net.parameters():
                p.add_(1.0)
        for tracker in (whole, sharded):
            tracker.update(cur_nimg=2 * get_preset(preset).batch, batch_size=get_preset(preset).batch)
        rows = distributed.all_gather_object(
            (held_bytes([t for ema in whole.emas for t in ema.state_dict().values()]), held_bytes(sharded.shards)))
        gathered = sharded.get()
        same = all(torch.equal(a, b) for (mine, _), theirs in zip(gathered, whole.emas)
                   for a, b in zip(mine.state_dict().values(), theirs.state_dict().values()))
        if rank == 0:
            print(f"\nMeasured: {preset}, {count_parameters(net):,} parameters, {tracks} tracks, "
                  f"{MEASURED_RANKS} Gloo processes on the CPU (storage bytes the EMA tracker holds)")
            print("| rank | whole (PowerFunctionEMA) | sharded (--ema-shard) | saved |")
            print("|---|---|---|---|")
            for r, (w, s) in enumerate(rows):
                print(f"| {r} | {size_text(w)} ({w:,} B) | {size_text(s)} ({s:,} B) | {size_text(w - s)} |")
            print(f"Gathered tracks on rank 0 equal the whole tracks bit for bit: {same}")
            measured = dict(preset=preset, bitwise_equal=same,
                            ranks=[dict(whole_bytes=w, sharded_bytes=s) for w, s in rows])
            print(json.dumps(dict(computed=computed, measured=measured)))


@click.command()
@click.option("--ranks", type=click.IntRange(min=1), default=8, show_default=True,
              help="Processes the computed table shards over")
@click.option("--preset", default="toy-small", show_default=True, help="Preset of the measured table (fits a CPU)")
def main(ranks: int, preset: str) -> None:
    """Print the computed and the measured table."""
    computed = computed_table(ranks)
    torch.multiprocessing.spawn(measure_rank, args=(distributed.free_port(), preset, computed), nprocs=MEASURED_RANKS)


if __name__ == "__main__":
    main()
