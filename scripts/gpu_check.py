"""Check and measure on one CUDA GPU what CI cannot, in under 9 minutes; write report.json and report.md.

    python scripts/gpu_check.py --out gpu-report

(a) fp32, fp16 and bf16 forward and backward of EDM2-S img512 against float64; (b) toy training with each
precision; (c) EDM2-S training throughput at 32 and 64 images per GPU, the release's configuration (eager fp16)
against eager bf16 channels-last, with MFU; (d) sampling throughput without and with guidance; (e) peak memory per
training step for XS..XXL at a fixed batch per GPU; (f) one process of train_edm2.py through torchrun (NCCL), then
generate.py from its snapshots, guided.

Each section runs in its own process with a time limit, so a failing, crashing or slow section is recorded and
the others still run; the report is rewritten after every section. Without CUDA: one line, exit status 2.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import click
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout: use its packages
from edm2.errors import EDM2Error, one_line
from edm2.runtime import bounded_json, files
from scripts import gpu_check_sections as sections

# name: (what it checks, the most seconds it may take, its function)
SECTIONS: dict[str, tuple[str, float, Callable]] = {
    "a_precision": ("fp32/fp16/bf16 forward and backward of EDM2-S against float64 (relative error)", 30,
                    sections.section_precision),
    "b_toy_training": ("toy training with each precision", 50, sections.section_toy_training),
    "c_training_speed": ("EDM2-S training: release (eager fp16) against eager bf16 channels-last", 100,
                         sections.section_training_speed),
    # Compiling the sampling networks (EDM2-S, then XS for guidance) took most of 90 s on an H100; the whole
    # section 115 s on an H200, and (f) 71 s before it sampled too.
    "d_sampling_speed": ("EDM2-S sampling without and with guidance", 130, sections.section_sampling_speed),
    "e_memory": ("peak GB per training step, XS..XXL", 80, sections.section_memory),
    "f_torchrun": ("train_edm2.py through torchrun, one process; generate.py from its snapshots, guided", 110,
                   sections.section_torchrun),
}
TOTAL_S = 510  # the sections' share of the 9 minutes; the rest is start-up and the report
RESERVE_S = 15  # kept back for each later section, so one slow section cannot starve the others
GRACE_S = 10  # how long a section may overrun its limit (releasing the GPU) before it is killed


def section_file(out: Path, name: str) -> Path:
    """Where a section process writes its results."""
    return out / "sections" / f"{name}.json"


def run_section(name: str, out: Path, seconds: float, config: sections.Config,
                probe_factory: Callable[[float], sections.Probe] = sections.Probe) -> int:
    """Run one section in this process; its results (and error) go to section_file as they come. Returns 0 or 1."""
    path = section_file(out, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    results: dict = {}

    def record(key: str, value: object) -> None:
        results[key] = value
        with files.atomic_path(path) as tmp:
            tmp.write_text(json.dumps({"results": results}, indent=1))

    function = SECTIONS[name][2]
    extra = dict(out=out / name) if name == "f_torchrun" else {}
    try:
        probe = probe_factory(time.monotonic() + seconds)
        record("device", probe.name)
        function(probe, config, record, **extra)
    except Exception as e:  # noqa: BLE001 (a failing section is a result: recorded, and the others still run)
        with files.atomic_path(path) as tmp:
            tmp.write_text(json.dumps({"results": results, "error": one_line(e),
                                       "traceback": traceback.format_exc()[-4000:]}, indent=1))
        return 1
    return 0


def launch_section(name: str, out: Path, seconds: float) -> dict:
    """Run a section in a child process limited to `seconds` (plus a grace period); its outcome as a report entry."""
    command = [sys.executable, str(Path(__file__).resolve()), f"--out={out}", f"--section={name}",
               f"--seconds={seconds}"]
    start = time.monotonic()
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=seconds + GRACE_S)
        status = "ok" if proc.returncode == 0 else "failed"
        tail = (proc.stderr or "").strip()[-2000:]
    except subprocess.TimeoutExpired:
        status, tail = "timeout", f"stopped after {seconds + GRACE_S:.0f} s"
    return outcome(section_file(out, name), status, time.monotonic() - start, tail)


def outcome(path: Path, status: str, seconds: float, tail: str) -> dict:
    """A report entry from a section's results file and how its process ended."""
    try:
        saved = bounded_json.read(path)
    except (OSError, bounded_json.JSONFileError):
        saved = {"results": {}}
    entry = dict(status=status, seconds=round(seconds, 1), results=saved.get("results", {}))
    if status != "ok":
        entry["error"] = saved.get("error") or tail or "no output"
    return entry


def run_all(out: Path, launch: Callable[[str, Path, float], dict] = launch_section,
            clock: Callable[[], float] = time.monotonic, total_s: float = TOTAL_S) -> dict:
    """Every section in turn within total_s, rewriting the reports after each; returns the report."""
    start = clock()
    report = dict(torch=torch.__version__, cuda=torch.version.cuda, budget_s=total_s, sections={})
    names = list(SECTIONS)
    for index, name in enumerate(names):
        left = total_s - (clock() - start) - RESERVE_S * (len(names) - index - 1)
        seconds = min(SECTIONS[name][1], left)
        if seconds < 5:
            report["sections"][name] = dict(status="skipped", seconds=0, results={}, error="out of time")
        else:
            report["sections"][name] = launch(name, out, seconds)
        report["seconds"] = round(clock() - start, 1)
        write_reports(out, report)
    return report


def write_reports(out: Path, report: dict) -> None:
    """report.json and the report.md tables, both written atomically."""
    with files.atomic_path(out / "report.json") as tmp:
        tmp.write_text(json.dumps(report, indent=1))
    with files.atomic_path(out / "report.md") as tmp:
        tmp.write_text(markdown(report))


def cell(value: object) -> str:
    """A table cell: floats to 4 significant digits, the rest as JSON."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return value if isinstance(value, str) else json.dumps(value)


def markdown(report: dict) -> str:
    """The report as Markdown: a summary table, then one table per section."""
    lines = [f"# GPU check (torch {report['torch']}, CUDA {report['cuda']}): {report.get('seconds', 0):.0f} s", "",
             "| section | checks | status | seconds |", "|---|---|---|---|"]
    for name, entry in report["sections"].items():
        status = entry["status"] + (f": {entry['error'].splitlines()[0][:200]}" if "error" in entry else "")
        lines.append(f"| {name} | {SECTIONS[name][0]} | {status} | {entry['seconds']} |")
    for name, entry in report["sections"].items():
        rows = entry["results"]
        if not rows:
            continue
        columns = sorted({k for v in rows.values() if isinstance(v, dict) for k in v})
        lines += ["", f"## {name}", "", "| | " + " | ".join(columns or ["value"]) + " |",
                  "|---" * (1 + max(len(columns), 1)) + "|"]
        for key, value in rows.items():
            values = [cell(value.get(c, "")) for c in columns] if isinstance(value, dict) else [cell(value)]
            lines.append(f"| {key} | " + " | ".join(values) + " |")
    return "\n".join(lines) + "\n"


@click.command()
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True, help="Report folder")
@click.option("--section", type=click.Choice(list(SECTIONS)), hidden=True, help="Run this section only (internal)")
@click.option("--seconds", type=float, hidden=True, help="The section's time limit (internal)")
def main(out: Path, section: str | None, seconds: float | None) -> None:
    """Check and measure this machine's CUDA GPU; see the module docstring for the sections."""
    if not torch.cuda.is_available():
        click.echo("gpu_check: no CUDA device is available here; run it on a machine with one CUDA GPU", err=True)
        sys.exit(2)
    if section is not None:
        sys.exit(run_section(section, out, seconds or SECTIONS[section][1], sections.Config()))
    try:
        files.check_writable_dir(out)
    except EDM2Error as e:
        raise click.BadParameter(one_line(e), param_hint="--out") from None
    report = run_all(out)
    click.echo((out / "report.md").read_text())
    sys.exit(0 if all(entry["status"] == "ok" for entry in report["sections"].values()) else 1)


if __name__ == "__main__":
    main()
