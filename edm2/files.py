"""Atomic file writes and cached downloads, so no reader ever sees a half-written file."""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import urllib.parse
from pathlib import Path
from typing import Iterator

import requests


class DownloadError(RuntimeError):
    """A URL could not be fetched; the message names the URL and the cache path."""


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it onto `path` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        # mkstemp makes the file private; the finished file gets the modes open() would have given it.
        tmp.chmod(0o666 & ~current_umask())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def current_umask() -> int:
    """The process's file-creation mask (reading it means setting it, so it is set back at once)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def cache_dir() -> Path:
    """Directory of cached downloads: $EDM2_CACHE_DIR, else ~/.cache/edm2."""
    return Path(os.environ.get("EDM2_CACHE_DIR", Path.home() / ".cache" / "edm2"))


def is_url(path_or_url: str | os.PathLike) -> bool:
    """True for https://, http:// and file:// addresses."""
    return str(path_or_url).split("://", 1)[0] in ("http", "https", "file") and "://" in str(path_or_url)


def cached_path(path_or_url: str | os.PathLike, timeout_s: float = 60) -> Path:
    """Local path of a file or URL; a URL is downloaded once into the cache and reused."""
    if not is_url(path_or_url):
        return Path(path_or_url)
    url = str(path_or_url)
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme == "file":
        return Path(urllib.parse.unquote(parsed.path))
    name = os.path.basename(parsed.path) or "download"
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    dest = cache_dir() / "downloads" / f"{digest}-{name}"
    if dest.is_file():
        return dest
    try:
        with requests.get(url, stream=True, timeout=timeout_s) as response:
            response.raise_for_status()
            with atomic_path(dest) as tmp, open(tmp, "wb") as f:
                for chunk in response.iter_content(chunk_size=1 << 20):
                    f.write(chunk)
    except (requests.RequestException, OSError) as e:
        raise DownloadError(f"cannot download {url} into {dest}: {e.__class__.__name__}: {e}") from None
    return dest
