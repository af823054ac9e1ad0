"""`batchspec steps` (batchspec_tools.bench.steps), fed hand-made step logs: what drafting cost
net, against the same run's plain steps of about as many rows."""
import json
import subprocess
import sys

import pytest

from batchspec_tools.bench import steps as step_summary


def load():
    return step_summary


def step(t: float, rows: int, drafts: int, committed: int, seconds: float) -> dict:
    return {"t": t, "step": int(t), "rows": rows, "drafts": [drafts] * rows,
            "committed": committed, "step_s": seconds, "verify_s": seconds * 0.9,
            "verify_compute_s": seconds * 0.8, "prefill_target_s": 0.0}


def test_drafting_net_is_weighed_against_plain_steps_of_its_bucket():
    summary = load()
    plain = [step(i, 8, 0, 8, 0.05) for i in range(5)] + \
        [step(5 + i, 32, 0, 32, 0.1) for i in range(5)]
    # 8 rows committing 12 tokens in 60 ms: plain steps would take 75 ms for them
    gaining = plain + [step(20, 8, 1, 12, 0.06)]
    assert summary.drafting_net_s(gaining) == pytest.approx(0.06 - 12 * 0.05 / 8)
    # 7 rows (the 5-8 bucket) and 30 rows (17-32) each against their own bucket's plain steps
    losing = plain + [step(21, 7, 1, 9, 0.09), step(22, 30, 1, 40, 0.3)]
    assert summary.drafting_net_s(losing) == pytest.approx(
        (0.09 - 9 * 0.05 / 8) + (0.3 - 40 * 0.1 / 32))
    # 2 rows: no plain step of its bucket; the nearest measured one (5-8) stands in
    assert summary.drafting_net_s(plain + [step(23, 2, 1, 3, 0.02)]) == pytest.approx(
        0.02 - 3 * 0.05 / 8)
    assert summary.drafting_net_s([step(0, 8, 1, 12, 0.06)]) is None  # nothing to weigh by
    assert summary.drafting_net_s(plain) is None  # nothing drafted: no cost to report


def test_the_table_reports_the_net_cost_per_method(tmp_path):
    plain = [step(i, 8, 0, 8, 0.05) for i in range(5)]
    logs = {"grpc_router-c8-r0.jsonl": plain + [step(9, 8, 2, 16, 0.2)],
            "grpc_target_only-c8-r0.jsonl": plain}
    for name, steps in logs.items():
        (tmp_path / name).write_text("".join(json.dumps(s) + "\n" for s in steps))
    out = subprocess.run([sys.executable, "-m", "batchspec_tools", "steps", str(tmp_path)],
                         capture_output=True, text=True, check=True).stdout
    router = next(line for line in out.splitlines() if line.startswith("| grpc_router |"))
    assert "| +0.10 |" in router  # 200 ms for what plain steps commit in 100
    plain_server = next(line for line in out.splitlines()
                        if line.startswith("| grpc_target_only |"))
    assert plain_server.split("|")[6].strip() == "-"  # no drafted steps, no net figure


def timed(t: float, kinds: list, drafts: list, committed: int, ms: dict) -> dict:
    """A step of len(kinds) rows whose stages took `ms` (as STAGES names them)."""
    seconds = {k: v / 1000 for k, v in ms.items()}
    draft_forward = seconds["draft forwards"]
    draft_compute = draft_forward + seconds["draft service"]
    draft = draft_compute + seconds["draft RPC"]
    verify_forward = seconds["verify forward"]
    verify_compute = verify_forward + seconds["verify service"]
    verify = verify_compute + seconds["verify RPC"]
    return {"t": t, "step": int(t), "rows": len(kinds), "kinds": kinds, "drafts": drafts,
            "committed": committed, "step_s": draft + verify + seconds["coordinator"],
            "draft_s": draft, "draft_compute_s": draft_compute, "draft_forward_s": draft_forward,
            "verify_s": verify, "verify_compute_s": verify_compute,
            "verify_forward_s": verify_forward, "prefill_target_s": 0.0, "prefill_draft_s": 0.0}


def test_the_breakdown_splits_steps_by_draft_kind_stage_by_stage(tmp_path):
    summary = load()
    names = [name for name, _ in summary.STAGES]
    plain_ms = dict.fromkeys(names, 0.0) | {"coordinator": 0.5, "verify RPC": 1.0,
                                             "verify service": 0.5, "verify forward": 10.0}
    head_ms = {name: float(i + 1) for i, name in enumerate(names)}  # 1 .. 7 ms, 28 a step
    steps = [timed(i, [None], [0], 1, plain_ms) for i in range(3)]
    steps += [timed(10 + i, [0], [2], committed, head_ms) for i, committed in enumerate((1, 3))]
    steps += [timed(20, [1], [4], 5, head_ms), timed(21, [0, 1], [1, 2], 4, head_ms)]
    steps += [timed(30, [None, None], [0, 0], 2, plain_ms)]  # two rows: not in rows=1
    prefill = timed(40, [0], [2], 3, head_ms)
    prefill["prefill_target_s"] = 0.1  # a step that prefilled is left out
    got = summary.breakdown(steps + [prefill], rows=1)
    assert set(got) == {"plain", "kind 0", "kind 1"}
    assert got["plain"]["count"] == 3 and got["plain"]["step"] == pytest.approx(12.0)
    assert got["plain"]["stages"]["verify forward"] == pytest.approx(10.0)
    head = got["kind 0"]
    assert head["count"] == 2 and head["committed"] == 2 and head["step"] == pytest.approx(28.0)
    assert head["per_token"] == pytest.approx(2 * 28.0 / 4)
    assert [head["stages"][n] for n in names] == pytest.approx([1, 2, 3, 4, 5, 6, 7])
    assert summary.breakdown(steps, rows=2)["mixed"]["count"] == 1
    (tmp_path / "grpc_router-c1-r0.jsonl").write_text(
        "".join(json.dumps(s) + "\n" for s in steps))
    out = subprocess.run([sys.executable, "-m", "batchspec_tools", "steps", str(tmp_path),
                          "--rows", "1"], capture_output=True, text=True, check=True).stdout
    row = next(line for line in out.splitlines() if "| kind 0 |" in line)
    assert [cell.strip() for cell in row.split("|")[4:8]] == ["2", "2.00", "28.00", "14.00"]


@pytest.mark.parametrize("line, complaint", [("garbage", "line 2: not JSON"),
                                             ('{"t": 1}', "line 2: not a step (no step_s")])
def test_a_file_that_is_no_step_log_is_refused_naming_its_line(tmp_path, capsys, line,
                                                                complaint):
    (tmp_path / "grpc-c1-r0.jsonl").write_text(json.dumps(step(0, 1, 0, 1, 0.01)) + "\n" + line)
    with pytest.raises(SystemExit) as exit_:
        step_summary.main([str(tmp_path)])
    assert exit_.value.code == 2 and complaint in capsys.readouterr().err
