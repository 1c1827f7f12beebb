"""Webdataset tar shards as a source of images (img2dataset's layout: KEY.jpg/png/webp plus KEY.cls or KEY.json
per sample), read through the `webdataset` package (the optional extra edm2[webdataset]).

The source is a .tar file, a folder of .tar files (sorted by name), or a brace pattern (data/{00000..00099}.tar).
A first pass lists the samples of each tar and their classes; samples are then read by global position.
"""

from __future__ import annotations

import io
import itertools
import json
import os
from pathlib import Path
from typing import Callable

import numpy as np

from edm2.data.convert import BACKGROUNDS, read_image
from edm2.data.dataset_json import is_class
from edm2.data.dataset_files import IMAGE_ERRORS, DatasetError, open_image

IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")
TAR_INSTALL = "pip install webdataset (or the extra: pip install 'edm2[webdataset]')"


class TarSourceError(DatasetError):
    """Tar shards that cannot be used: the package missing, a sample without its image or class, mixed sizes."""


def _tariterators():
    try:
        from webdataset import tariterators
    except ImportError:
        raise TarSourceError(f"reading webdataset tar shards needs the webdataset package: {TAR_INSTALL}") from None
    return tariterators


def is_tar_source(spec: str | os.PathLike) -> bool:
    """True for a .tar file, a brace pattern of them, or a folder holding .tar files and no dataset."""
    spec = str(spec)
    if spec.endswith(".tar"):
        return True
    folder = Path(spec)
    return folder.is_dir() and any(folder.glob("*.tar")) and not any(
        (folder / name).exists() for name in ("dataset.json", "index.json"))


def tar_paths(spec: str | os.PathLike) -> list[str]:
    """The tar files of a source, in order."""
    spec = str(spec)
    if Path(spec).is_dir():
        paths = sorted(str(p) for p in Path(spec).glob("*.tar"))
    else:
        from braceexpand import braceexpand  # webdataset's dependency
        paths = list(braceexpand(spec)) if "{" in spec else [spec]
    missing = [p for p in paths if not Path(p).is_file()]
    if missing or not paths:
        raise TarSourceError(f"{spec}: no tar file {missing[0] if missing else 'found'}")
    return paths


def _samples(path: str):
    return _tariterators().tarfile_samples([{"url": path}])


def _class(sample: dict, path: str, label_map: dict[str, int] | None = None) -> int | None:
    """The sample's class from KEY.cls (a decimal integer) or KEY.json ({"label": n} or {"class": n}); with a
    label_map ({name: class}), the class that maps the name they give."""
    label = None
    if "cls" in sample:
        text = sample["cls"].decode("ascii", "replace").strip()
        label = int(text) if text.isdigit() else text
    elif "json" in sample:
        try:
            meta = json.loads(sample["json"])
        except ValueError as e:
            raise TarSourceError(f"{path}: sample {sample['__key__']} has unreadable JSON ({e})") from None
        label = meta.get("label", meta.get("class")) if isinstance(meta, dict) else None
    if label is not None and label_map is not None:
        if str(label) not in label_map:
            raise TarSourceError(f"{path}: sample {sample['__key__']} has class {str(label)!r}, which the label map "
                                 "does not name")
        label = label_map[str(label)]
    if label is not None and not is_class(label):
        raise TarSourceError(f"{path}: sample {sample['__key__']} has class {label!r}, not a non-negative integer")
    return label


class TarSource:
    """The samples of tar shards: count, classes (None when unlabeled), and images by position; alpha and background
    are read_image's (transparency dropped, kept or composited), and transparent holds the positions read whose
    image had transparent pixels."""

    def __init__(self, spec: str | os.PathLike, transform: Callable[[np.ndarray], np.ndarray], alpha: str = "drop",
                 background: tuple[int, int, int] = BACKGROUNDS["white"], label_map: dict[str, int] | None = None):
        self.spec, self.paths, self.transform = str(spec), tar_paths(spec), transform
        self.alpha, self.background, self.transparent = alpha, background, set()
        self.classes = label_map  # the class names, where a label map gave them
        self.counts, labels = [], []
        for path in self.paths:
            count = 0
            for sample in _samples(path):
                if not any(key in sample for key in IMAGE_KEYS):
                    raise TarSourceError(f"{path}: sample {sample['__key__']} has no image "
                                         f"({', '.join(IMAGE_KEYS)})")
                labels.append(_class(sample, path, label_map))
                if (labels[-1] is None) != (labels[0] is None):
                    raise TarSourceError(f"{path}: sample {sample['__key__']} has "
                                         f"{'no' if labels[-1] is None else 'a'} class (cls or json 'label'), "
                                         f"the first sample {'has' if labels[-1] is None else 'none'}")
                count += 1
            self.counts.append(count)
        if not labels:
            raise TarSourceError(f"{self.spec}: the tar files hold no samples")
        self.labels = None if labels[0] is None else np.array(labels, dtype=np.int64)
        self.label_dim = 0 if self.labels is None else int(self.labels.max()) + 1
        self.starts = np.cumsum([0] + self.counts)
        self.image_shape = list(self.pixels(0, 1).shape[1:])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def pixels(self, first: int, n: int) -> np.ndarray:
        """Samples [first, first + n) as uint8 NCHW, transformed; every one of the first's shape."""
        out = []
        k = int(np.searchsorted(self.starts, first, side="right")) - 1
        while len(out) < n:
            skip = first + len(out) - int(self.starts[k])
            for sample in itertools.islice(_samples(self.paths[k]), skip, skip + n - len(out)):
                image, transparent = self._image(sample, self.paths[k])
                if transparent:
                    self.transparent.add(first + len(out))
                out.append(image)
            k += 1
        shapes = {image.shape for image in out}
        if len(shapes) > 1 or (hasattr(self, "image_shape") and list(out[0].shape) != self.image_shape):
            raise TarSourceError(f"{self.spec}: images of shapes {sorted(shapes)} among samples {first} to "
                                 f"{first + n - 1}; mixed sizes (use --resolution and --transform)")
        return np.stack(out)

    def _image(self, sample: dict, path: str) -> tuple[np.ndarray, bool]:
        data = next(sample[key] for key in IMAGE_KEYS if key in sample)
        try:
            with open_image(io.BytesIO(data)):  # refuses a header of too many pixels before decoding
                pass
            image, transparent = read_image(data, alpha=self.alpha, background=self.background)
            image = self.transform(image)
        except IMAGE_ERRORS as e:
            raise TarSourceError(f"{path}: cannot read the image of sample {sample['__key__']} ({e})") from None
        return image.transpose(2, 0, 1), transparent
