"""One error root and one way to read an error as a line."""

import errno

import pytest
import torch.utils.data

from edm2.errors import EDM2Error, one_line


class PlantedError(EDM2Error):
    pass


class FailingDataset(torch.utils.data.Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, idx):
        raise PlantedError("data.zip: cannot read 00000/img00000001.png (broken chunk)")


def test_an_error_a_dataloader_worker_wrapped_reads_as_its_own_message():
    with pytest.raises(PlantedError) as info:
        next(iter(torch.utils.data.DataLoader(FailingDataset(), num_workers=1)))
    assert "Traceback" in str(info.value)  # what the worker hands back
    assert one_line(info.value) == "data.zip: cannot read 00000/img00000001.png (broken chunk)"


@pytest.mark.parametrize("error, line", [
    (PlantedError("first\nsecond"), "first"),
    (PlantedError(""), "PlantedError"),
    (PlantedError("   \n "), "PlantedError"),
    (OSError(errno.ENOSPC, "No space left on device", "/runs/x/state.pt"), "/runs/x/state.pt: No space left on device"),
    (OSError(errno.EROFS, "Read-only file system"), "Read-only file system"),
    (KeyError("k"), "'k'"),
])
def test_one_line(error, line):
    assert one_line(error) == line
