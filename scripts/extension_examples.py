"""Apply docs/extending.md's examples to a scratch clone of this repository and run each from the command line.

For each example (a solver, a loss weighting, a network family, a data encoding, a second VAE) it prints the files
the example touches and the lines it adds, then runs the example's command lines with the example's own options in
the clone, on a toy dataset, and says whether each ended well. The solver and loss blocks are edits this script makes
to the files the page names; the family, the encoding and the VAE are rows this repository already has, so their
lines are counted where they stand. Minutes on a CPU; the clone is deleted afterwards unless --keep.

    python scripts/extension_examples.py
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

REPO = Path(__file__).resolve().parent.parent
TRAIN = ["--preset=toy-tiny", "--duration=64", "--snapshot=64", "--checkpoint=64", "--status=32"]
SNAPSHOT = "<the run's newest snapshot>"  # resolved when the command runs, after the training that writes it


def section(page: str, title: str) -> str:
    """The text of one '### title' subsection of a docs page, up to the next heading."""
    start = page.index(f"### {title}\n")
    following = re.search(r"\n#{2,3} ", page[start + 4:])
    return page[start:start + 4 + following.start()] if following else page[start:]


def blocks(text: str) -> tuple[str, str, str]:
    """The file a subsection says it touches ('Touches one file, `PATH`'), and its two Python blocks: the function
    and the table row."""
    path = re.search(r"Touches one file, `([^`]+)`", " ".join(text.split())).group(1)
    function, row = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    return path, function, row


def with_example(source: str, function: str, row: str, table: str) -> str:
    """A module's source with an example applied as the page says: the function before the table, the row first in
    it."""
    start = source.index(f"\n{table}: dict")
    opening = source.index("{\n", start) + 2
    return source[:start] + "\n\n" + function + "\n" + source[start:opening] + row + source[opening:]


def apply_blocks(clone: Path, text: str, table: str) -> tuple[str, int]:
    """Apply a subsection's example to the one file it names in the clone. Returns the file and the lines added."""
    path, function, row = blocks(text)
    (clone / path).write_text(with_example((clone / path).read_text(), function, row, table))
    return path, len((function + row).splitlines())


def lines_of(clone: Path, path: str, pattern: str | None = None) -> int:
    """Non-blank lines of a file of the clone, or of its lines from the one matching pattern to the next top-level
    definition."""
    lines = (clone / path).read_text().splitlines()
    if pattern is not None:
        start = next(i for i, line in enumerate(lines) if re.match(pattern, line))
        end = next((i for i in range(start + 1, len(lines)) if re.match(r"(class |def |[A-Z_]+ = |@)", lines[i])),
                   len(lines))
        lines = lines[start:end]
    return sum(1 for line in lines if line.strip())


def resolved(argument: str) -> str:
    """An argument with SNAPSHOT replaced by the newest network snapshot of the run directory before it."""
    if SNAPSHOT not in argument:
        return argument
    prefix, rest = argument.split(SNAPSHOT, 1)
    folder = Path(prefix.split("=", 1)[-1])
    found = sorted(folder.glob("network-snapshot-*.safetensors"))
    return argument.replace(SNAPSHOT, found[-1].name if found else "none")


def run(clone: Path, *args: str) -> tuple[bool, str]:
    """Run a command line of the clone with one thread; (ended well, its last line of output)."""
    args = tuple(map(resolved, args))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    result = subprocess.run([sys.executable, *args], cwd=clone, env=env, capture_output=True, text=True)
    output = (result.stdout + result.stderr).strip().splitlines()
    return result.returncode == 0, output[-1] if output else ""


def tiny_vae(path: Path, latent_channels: int) -> Path:
    """A randomly initialized diffusers AutoencoderKL with two levels, saved as a local directory."""
    import torch
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    AutoencoderKL(in_channels=3, out_channels=3, latent_channels=latent_channels, block_out_channels=(8, 16),
                  down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                  layers_per_block=1, norm_num_groups=8, sample_size=16).save_pretrained(path)
    return path


def examples(clone: Path, page: str, data: Path, work: Path) -> list[tuple[str, list[str], list[list[str]]]]:
    """(name, files touched with their lines, command lines) of each example, its edits made in the clone."""
    snapshot = SNAPSHOT
    solver_file, solver_lines = apply_blocks(clone, section(page, "A solver"), "SOLVERS")
    loss_file, loss_lines = apply_blocks(clone, section(page, "A loss weighting"), "WEIGHTINGS")
    vae = tiny_vae(work / "vae16", 16)
    settings = '{"latent_channels": 16, "raw_mean": 0.0609, "raw_std": 0.6534}'
    return [
        ("a solver (midpoint)", [f"{solver_file}: +{solver_lines}"], [
            ["train_edm2.py", *TRAIN, f"--data={data}", f"--outdir={work / 'base'}"],
            ["generate.py", f"--net={work / 'base' / snapshot}", "--solver=midpoint", "--steps=4", "--seeds=0-3",
             f"--outdir={work / 'midpoint'}"]]),
        ("a loss weighting (min-snr, uncertainty off)", [f"{loss_file}: +{loss_lines}"], [
            ["train_edm2.py", *TRAIN, f"--data={data}", f"--outdir={work / 'min-snr'}", "--loss-weighting=min-snr",
             "--uncertainty=off"]]),
        ("a network family (mp-resnet, its own --depth)", [
            f"edm2/architectures/mp_resnet.py: {lines_of(clone, 'edm2/architectures/mp_resnet.py')}",
            "edm2/architectures/__init__.py: 1"], [
            ["train_edm2.py", *TRAIN, f"--data={data}", f"--outdir={work / 'mp-resnet'}", "--arch=mp-resnet",
             "--depth=2"],
            ["generate.py", f"--net={work / 'mp-resnet' / snapshot}", "--steps=4", "--seeds=0-3",
             f"--outdir={work / 'mp-resnet-out'}"],
            ["count_flops.py", str(work / "mp-resnet" / snapshot)]]),
        ("a data encoding (linear-rgb, its gamma)", [
            f"edm2/encoders.py: {lines_of(clone, 'edm2/encoders.py', r'class LinearRGBEncoder')} + 1 in ENCODINGS"], [
            ["dataset_tool.py", "convert", f"--source={data}", f"--dest={work / 'linear.zip'}", "--encoding=linear-rgb",
             '--encoding-settings={"gamma": 2.2}'],
            ["train_edm2.py", *TRAIN, f"--data={work / 'linear.zip'}", f"--outdir={work / 'linear'}"]]),
        ("a second VAE (diffusers-vae, 16 channels)", ["none: command lines only"], [
            ["dataset_tool.py", "encode", f"--source={data}", f"--dest={work / 'vae16.zip'}", "--encoding=diffusers-vae",
             f"--vae={vae}", f"--encoding-settings={settings}"],
            ["dataset_tool.py", "encode", f"--source={data}", f"--dest={work / 'vae16.shards'}",
             "--encoding=diffusers-vae", f"--vae={vae}", f"--encoding-settings={settings}"],
            ["train_edm2.py", *TRAIN, f"--data={work / 'vae16.shards'}", f"--outdir={work / 'vae16'}"],
            ["generate.py", f"--net={work / 'vae16' / snapshot}", "--steps=4", "--seeds=0-3",
             f"--outdir={work / 'vae16-out'}"]]),
    ]


@click.command()
@click.option("--keep", is_flag=True, help="Keep the scratch clone and its outputs, and say where")
def main(keep: bool) -> None:
    """Apply and run docs/extending.md's five examples in a scratch clone of this repository."""
    work = Path(tempfile.mkdtemp(prefix="edm2-examples-"))
    clone = work / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    data = work / "toy16.zip"
    ok, last = run(clone, "dataset_tool.py", "toy", f"--dest={data}", "--resolution=16", "--num=64", "--classes=4")
    if not ok:
        raise click.ClickException(f"the toy dataset: {last}")
    page = (clone / "docs" / "extending.md").read_text()
    failed = 0
    for name, touched, commands in examples(clone, page, data, work):
        click.echo(f"{name}\n  touches {'; '.join(touched)}")
        for command in commands:
            start = time.perf_counter()
            ok, last = run(clone, *command)
            failed += not ok
            shown = " ".join(c.replace(str(work), "$WORK") for c in command)
            click.echo(f"  {'ok ' if ok else 'FAILED'} {time.perf_counter() - start:5.1f} s  {shown}"
                       + ("" if ok else f"\n         {last}"))
    if keep:
        click.echo(f"kept in {work}")
    else:
        shutil.rmtree(work)
    if failed:
        raise click.ClickException(f"{failed} command(s) failed")


if __name__ == "__main__":
    main()
