"""Converting webdataset tar shards into a dataset of PNGs (a folder or ZIP), as convert does a folder of images."""

from __future__ import annotations

from tqdm import tqdm

from edm2.data.dataset import image_fname
from edm2.data.dataset_writer import DatasetWriter, png_bytes
from edm2.data.tar_source import TarSource

# Images read from the tars at a time: TarSource.pixels holds them in memory together.
BLOCK = 256


def convert_tar_images(source: TarSource, writer: DatasetWriter, max_images: int | None = None) -> tuple[int, int]:
    """Write the first max_images samples of source (transformed and with its alpha handling) as image i ->
    image_fname(i) with its class and caption; return the count and how many had transparent pixels."""
    count = min(len(source), max_images or len(source))
    with tqdm(total=count, desc="convert", unit="img") as progress:
        for first in range(0, count, BLOCK):
            block = source.pixels(first, min(BLOCK, count - first))
            for i, image in enumerate(block, start=first):
                label = None if source.labels is None else int(source.labels[i])
                caption = None if source.captions is None else source.captions[i]
                writer.add(image_fname(i), png_bytes(image.transpose(1, 2, 0)), label, caption)
            progress.update(len(block))
    return count, sum(1 for i in source.transparent if i < count)
