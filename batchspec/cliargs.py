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
