"""Servers started with different flags, served the same prompts in turns: tokens a second
of each, its speed over the first server round by round, and whether its answers equal the
first server's.

    python3 scripts/ab_servers.py --server plain-f32="--draft-model none --dtype float32" \
        --server plain="--draft-model none" --server default="" --concurrency 1,8 --rounds 3

Every server is `batchspec serve` with its flags (`--build NAME=DIR`: imported from the source
tree DIR, so two builds are measured in one run), started once and kept; at each client count
every server first answers one untimed request per client, then each round serves the whole
prompt set to C closed-loop clients (each sends its next request when its last one ended),
the servers taken in turn and their order reversed every other round, so a machine whose
speed drifts moves them alike. Chat prompts through the target's template; greedy requests,
or with --temperature sampled ones (prompt i's request seeded i, so every server answers the
same seeded requests and a plain server's answers are the yardstick's).
"""
import argparse
import os
import shlex
import statistics
import subprocess
import sys

from batchspec import cliargs


def parse_pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, not {text!r}")
    return name, value


def parse_server(text: str) -> tuple[str, list[str]]:
    name, flags = parse_pair(text)
    return name, shlex.split(flags)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server", type=parse_server, action="append", required=True,
                        help="NAME=FLAGS of `batchspec serve` (repeat; the first is the "
                             "yardstick)")
    parser.add_argument("--build", type=parse_pair, action="append", default=[],
                        help="NAME=DIR: server NAME runs the source tree DIR (a checkout of "
                             "another commit) instead of the installed batchspec")
    parser.add_argument("--concurrency", default="1", help="client counts, comma-separated")
    parser.add_argument("--rounds", type=cliargs.positive_int, default=3)
    parser.add_argument("--prompts", default=None,
                        help="JSONL file of {\"prompt\": ...} (default: the packaged set)")
    parser.add_argument("--num-prompts", type=cliargs.positive_int, default=16)
    parser.add_argument("--max-new-tokens", type=cliargs.positive_int, default=64)
    parser.add_argument("--target", default="smollm2", help="the tokenizer's model")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sample every request at this temperature (default: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="the sampled requests' top_p")
    parser.add_argument("--log-dir", default=None,
                        help="keep each server's log (its services' start-up included) in "
                             "DIR/NAME.log (default: discarded)")
    args = parser.parse_args()
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        parser.error("--temperature must be >= 0 and --top-p in (0, 1]")
    clients = [int(c) for c in args.concurrency.split(",") if c]
    names = [name for name, _ in args.server]
    if len(set(names)) != len(names):
        parser.error("each --server needs its own name")
    builds = {name: os.path.abspath(tree) for name, tree in args.build}
    if args.log_dir:
        if os.path.exists(args.log_dir) and not os.path.isdir(args.log_dir):
            parser.error(f"--log-dir {args.log_dir}: exists and is not a directory")
        os.makedirs(args.log_dir, exist_ok=True)
    if set(builds) - set(names) or not all(os.path.isdir(t) for t in builds.values()):
        parser.error("--build takes NAME=DIR, a NAME of --server and a source tree DIR")

    from batchspec.runtime import models
    from batchspec_tools.data import bench_prompts
    from batchspec_tools.processes import free_port, wait_healthy

    tokenizer = models.load_tokenizer(args.target)
    prompts = [models.chat_ids(tokenizer, r["prompt"])
               for r in bench_prompts(args.num_prompts, args.prompts)]
    procs, ports = {}, {}
    try:
        for name, flags in args.server:
            ports[name] = free_port()
            # a build's tree first on the path: the working directory (`-m` puts it first)
            # and PYTHONPATH (for the services it starts)
            tree = builds.get(name)
            env = dict(os.environ, PYTHONPATH=tree) if tree else None
            log = open(os.path.join(args.log_dir, f"{name}.log"), "w") if args.log_dir \
                else subprocess.DEVNULL
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "batchspec_tools.cli", "serve", "--port",
                 str(ports[name]), *flags],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tree)
            if log is not subprocess.DEVNULL:
                log.close()  # the server holds its own copy
            wait_healthy(f"127.0.0.1:{ports[name]}", "batchspec.v1.Coordinator", 900,
                         [procs[name]])
            print(f"started {name}: batchspec serve {shlex.join(flags)}", flush=True)
        runs = measure(ports, names, prompts, clients, args)
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(timeout=60)
    report(runs, names, clients)
    return 0


def measure(ports: dict, names: list[str], prompts, clients, args) -> dict:
    """{(name, clients): [(tok/s, traces) per round]}."""
    import grpc

    from batchspec.v1 import generate_pb2_grpc
    from batchspec_tools.bench import arrivals

    channels = {n: grpc.insecure_channel(f"127.0.0.1:{ports[n]}") for n in names}
    stubs = {n: generate_pb2_grpc.CoordinatorStub(c) for n, c in channels.items()}
    runs: dict[tuple[str, int], list] = {}
    sampled = dict(temperature=args.temperature, top_p=args.top_p) if args.temperature else {}
    fields = (lambda i: dict(sampled, seed=i)) if sampled else None
    for count in clients:
        for name in names:  # untimed: a request per client
            arrivals.run_closed_loop(stubs[name], prompts[:count], args.max_new_tokens, count,
                                     fields)
        for round_ in range(args.rounds):
            for name in names if round_ % 2 == 0 else names[::-1]:
                traces, seconds = arrivals.run_closed_loop(stubs[name], prompts,
                                                           args.max_new_tokens, count, fields)
                rate = sum(len(t.token_ids) for t in traces) / seconds
                runs.setdefault((name, count), []).append((rate, traces))
                print(f"{name} clients {count} round {round_}: {rate:.1f} tok/s", flush=True)
    for channel in channels.values():
        channel.close()
    return runs


def report(runs: dict, names: list[str], clients: list[int]) -> None:
    from batchspec_tools.bench import arrivals

    first = names[0]
    print(f"\n| server | clients | tok/s (median; rounds) | over {first} (median; range) "
          f"| answers equal to {first}'s |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for count in clients:
        base = runs[(first, count)]
        reference = [t.token_ids for t in base[0][1]]
        for name in names:
            found = runs[(name, count)]
            rates = [r for r, _ in found]
            ratios = [r / b for (r, _), (b, _) in zip(found, base)]
            equal = min(arrivals.exact_share(traces, reference) for _, traces in found)
            spread = f"{min(ratios):.2f}-{max(ratios):.2f}"
            print(f"| {name} | {count} | {statistics.median(rates):.1f}; "
                  f"{', '.join(f'{r:.1f}' for r in rates)} | "
                  f"{statistics.median(ratios):.2f}x; {spread} | {equal:.0%} |")


if __name__ == "__main__":
    sys.exit(main())
