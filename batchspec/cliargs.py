"""What every batchspec command line shares: help that shows each flag's default."""
import argparse
import os
import pathlib


class DefaultsFormatter(argparse.HelpFormatter):
    """Appends '(default: X)' to a flag's help unless the help already speaks of its default
    or there is none to show (None, False)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) \
                or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def parser(prog: str, description: str | None = None) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=prog, description=description,
                                   formatter_class=DefaultsFormatter)


def address(value: str) -> str:
    """An argparse type: HOST:PORT (an IPv6 host in brackets), the port in 1..65535."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, not {value!r}")
    return value


def _number(value: str, convert, what: str, within, rule: str):
    """`value` converted, where it converts and `within` holds for it; else an argparse
    type error: "expected {what}" or "{rule}"."""
    try:
        number = convert(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, not {value!r}") from None
    if not within(number):
        raise argparse.ArgumentTypeError(f"{rule}, not {value}")
    return number


def bounded(kind, minimum, below=None):
    """An argparse type: `kind` (int or float) at least `minimum`, and less than `below`
    where given."""
    what = "a whole number" if kind is int else "a number"
    rule = f"must be >= {minimum}" + ("" if below is None else f" and < {below}")

    def parse(value: str):
        return _number(value, kind, what,
                       lambda n: n >= minimum and (below is None or n < below), rule)
    parse.__name__ = kind.__name__  # argparse names the type by it in its messages
    return parse


def check_ports(*named: tuple[str, int | None]) -> None:
    """ValueError naming the first (name, port) outside 0..65535 (0: a free one; None: no
    such server)."""
    for name, port in named:
        if port is not None and not 0 <= port <= 65535:
            raise ValueError(f"{name} must be in [0, 65535], not {port}")


def positive_seconds(value: str) -> float:
    """An argparse type: a number of seconds > 0."""
    return _number(value, float, "seconds", lambda s: s > 0, "must be > 0")


def positive_int(value: str) -> int:
    """An argparse type: a whole number >= 1."""
    return _number(value, int, "a whole number", lambda n: n >= 1, "must be >= 1")


def port(value: str) -> int:
    """An argparse type: a TCP port, 1..65535."""
    return _number(value, int, "a port", lambda n: 1 <= n <= 65535, "a port is in 1..65535")


def non_negative_int(value: str) -> int:
    """An argparse type: a whole number >= 0."""
    return _number(value, int, "a whole number", lambda n: n >= 0, "must be >= 0")


def share(value: str) -> float:
    """An argparse type: a fraction in [0, 1]."""
    return _number(value, float, "a number", lambda x: 0 <= x <= 1, "must be in [0, 1]")


def int_span(value: str) -> tuple[int, int]:
    """An argparse type: MIN,MAX, whole numbers with 0 < MIN <= MAX."""
    low, sep, high = value.partition(",")
    try:
        values = int(low), int(high)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX, not {value!r}") from None
    if not sep or not 0 < values[0] <= values[1]:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX with 0 < MIN <= MAX, not {value!r}")
    return values


def writable_dir(path: str) -> bool:
    """`path` is a directory this process can write in, or can be made one (checked before a
    run of an hour, not after it)."""
    where = pathlib.Path(path).absolute()
    while not where.exists():
        where = where.parent
    return where.is_dir() and os.access(where, os.W_OK | os.X_OK)
