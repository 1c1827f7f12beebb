"""Crop/resize transforms: ADM's ImageNet preprocessing against an independent computation, and the factory
that turns a mode and an output size into an image function."""

import numpy as np
import pytest

from edm2.data import transforms
from edm2.data.transforms import TransformError, make_transform
from edm2.errors import EDM2Error

# center-crop-dhariwal equals an independent computation of ADM's procedure, which
# resamples like PIL: separable (horizontal, then vertical), support scaled by the reduction
# factor, weights normalized, rounded to uint8 after each pass.

def box_filter(x):
    return ((x > -0.5) & (x <= 0.5)).astype(np.float64)


def bicubic_filter(x, a=-0.5):
    x = np.abs(x)
    return np.where(x < 1, ((a + 2) * x - (a + 3)) * x * x + 1,
                    np.where(x < 2, (((x - 5) * x + 8) * x - 4) * a, 0.0))


def resample_axis(image, out_size, kernel, support, axis):
    image = np.moveaxis(image.astype(np.float64), axis, 0)
    scale = image.shape[0] / out_size
    stretch = max(scale, 1.0)
    out = np.empty((out_size,) + image.shape[1:])
    for i in range(out_size):
        center = (i + 0.5) * scale
        lo = max(int(center - support * stretch + 0.5), 0)
        hi = min(int(center + support * stretch + 0.5), image.shape[0])
        weights = kernel((np.arange(lo, hi) - center + 0.5) / stretch)
        out[i] = np.tensordot(weights / weights.sum(), image[lo:hi], axes=1)
    return np.moveaxis(np.clip(np.floor(out + 0.5), 0, 255), 0, axis)


def reference_resize(image, width, height, kernel, support):
    if image.shape[1] != width:
        image = resample_axis(image, width, kernel, support, axis=1)
    if image.shape[0] != height:
        image = resample_axis(image, height, kernel, support, axis=0)
    return image


def reference_adm(image, size, halve=True):
    while halve and min(image.shape[:2]) >= 2 * size:
        image = reference_resize(image, image.shape[1] // 2, image.shape[0] // 2, box_filter, 0.5)
    scale = size / min(image.shape[:2])
    image = reference_resize(image, round(image.shape[1] * scale), round(image.shape[0] * scale), bicubic_filter, 2.0)
    top, left = (image.shape[0] - size) // 2, (image.shape[1] - size) // 2
    return image[top:top + size, left:left + size].astype(np.uint8)


@pytest.mark.parametrize("width, height, size", [
    (300, 200, 64), (200, 300, 64), (1001, 333, 64), (129, 257, 32), (97, 64, 32), (41, 23, 32), (64, 64, 64)])
def test_center_crop_dhariwal_equals_independent_adm(width, height, size):
    image = np.random.default_rng(width * height).integers(0, 256, (height, width, 3), dtype=np.uint8)
    ours = transforms.center_crop_dhariwal(image, size).astype(int)
    expected = reference_adm(image, size).astype(int)
    assert ours.shape == (size, size, 3)
    # Pillow resamples 8-bit images in integer arithmetic (the same on every machine) with weights of 22
    # fractional bits (Resample.c, PRECISION_BITS): each of the <= 9 taps of a pass (bicubic support 2
    # stretched by a factor < 2 after the halvings) is off by <= 2**-23 * 255 = 3e-5 levels, so a value
    # moves by <= 2.7e-4 levels: never a whole level, and it rounds otherwise than float64 only when it lies
    # that close to a .5 boundary: <= 5.4e-4 of the values per pass at worst, about 1e-4 with the weights'
    # errors of random sign, so under 1e-3 over both passes. A procedural slip moves most pixels.
    assert np.abs(ours - expected).max() <= 1 and (ours != expected).mean() < 1e-3
    if min(width, height) >= 2 * size:
        assert (ours != reference_adm(image, size, halve=False)).mean() > 0.5



def test_make_transform_gives_each_mode_its_function():
    image = np.random.default_rng(0).integers(0, 256, (30, 50, 3), dtype=np.uint8)
    assert make_transform(None, None)(image) is image
    expected = {
        None: transforms.resize(image, 16, 16),
        "center-crop": transforms.center_crop(image, 16, 16),
        "center-crop-dhariwal": transforms.center_crop_dhariwal(image, 16),
    }
    for mode, result in expected.items():
        assert np.array_equal(make_transform(mode, (16, 16))(image), result), mode
    wide = make_transform("center-crop-wide", (16, 8))(image)
    assert wide.shape == (16, 16, 3) and np.array_equal(wide, transforms.center_crop_wide(image, 16, 8))
    assert len({r.tobytes() for r in expected.values()}) == 3  # the modes differ on this image


@pytest.mark.parametrize("mode, size, words", [
    ("center-crop", None, ["center-crop needs an output size"]),
    ("center-crop-wide", (8, 16), ["width >= height", "8x16"]),
    ("center-crop-dhariwal", (16, 8), ["square", "16x8"]),
    ("center-crop", (16, 8), ["square"]),
    (None, (16, 8), ["resizing needs a square resolution"]),
    ("stretch", (16, 16), ["unknown transform 'stretch'"]),
])
def test_make_transform_refuses_what_does_not_go_together(mode, size, words):
    with pytest.raises(TransformError) as info:
        make_transform(mode, size)
    assert isinstance(info.value, EDM2Error) and all(word in str(info.value) for word in words)
