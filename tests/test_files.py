"""Atomic writes and the download cache."""

import os
import stat
from pathlib import Path

import pytest

from edm2 import files


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
