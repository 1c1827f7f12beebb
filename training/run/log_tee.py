"""log.txt: everything a run prints goes to the terminal and, appended, to the run's log file.

The terminal may go away while a run trains: the reader of a pipe dies (`... | tee log` and Ctrl-C, which
signals tee too), a terminal closes (EIO), a `nohup` redirect breaks. Python ignores SIGPIPE, so such writes
raise OSError; a run must still checkpoint and stop as documented. From the first failed write on, the
console is dropped quietly (its file descriptor now leads to /dev/null, so no later write or flush, by us, by
a library or by the interpreter at exit, fails on it) and the log keeps every line.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import BinaryIO, Callable, Iterator, TextIO


class Tee:
    """A text stream that writes to a console stream while it works and, unbuffered, to a log file (a killed
    run keeps its last lines; a failed write to the log, e.g. on a full disk, raises OSError naming it).
    Without a log it only guards the console."""

    def __init__(self, stream: TextIO, log: BinaryIO | None):
        self.stream, self.log = stream, log

    def write(self, text: str) -> int:
        """Write text to the console (while it works) and the log."""
        self._to_console(lambda stream: (stream.write(text), stream.flush()))
        data = memoryview(text.encode(errors="replace")) if self.log is not None else b""
        try:
            while data:
                data = data[self.log.write(data):]
        except OSError as e:
            raise OSError(e.errno, e.strerror, self.log.name) from None
        return len(text)

    def flush(self) -> None:
        """Flush the console stream (the log has no buffer)."""
        self._to_console(lambda stream: stream.flush())

    def _to_console(self, action: Callable[[TextIO], object]) -> None:
        if self.stream is None:
            return
        try:
            action(self.stream)
        except (OSError, ValueError):  # EPIPE, EIO, or a stream someone closed
            silence(self.stream)
            self.stream = None


def silence(stream: TextIO) -> None:
    """Point the file descriptor behind a dead console stream at /dev/null, and drop what its buffer holds by
    flushing it there; a stream without a descriptor is left alone."""
    with contextlib.suppress(OSError, ValueError):
        fd = stream.fileno()
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, fd)
        finally:
            os.close(null)
        stream.flush()


@contextlib.contextmanager
def tee_output(path: str | os.PathLike | None) -> Iterator[None]:
    """Copy stdout and stderr to the file path (appended; None: no log) while the block runs; a console that
    fails meanwhile is dropped rather than raising."""
    with open(path, "ab", buffering=0) if path is not None else contextlib.nullcontext() as log, \
            contextlib.redirect_stdout(Tee(sys.stdout, log)), contextlib.redirect_stderr(Tee(sys.stderr, log)):
        yield
