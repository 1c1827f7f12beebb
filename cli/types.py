"""click parameter types shared by the command lines."""

from __future__ import annotations

import math
import re

import click

from edm2.generation import MAX_SEED, SeedRanges


class Number(click.FloatRange):
    """A float in an optional range that is never NaN, and finite unless allow_inf says otherwise.

    click's FloatRange lets NaN through (every comparison with NaN is false), and float() accepts 'inf'.
    """

    name = "float"

    def __init__(self, min: float | None = None, max: float | None = None, min_open: bool = False,
                 max_open: bool = False, allow_inf: bool = False):
        super().__init__(min=min, max=max, min_open=min_open, max_open=max_open)
        self.allow_inf = allow_inf

    def convert(self, value, param, ctx) -> float:
        """Parse value and refuse NaN (always) and infinities (unless allowed) before the range check."""
        number = value if isinstance(value, float) else click.FLOAT.convert(value, param, ctx)
        if math.isnan(number) or (math.isinf(number) and not self.allow_inf):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return super().convert(number, param, ctx)


class SeedList(click.ParamType):
    """Seeds like '0-63', '1,5,9' or '0-3,10': distinct, in the order given, held as ranges (never one list).

    Seeds must lie in [0, 2**32) (edm2.generation.MAX_SEED), so '0-99999999999' is refused, not expanded.
    """

    name = "seeds"
    _PART = re.compile(r"\s*([0-9]+)\s*(?:-\s*([0-9]+)\s*)?")

    def convert(self, value, param, ctx) -> SeedRanges:
        """Parse value into a SeedRanges; refuse malformed parts, reversed ranges and seeds out of range."""
        if isinstance(value, SeedRanges):
            return value
        ranges = []
        for part in str(value).split(","):
            match = self._PART.fullmatch(part)
            if not match:
                self.fail(f"{value!r}: expected numbers and ranges like 0-63,100,200-209", param, ctx)
            first, last = (self._seed(text, param, ctx) for text in (match[1], match[2] or match[1]))
            if last < first:
                self.fail(f"{part.strip()!r}: a range must not end before it starts", param, ctx)
            ranges.append(range(first, last + 1))
        return SeedRanges(ranges)

    def _seed(self, text: str, param, ctx) -> int:
        """One seed; compared as text first, so a thousand-digit number is refused without converting it."""
        digits = text.lstrip("0") or "0"
        if len(digits) > len(str(MAX_SEED)) or int(digits) >= MAX_SEED:
            self.fail(f"seed {digits if len(digits) <= 30 else digits[:27] + '...'} is not below {MAX_SEED} (2**32)",
                      param, ctx)
        return int(digits)


class ImageCount(click.ParamType):
    """An image count such as 2048, 128Ki, 8Mi or 10M, at least `min`."""

    name = "NIMG"
    _SUFFIXES = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    _PATTERN = re.compile(r"\s*(\d+)\s*(|K|M|G|Ki|Mi|Gi)\s*")

    def __init__(self, min: int = 0):
        self.min = min

    def convert(self, value, param, ctx) -> int:
        """Parse value into a number of images; refuse other text and counts below min."""
        if isinstance(value, int):
            count = value
        else:
            match = self._PATTERN.fullmatch(str(value))
            if match is None:
                self.fail(f"{value!r} is not an image count like 2048, 128Ki, 8Mi or 10M", param, ctx)
            count = int(match.group(1)) * self._SUFFIXES[match.group(2)]
        if count < self.min:
            self.fail(f"{value!r} is fewer than {self.min} image(s)", param, ctx)
        return count
