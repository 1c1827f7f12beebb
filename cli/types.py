"""click parameter types shared by the command lines."""

from __future__ import annotations

import math

import click


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
