"""The root of every error the library raises on purpose, and how any error reads as one line."""

from __future__ import annotations


class EDM2Error(Exception):
    """Base class of the library's errors: bad input or a file it cannot use; the message says which and why."""


def one_line(error: BaseException) -> str:
    """The error's message as a single line, also when a DataLoader worker wrapped it with a traceback."""
    if isinstance(error, OSError) and error.strerror:
        # str() of an OSError starts with '[Errno N]'; the file and the reason are what a user needs.
        where = error.filename if error.filename is not None else ""
        return f"{where}: {error.strerror}" if where else error.strerror
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    # A worker's re-raised error carries 'Original Traceback', whose last line is 'module.Class: message'.
    wrapped = len(lines) > 1 and lines[1].startswith("Original Traceback")
    line = lines[-1] if wrapped else lines[0]
    qualified = f"{type(error).__module__}.{type(error).__name__}: "
    for prefix in (qualified, f"{type(error).__name__}: "):
        line = line.removeprefix(prefix)
    return line


def shown(name: object) -> str:
    """A user-supplied name (a file, a folder, a class) as output may show it: every character that is not
    printable (a newline, a carriage return, an escape sequence) written as its Python escape, so that a name can
    neither forge a line of output nor hide one; printable text, non-ASCII letters and emoji included, is kept."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(name))


class SnapshotError(EDM2Error):
    """A network file is missing, unreadable, not one of ours, or (ReleasePickleError) an unsafe pickle.

    It lives here, not in edm2.formats.snapshot, so that edm2.formats.release_pickle can derive its error from it while
    edm2.formats.snapshot imports edm2.formats.release_pickle to load the release's files: no import cycle.
    """
