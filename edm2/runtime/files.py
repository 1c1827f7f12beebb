"""Atomic, durable file writes, clean-up after killed writers, and cached downloads."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import secrets
import socket
import stat
import tempfile
import urllib.parse
from pathlib import Path
from typing import BinaryIO, Iterator

from edm2.errors import EDM2Error

TMP_SUFFIX = ".tmp"
_TOKEN_BYTES = 4  # RANDOM below: 8 hex digits
# .NAME.PID@HOST.RANDOM.tmp: the writer's process and host tell a stale temporary from a live one. The one
# definition of our temporaries' names: temporary_name makes them, and the clean-up removes nothing else.
_TMP_NAME = re.compile(r"\.(?P<name>.+)\.(?P<pid>[0-9]+)@(?P<host>[^/@]+)\.[0-9a-f]{%d}%s"
                       % (2 * _TOKEN_BYTES, re.escape(TMP_SUFFIX)))


class DownloadError(EDM2Error):
    """A URL could not be fetched; the message names the URL and the cache path."""


class OutputError(EDM2Error):
    """An output path cannot be written (under a file, read-only, no permission); the message names it."""


def temporary_prefix(name: str) -> str:
    """Prefix of a temporary beside the file `name`: '.NAME.PID@HOST.'; temporary_name completes it."""
    return f".{name}.{os.getpid()}@{socket.gethostname()}."


def temporary_name(name: str, prefix: str | None = None) -> str:
    """A new temporary name for the file `name` (.NAME.PID@HOST.RANDOM.tmp); prefix replaces '.NAME.PID@HOST.'."""
    return f"{prefix or temporary_prefix(name)}{secrets.token_hex(_TOKEN_BYTES)}{TMP_SUFFIX}"


def new_temporary(path: str | os.PathLike, folder: bool = False, named: str | None = None) -> Path:
    """Create (exclusively, private to the user) an empty temporary file, or folder, beside `path`; return it.
    Its name is made from `named` when given, else from path's name."""
    path = Path(path)
    while True:
        tmp = path.parent / temporary_name(named or path.name)
        try:
            if folder:
                tmp.mkdir(mode=0o700)
            else:
                os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            return tmp
        except FileExistsError:  # 2**32 names per process: a clash is rare, and the next name is another
            continue


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file's or a folder's contents (a folder's: its entries) to the storage device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, named: str | None = None) -> Iterator[Path]:
    """Yield a temporary path beside `path`; only if the block succeeds, make it durable and rename it onto `path`.

    The temporary's name is made from `named` when given (a reader that picks files by a part of path's name, as
    TensorBoard does, must not see it), else from path's name.
    The file is fsynced before the rename and the folder after it, so a finished file survives a power loss.
    An OSError that names no file, or the temporary, is re-raised naming `path`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = new_temporary(path, named=named)
    try:
        yield tmp
        # new_temporary makes the file private; the finished file gets the modes open() would have given it.
        tmp.chmod(0o666 & ~current_umask())
        fsync_path(tmp)
        os.replace(tmp, path)
        fsync_path(path.parent)
    except OSError as e:
        # A full disk fails on a write or the close with no file name: the error names the output instead.
        if e.filename is None or e.filename == str(tmp):
            e.filename = str(path)
        raise
    finally:
        if tmp.exists():
            tmp.unlink()


def _writer_is_gone(match: re.Match) -> bool:
    """True when the temporary's writer ran on this host and no process with its id exists any more."""
    if match["host"] != socket.gethostname():
        return False
    try:
        os.kill(int(match["pid"]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # a process of another user holds that id
        return False
    return False


def stale_temporaries(directory: str | os.PathLike, name: str | None = None, owned: bool = False,
                      recursive: bool = False, folders: bool = False) -> list[Path]:
    """Temporaries that killed writers left in `directory`: regular files, or with `folders` folders, named
    exactly as temporary_name names them (of `name` when given).

    A temporary counts as stale when its writer process is gone; with `owned` (the caller holds the folder,
    e.g. under a run lock) every temporary counts.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for path in sorted(directory.rglob(f"*{TMP_SUFFIX}") if recursive else directory.glob(f"*{TMP_SUFFIX}")):
        match = _TMP_NAME.fullmatch(path.name)
        if match is None or name is not None and match["name"] != name:
            continue
        if _file_type(path) == (stat.S_IFDIR if folders else stat.S_IFREG) and (owned or _writer_is_gone(match)):
            found.append(path)
    return found


def remove_stale_temporaries(directory: str | os.PathLike, name: str | None = None, owned: bool = False,
                             recursive: bool = False) -> list[Path]:
    """Delete the stale_temporaries files in `directory` (never a folder, nor any other name: those are a
    user's); return what was deleted."""
    removed = stale_temporaries(directory, name, owned, recursive)
    for path in removed:
        path.unlink(missing_ok=True)
    return removed


def _file_type(path: Path) -> int | None:
    """The type bits of `path` itself (a link is a link), None when it is gone."""
    try:
        return stat.S_IFMT(path.lstat().st_mode)
    except OSError:
        return None


_NOT_REGULAR = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
                stat.S_IFSOCK: "a socket"}


def file_kind(path: str | os.PathLike) -> str:
    """What `path` (a link: what it points to) is, in words: 'a FIFO', 'a regular file', 'a directory', ..."""
    try:
        kind = stat.S_IFMT(os.stat(path).st_mode)
    except OSError as e:
        return "a broken link" if os.path.islink(path) else f"unreadable ({e.strerror})"
    return {stat.S_IFREG: "a regular file", stat.S_IFDIR: "a directory"}.get(kind) or _NOT_REGULAR.get(kind,
                                                                                                     "a special file")


def open_input(path: str | os.PathLike) -> BinaryIO:
    """Open an input file for reading in binary mode; OSError naming it when it is not a regular file.

    The check is made on the very file the caller then reads (opened without waiting, then fstat): a FIFO would
    wait for a writer forever, and a device never ends. A folder is an IsADirectoryError, as open() gives.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        kind = stat.S_IFMT(os.fstat(fd).st_mode)
        if kind == stat.S_IFDIR:
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        if kind != stat.S_IFREG:
            what = _NOT_REGULAR.get(kind, "a special file")
            raise OSError(errno.EINVAL, f"{what}, not a regular file", str(path))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def check_writable_dir(path: str | os.PathLike) -> None:
    """Raise OutputError unless the folder `path` exists or can be created, and files can be written in it.

    Cheap, and meant to run before any expensive work: it finds the deepest existing ancestor and creates
    (and at once deletes) an anonymous file there, which fails on read-only filesystems, also for root.
    """
    path = Path(path)
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = "is a file" if existing == path else f"lies under {existing}, which is a file"
        raise OutputError(f"{path} {what}, not a folder")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise OutputError(f"{path}: cannot write in {existing} ({e.strerror or e})") from None


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


def download_cache_path(url: str) -> Path:
    """Where cached_path keeps the download of `url`: a name unique to the URL under the cache's downloads/."""
    name = os.path.basename(urllib.parse.urlparse(url).path) or "download"
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    return cache_dir() / "downloads" / f"{digest}-{name}"


def download(url: str, dest: str | os.PathLike, timeout_s: float = 60) -> Path:
    """Fetch `url` into the file `dest` (atomically: a failed download leaves nothing); return dest."""
    import requests  # here, not at the top: 0.3 s of every command's start that only a download needs

    dest = Path(dest)
    try:
        with requests.get(url, stream=True, timeout=timeout_s) as response:
            response.raise_for_status()
            with atomic_path(dest) as tmp, open(tmp, "wb") as f:
                for chunk in response.iter_content(chunk_size=1 << 20):
                    f.write(chunk)
    except (requests.RequestException, OSError) as e:
        raise DownloadError(f"cannot download {url} into {dest}: {e.__class__.__name__}: {e}") from None
    return dest


def cached_path(path_or_url: str | os.PathLike, timeout_s: float = 60) -> Path:
    """Local path of a file or URL; a URL is downloaded once into the cache and reused."""
    if not is_url(path_or_url):
        return Path(path_or_url)
    url = str(path_or_url)
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme == "file":
        return Path(urllib.parse.unquote(parsed.path))
    dest = download_cache_path(url)
    return dest if dest.is_file() else download(url, dest, timeout_s)
