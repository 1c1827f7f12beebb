"""The command lines' shared plumbing: one-line errors, option types, one process where only one can work."""

import errno
import math

import click
import pytest
import torch
from click.testing import CliRunner

from cli.command import Command, Group
from cli.types import Number
from edm2.errors import EDM2Error
from edm2.runtime import distributed
from tests.helpers import assert_one_error_line


@click.command(cls=Command)
@click.option("--fail", type=click.Choice(["library", "disk", "bug", "peer", "dist"]))
def command(fail):
    if fail == "library":
        raise EDM2Error("net.safetensors: not an EDM2 snapshot\n(details)")
    if fail == "disk":
        raise OSError(errno.ENOSPC, "No space left on device", "out/000001.png")
    if fail == "bug":
        raise ZeroDivisionError("a bug stays a traceback")
    if fail == "peer":  # as DistributedDataParallel's backward raised it when the other rank was killed (PyTorch 2.13)
        raise RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                           "[127.0.0.1]:5336: Connection reset by peer. This is typically caused by a remote worker "
                           "hanging or bugs in the application.")
    if fail == "dist":
        raise torch.distributed.DistBackendError("NCCL communicator was aborted\non rank 1")


@click.group(cls=Group)
def group():
    pass


@group.command()
def sub():
    raise EDM2Error("from a subcommand")


@pytest.mark.parametrize("fail, line", [("library", "Error: net.safetensors: not an EDM2 snapshot"),
                                        ("disk", "Error: out/000001.png: No space left on device")])
def test_library_and_filesystem_errors_become_one_line(fail, line):
    assert assert_one_error_line(CliRunner().invoke(command, ["--fail", fail])) == line


def test_subcommands_of_a_group_get_one_line_too():
    assert assert_one_error_line(CliRunner().invoke(group, ["sub"])) == "Error: from a subcommand"


@pytest.mark.parametrize("fail", ["peer", "dist"])
def test_a_process_that_lost_its_group_says_so_in_one_line(fail):
    # The rank whose peer ended (killed, or failed with its own error line) adds one line, not a traceback.
    line = assert_one_error_line(CliRunner().invoke(command, ["--fail", fail]))
    assert line.startswith("Error: another process of this run ended (") and "its own error" in line


def test_other_exceptions_are_not_swallowed():
    assert isinstance(CliRunner().invoke(command, ["--fail", "bug"]).exception, ZeroDivisionError)


@pytest.mark.parametrize("value", ["nan", "NaN", "-nan", "inf", "-inf", "1e999"])
def test_number_refuses_non_finite_values(value):
    with pytest.raises(click.BadParameter, match="not a finite number"):
        Number().convert(value, None, None)


def test_number_keeps_ranges_and_may_allow_infinity():
    assert Number(min=0, min_open=True).convert("0.5", None, None) == 0.5
    with pytest.raises(click.BadParameter):
        Number(min=0, min_open=True).convert("0", None, None)
    assert Number(min=0, allow_inf=True).convert("inf", None, None) == math.inf
    with pytest.raises(click.BadParameter, match="not a finite number"):
        Number(allow_inf=True).convert("nan", None, None)


def test_single_process_session_refuses_torchrun(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(distributed.DistributedError, match="start it with python, not torchrun"):
        with distributed.session(single_process=True):
            pass
    monkeypatch.setenv("WORLD_SIZE", "1")
    with distributed.session(single_process=True):
        assert distributed.get_world_size() == 1
