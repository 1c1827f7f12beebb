"""Atomic writes and the download cache."""

import errno
import glob
import os
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from edm2.runtime import files
from tests.helpers import REPO, dead_pid


def test_atomic_path_renames_only_on_success(tmp_path):
    dest = tmp_path / "sub" / "out.bin"
    with files.atomic_path(dest) as tmp:
        tmp.write_bytes(b"ok")
        assert not dest.exists()
    assert dest.read_bytes() == b"ok"
    with pytest.raises(ValueError):
        with files.atomic_path(dest) as tmp:
            tmp.write_bytes(b"half")
            raise ValueError("interrupted")
    assert dest.read_bytes() == b"ok"
    assert [p.name for p in dest.parent.iterdir()] == ["out.bin"]


@pytest.mark.parametrize("name", ["none", "the temporary", "another file"])
def test_a_failed_write_names_the_output_not_the_temporary(tmp_path, name):
    # A full disk fails on a write or the close with no file name; an error on the temporary would name a file
    # the user never asked for. A file named otherwise (say, an input) stays named.
    dest = tmp_path / "out.bin"
    with pytest.raises(OSError) as info:
        with files.atomic_path(dest) as tmp:
            filename = {"none": None, "the temporary": str(tmp), "another file": str(tmp_path / "in.bin")}[name]
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)
    assert info.value.filename == (str(tmp_path / "in.bin") if name == "another file" else str(dest))
    assert list(tmp_path.iterdir()) == []


def test_cached_path_local_and_file_url(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("x")
    assert files.cached_path(f) == f
    assert files.cached_path(f.as_uri()) == f
    assert not files.is_url(str(f))


def test_unreachable_url_names_url_and_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EDM2_CACHE_DIR", str(tmp_path / "cache"))
    url = "http://127.0.0.1:9/missing.pkl"
    with pytest.raises(files.DownloadError) as info:
        files.cached_path(url, timeout_s=5)
    message = str(info.value)
    assert url in message and str(tmp_path / "cache") in message
    assert not list(Path(tmp_path / "cache").rglob("*missing.pkl"))


def test_atomic_path_gives_the_usual_file_mode(tmp_path):
    # mkstemp creates 0600 files; a finished file must be readable like one written with open().
    old = os.umask(0o022)
    try:
        with files.atomic_path(tmp_path / "out.bin") as tmp:
            tmp.write_bytes(b"ok")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "out.bin").stat().st_mode) == 0o644


def test_atomic_path_fsyncs_the_file_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(b))), real_replace(a, b)))
    with files.atomic_path(tmp_path / "out.bin") as tmp:
        tmp.write_bytes(b"ok")
    assert events == [("fsync", str(tmp)), ("replace", str(tmp_path / "out.bin")), ("fsync", str(tmp_path))]


def test_a_killed_writer_leaves_a_temporary_that_a_rerun_removes(tmp_path):
    # A child process dies inside atomic_path, as a SIGKILL would leave it.
    script = ("import os, sys; from edm2.runtime import files\n"
              "with files.atomic_path(sys.argv[1]) as tmp:\n"
              "    tmp.write_bytes(b'half'); os._exit(9)\n")
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "state.pt")], cwd=REPO)
    assert result.returncode == 9
    [stale] = tmp_path.glob(".state.pt.*.tmp")
    live = tmp_path / files.temporary_name('other.pt')  # this process: alive
    live.write_bytes(b"busy")
    foreign = tmp_path / files.temporary_name("x.pt", ".x.pt.1@some-other-host.")  # cannot tell whether its writer lives
    foreign.write_bytes(b"?")
    assert files.remove_stale_temporaries(tmp_path) == [stale]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, foreign.name])
    assert files.remove_stale_temporaries(tmp_path, name="other.pt") == []
    assert sorted(files.remove_stale_temporaries(tmp_path, owned=True)) == sorted([live, foreign])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name, lookalike", [("d[1].zip", "d1.zip"), ("a*b?.zip", "axbc.zip"), ("[!x].zip", "y.zip")])
def test_stale_temporaries_of_a_name_with_glob_characters_are_removed(tmp_path, name, lookalike):
    # As a glob, 'd[1].zip' matches 'd1.zip' and never the name itself.
    gone = f"{dead_pid()}@{socket.gethostname()}"
    for dest in (name, lookalike):
        (tmp_path / files.temporary_name(dest, f".{dest}.{gone}.")).write_bytes(b"half")
    [stale] = tmp_path.glob(f".{glob.escape(name)}.*")
    [other] = tmp_path.glob(f".{glob.escape(lookalike)}.*")
    assert files.remove_stale_temporaries(tmp_path, name=name) == [stale]
    assert list(tmp_path.iterdir()) == [other]


def test_check_writable_dir(tmp_path):
    files.check_writable_dir(tmp_path / "new" / "deeper")  # creatable: fine, and nothing is created
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "file").write_text("x")
    with pytest.raises(files.OutputError, match="file, not a folder"):
        files.check_writable_dir(tmp_path / "file")
    with pytest.raises(files.OutputError, match="lies under .*file, which is a file"):
        files.check_writable_dir(tmp_path / "file" / "out")


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare to mount a read-only folder")
def test_check_writable_dir_refuses_a_read_only_filesystem_also_for_root(tmp_path):
    (tmp_path / "ro").mkdir()
    script = ("from edm2.runtime import files\n"
              f"try:\n    files.check_writable_dir({str(tmp_path / 'ro' / 'out')!r})\n"
              "except files.OutputError as e:\n    print(e)\n")
    result = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o ro tmpfs {tmp_path / 'ro'} && "
                             f"{sys.executable} -c \"$0\"", script], cwd=REPO, capture_output=True, text=True)
    if "mount" in result.stderr:
        pytest.skip(f"cannot mount here: {result.stderr.strip()}")
    assert "Read-only file system" in result.stdout, result.stdout + result.stderr
