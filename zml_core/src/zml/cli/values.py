"""Types for command-line values, so that a bad one is refused by argparse in one line.

argparse turns the ``ArgumentTypeError`` raised here into ``zml demo: error: argument
--time-scale: ...`` and exit status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import math

__all__ = ["positive_float", "positive_int"]


def positive_float(text: str) -> float:
    """A positive, finite number (``--time-scale``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a positive number, e.g. 0.5")
    return value


def positive_int(text: str) -> int:
    """A positive whole number (``--requests``)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 1")
    return value
