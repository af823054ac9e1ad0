"""What every batchspec command line shares: help that shows each flag's default."""
import argparse


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


def positive_seconds(value: str) -> float:
    """An argparse type: a number of seconds > 0."""
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, not {value!r}") from None
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, not {value}")
    return seconds


def positive_int(value: str) -> int:
    """An argparse type: a whole number >= 1."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, not {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, not {value}")
    return number


def port(value: str) -> int:
    """An argparse type: a TCP port, 1..65535."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port, not {value!r}") from None
    if not 1 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"a port is in 1..65535, not {value}")
    return number
