"""Dates and frequencies as the anemoi-datasets layout spells them.

:func:`parse_frequency` reads ``"6h"``, ``"30m"``, ``"1d"``, ``"3600s"``, an int (hours) or
``"06:00:00"``; :func:`frequency_to_string` writes anemoi's spelling back; :func:`as_datetime64`
turns a date given any common way into ``datetime64[s]``.
"""

from __future__ import annotations

import datetime
import re
from typing import Any

import numpy as np

__all__ = ["parse_frequency", "frequency_to_string", "as_datetime64"]

_FREQ = re.compile(r"^\s*(\d+)\s*([smhdSMHD]?)\s*$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "": 3600}


def parse_frequency(value: str | int | datetime.timedelta | np.timedelta64) -> datetime.timedelta:
    """A frequency as a timedelta: ``"6h"``, ``"30m"``, ``"1d"``, ``"3600s"``, ``6`` (hours) or ``"06:00:00"``."""
    if isinstance(value, datetime.timedelta):
        td = value
    elif isinstance(value, np.timedelta64):
        td = datetime.timedelta(seconds=float(value / np.timedelta64(1, "s")))
    elif isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        td = datetime.timedelta(hours=int(value))
    elif isinstance(value, str):
        m = _FREQ.match(value)
        if m:
            td = datetime.timedelta(seconds=int(m.group(1)) * _UNIT_SECONDS[m.group(2).lower()])
        elif re.fullmatch(r"\d+:\d\d(:\d\d)?", value.strip()):
            parts = [int(p) for p in value.strip().split(":")] + [0]
            td = datetime.timedelta(hours=parts[0], minutes=parts[1], seconds=parts[2])
        else:
            raise ValueError(
                f"frequency {value!r} is not understood: use a number and a unit such as '6h', '30m', '1d', "
                "'3600s', or hours as an integer"
            )
    else:
        raise TypeError(f"frequency must be a string, an int (hours) or a timedelta, got {type(value).__name__}")
    if td.total_seconds() <= 0 or td.total_seconds() != int(td.total_seconds()):
        raise ValueError(f"frequency {value!r} must be a positive whole number of seconds")
    return td


def frequency_to_string(td: datetime.timedelta) -> str:
    """``6h``, ``1d``, ``30m`` or ``90s``: the largest unit that divides the frequency (anemoi's spelling)."""
    seconds = int(parse_frequency(td).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def as_datetime64(value: Any, what: str = "date") -> np.datetime64:
    """A date (ISO string, datetime, np.datetime64, or an int year) as ``datetime64[s]``."""
    try:
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            return np.datetime64(f"{int(value):04d}-01-01T00:00:00", "s")
        return np.datetime64(value, "s")
    except (ValueError, TypeError):
        raise ValueError(
            f"{what} {value!r} is not a date: give an ISO string such as '2020-01-01T06:00', a datetime, "
            "a numpy datetime64 or a year"
        ) from None
