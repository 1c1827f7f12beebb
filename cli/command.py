"""click command classes that turn every library error into one line, a non-zero exit and no traceback."""

from __future__ import annotations

import os
import re

import click
import torch

from edm2.errors import EDM2Error, one_line, shown
from edm2.runtime import distributed

# What a command can make smaller when memory runs out, in the order a user would try them: its images per
# batch first, then the network's size (train_edm2.py --channels, toy_example.py train --dim and --layers).
MEMORY_OPTIONS = ("--batch-gpu", "--batch", "--channels", "--dim", "--layers")
# The CPU allocator's words (c10's DefaultCPUAllocator), CUDA's and other backends', and C++'s operator new's
# (std::bad_alloc, which PyTorch passes on as a RuntimeError: a random generator's state under an address-space
# limit, say) for a failed allocation.
_OUT_OF_MEMORY = re.compile(r"DefaultCPUAllocator|out of memory|not enough memory|can't allocate memory|bad_alloc",
                            re.I)


# In each rank cli.local_launch starts: the launcher's process id. That launcher reports the rank that failed, so a
# rank that only lost its group (the failed one ended) says nothing and ends with LOST_PEER_STATUS; so does, under
# any launcher, a rank other than 0 that raises rank 0's error, which rank 0 prints (distributed.on_main_rank).
LAUNCHER_ENV = "EDM2_LAUNCHER_PID"
LOST_PEER_STATUS = 75

# Gloo's words when another process of the group ended (PyTorch raises them as a RuntimeError or a DistError).
_LOST_PEER = re.compile(r"gloo.*Connection (reset|closed) by peer", re.I | re.S)


def lost_peer(error: BaseException) -> bool:
    """Whether error says that another process of the run's group ended: its own error, printed by it, says why."""
    return isinstance(error, torch.distributed.DistError) or (
        isinstance(error, RuntimeError) and bool(_LOST_PEER.search(str(error))))


def out_of_memory(error: BaseException) -> bool:
    """Whether error is a failed allocation: torch.OutOfMemoryError (CUDA), MemoryError, or the RuntimeError of
    torch's CPU allocator or of C++'s std::bad_alloc."""
    return isinstance(error, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(error, RuntimeError) and bool(_OUT_OF_MEMORY.search(str(error))))


def memory_hint(command: click.Command) -> str:
    """What to change when command runs out of memory: its options of MEMORY_OPTIONS."""
    names = {name for param in command.params for name in getattr(param, "opts", ())}
    options = [option for option in MEMORY_OPTIONS if option in names]
    if not options:
        return "free memory on this device, or use one with more"
    listed = ", ".join(options[:-1]) + (" or " if len(options) > 1 else "") + options[-1]
    return f"give a smaller {listed}"


# ctx.meta key of the arguments a command was given, as given: a command that starts its own ranks passes them on.
ARGS = "edm2.args"


class _OneLineErrors:
    """Mixin for click commands: EDM2Error and OSError (a full disk, a read-only folder) become click errors, and
    running out of memory one line saying which options make the work smaller; no error's message can hold a second
    line (a name with a newline in it is shown escaped: edm2.errors.shown)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        """Parse as click does, keeping the arguments as given in ctx.meta[ARGS]."""
        ctx.meta[ARGS] = list(args)
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context):
        """Run the command, reporting library and file-system errors as `Error: <one line>`."""
        try:
            return super().invoke(ctx)
        except (EDM2Error, OSError) as e:
            if distributed.raised_by_main_rank(e):
                raise click.exceptions.Exit(LOST_PEER_STATUS) from None
            raise click.ClickException(shown(one_line(e))) from None
        except click.ClickException as e:
            e.message = shown(e.message)
            raise
        except (RuntimeError, MemoryError) as e:
            if lost_peer(e):
                if LAUNCHER_ENV in os.environ:
                    raise click.exceptions.Exit(LOST_PEER_STATUS) from None
                raise click.ClickException(shown(f"another process of this run ended ({one_line(e)}); its own "
                                                 "error, or the signal that ended it, says why")) from None
            if not out_of_memory(e):
                raise
            detail = one_line(e) if str(e).strip() else type(e).__name__
            raise click.ClickException(shown(f"out of memory ({detail}); {memory_hint(ctx.command)}")) from None


class Command(_OneLineErrors, click.Command):
    """A click command whose library errors read as one line."""


class Group(_OneLineErrors, click.Group):
    """A click group whose subcommands' library errors read as one line."""

    command_class = Command
