"""Running out of memory is one line naming what to make smaller, in every command (issue 26, item 2): the
translation lives in cli.command, which every command line's click class shares."""

import click
import pytest
import torch
from click.testing import CliRunner

import generate
import toy_example
import train_edm2
import training.run.loop
from cli.command import Command, memory_hint, out_of_memory
from edm2.encoders import StandardRGBEncoder
from edm2.formats import snapshot
from tests.helpers import TRAIN_ARGS, assert_refused, tiny_precond


def impossible_allocation(*args, **kwargs):
    """A genuine allocation failure without exhausting the machine: 2**62 bytes, which no allocator can give."""
    return torch.empty(2**62, dtype=torch.uint8)


def test_the_cpu_allocators_error_is_recognized_and_others_are_not():
    with pytest.raises(RuntimeError) as info:
        impossible_allocation()
    assert "DefaultCPUAllocator" in str(info.value) and out_of_memory(info.value)
    assert out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert out_of_memory(MemoryError())
    assert out_of_memory(RuntimeError("std::bad_alloc"))  # C++'s operator new, as PyTorch passes it on
    assert not out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not out_of_memory(ValueError("out of memory"))  # only the allocators' error types


def test_the_hint_names_the_commands_own_options():
    hints = {name: memory_hint(command) for name, command in [
        ("train", train_edm2.main), ("generate", generate.main), ("toy train", toy_example.main.commands["train"]),
        ("toy plot", toy_example.main.commands["plot"])]}
    assert hints == {"train": "give a smaller --batch-gpu, --batch or --channels", "generate": "give a smaller --batch",
                     "toy train": "give a smaller --dim or --layers",
                     "toy plot": "free memory on this device, or use one with more"}
    assert memory_hint(click.Command("bare")) == "free memory on this device, or use one with more"


def test_an_error_that_is_not_about_memory_stays_a_traceback():
    @click.command(cls=Command)
    def broken():
        raise RuntimeError("a bug, not a lack of memory")

    result = CliRunner().invoke(broken, [])
    assert isinstance(result.exception, RuntimeError)


@pytest.mark.bad_input
def test_training_out_of_memory_is_one_line(train_data, tmp_path, monkeypatch):
    # Before: a DefaultCPUAllocator traceback.
    monkeypatch.setattr(training.run.loop, "training_step", impossible_allocation)
    assert_refused(tmp_path, lambda: CliRunner().invoke(train_edm2.main, [
        *TRAIN_ARGS, f"--data={train_data}", f"--outdir={tmp_path / 'run'}", "--workers=0"]),
        "out of memory", "DefaultCPUAllocator", "give a smaller --batch-gpu, --batch or --channels")


@pytest.mark.bad_input
def test_generate_out_of_memory_is_one_line(tmp_path, monkeypatch):
    net = tmp_path / "net.safetensors"
    snapshot.save_network(net, tiny_precond(label_dim=0), {"encoder": StandardRGBEncoder().config()})
    monkeypatch.setattr(generate, "generate_images", impossible_allocation)
    assert_refused(tmp_path, lambda: CliRunner().invoke(generate.main, [
        f"--net={net}", "--seeds=0-3", "--steps=2", f"--outdir={tmp_path / 'out'}"]),
        "out of memory", "DefaultCPUAllocator", "give a smaller --batch")


@pytest.mark.bad_input
def test_toy_training_out_of_memory_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(toy_example, "train_toy", impossible_allocation)
    assert_refused(tmp_path, lambda: CliRunner().invoke(toy_example.main, [
        "train", f"--outdir={tmp_path / 'toy'}", "--iters=1", "--viz=False"]),
        "out of memory", "DefaultCPUAllocator", "give a smaller --dim or --layers")


def bad_alloc(*args, **kwargs):
    """What PyTorch raises where C++'s operator new fails (generate.py --batch=1048576 under a 4 GiB address-space
    limit, in the generators' noise): a RuntimeError of std::bad_alloc's words."""
    raise RuntimeError("std::bad_alloc")


@pytest.mark.bad_input
@pytest.mark.parametrize("command", ["train", "generate", "toy"])
def test_a_bad_alloc_is_one_line_naming_the_size_options_in_every_command(command, train_data, tmp_path, monkeypatch):
    # Before: a RuntimeError traceback, the allocator's words being C++'s, not PyTorch's.
    net = tmp_path / "net.safetensors"
    snapshot.save_network(net, tiny_precond(label_dim=0), {"encoder": StandardRGBEncoder().config()})
    main, target, args, hint = {
        "train": (train_edm2.main, (training.run.loop, "training_step"),
                  [*TRAIN_ARGS, f"--data={train_data}", f"--outdir={tmp_path / 'run'}", "--workers=0"],
                  "give a smaller --batch-gpu, --batch or --channels"),
        "generate": (generate.main, (generate, "generate_images"),
                     [f"--net={net}", "--seeds=0-3", "--steps=2", f"--outdir={tmp_path / 'out'}"],
                     "give a smaller --batch"),
        "toy": (toy_example.main, (toy_example, "train_toy"),
                ["train", f"--outdir={tmp_path / 'toy'}", "--iters=1", "--viz=False"],
                "give a smaller --dim or --layers"),
    }[command]
    monkeypatch.setattr(*target, bad_alloc)
    assert_refused(tmp_path, lambda: CliRunner().invoke(main, args), "out of memory (std::bad_alloc)", hint)
