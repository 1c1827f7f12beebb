"""What the run dashboard costs a training: the demo's run with and without it, and the time spent in it.

Each training runs in its own process, with and without the dashboard in turn; the time inside the dashboard
(its setup and every snapshot's update, matplotlib's import included) is measured directly as well, since on
a shared machine two whole runs differ by more than the dashboard costs. Example:

    python scripts/bench_dashboard.py --data=demo-out/toy.zip --repeats=2
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

REPO = Path(__file__).resolve().parent.parent


def child(mode: str, train_args: list[str]) -> None:
    """Train in this process, the dashboard off or timed, and print the seconds spent in it."""
    sys.path.insert(0, str(REPO))
    import train_edm2
    from training.run import loop
    from training.run import dashboard

    spent = [0.0]
    if mode == "off":
        loop._dashboard = lambda *args: None
    else:
        for name in ("__init__", "update"):
            def timed(self, *args, _inner=getattr(dashboard.Dashboard, name), **kwargs):
                # Seconds spent inside the dashboard during one training, summed: not a callable on its own.
                start = time.perf_counter()
                try:
                    return _inner(self, *args, **kwargs)
                finally:
                    spent[0] += time.perf_counter() - start
            setattr(dashboard.Dashboard, name, timed)
    try:
        train_edm2.main(train_args, standalone_mode=False)
    finally:
        print(json.dumps({"dashboard_s": spent[0]}), flush=True)


@click.command()
@click.option("--data", required=True, help="Dataset (the demo's demo-out/toy.zip)")
@click.option("--preset", default="toy-small", show_default=True, help="Training preset")
@click.option("--duration", default=None, help="Training duration (images)  [default: the preset's]")
@click.option("--repeats", type=click.IntRange(min=1), default=2, show_default=True, help="Runs per setting")
@click.option("--child", "child_mode", type=click.Choice(["on", "off"]), hidden=True)
@click.option("--outdir", hidden=True)
def main(data: str, preset: str, duration: str | None, repeats: int, child_mode: str | None, outdir: str | None):
    """Report the training time with and without the dashboard, and the dashboard's own time."""
    train_args = [f"--preset={preset}", f"--data={data}", "--workers=0", *([f"--duration={duration}"] if duration else [])]
    if child_mode:
        child(child_mode, [*train_args, f"--outdir={outdir}"])
        return
    sys.path.insert(0, str(REPO))
    from edm2.runtime import bounded_json

    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(repeats):
            for mode in ("off", "on"):
                run = Path(tmp) / f"{mode}{repeat}"
                out = subprocess.run([sys.executable, __file__, f"--data={data}", f"--preset={preset}",
                                      *([f"--duration={duration}"] if duration else []), f"--child={mode}",
                                      f"--outdir={run}"], capture_output=True, text=True, check=True).stdout
                stats = run / "stats.jsonl"
                rows = [bounded_json.parse(line, str(stats)) for line in stats.read_text().splitlines()]
                spent = bounded_json.parse(out.strip().splitlines()[-1], "the training process's output")["dashboard_s"]
                print(f"dashboard {mode:3s}  training {rows[-1]['elapsed_s']:7.1f} s  in the dashboard {spent:5.2f} s "
                      f"({100 * spent / rows[-1]['elapsed_s']:.2f}%)", flush=True)


if __name__ == "__main__":
    main()
