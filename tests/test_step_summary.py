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
