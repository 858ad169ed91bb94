"""The argparse pieces shared by `mpiasgd`'s commands, the tools and `bench/` scripts: value types that
refuse a bad flag value with one line, the subcommand helper, and `mpiasgd report`'s defaults.

It imports nothing of mpiasgd, so a script's `--help` loads no training code.
"""

from __future__ import annotations

import argparse
import math

DEFAULT_TARGET = 0.9  # `mpiasgd report`: test accuracy (fraction) of the "time to" column unless --target-accuracy
FORMATS = ("text", "markdown", "csv")  # `mpiasgd report --format`


def positive(text: str) -> int:
    """An integer >= 1; argparse.ArgumentTypeError otherwise."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def seconds(text: str) -> float:
    """A positive, finite number of seconds."""
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text}")
    return value


def fraction(text: str) -> float:
    """A test accuracy given as a fraction in (0, 1]; a percentage such as 60 is refused, not guessed."""
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], e.g. 0.6 for 60 %; got {text}")
    return value


def command(sub: argparse._SubParsersAction, name: str, text: str) -> argparse.ArgumentParser:
    """A subcommand whose one-line `text` is both its entry in `mpiasgd --help` and its own description."""
    return sub.add_parser(name, help=text, description=text)
