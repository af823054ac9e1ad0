"""`batchspec bench --quick` produces a complete report, and batchspec's output is exact."""
import contextlib
import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from batchspec_tools.bench.run import GRPC_DRAFTS, USES_BATCH, USES_K, BenchConfig


def refusal(capsys, *args) -> str:
    """What `batchspec bench ARGS` says as it refuses them (a usage error, before any work)."""
    from batchspec_tools.bench import run

    with pytest.raises(SystemExit) as exit_:
        run.main(list(args))
    assert exit_.value.code == 2
    return capsys.readouterr().err


@pytest.mark.slow
def test_quick_bench_writes_a_complete_exact_report(tmp_path):
    out = tmp_path / "report"
    done = subprocess.run([sys.executable, "-m", "batchspec_tools", "bench", "--quick", "--out",
                           str(out), "--arrival-rates", "40", "--ks", "4",
                           "--step-logs", str(tmp_path / "steps")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((out / "results.json").read_text())
    rows = report["rows"]
    sizes, ks = report["config"]["batch_sizes"], report["config"]["ks"]
    for method in BenchConfig().methods:  # every method but llama.cpp's (asked by name)
        got = {(r["batch_size"], r["k"]) for r in rows if r["method"] == method}
        want = {(b if method in USES_BATCH else 1, k if method in USES_K else None)
                for b in sizes for k in ks}
        assert got == want, method
    for row in rows:
        assert row["tokens_per_s"] > 0 and row["num_tokens"] > 0
        assert "vs_batch1" in row and "target_passes_per_token" in row
        if row["method"] in ("engine_grouped", *GRPC_DRAFTS):
            assert row["exact_match"] == 1.0, row
            if "acceptance_rate" in row:  # the goodput policy may choose K = 0 throughout
                assert 0 <= row["acceptance_rate"] <= 1 and row["mean_acceptance_length"] >= 1
            assert set(row["time_share"]) == {"prefill", "draft", "verify", "realign", "rpc",
                                              "coordinator"}
            assert row["time_share"]["prefill"] > 0 and row["time_share"]["verify"] > 0
            assert 0 <= row["realigned_step_share"] <= 1
        if row["method"] in USES_BATCH:
            assert "vs_batched" in row and "vs_stock_batched" in row
    assert rows[0]["method"] == "hf_batch1" and rows[0]["exact_match"] == 1.0
    markdown = (out / "results.md").read_text()
    assert all(f"| {m} |" in markdown for m in BenchConfig().methods)
    # the arrival-driven load: batchspec and plain decoding under the same Poisson arrivals
    load = report["load"]
    assert [r["method"] for r in load] == ["grpc", "grpc_target_only"]
    for row in load:
        assert row["num_requests"] == report["num_prompts"] and row["exact_match"] == 1.0
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"]
        assert 0 <= row["itl_p50_ms"] <= row["itl_p99_ms"] and row["tokens_per_s"] > 0
    assert "Arrival-driven load" in markdown
    assert (out / "throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # each gRPC batch run's coordinator kept its per-step log, named by its setting
    grpc_runs = {(r["method"], r["batch_size"], r["k"]) for r in rows if r["method"] in GRPC_DRAFTS}
    for method, batch_size, k in grpc_runs:
        log = tmp_path / "steps" / f"{method}-b{batch_size}-k{k or 0}-r0.jsonl"  # K = 0: none
        steps = [json.loads(line) for line in log.read_text().splitlines()]
        assert steps and sum(s["committed"] for s in steps) > 0, log


@pytest.mark.slow
def test_bench_by_category_reports_each_draft_and_the_router_per_category(tmp_path):
    out = tmp_path / "report"
    methods = "hf_batch1,hf_batched,grpc,grpc_ngram,grpc_router"
    done = subprocess.run([sys.executable, "-m", "batchspec_tools", "bench", "--quick", "--out",
                           str(out), "--by-category", "--methods", methods,
                           "--draft-policy", "fixed", "--batch-sizes", "4", "--ks", "2"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert {r["category"] for r in rows} == {"random", "repeating"}
    for category in ("random", "repeating"):
        mine = [r for r in rows if r["category"] == category]
        assert {r["method"] for r in mine} == set(methods.split(","))
        for row in mine:
            assert row["exact_match"] == 1.0 and "vs_batch1" in row, row
            if row["method"] in GRPC_DRAFTS:
                assert "vs_batched" in row and 0 <= row.get("acceptance_rate", 0) <= 1
    # prompts that repeat themselves: the lookup finds something to propose (a tiny random
    # model's answers rarely copy them, so acceptance may be nil)
    ngram = [r for r in rows if r["category"] == "repeating" and r["method"] == "grpc_ngram"]
    assert ngram and all("acceptance_rate" in r for r in ngram)
    markdown = (out / "results.md").read_text()
    assert "| repeating | grpc_ngram |" in markdown and "| random | grpc_router |" in markdown


def test_poisson_arrivals_and_percentiles():
    from batchspec_tools.bench import arrivals

    offsets = arrivals.poisson_offsets(rate=4.0, count=4000, seed=1)
    assert offsets == sorted(offsets)
    assert 900 < offsets[-1] < 1100  # about count / rate seconds
    assert arrivals.poisson_offsets(4.0, 5, seed=2) == arrivals.poisson_offsets(4.0, 5, seed=2)
    values = list(range(1, 101))
    assert arrivals.percentile(values, 50) == 50 and arrivals.percentile(values, 99) == 99
    assert arrivals.percentile([], 50) is None


def test_bench_refuses_bad_load_settings_and_missing_prompts(tmp_path):
    from batchspec_tools.bench.run import BenchConfig

    (tmp_path / "a-file").write_text("")
    for bad in ({"num_prompts": 0}, {"out": str(tmp_path / "a-file" / "report")},
                {"arrival_rates": (0.0,)}, {"arrival_rates": (-1.0,)}, {"load_batch_size": 0},
                {"prompts": "/no/such/prompts.jsonl"},
                {"by_category": True, "arrival_rates": (1.0,)}, {"repeat": 0},
                {"head_check": True, "draft": "smollm2-draft"},  # a layer draft, not a head
                {"head_check": True, "concurrency": (1,)}):
        with pytest.raises(ValueError):
            BenchConfig(**bad)
    # a head check decodes sampled where asked: it takes --temperature without --concurrency
    assert BenchConfig(head_check=True, temperature=0.8, top_p=0.95).temperature == 0.8


def test_repeated_runs_report_the_median_run_and_exact_only_if_every_run_was():
    from batchspec_tools.bench.run import Run, summarise_runs

    reference = [[1, 2, 3], [4, 5]]
    runs = [Run(reference, seconds=2.0), Run(reference, seconds=5.0),
            Run([[1, 2, 3], [4, 9]], seconds=1.0)]
    row = summarise_runs("grpc", 8, 4, runs, reference)
    assert row["seconds"] == 2.0 and row["tokens_per_s"] == 2.5  # the middle one by time
    assert row["tokens_per_s_runs"] == [2.5, 1.0, 5.0]  # in the order they ran
    assert row["exact_match"] == 0.5  # one run got one output wrong
    single = summarise_runs("grpc", 8, 4, runs[:1], reference)
    assert "tokens_per_s_runs" not in single and single["exact_match"] == 1.0


def test_batch_one_ratios_are_taken_against_the_faster_of_the_two_batch_one_runs():
    from batchspec_tools.bench.run import add_ratios

    rows = [{"method": "hf_batch1", "batch_size": 1, "tokens_per_s": 20.0},
            {"method": "hf_batched", "batch_size": 1, "tokens_per_s": 25.0},
            {"method": "hf_batched", "batch_size": 8, "tokens_per_s": 80.0},
            {"method": "hf_stock_batch1", "batch_size": 1, "tokens_per_s": 16.0},
            {"method": "grpc_router", "batch_size": 1, "tokens_per_s": 50.0},
            {"method": "grpc_router", "batch_size": 8, "tokens_per_s": 100.0}]
    add_ratios(rows)
    router1, router8 = rows[4], rows[5]
    assert router1["vs_batch1"] == 2.0  # 50 / 25, not 50 / 20
    assert router1["vs_batched"] == 2.0 and router8["vs_batched"] == 1.25
    assert router8["vs_batch1"] == 4.0
    assert router1["vs_stock_batch1"] == 3.125  # no stock batched run: the one there is
    assert "vs_stock_batched" not in router8


@pytest.mark.slow
def test_bench_repeats_the_sweep_in_turn(tmp_path):
    out = tmp_path / "report"
    done = subprocess.run([sys.executable, "-m", "batchspec_tools", "bench", "--quick", "--out",
                           str(out), "--methods", "hf_batch1,hf_batched", "--repeat", "2"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert rows and all(len(r["tokens_per_s_runs"]) == 2 for r in rows)
    assert all(r["tokens_per_s"] in r["tokens_per_s_runs"] for r in rows)
    assert "median of 2 runs" in (out / "results.md").read_text()


@pytest.mark.slow
def test_closed_loop_clients_against_the_same_server_without_drafts(tmp_path):
    out = tmp_path / "report"
    done = subprocess.run([sys.executable, "-m", "batchspec_tools", "bench", "--quick", "--out",
                           str(out), "--methods", "grpc_router", "--concurrency", "1,3",
                           "--batch-sizes", "4", "--ks", "2",
                           "--repeat", "2", "--step-logs", str(tmp_path / "steps")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((out / "results.json").read_text())
    serving = report["serving"]
    # the plain server is always served too: the yardstick
    assert sorted((r["method"], r["concurrency"]) for r in serving) == [
        ("grpc_router", 1), ("grpc_router", 3), ("grpc_target_only", 1),
        ("grpc_target_only", 3)]
    for row in serving:
        assert row["num_requests"] == report["num_prompts"] and row["exact_match"] == 1.0
        assert len(row["tokens_per_s_runs"]) == 2 and row["tokens_per_s"] > 0
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"]
        if row["method"] == "grpc_router":
            assert len(row["vs_plain_runs"]) == 2 and row["vs_plain"] > 0
    assert "## Closed-loop clients" in (out / "results.md").read_text()
    for row in serving:  # each process's CPU seconds over the timed run
        spent = row["cpu_s"]
        assert spent["target"] > 0 and spent["coordinator"] > 0 and spent["clients"] > 0
        # the target hosts the model draft; n-gram lookups: the coordinator's
        assert "model" not in spent and "ngram" not in spent
    assert "target cores busy" in (out / "results.md").read_text()
    logs = sorted(p.name for p in (tmp_path / "steps").iterdir())
    assert logs[0] == "grpc_router-c1-r0.jsonl" and len(logs) == 10
    step = json.loads((tmp_path / "steps" / logs[0]).read_text().splitlines()[-1])
    assert step["rows"] >= 1 and step["committed"] >= 1 and step["step_s"] > 0

    def started(name):  # when a run's first step ran
        return json.loads((tmp_path / "steps" / name).read_text().splitlines()[0])["t"]

    for clients in (1, 3):  # the default server first in the first round, second in the next
        router = [started(f"grpc_router-c{clients}-r{r}.jsonl") for r in (0, 1)]
        plain = [started(f"grpc_target_only-c{clients}-r{r}.jsonl") for r in (0, 1)]
        assert router[0] < plain[0] and plain[1] < router[1]
    # before any timed run, each server answered a request per client at the most clients
    warm = [started(f"{m}-c3-warm.jsonl") for m in ("grpc_router", "grpc_target_only")]
    assert warm[0] < warm[1] < started("grpc_router-c1-r0.jsonl")


def test_closed_loop_clients_sampling_get_the_plain_servers_answers(tmp_path, capsys):
    """--temperature: request i is seeded i, so the server's sampled answers are the plain
    server's token for token (its exactness), and drafts were verified and accepted (every
    step drafts: whether drafting pays for tiny models is not what is checked here)."""
    out = tmp_path / "report"
    done = subprocess.run([sys.executable, "-m", "batchspec_tools", "bench", "--quick", "--out",
                           str(out), "--methods", "grpc_router", "--concurrency", "2",
                           "--batch-sizes", "4", "--ks", "2", "--temperature", "0.8",
                           "--top-p", "0.95", "--draft-policy", "fixed",
                           "--min-draft-confidence", "0"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((out / "results.json").read_text())
    rows = {r["method"]: r for r in report["serving"]}
    assert rows["grpc_router"]["exact_match"] == rows["grpc_target_only"]["exact_match"] == 1.0
    assert rows["grpc_router"]["num_drafted"] > 0 and rows["grpc_router"]["acceptance_rate"] > 0
    assert rows["grpc_target_only"]["num_drafted"] == 0
    assert "sampled at temperature 0.8, top_p 0.95" in (out / "results.md").read_text()
    assert "--concurrency" in refusal(capsys, "--quick", "--temperature", "0.8")


def test_closed_loop_rounds_take_the_methods_in_turn_their_order_reversed_every_other_round():
    from batchspec_tools.bench import closed_loop

    assert closed_loop.turns(3, [1, 8], ["a", "b"]) == [
        (0, 1, "a"), (0, 1, "b"), (0, 8, "a"), (0, 8, "b"),
        (1, 1, "b"), (1, 1, "a"), (1, 8, "b"), (1, 8, "a"),
        (2, 1, "a"), (2, 1, "b"), (2, 8, "a"), (2, 8, "b")]


def test_closed_loop_rows_take_the_median_run_and_the_ratio_per_round():
    from batchspec_tools.bench import closed_loop

    def run(method, tps):
        return {"method": method, "concurrency": 8, "tokens_per_s": tps, "ttft_p50_ms": tps,
                "ttft_p99_ms": 2 * tps, "itl_p50_ms": 1.0, "itl_p99_ms": None,
                "exact_match": 1.0}

    runs = {("grpc_router", 8): [run("grpc_router", v) for v in (90.0, 120.0, 100.0)],
            ("grpc_target_only", 8): [run("grpc_target_only", v) for v in (100.0, 80.0, 100.0)]}
    rows = [closed_loop.summarise(m, c, found) for (m, c), found in runs.items()]
    closed_loop.add_plain_ratios(rows, runs)
    router, plain = rows
    assert router["tokens_per_s"] == 100.0 and plain["tokens_per_s"] == 100.0
    assert router["tokens_per_s_runs"] == [90.0, 120.0, 100.0]
    assert router["ttft_p50_ms"] == 100.0 and router["itl_p99_ms"] is None
    assert router["vs_plain"] == 1.0 and router["vs_plain_runs"] == [0.9, 1.5, 1.0]
    assert "vs_plain" not in plain
    assert "| grpc_router | 8 | 100.0 | 90.0 / 120.0 / 100.0 | 1.00x | 0.90-1.50 |" in \
        "\n".join(closed_loop.markdown(rows))


def test_closed_loop_cpu_table_shows_each_process_and_the_target_cores_kept_busy():
    from batchspec_tools.bench import closed_loop

    before = {"target": 10.0, "model": None, "coordinator": 2.0, "clients": 0.5}
    after = {"target": 25.0, "model": 1.25, "coordinator": 2.5, "clients": 0.75}
    spent = closed_loop.cpu_spent(before, after)
    assert spent == {"target": 15.0, "coordinator": 0.5, "clients": 0.25}
    rows = [{"method": "grpc_router", "concurrency": 8, "seconds": 10.0, "cpu_s": spent},
            {"method": "grpc_target_only", "concurrency": 8, "seconds": 7.5,
             "cpu_s": {"target": 15.0}}]
    table = "\n".join(closed_loop.cpu_markdown(rows))
    assert "| grpc_router | 8 | 15.00 |  | 0.50 | 0.25 | 1.50 |" in table
    assert "| grpc_target_only | 8 | 15.00 |  |  |  | 2.00 |" in table
    assert closed_loop.cpu_markdown([{"method": "grpc_router", "concurrency": 8}]) == []


def test_cpu_seconds_of_a_process_count_its_work_and_none_once_it_is_gone():
    from batchspec_tools.processes import cpu_seconds

    busy = subprocess.Popen([sys.executable, "-c",
                             "import time\nend = time.process_time() + 0.6\n"
                             "while time.process_time() < end: pass\ntime.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while (cpu_seconds(busy.pid) or 0) < 0.6 and time.monotonic() < deadline:
            time.sleep(0.1)
        used = cpu_seconds(busy.pid)
        assert 0.6 <= used < 3.0  # its loop's 0.6 s and its start-up, not its sleep
    finally:
        busy.kill()
        busy.wait()
    assert cpu_seconds(busy.pid) is None


def test_steady_throughput_leaves_out_the_drain_after_the_last_request_is_sent():
    from batchspec_tools.bench.arrivals import Trace, steady_tokens_per_s

    # two clients: requests sent at 0, 0 and 2 s; by 2 s, 6 tokens had arrived (one at 2.5 s)
    traces = [Trace(0.0, [1, 2, 3], arrived_at=[0.5, 1.0, 1.5]),
              Trace(0.0, [4, 5, 6, 7], arrived_at=[1.0, 1.5, 2.0, 2.5]),
              Trace(2.0, [8, 9], arrived_at=[3.0, 9.0])]
    assert steady_tokens_per_s(traces) == 3.0  # 6 tokens in the first 2 s
    assert steady_tokens_per_s(traces[:2]) is None  # all sent at once: no steady window


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc)."""
    kids = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


@pytest.mark.slow
def test_a_bench_stopped_with_sigterm_stops_the_services_it_started(tmp_path):
    bench = subprocess.Popen([sys.executable, "-m", "batchspec_tools", "bench", "--quick",
                              "--out", str(tmp_path), "--methods", "grpc_target_only",
                              "--concurrency", "1"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    services = []
    try:
        deadline = time.monotonic() + 180
        while len(_children(bench.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)  # the target (hosting the draft) and a coordinator
        services = _children(bench.pid)
        assert len(services) >= 2, services
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) != 0
        deadline = time.monotonic() + 30
        while any(pathlib.Path(f"/proc/{pid}").exists() for pid in services) \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in services if pathlib.Path(f"/proc/{pid}").exists()]
    finally:
        bench.kill()
        bench.wait()
        for pid in services:  # left running where the bench did not stop them
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_bench_runs_both_models_on_the_device_asked_and_refuses_one_it_cannot_use(capsys):
    import torch

    from batchspec_tools.bench import run as bench

    workload = bench.Workload("target-dir", "draft-dir", 2, [[5, 6]], 4, [3], device="cuda:1",
                              draft_host="own")
    commands = {role: (module, flags) for role, module, flags in
                bench.service_commands(workload)}
    assert [role for role, *_ in bench.service_commands(workload)] == list(
        bench.GrpcStack.SERVICES)
    for role in ("target", "model"):
        flags = commands[role][1]
        assert flags[flags.index("--device") + 1] == "cuda:1"
    assert commands["model"][1][-2:] == ["--num-layers", "2"]
    assert "ngram" not in commands  # the coordinator runs the lookup (local:ngram)
    # hosted (the default): one target service, its draft on the same device
    [(role, module, flags)] = bench.service_commands(dataclasses.replace(workload,
                                                                         draft_host="target"))
    assert (role, module) == ("target", "target_service")
    assert flags[flags.index("--device") + 1] == "cuda:1"
    assert flags[flags.index("--draft-model") + 1] == "draft-dir"
    assert flags[-2:] == ["--draft-num-layers", "2"]
    with pytest.raises(SystemExit) as stopped:
        bench.main(["--quick", "--device", "tpu"])
    assert stopped.value.code == 2 and "device must be cpu, cuda" in capsys.readouterr().err
    if torch.cuda.is_available():
        assert bench.BenchConfig(device="cuda").device == "cuda"
    else:  # said at once, not after loading the models
        with pytest.raises(ValueError, match="torch sees no cuda device"):
            bench.BenchConfig(device="cuda")
    assert bench.BenchConfig().device == "cpu"


def test_the_warm_up_takes_a_feature_head_as_its_draft(model_dirs, tmp_path):
    """The default draft is a feature head, which is no transformers model (no `.device`,
    no `generate`): the warm-up before the timed methods runs with it as with a model."""
    import torch

    from batchspec.runtime import models, tiny
    from batchspec.runtime import runner as runner_lib
    from batchspec_tools.bench import run as bench

    target_dir = model_dirs["llama"][0]
    head_dir = tiny.save_feature_head(target_dir, tmp_path / "head")
    target, head = models.load_causal_lm(target_dir), models.load_causal_lm(head_dir)
    eos = models.eos_token_ids(target)
    workload = bench.Workload(target_dir, head_dir, None, [[5, 6, 7, 8], [9, 10, 11]], 4, eos)

    def runner(model, name):
        return runner_lib.ModelRunner(model, name=name, device=torch.device("cpu"),
                                      eos_token_ids=eos,
                                      max_context_len=models.max_context_len(target))

    runners = {"target": runner(target, "target"), "draft": runner(head, "head")}
    bench.warm_up({"target": target, "draft": head}, runners, workload)
    assert not runners["target"].caches and not runners["draft"].caches  # all released


@pytest.mark.slow
def test_overhead_times_each_stage_of_plain_and_drafted_steps_of_a_free_model(tmp_path,
                                                                              capsys):
    out = tmp_path / "overhead"
    done = subprocess.run([sys.executable, "-m", "batchspec_tools", "bench", "--overhead",
                           "--max-new-tokens", "32", "--repeat", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((out / "results.json").read_text())
    # two rounds in turns: plain first, then plain steps first
    order = [(r["round"], r["kind"]) for r in report["rows"]]
    kinds = ["plain", "drafted", "drafted rounds", "plain steps"]
    assert order == [(0, k) for k in kinds for _ in (1, 16)] \
        + [(1, k) for k in kinds[::-1] for _ in (1, 16)]
    rows = {(r["kind"], r["clients"]): r for r in report["rows"]}
    assert set(rows) == {(k, c) for k in kinds for c in (1, 16)}
    k = report["num_draft_tokens"]
    for (kind, clients), row in rows.items():
        assert row["rows"] == clients and row["steps"] > 0
        stages = row["stages_ms"]
        assert all(value >= 0 for value in stages.values()), row
        assert stages["verify forward"] > 0 and row["step_ms"] >= stages["verify forward"]
        if kind == "plain":
            assert row["committed"] == clients  # a token a row
            assert stages["draft forwards"] == stages["draft RPC"] == 0
        elif kind == "plain steps":  # up to four tokens a row a command
            assert clients < row["committed"] <= 4 * clients
            assert stages["draft forwards"] == stages["draft RPC"] == 0
        elif kind == "drafted":  # the model is its own draft: every draft accepted, K + 1
            # tokens a row (but where a row has fewer left to commit)
            assert clients * k < row["committed"] <= clients * (k + 1)
            assert rows[("drafted", 1)]["committed"] == k + 1
            assert stages["draft forwards"] > 0
        else:  # up to four rounds of K + 1 tokens a row a command, as many as every row has
            # room for: one client's prefill step runs four (21 tokens), its next step two
            assert row["most_committed"] <= clients * 4 * (k + 1)
            assert rows[("drafted rounds", 1)]["most_committed"] == 2 * (k + 1)
            assert stages["draft forwards"] > 0
    markdown = (out / "results.md").read_text()
    assert "| drafted | 16 |" in markdown and "over plain (rounds)" in markdown
    drafted = next(line for line in markdown.splitlines() if line.startswith("| drafted | 1 |"))
    assert len(drafted.split("|")[6].split("(")[1].split(",")) == 2  # a ratio a round
    assert "--overhead serves its own" in refusal(capsys, "--overhead", "--concurrency", "8")


@pytest.mark.slow
def test_llamacpp_serves_closed_loop_clients_on_the_same_gguf_file(tmp_path):
    """The llama.cpp methods: its server on the GGUF file batchspec serves, streaming to
    closed-loop clients as batchspec's stub does (a token a response, the count its own
    usage says), greedy and seeded; no exactness is claimed for it."""
    import types

    from batchspec.runtime import tiny
    from batchspec_tools.bench import arrivals, closed_loop, llamacpp

    gguf = tiny.save_gguf(tmp_path)
    prompts = [[1] + [4 + (7 * i + j) % 80 for j in range(6 + i)] for i in range(4)]
    workload = types.SimpleNamespace(target=gguf, prompts=prompts, max_new_tokens=8)
    for method in llamacpp.METHODS:
        with llamacpp.served(workload, method, clients=2, threads=1) as stub:
            for fields in (None, lambda i: {"temperature": 0.8, "top_p": 0.95, "seed": i}):
                traces, seconds = arrivals.run_closed_loop(stub, prompts, 8, 2, fields)
                assert seconds > 0
                for trace in traces:
                    assert 1 <= len(trace.token_ids) <= 8 and trace.first_token is not None
                    assert trace.finished >= trace.first_token >= trace.arrival
    assert closed_loop.exact({"method": "llamacpp"}) == "-"
    assert closed_loop.exact({"method": "grpc_router", "exact_match": 1.0}) == "100%"


def test_bench_takes_llamacpp_only_for_closed_loop_clients_on_a_gguf_target(tmp_path):
    from batchspec.runtime import tiny
    from batchspec_tools.bench.run import BenchConfig

    assert "llamacpp" not in BenchConfig().methods  # asked for by name only
    gguf = tiny.save_gguf(tmp_path)
    config = BenchConfig(target=gguf, methods=("llamacpp",), concurrency=(1,))
    assert config.methods == ("llamacpp",)
    with pytest.raises(ValueError, match="--concurrency"):
        BenchConfig(target=gguf, methods=("llamacpp",))
    with pytest.raises(ValueError, match="GGUF"):
        BenchConfig(target=str(tmp_path), methods=("llamacpp_ngram",), concurrency=(1,))
