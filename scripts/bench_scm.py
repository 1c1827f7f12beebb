"""One consistency-distillation (sCD) training step against one diffusion training step of its teacher (--method=edm2),
the same network, batch and synthetic data through the loop's own step: the median over repetitions of each, and
their ratio (sCM's paper: about 2x, a jvp and a teacher evaluation on top of the forward and backward pass); the last
line printed is JSON."""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

import click
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout: use its packages
from edm2.eval import benchmark
from edm2.formats.snapshot import save_network
from edm2.runtime import distributed
from training.run.benchmark import synthetic_step, with_unit_gains
from training.step import WARMUP_STEPS, training_step


@click.command(epilog="""\b
Examples:
  python scripts/bench_scm.py --preset=toy-small
  python scripts/bench_scm.py --preset=toy-tiny --batch-gpu=16 --reps=3
""")
@click.option("--preset", type=click.Choice(["toy-tiny", "toy-small"]), default="toy-small", show_default=True,
              help="The teacher's recipe; the student's is scd-PRESET, the same network")
@click.option("--batch-gpu", type=click.IntRange(min=1), default=32, show_default=True, help="Images per step")
@click.option("--steps", type=click.IntRange(min=1), default=3, show_default=True, help="Timed steps per repetition")
@click.option("--reps", type=click.IntRange(min=1), default=5, show_default=True, help="Repetitions (median taken)")
@click.option("--warmup", type=click.IntRange(min=0), default=WARMUP_STEPS, show_default=True,
              help="Untimed steps first")
def main(preset: str, batch_gpu: int, steps: int, reps: int, warmup: int) -> None:
    """Time an sCD step against its teacher's diffusion step on one device."""
    device = distributed.device()
    teacher_step = synthetic_step(preset, batch_gpu, device, compile=False)
    with tempfile.TemporaryDirectory() as folder:
        teacher = str(Path(folder) / "teacher.safetensors")
        save_network(teacher, with_unit_gains(teacher_step.state.net).eval(),
                     {"encoder": teacher_step.encoder.config()})
        student_step = synthetic_step(f"scd-{preset}", batch_gpu, device, compile=False, teacher=teacher, init=teacher)
    teacher_step.state.net.train()
    seconds = {}
    for name, step in (("edm2", teacher_step), ("scd", student_step)):
        for _ in range(warmup):
            training_step(step)
        seconds[name] = statistics.median(benchmark.seconds_per_call(lambda: training_step(step), steps, 0, device)
                                          for _ in range(reps))
    ratio = seconds["scd"] / seconds["edm2"]
    click.echo(f"{preset} network, {batch_gpu} images per step on {device} ({torch.get_num_threads()} CPU thread(s)): "
               f"edm2 {seconds['edm2'] * 1000:.1f} ms/step, scd {seconds['scd'] * 1000:.1f} ms/step, "
               f"ratio {ratio:.2f} (medians of {reps} x {steps} steps)")
    click.echo(json.dumps(dict(preset=preset, batch=batch_gpu, device=str(device), edm2_ms=seconds["edm2"] * 1000,
                               scd_ms=seconds["scd"] * 1000, ratio=ratio, reps=reps, steps=steps)))


if __name__ == "__main__":
    main()
