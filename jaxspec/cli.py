"""What the command-line tools share: user-input errors, flag validation, and their reporting.

Every CLI (`python -m jaxspec.generate`, `jaxspec.tune`, `jaxspec.train_draft`,
`jaxspec.profile_report`, `checkpoints_convert`) reports a user-input error (a bad
flag, a path that is missing or wrong, a file whose content does not fit) as one
line on stderr,

    error: --top-p must be in (0, 1], found 1.5

and exits with status 2, argparse's convention. Flags are checked at parse time
(types, choices, ranges: `at_least`, `above`, `in_range`); what only shows later
(a checkpoint directory, a tensor, a mesh) raises `UsageError` (or one of the
library's error classes derived from it: `config.ConfigError`,
`sharding.MeshError`, `tune.TuneError`, ...) or an OSError about a path, and
`entry_point` turns exactly those into the `error:` line. Any other exception is
a bug and keeps its traceback.

Only the standard library is imported here: parsing flags costs no JAX import.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys

EXIT_USAGE = 2


class UsageError(ValueError):
    """Bad user input: a flag, a path or a file's content. The message names it, with what was
    expected and what was found. A CLI prints it as one `error: ...` line and exits with status 2."""


# OSErrors about a path the user gave (a missing --model, an --out that is a file, ...).
PATH_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError, PermissionError)
USER_ERRORS = (UsageError, *PATH_ERRORS)


def message(e: BaseException) -> str:
    """`e` as one line: an OSError from the system as 'PATH: reason', others as their message."""
    if isinstance(e, OSError) and e.strerror and e.filename is not None:
        text = f"{e.filename}: {e.strerror}"
    else:
        text = str(e)
    return " ".join(text.split("\n"))


def report(e: BaseException) -> int:
    """Print `e` as the `error:` line on stderr; returns the exit status."""
    print(f"error: {message(e)}", file=sys.stderr)
    return EXIT_USAGE


def entry_point(main):
    """Decorator for a CLI's `main(argv=None, ...) -> int`: a user-input error (`USER_ERRORS`)
    becomes one `error: ...` line on stderr and the return value 2; anything else propagates."""

    @functools.wraps(main)
    def wrapped(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except USER_ERRORS as e:
            return report(e)

    return wrapped


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """`--help` for every CLI: the description as written (its examples keep their lines), and each option's
    default appended as '(default: X)' where it has one worth saying: not where the help text already says what
    the default is, nor for a flag that is off unless given (False) or a value left to the program (None)."""

    def _get_help_string(self, action):
        text = action.help or ""
        d = action.default
        if d is None or d is False or d is argparse.SUPPRESS or action.nargs == 0 or "default" in text:
            return text
        return f"{text} (default: {_fmt(d)})" if text else f"default: {_fmt(d)}"


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad command line by raising `UsageError` (the message naming the flag),
    which `entry_point` prints as the one `error:` line, instead of printing the usage and exiting.
    Its `--help` uses `HelpFormatter` unless told otherwise."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("exit_on_error", False)  # let parse_known_args raise ArgumentError to us
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        try:
            return super().parse_known_args(args, namespace)
        except argparse.ArgumentError as e:
            # argparse's own checks (types, choices, counts) say what was expected and found;
            # prefix the flag they concern.
            raise UsageError(f"{e.argument_name}: {e.message}" if e.argument_name else e.message) from None

    def error(self, message):
        raise UsageError(f"{message} (see {self.prog} --help)")


def _fmt(x) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _range_action(test, expected: str):
    """An argparse Action that stores the value(s) after checking `test(value)` for each; a failure is
    reported as '<flag> must be <expected>, found <value>'."""

    class Check(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            for v in values if isinstance(values, list) else [values]:
                finite = not isinstance(v, float) or math.isfinite(v)
                if not (finite and test(v)):
                    what = expected if finite else f"a finite number {expected}"
                    raise UsageError(f"{option_string or self.dest} must be {what}, found {v}")
            setattr(namespace, self.dest, values)

    return Check


def at_least(low):
    """`action=` for a flag whose value(s) must be >= `low`."""
    return _range_action(lambda v: v >= low, f">= {_fmt(low)}")


def above(low):
    """`action=` for a flag whose value(s) must be > `low`."""
    return _range_action(lambda v: v > low, f"> {_fmt(low)}")


def in_range(low, high, low_open: bool = False):
    """`action=` for a flag whose value(s) must lie in [low, high] ((low, high] with `low_open`)."""
    if low_open:
        return _range_action(lambda v: low < v <= high, f"in ({_fmt(low)}, {_fmt(high)}]")
    return _range_action(lambda v: low <= v <= high, f"in [{_fmt(low)}, {_fmt(high)}]")
