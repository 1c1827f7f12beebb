"""click command classes that turn every library error into one line, a non-zero exit and no traceback."""

from __future__ import annotations

import click

from edm2.errors import EDM2Error, one_line, shown


class _OneLineErrors:
    """Mixin for click commands: EDM2Error and OSError (a full disk, a read-only folder) become click errors, and
    no error's message can hold a second line (a name with a newline in it is shown escaped: edm2.errors.shown)."""

    def invoke(self, ctx: click.Context):
        """Run the command, reporting library and file-system errors as `Error: <one line>`."""
        try:
            return super().invoke(ctx)
        except (EDM2Error, OSError) as e:
            raise click.ClickException(shown(one_line(e))) from None
        except click.ClickException as e:
            e.message = shown(e.message)
            raise


class Command(_OneLineErrors, click.Command):
    """A click command whose library errors read as one line."""


class Group(_OneLineErrors, click.Group):
    """A click group whose subcommands' library errors read as one line."""

    command_class = Command
