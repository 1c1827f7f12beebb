"""log.txt: everything a run prints goes to the terminal and, appended, to the run's log file."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import BinaryIO, Iterator, TextIO


class Tee:
    """A text stream that writes to a terminal stream and, unbuffered, to a log file (a killed run keeps
    its last lines; a failed write, e.g. on a full disk, raises OSError naming the log)."""

    def __init__(self, stream: TextIO, log: BinaryIO):
        self.stream, self.log = stream, log

    def write(self, text: str) -> int:
        """Write text to both."""
        self.stream.write(text)
        self.stream.flush()
        data = memoryview(text.encode(errors="replace"))
        try:
            while data:
                data = data[self.log.write(data):]
        except OSError as e:
            raise OSError(e.errno, e.strerror, self.log.name) from None
        return len(text)

    def flush(self) -> None:
        """Flush the terminal stream (the log has no buffer)."""
        self.stream.flush()


@contextlib.contextmanager
def tee_output(path: str | os.PathLike) -> Iterator[None]:
    """Copy stdout and stderr to the file path (appended) while the block runs."""
    with open(path, "ab", buffering=0) as log, contextlib.redirect_stdout(Tee(sys.stdout, log)), \
            contextlib.redirect_stderr(Tee(sys.stderr, log)):
        yield
