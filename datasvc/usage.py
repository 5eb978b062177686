"""How the commands meet their user: a mistake is a ``UserError``, shown as one line saying what to
change (exit 2) before anything starts, while everything else is a defect and keeps its traceback;
counts are checked as they are parsed; every ``--help`` shows the defaults."""
from __future__ import annotations

import argparse
import math


class UserError(Exception):
    """A mistake in the user's input or setup, with its fix in the message."""


def positive_int(text: str) -> int:
    """An argparse type for counts and sizes: argparse then names the flag and the fix in one line."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, not {value}")
    return value


def positive_float(text: str) -> float:
    """An argparse type for rates: a finite number above zero."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number > 0, not {text}")
    return value


def positive_ints(text: str) -> list[int]:
    """An argparse type for a comma list of counts (``--mbs 1,2,4``)."""
    return _comma_list(text, positive_int)


def positive_floats(text: str) -> list[float]:
    """An argparse type for a comma list of rates or times."""
    return _comma_list(text, positive_float)


def _comma_list(text: str, item) -> list:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"{text!r} holds no number")
    return [item(p) for p in parts]


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the description's layout and appends ``(default: ...)`` to options that have one."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default == []:
            return action.help  # "(default: None)" tells a reader nothing; the help says what happens
        return super()._get_help_string(action)
