"""argparse pieces shared by loadlab's command lines (`loadlab`, `loadlab sim`, the Locust options)."""

from __future__ import annotations

import argparse
import math

from loadlab import exits


class OneLineParser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage dump) and exit status 2."""

    def error(self, message):
        self.exit(exits.BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _bounded(kind, what: str, ok):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not ok(value) or not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    parse.__name__ = kind.__name__
    return parse


def positive(kind):
    """An argparse type: a positive int or float (finite)."""
    return _bounded(kind, "a positive integer" if kind is int else "a positive number", lambda v: v > 0)


def non_negative(kind):
    """An argparse type: an int or float >= 0 (finite)."""
    return _bounded(kind, "an integer >= 0" if kind is int else "a number >= 0", lambda v: v >= 0)


def port(text: str) -> int:
    """An argparse type: a TCP port number, 1-65535."""
    return _bounded(int, "a port number 1-65535", lambda v: 1 <= v <= 65535)(text)
