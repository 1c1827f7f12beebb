"""The dataset writer: atomic, durable ZIP or folder output that reads back, with temporaries a rerun can clean."""

import errno
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from edm2.data.dataset import ImageFolderDataset, image_fname
from edm2.data.dataset_writer import dataset_writer, png_bytes
from edm2.runtime import files
from tests.helpers import REPO


@pytest.mark.parametrize("dest_name", ["out.zip", "out"])
def test_writer_output_reads_back_and_zip_is_stored(tmp_path, dest_name):
    dest = tmp_path / dest_name
    images = [np.full((4, 4, 3), 10 * i, np.uint8) for i in range(3)]
    with dataset_writer(dest) as writer:
        for i, image in enumerate(images):
            writer.add(image_fname(i), png_bytes(image), label=i % 2)
    ds = ImageFolderDataset(dest)
    assert [ds[i][1].argmax() for i in range(3)] == [0, 1, 0]
    assert all(np.array_equal(ds[i][0], images[i].transpose(2, 0, 1)) for i in range(3))
    if dest_name.endswith(".zip"):
        with zipfile.ZipFile(dest) as archive:
            assert {info.compress_type for info in archive.infolist()} == {zipfile.ZIP_STORED}
    assert [p.name for p in tmp_path.iterdir()] == [dest_name]
    umask = os.umask(0)
    os.umask(umask)
    assert dest.stat().st_mode & 0o777 == (0o666 if dest_name.endswith(".zip") else 0o777) & ~umask


@pytest.mark.parametrize("dest_name", ["out.zip", "out"])
def test_writer_leaves_nothing_on_failure_and_null_labels_unless_all(tmp_path, dest_name):
    with pytest.raises(RuntimeError):
        with dataset_writer(tmp_path / dest_name) as writer:
            writer.add(image_fname(0), png_bytes(np.zeros((4, 4, 3), np.uint8)))
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []
    with dataset_writer(tmp_path / dest_name) as writer:
        writer.add(image_fname(0), png_bytes(np.zeros((4, 4, 3), np.uint8)), label=3)
        writer.add(image_fname(1), png_bytes(np.zeros((4, 4, 3), np.uint8)), label=None)
    assert not ImageFolderDataset(tmp_path / dest_name).has_labels


def test_a_killed_writers_temporary_folder_is_named_and_never_removed(tmp_path):
    # A ZIP is written through files.atomic_path (tests/test_files.py); a folder has its own temporary, and the
    # clean-up removes no folder: a user's folder may carry the same kind of name.
    dest_name = "out"
    script = ("import os, sys, numpy as np\n"
              "from edm2.data.dataset_writer import dataset_writer, png_bytes\n"
              "with dataset_writer(sys.argv[1]) as writer:\n"
              "    writer.add('00000/img00000000.png', png_bytes(np.zeros((4, 4, 3), np.uint8)))\n"
              "    os._exit(9)\n")
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / dest_name)], cwd=REPO)
    assert result.returncode == 9
    [stale] = tmp_path.iterdir()
    assert stale.is_dir() and stale.name.startswith(f".{dest_name}.") and stale.name.endswith(files.TMP_SUFFIX)
    with dataset_writer(tmp_path / dest_name) as writer:  # a live writer's temporary is never taken for stale
        assert files.stale_temporaries(tmp_path, name=dest_name, folders=True) == [stale]
        assert files.remove_stale_temporaries(tmp_path, name=dest_name) == []
        writer.add(image_fname(0), png_bytes(np.zeros((4, 4, 3), np.uint8)), label=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([stale.name, dest_name])
    assert len(ImageFolderDataset(tmp_path / dest_name)) == 1


@pytest.mark.parametrize("dest_name", ["out.zip", "out"])
def test_a_failed_write_names_the_output_and_leaves_nothing(tmp_path, monkeypatch, dest_name):
    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(zipfile.ZipFile, "writestr", full_disk)
    monkeypatch.setattr(Path, "write_bytes", full_disk)
    with pytest.raises(files.OutputError) as info:
        with dataset_writer(tmp_path / dest_name) as writer:
            writer.add(image_fname(0), png_bytes(np.zeros((4, 4, 3), np.uint8)))
    assert str(info.value) == f"{tmp_path / dest_name}: cannot write ({os.strerror(errno.ENOSPC)})"
    assert list(tmp_path.iterdir()) == []


def test_errors_of_the_callers_own_work_pass_through_unchanged(tmp_path):
    # Reading a source file is not writing the dataset: its error must not be blamed on the output.
    with pytest.raises(FileNotFoundError):
        with dataset_writer(tmp_path / "out.zip"):
            (tmp_path / "missing.png").read_bytes()
    assert list(tmp_path.iterdir()) == []
