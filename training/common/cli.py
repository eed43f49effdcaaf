"""Command-line pieces every entry point of ``training/`` shares, importing nothing heavy (``--help`` answers before
torch loads): the one-line usage error, the program name as the user typed it, argparse types for counts."""

from __future__ import annotations

import argparse
import os
import sys


class UsageError(Exception):
    """Bad input: said in one line on stderr, exit status 2."""


def one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def program_name(module: str, command: str | None = None) -> str:
    """``hf-spectral train <command>`` from the command-line tool, else ``python -m <package>.<module>`` (``training``
    in a checkout, ``hf_spectral.recipes`` installed)."""
    if os.path.basename(sys.argv[0]) == "hf-spectral":
        return f"hf-spectral train {command or module}"
    return f"python -m {__package__.rpartition('.')[0]}.{module}"


def run_main(function, argv, prog: str) -> int:
    """``function(argv)``, with a `UsageError` printed as one line (``<prog>: error: ...``) and exit status 2."""
    try:
        return function(argv)
    except UsageError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are a `UsageError` (one line) instead of the usage text and an exit."""

    def error(self, message):
        raise UsageError(message)


def positive_int(text: str) -> int:
    """An argparse ``type`` for counts that must be at least 1 (``--threads``, ``--jobs``)."""
    return _int_at_least(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    """An argparse ``type`` for counts that may be 0."""
    return _int_at_least(text, 0, "an integer >= 0")


def _int_at_least(text: str, lowest: int, kind: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < lowest:
        raise argparse.ArgumentTypeError(f"must be {kind}, got {value}")
    return value


def percentage(text: str) -> float:
    """An argparse ``type`` for a percentage or percentile in [0, 100] (NaN refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not 0 <= value <= 100:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a number in [0, 100], got {text}")
    return value
