"""Small helpers shared by test modules."""

import socket
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now, for torchrun's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
