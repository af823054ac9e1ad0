"""The command line as a user meets it: usage errors instead of tracebacks, help that shows
every default, --version, and a clear word when no server is running."""
import argparse
import importlib
import os
import subprocess
import sys

import pytest

from batchspec import cliargs
from batchspec.runtime import service
from batchspec_tools import cli
from batchspec_tools.processes import free_port


def all_parsers() -> dict[str, argparse.ArgumentParser]:
    import coordinator.__main__ as coordinator_main

    service_parser = cliargs.parser("batchspec target")
    service.add_service_arguments(service_parser, 0)
    parsers = {"serve": cli.serve_parser(), "generate": cli.generate_parser(),
               "coordinator": coordinator_main.build_parser(), "target/draft": service_parser}
    for name, module in (("bench", "batchspec_tools.bench.run"),
                         ("distill", "batchspec_tools.drafting.distill"),
                         ("evaluate-draft", "batchspec_tools.drafting.evaluate"),
                         ("loadtest", "batchspec_tools.bench.loadtest")):
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


def test_serve_passes_the_coordinator_its_own_flags_with_their_values():
    """A coordinator flag `serve` takes is the coordinator's declaration itself: same name,
    same default, and what serve forwards parses back to the values serve was given."""
    import coordinator.__main__ as coordinator_main
    from coordinator import config

    serve, coordinator = cli.serve_parser(), coordinator_main.build_parser()
    defaults = serve.parse_args([])
    base = ["--target", "127.0.0.1:1"]
    for flag in cli.serve_flags():
        assert getattr(defaults, flag.dest) == getattr(coordinator.parse_args(base), flag.dest)
    given = serve.parse_args(["-k", "6", "--batch-size", "5", "--draft-policy", "fixed",
                              "--max-queue", "7", "--min-draft-confidence", "0.25",
                              "--metrics-port", "9464"])
    forwarded = coordinator.parse_args(base + config.forward(given, cli.serve_flags()))
    assert (forwarded.num_draft_tokens, forwarded.batch_size, forwarded.draft_policy,
            forwarded.max_queue, forwarded.min_draft_confidence,
            forwarded.metrics_port) == (6, 5, "fixed", 7, 0.25, 9464)
    assert config.engine_config_from_args(forwarded) == config.engine_config_from_args(given)


def test_serve_hosts_the_first_draft_model_in_the_target_unless_told_otherwise():
    """The default pair: the target service hosts the feature head (no draft service of its
    own) and the coordinator names the target as that draft; --draft-host own, or a draft on
    another device, gets a draft service."""
    parser = cli.serve_parser()
    args = parser.parse_args([])
    names = ["auto", "ngram"]
    [(target_cmd, _, _)] = cli.serve_services(args, names)
    assert cli.hosted_draft(args, names) == "auto"
    assert target_cmd[target_cmd.index("--draft-model") + 1] == "smollm2-eagle"
    for flags in (["--draft-host", "own"], ["--draft-device", "meta"]):
        args = parser.parse_args(flags)
        services = cli.serve_services(args, names)
        assert cli.hosted_draft(args, names) is None and len(services) == 2
        assert "--draft-model" not in services[0][0]
        assert "draft_service" in services[1][0]


def test_coordinator_flag_defaults_are_the_config_defaults():
    """Defaults are declared once, in the config dataclasses: parsing no flags builds the
    same config as the dataclasses' own defaults."""
    import coordinator.__main__ as coordinator_main
    from coordinator import config

    args = coordinator_main.build_parser().parse_args(["--target", "127.0.0.1:1"])
    assert config.config_from_args(args) == config.CoordinatorConfig(targets=("127.0.0.1:1",))


@pytest.mark.parametrize("flags, complaint", [
    (["-k", "0"], "num_draft_tokens"),
    (["--port", "99999"], "port must be"),
    (["--http-port", "70000"], "http_port must be"),
    (["--metrics-port", "70000"], "metrics_port must be"),
    (["--step-log", "/no/such/dir/steps.jsonl"], "step_log"),
])
def test_serve_refuses_a_bad_coordinator_value_before_starting_anything(capsys, monkeypatch,
                                                                        flags, complaint):
    def started(*args, **kwargs):
        raise AssertionError("a service was started")

    monkeypatch.setattr(cli, "run_services", started)
    with pytest.raises(SystemExit) as exit_:
        cli.serve(["--draft-model", "none", *flags])
    assert exit_.value.code == 2 and complaint in capsys.readouterr().err


def run(*args, timeout=60, env=None):
    return subprocess.run([sys.executable, "-m", "batchspec_tools", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


@pytest.mark.slow
def test_version_and_unknown_commands():
    done = run("--version")
    assert done.returncode == 0 and done.stdout.startswith("batchspec ")
    done = run("sevre")
    assert done.returncode == 2 and "unknown command 'sevre'" in done.stderr
    assert "Traceback" not in done.stderr


def refusal(capsys, *args) -> str:
    """What `batchspec ARGS` says as it refuses them: a usage error (status 2), in this
    process (test_version_and_unknown_commands runs the command itself)."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(list(args))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err
    return err


@pytest.mark.parametrize("args, complaint", [
    (["--max-new-tokens", "-1", "hi"], "--max-new-tokens"),
    (["--seed", "-1", "hi"], "--seed"),
    (["--seed", str(2**64), "hi"], "--seed"),  # past what the wire carries
    (["--top-k", str(2**31), "hi"], "--top-k"),
    (["--timeout", "-1", "hi"], "--timeout"),
    (["--token-ids", "1,abc"], "--token-ids"),
    (["--top-p", "1.5", "hi"], "--top-p"),
    (["--frequency-penalty", "3", "hi"], "--frequency-penalty"),
    ([], "give a prompt"),
])
def test_a_users_mistake_is_a_usage_error_not_a_traceback(args, complaint, capsys):
    assert complaint in refusal(capsys, "generate", *args)


@pytest.mark.parametrize("args, complaint", [
    (["serve", "--batch-size", "0"], "batch_size"),
    (["serve", "--draft-model", "none,ngram"], "--draft-model"),
    (["serve", "--target-model", "/no/such/model"], "no such file or directory"),
    (["serve", "--device", "gpu"], "device must be"),
    (["serve", "--port", "x"], "--port"),
    (["target", "--model", "./no-such-dir"], "no such file or directory"),
    (["target", "--device", "gpu7"], "device must be"),
    (["target", "--dtype", "float8"], "--dtype"),
    (["target", "--draft-model", "ngram"], "n-gram draft"),
    (["target", "--grace", "-5"], "--grace"),
    (["target", "--metrics-port", "70000"], "metrics_port"),  # was a traceback after loading
    (["target", "--num-layers", "0"], "--num-layers"),
    (["serve", "--startup-timeout", "-1"], "--startup-timeout"),  # was a failure after start
    (["coordinator", "--target", "127.0.0.1:1", "--connect-timeout", "-1"],
     "connect_timeout_s"),
    (["coordinator", "--target", "127.0.0.1:1", "--grace", "-1"], "grace_s"),
    (["draft", "--model", "/no/such/draft"], "no such file or directory"),
    (["draft", "--model", "ngram", "--port", "-5"], "port must be"),
    (["bench", "--concurrency", "1,x"], "--concurrency takes whole numbers"),
    (["bench", "--target", "/no/such"], "no such file or directory"),  # were tracebacks
    (["bench", "--draft", "/no/such"], "no such file or directory"),
    (["evaluate-draft", "--draft", "/no/such/draft"], "no such file or directory"),
    (["distill", "--target", "/no/such/model"], "no such file or directory"),
    (["distill", "--out", "/dev/null/draft"], "cannot write a draft there"),
    (["loadtest", "--out", "/dev/null/report.json"], "cannot write a report file there"),
    (["evaluate-draft", "--draft", "ngram"], "not a model"),
    (["evaluate-draft", "--draft", "smollm2-draft", "--max-new-tokens", "0"], "must be >= 1"),
    (["evaluate-draft", "--draft", "smollm2-eagle", "--num-layers", "2"], "its own number"),
    (["evaluate-draft", "--draft", "smollm2-draft", "--training-data", "/no/such"],
     "not a distill directory"),
    (["health"], "address"),
    (["health", "no-port-here"], "HOST:PORT"),
    (["health", "127.0.0.1:50051", "--timeout", "-1"], "--timeout"),
])
def test_every_command_refuses_bad_arguments_with_its_usage(args, complaint, capsys):
    """Nothing is started: the arguments are refused first (a usage message, status 2)."""
    assert complaint in refusal(capsys, *args)


@pytest.mark.slow
@pytest.mark.parametrize("args, complaint", [
    (["target", "--model", "no-such-owner/no-such-model", "--port", "0"],
     "cannot serve no-such-owner/no-such-model"),
    (["evaluate-draft", "--draft", "no-such-owner/no-such-model"], "cannot load the models"),
    (["distill", "--target", "no-such-owner/no-such-model", "--out", "{tmp}/draft"],
     "cannot load the target"),
])
def test_a_model_that_cannot_be_loaded_is_an_error_not_a_traceback(args, complaint, tmp_path):
    done = run(*[a.format(tmp=tmp_path) for a in args], env={"HF_HUB_OFFLINE": "1"})
    assert done.returncode == 1, done.stderr
    assert complaint in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_generate_without_a_server_says_how_to_start_one():
    done = run("generate", "--address", f"127.0.0.1:{free_port()}", "--timeout", "5", "hi")
    assert done.returncode == 1 and "batchspec serve" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("source, complaint", [("127.0.0.1:{port}", "not reachable"),
                                               ("file:/no/such/replicas", "no target replica")])
def test_a_coordinator_with_no_target_to_reach_is_an_error_not_a_traceback(source, complaint):
    done = run("coordinator", "--target", source.format(port=free_port()),
               "--connect-timeout", "1")
    assert done.returncode == 1, done.stderr
    assert complaint in done.stderr and "cannot start" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_health_of_nothing_says_what_is_not_healthy():
    address = f"127.0.0.1:{free_port()}"
    done = run("health", address, "--timeout", "0.5")
    assert done.returncode == 1
    assert done.stderr.strip() == f"the server at {address} not healthy after 0.5s"


def test_shared_argument_types_refuse_what_they_cannot_be():
    import argparse

    assert cliargs.positive_int("3") == 3 and cliargs.port("50051") == 50051
    for kind, bad in ((cliargs.positive_int, "0"), (cliargs.positive_int, "2.5"),
                      (cliargs.port, "0"), (cliargs.port, "65536"), (cliargs.port, "x")):
        with pytest.raises(argparse.ArgumentTypeError):
            kind(bad)
