"""The command line as a user meets it: usage errors instead of tracebacks, help that shows
every default, --version, and a clear word when no server is running."""
import argparse
import importlib
import subprocess
import sys

import pytest

from batchspec import cli, cliargs
from batchspec.processes import free_port
from batchspec.runtime import service


def all_parsers() -> dict[str, argparse.ArgumentParser]:
    import coordinator.__main__ as coordinator_main

    service_parser = cliargs.parser("batchspec target")
    service.add_service_arguments(service_parser, 0)
    parsers = {"serve": cli.serve_parser(), "generate": cli.generate_parser(),
               "coordinator": coordinator_main.build_parser(), "target/draft": service_parser}
    for name, module in (("bench", "batchspec.bench.run"),
                         ("distill", "batchspec.drafting.distill"),
                         ("evaluate-draft", "batchspec.drafting.evaluate"),
                         ("loadtest", "batchspec.bench.loadtest")):
        parsers[name] = importlib.import_module(module).build_parser()
    return parsers


@pytest.mark.parametrize("name", list(all_parsers()))
def test_every_flag_has_help_that_shows_its_default(name):
    parser = all_parsers()[name]
    text = " ".join(parser.format_help().split())  # as one line: help wraps anywhere
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{name}: {action.option_strings or action.dest} has no help"
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
            shown = action.help if "default" in action.help else f"(default: {action.default})"
            assert "default" in action.help or shown in text, (name, action.option_strings)


def run(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "batchspec", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_version_and_unknown_commands():
    done = run("--version")
    assert done.returncode == 0 and done.stdout.startswith("batchspec ")
    done = run("sevre")
    assert done.returncode == 2 and "unknown command 'sevre'" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("args, complaint", [
    (["--max-new-tokens", "-1", "hi"], "--max-new-tokens"),
    (["--seed", "-1", "hi"], "--seed"),
    (["--token-ids", "1,abc"], "--token-ids"),
    (["--top-p", "1.5", "hi"], "--top-p"),
    ([], "give a prompt"),
])
def test_a_users_mistake_is_a_usage_error_not_a_traceback(args, complaint):
    done = run("generate", *args)
    assert done.returncode == 2, done.stderr
    assert complaint in done.stderr and "usage:" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_generate_without_a_server_says_how_to_start_one():
    done = run("generate", "--address", f"127.0.0.1:{free_port()}", "--timeout", "5", "hi")
    assert done.returncode == 1 and "batchspec serve" in done.stderr
    assert "Traceback" not in done.stderr
