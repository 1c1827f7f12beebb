"""click parameter types shared by the command lines."""

from __future__ import annotations

import math
import re

import click

from edm2 import phema, sampler
from edm2.formats.snapshot import MAX_NIMG, std_tag
from edm2.procedures.generation import MAX_SEED, SeedRanges
from training.sections import Bound, Count, GridShape, Images

# Bounds of the integer options that several commands share.
MAX_KIMG = (MAX_NIMG - 1) // 1000  # training times in thousands of images (edm2.formats.snapshot.MAX_NIMG)
MAX_RESOLUTION = 8192  # image sizes: 16 times ImageNet-512's, 200 MB per RGB image
MAX_SEED_OPTION = MAX_SEED - 1  # seeds lie in [0, 2**32) (edm2.procedures.generation.MAX_SEED)


def shown(text: str) -> str:
    """Text as an error message shows it: at most 30 characters (a 5,000-digit number is not repeated)."""
    return text if len(text) <= 30 else text[:27] + "..."


def too_many_digits(text: str, bound: int) -> bool:
    """Whether the integer in `text` has more digits than `bound`: then it is out of range, decided without
    converting it (Python refuses more than 4,300 digits with a ValueError and takes quadratic time below)."""
    return len(text.strip().lstrip("+-").lstrip("0")) > len(str(abs(bound)))


class Integer(click.IntRange):
    """The type of every integer option: an integer in [min, max], both bounds required, so that no option
    takes a number beyond a sane range (--batch=10**20 overflowed, --steps=10**10 hung)."""

    def __init__(self, min: int, max: int):
        super().__init__(min=min, max=max)

    def convert(self, value, param, ctx) -> int:
        """Parse value; more digits than either bound has is refused before converting."""
        if isinstance(value, str) and too_many_digits(value, max(-self.min, self.max)):
            self.fail(f"{shown(value.strip())} is not in the range {self._describe_range()}.", param, ctx)
        return super().convert(value, param, ctx)


class Number(click.FloatRange):
    """A float in an optional range that is never NaN, and finite unless allow_inf says otherwise.

    click's FloatRange lets NaN through (every comparison with NaN is false), and float() accepts 'inf'.
    """

    name = "float"

    def __init__(self, min: float | None = None, max: float | None = None, min_open: bool = False,
                 max_open: bool = False, allow_inf: bool = False):
        super().__init__(min=min, max=max, min_open=min_open, max_open=max_open)
        self.allow_inf = allow_inf

    def _describe_range(self) -> str:
        """The range for --help; nothing without bounds (click would print 'x<=None')."""
        return "" if self.min is None and self.max is None else super()._describe_range()

    def convert(self, value, param, ctx) -> float:
        """Parse value and refuse NaN (always) and infinities (unless allowed) before the range check."""
        number = value if isinstance(value, float) else click.FLOAT.convert(value, param, ctx)
        if math.isnan(number) or (math.isinf(number) and not self.allow_inf):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return super().convert(number, param, ctx)


class Guidance(Number):
    """Eq. 152's guidance weight: a finite number within edm2.sampler.check_guidance's bound, refused while the
    options are read."""

    def convert(self, value, param, ctx) -> float:
        """Parse value as a Number and check its bound."""
        number = super().convert(value, param, ctx)
        try:
            sampler.check_guidance(number)
        except sampler.SamplerError as e:
            self.fail(str(e).removeprefix("guidance="), param, ctx)
        return number


class SeedList(click.ParamType):
    """Seeds like '0-63', '1,5,9' or '0-3,10': distinct, in the order given, held as ranges (never one list).

    Seeds must lie in [0, 2**32) (edm2.procedures.generation.MAX_SEED), so '0-99999999999' is refused, not expanded.
    """

    name = "seeds"
    min, max = 0, MAX_SEED - 1
    _PART = re.compile(r"\s*([0-9]+)\s*(?:-\s*([0-9]+)\s*)?")

    def __init__(self, noun: str = "seed"):
        self.noun = noun  # 'class' for generate.py --class, which takes the same lists and ranges

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
        if too_many_digits(digits, MAX_SEED) or int(digits) >= MAX_SEED:
            self.fail(f"{self.noun} {shown(digits)} is not below {MAX_SEED} (2**32)", param, ctx)
        return int(digits)


# Distinct std_tag file name suffixes in (0, 12^-0.5): 0.001 ... 0.288.
MAX_STD_COUNT = 288


class StdList(click.ParamType):
    """Comma-separated sigma_rel values; 'a,b,...,c' expands to the evenly spaced range a, b, ..., c.

    Values are sorted and made distinct; each must lie in (0, 12^-0.5) (edm2.phema.MAX_STD), and no two may
    share the suffix (edm2.formats.snapshot.std_tag) of a snapshot file name.
    """

    name = "LIST"

    def convert(self, value, param, ctx) -> list[float]:
        """Parse value into sorted, distinct sigma_rel values, expanding '...' ranges."""
        if isinstance(value, list):
            return value
        stds = self._expand(value, self._numbers(value, param, ctx), param, ctx)
        bad = [s for s in stds if not 0 < s < phema.MAX_STD]
        if bad:
            self.fail(f"{bad[0]} is outside (0, {phema.MAX_STD:.4f}), the range of sigma_rel", param, ctx)
        stds = sorted(set(stds))
        names = [std_tag(s) for s in stds]
        for s, t, name, next_name in zip(stds, stds[1:], names, names[1:]):
            if name == next_name:
                self.fail(f"{s} and {t} would share the file name suffix {name}", param, ctx)
        return stds

    def _numbers(self, value, param, ctx) -> list[float | None]:
        """The list's numbers, None for '...'; 'nan' and 'inf' are no sigma_rel (and no range end)."""
        tokens = [t.strip() for t in str(value).split(",")]
        try:
            numbers = [None if t == "..." else float(t) for t in tokens]
        except ValueError:
            self.fail(f"{value!r} is not a comma-separated list of numbers", param, ctx)
        infinite = [t for t, n in zip(tokens, numbers) if n is not None and not math.isfinite(n)]
        if infinite:
            self.fail(f"{infinite[0]!r} is not a finite number", param, ctx)
        return numbers

    def _expand(self, value, numbers: list[float | None], param, ctx) -> list[float]:
        """The numbers with each 'a, b, ..., c' replaced by a, b, b + (b - a), ..., c."""
        stds = []
        for i, v in enumerate(numbers):
            if v is not None:
                stds.append(v)
                continue
            around = numbers[i - 2:i] + numbers[i + 1:i + 2] if i >= 2 else []
            if len(around) < 3 or None in around:
                self.fail(f"{value!r}: '...' needs two numbers before it and one after", param, ctx)
            a, b, c = numbers[i - 2], numbers[i - 1], numbers[i + 1]
            count = (c - b) / (b - a) if b != a else -1.0
            if count < 1 - 1e-6 or abs(count - round(count)) > 1e-6:
                self.fail(f"{value!r}: {a}, {b}, ..., {c} is not an evenly spaced range", param, ctx)
            if count > MAX_STD_COUNT:  # refused before materializing a range of millions of values
                self.fail(f"{value!r}: {a}, {b}, ..., {c} has {round(count) + 2} values, more than the "
                          f"{MAX_STD_COUNT} distinct sigma_rel file names", param, ctx)
            stds += [round(b + (b - a) * k, 12) for k in range(1, round(count))]
        return stds


class ImageCount(click.ParamType):
    """An image count such as 2048, 128Ki, 8Mi or 10M, at least `min` and below 2**53
    (edm2.formats.snapshot.MAX_NIMG)."""

    name = "NIMG"
    _SUFFIXES = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    _PATTERN = re.compile(r"\s*(\d+)\s*(|K|M|G|Ki|Mi|Gi)\s*")

    def __init__(self, min: int = 0):
        self.min, self.max = min, MAX_NIMG - 1

    def convert(self, value, param, ctx) -> int:
        """Parse value into a number of images; refuse other text and counts outside [min, 2**53)."""
        if isinstance(value, int):
            count = value
        else:
            match = self._PATTERN.fullmatch(str(value))
            if match is None:
                self.fail(f"{shown(str(value))!r} is not an image count like 2048, 128Ki, 8Mi or 10M", param, ctx)
            too_many = too_many_digits(match.group(1), self.max)
            count = self.max + 1 if too_many else int(match.group(1)) * self._SUFFIXES[match.group(2)]
        if count < self.min:
            self.fail(f"{value!r} is fewer than {self.min} image(s)", param, ctx)
        if count > self.max:
            self.fail(f"{shown(str(value).strip())} is 2**53 images or more", param, ctx)
        return count


class SigmaInterval(click.ParamType):
    """'SIGMA_LO,SIGMA_HI': the noise levels (sigma_lo, sigma_hi] where guidance applies; sigma_hi may be 'inf'."""

    name = "LO,HI"

    def convert(self, value, param, ctx) -> tuple[float, float]:
        """Parse value into (sigma_lo, sigma_hi) with 0 <= sigma_lo < sigma_hi; refuse NaN and other text."""
        if isinstance(value, tuple):
            return value
        parts = str(value).split(",")
        try:
            lo, hi = (float(part) for part in parts)
        except ValueError:
            self.fail(f"{value!r} is not two numbers SIGMA_LO,SIGMA_HI (for example 0.28,5.42)", param, ctx)
        try:
            sampler.check_guidance_interval((lo, hi))
        except sampler.SamplerError:
            self.fail(f"{value!r}: needs 0 <= SIGMA_LO < SIGMA_HI (SIGMA_HI may be inf)", param, ctx)
        return lo, hi


class IntList(click.ParamType):
    """Comma-separated integers in [min, max], like '1,2,2'; with allow_empty, '' is the empty list."""

    name = "LIST"

    def __init__(self, min: int, max: int, allow_empty: bool = False):
        self.min, self.max, self.allow_empty = min, max, allow_empty

    def convert(self, value, param, ctx) -> tuple[int, ...]:
        """Parse value into a tuple of integers; refuse other text, values out of range, and '' unless allowed."""
        if isinstance(value, tuple):
            return value
        text = str(value).strip()
        if not text:
            if self.allow_empty:
                return ()
            self.fail("needs at least one number, e.g. 1,2,2", param, ctx)
        parts = [part.strip() for part in text.split(",")]
        if not all(re.fullmatch(r"[+-]?\d+", part) for part in parts):
            self.fail(f"{shown(str(value))!r} is not a comma-separated list of integers like 1,2,2", param, ctx)
        if any(too_many_digits(part, self.max) for part in parts):
            self.fail(f"{shown(str(value))!r}: every number must lie in [{self.min}, {self.max}]", param, ctx)
        numbers = tuple(int(part) for part in parts)
        if min(numbers) < self.min or max(numbers) > self.max:
            self.fail(f"{value!r}: every number must lie in [{self.min}, {self.max}]", param, ctx)
        return numbers


class Resolution(click.ParamType):
    """N (square) or WxH, each in [1, MAX_RESOLUTION]."""

    name = "N|WxH"
    min, max = 1, MAX_RESOLUTION

    def convert(self, value, param, ctx) -> tuple[int, int]:
        """Parse '64' -> (64, 64) and '512x384' -> (512, 384)."""
        if isinstance(value, tuple):
            return value
        match = re.fullmatch(r"\s*(\d+)\s*(?:[x,]\s*(\d+)\s*)?", str(value))
        sizes = [size for size in (match[1], match[2]) if size is not None] if match else []
        if not sizes or any(too_many_digits(size, self.max) or not 1 <= int(size) <= self.max for size in sizes):
            self.fail(f"{shown(str(value))!r} is not N or WxH with sizes from 1 to {self.max} (for example 64 or "
                      "512x384)", param, ctx)
        return int(sizes[0]), int(sizes[-1])


class GridSize(click.ParamType):
    """'ROWSxCOLS' (each least..most), or '0' for none: the shape of an image grid, as (rows, cols) or ().

    training_options.json holds it as a list, which --config hands over as 'ROWS,COLS' ('' for none)."""

    name = "ROWSxCOLS"

    def __init__(self, least: int, most: int):
        self.least, self.most = least, most

    def convert(self, value, param, ctx) -> tuple[int, ...]:
        """Parse value into (rows, cols), or () for '0'; refuse other text and sizes outside least..most."""
        if isinstance(value, tuple):
            return value
        text = str(value).strip()
        if text in ("0", ""):
            return ()
        match = re.fullmatch(r"(\d{1,9})\s*[xX,]\s*(\d{1,9})", text)
        if match is None:
            self.fail(f"{value!r} is not ROWSxCOLS like 4x8, or 0 for none", param, ctx)
        size = int(match.group(1)), int(match.group(2))
        if not all(self.least <= n <= self.most for n in size):
            self.fail(f"{value!r}: rows and columns must each be {self.least} to {self.most}", param, ctx)
        return size


class TableChoice(click.Choice):
    """click.Choice over a table's names (edm2.solvers.SOLVERS, edm2.loss.WEIGHTINGS, ...) as they are when a command
    line parses its options: a row added to the table is a choice."""

    def __init__(self, table: dict) -> None:
        self.table, self.case_sensitive = table, True

    @property
    def choices(self) -> tuple[str, ...]:
        """The table's names."""
        return tuple(self.table)


class NameList(click.ParamType):
    """Comma-separated names of a table's (read when parsed), like 'loss,fid': distinct, in the order given. A
    tuple already parsed (click converts a --config file's converted value again) is checked as it is."""

    name = "LIST"

    def __init__(self, table: dict | tuple[str, ...], noun: str = "name") -> None:
        self.table, self.noun = table, noun

    def convert(self, value, param, ctx) -> tuple[str, ...]:
        """Parse value into a tuple of names; refuse, naming every one, those not in the table."""
        parts = value if isinstance(value, (list, tuple)) else str(value).split(",")
        names = tuple(dict.fromkeys(name.strip() for name in parts if name.strip()))
        unknown = [name for name in names if name not in self.table]
        if unknown:
            self.fail(f"unknown {self.noun} {', '.join(map(repr, unknown))}; choose from {', '.join(self.table)}",
                      param, ctx)
        return names


def bound_type(bound: Bound) -> click.ParamType:
    """The option type that takes the values a bound of the training options admits (training.sections): a
    GridSize, an ImageCount, an Integer or a Number."""
    if isinstance(bound, GridShape):
        return GridSize(bound.low, bound.high)
    if isinstance(bound, Images):
        return ImageCount(min=bound.low)
    if isinstance(bound, Count):
        return Integer(bound.low, bound.high)
    return Number(min=None if math.isinf(bound.low) else bound.low, max=None if math.isinf(bound.high) else bound.high,
                  min_open=bound.low_open, max_open=bound.high_open)
