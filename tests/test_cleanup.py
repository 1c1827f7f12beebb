"""The clean-up of killed writers' temporaries, in every folder a command cleans: it removes a leftover named exactly
as our writers name their temporaries, and never a user's file or folder that only looks like one."""

import os
import socket
from pathlib import Path

import torch
from click.testing import CliRunner

import dataset_tool
import generate
import plot_run
import reconstruct_phema
import toy_example
import train_edm2
from edm2.encoders import StandardRGBEncoder
from edm2.formats import snapshot
from edm2.runtime import files
from tests.helpers import TRAIN_ARGS, dead_pid, fake_training_run, tiny_precond, write_image_dataset


def seed(folder: Path, name: str = "out.png") -> tuple[Path, dict[Path, bytes | None]]:
    """A genuine leftover of a killed writer of `name` in folder, and look-alikes: {path: file bytes, or None for a
    folder (holding a file of the user's)}."""
    folder.mkdir(parents=True, exist_ok=True)
    gone = f"{dead_pid()}@{socket.gethostname()}"
    genuine = folder / files.temporary_name(name, f".{name}.{gone}.")
    genuine.write_bytes(b"half written")
    lookalikes = {
        folder / f".notes-{name}.tmp": None,  # a user's folder
        folder / f".keep-{name}.tmp": b"a user's file",
        folder / files.temporary_name(name, f".{name}.{gone}."): None,  # our exact pattern, but a folder
        folder / f".{name}.{gone}.abc.tmp": b"not our random part",
        folder / f".{name}.{gone}.0123abcd.tmp.bak": b"not our suffix",
        folder / f"{name}.{gone}.0123abcd.tmp": b"no leading dot",
    }
    for path, data in lookalikes.items():
        if data is None:
            path.mkdir()
            (path / "thesis.txt").write_text("years of work")
        else:
            path.write_bytes(data)
    link = folder / files.temporary_name(name, f".{name}.{gone}.")  # our exact pattern, but a link to a user's file
    (folder.parent / f"{folder.name}-target.txt").write_text("linked")
    link.symlink_to(folder.parent / f"{folder.name}-target.txt")
    lookalikes[link] = b"linked"
    return genuine, lookalikes


def assert_cleaned(genuine: Path, lookalikes: dict[Path, bytes | None], output: str = "") -> None:
    """The genuine leftover is gone; every look-alike is there, unchanged."""
    assert not os.path.lexists(genuine), output
    for path, data in lookalikes.items():
        if data is None:
            assert path.is_dir() and (path / "thesis.txt").read_text() == "years of work", (path, output)
        else:
            assert path.read_bytes() == data, (path, output)


def invoke(main, *args):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def test_files_cleanup_removes_only_our_regular_temporaries(tmp_path):
    for owned in (False, True):
        genuine, lookalikes = seed(tmp_path / f"owned{owned}", "state.pt")
        assert files.remove_stale_temporaries(genuine.parent, owned=owned) == [genuine]
        assert_cleaned(genuine, lookalikes)
    genuine, lookalikes = seed(tmp_path / "deep" / "sub", "x.png")
    assert files.remove_stale_temporaries(tmp_path / "deep", recursive=True) == [genuine]
    assert_cleaned(genuine, lookalikes)


def test_training_cleans_its_run_dir_samples_and_plots_and_plot_run_its_plots(train_data, tmp_path):
    run = tmp_path / "run"
    seeded = [seed(run, "stats.jsonl"), seed(run / "samples", "grid-0000001.png"), seed(run / "plots", "training.json")]
    output = invoke(train_edm2.main, *TRAIN_ARGS, "--duration=256", "--snapshot=256", "--checkpoint=256", "--workers=0", f"--data={train_data}",
                    f"--outdir={run}")
    for genuine, lookalikes in seeded:
        assert_cleaned(genuine, lookalikes, output)
        assert f"Removed {genuine.name}" in output or genuine.parent != run
    genuine, lookalikes = seed(run / "plots", "training.png")
    invoke(plot_run.main, run)
    assert_cleaned(genuine, lookalikes)


def test_generate_and_reconstruct_phema_clean_their_outdirs(tmp_path):
    net = tmp_path / "net.safetensors"
    torch.manual_seed(0)
    snapshot.save_network(net, tiny_precond(8, 3, 0).eval(), {"encoder": StandardRGBEncoder().config()})
    out = tmp_path / "gen"
    seeded = [seed(out, "grid.png"), seed(out / "000000", "000000.png")]
    invoke(generate.main, "--net", net, "--seeds=0-1", "--subdirs", "--steps=2", "--outdir", out)
    for genuine, lookalikes in seeded:
        assert_cleaned(genuine, lookalikes)

    run, out = fake_training_run(tmp_path / "run", num_snapshots=2), tmp_path / "phema"
    genuine, lookalikes = seed(out, "phema-0000002-0.100.safetensors")
    invoke(reconstruct_phema.main, f"--indir={run}", f"--outdir={out}", "--std=0.1")
    assert_cleaned(genuine, lookalikes)


def test_dataset_tool_and_toy_example_clean_their_destinations(tmp_path):
    source = write_image_dataset(tmp_path / "source", num=4)
    genuine, lookalikes = seed(tmp_path / "dest", "converted.zip")
    invoke(dataset_tool.main, "convert", "--source", source, "--dest", tmp_path / "dest" / "converted.zip")
    assert_cleaned(genuine, lookalikes)

    genuine, lookalikes = seed(tmp_path / "toy", "iter0001.safetensors")
    invoke(toy_example.main, "train", "--outdir", tmp_path / "toy", "--dim", 8, "--layers", 2, "--iters", 1,
           "--viz", "false")
    assert_cleaned(genuine, lookalikes)
