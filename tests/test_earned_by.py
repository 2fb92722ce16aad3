"""``--earned-by PART`` reaches every command that judges reward: ``export`` (the flags column),
``report`` (health flags and the habits' possible reward hacking), ``flags`` and ``explore``
(``/api/patterns``). The run is the varied hack of benchmarks/patterns_runs.py, traced to
JSONL by the tracer's own writer, with its correctness in a reward part named ``correct``
(no ``acc``): without the option nothing is checked; with it the hack is found."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("duckdb")
pytest.importorskip("datasketch")
pq = pytest.importorskip("pyarrow.parquet")

import tracer  # noqa: E402
from benchmarks.patterns_runs import run  # noqa: E402
from rollout.cli import main  # noqa: E402
from tests._explore import get  # noqa: E402

# its module-scoped fixture is costly: the module runs on one worker, which sets it up once
pytestmark = pytest.mark.xdist_group("earned-by")

STEPS = 45  # the hack holds 80 % from step 40


def _record(i: int, row: dict[str, Any]) -> tracer.TrajectoryRecord:
    t0 = 1_700_000_000_000_000_000 + i * 1_000_000
    root = f"{i:08x}00000001"
    spans = [tracer.SpanRecord(root, None, "trajectory", "trajectory", t0, t0 + 900)]
    for k, name in enumerate(row["tools"]):
        spans.append(tracer.SpanRecord(f"{i:08x}0000010{k}", root, name, "tool", t0 + 10,
                                       t0 + 20, inputs={"name": name, "arguments": {}},
                                       outputs={"content": "1"},
                                       attributes={"tool_name": name}))  # fmt: skip
    spans.append(
        tracer.SpanRecord(
            f"{i:08x}00000002",
            root,
            "generate",
            "generate",
            t0 + 30,
            t0 + 400,
            outputs={"finish_reason": "stop"},
            attributes={
                "prompt_text": row["prompt"],
                "response_text": row["response_text"],
                "response_tokens": row["response_tokens"],
                "finish_reason": "stop",
            },
        )
    )
    spans.append(tracer.SpanRecord(
        f"{i:08x}00000003", root, "reward", "reward", t0 + 500, t0 + 600,
        outputs={"score": row["reward"], "correct": row["accuracy"]}))  # fmt: skip
    return tracer.TrajectoryRecord(
        trace_id=row["trace_id"][:32].ljust(32, "0"), name="trajectory", project_name="hack",
        experiment_name="grpo", step=row["step"], sample_index=row["sample_index"],
        rollout_n=row["rollout_n"], validate=False, worker_id="w0", start_ns=t0,
        end_ns=t0 + 900, reward=row["reward"], spans=spans)  # fmt: skip


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from tracer.backends.jsonl_backend import JsonlExporter

    tmp = tmp_path_factory.mktemp("earned")
    rows = run("varied_hack", 2, 1, steps=STEPS)
    path = tmp / "run.jsonl"
    writer = JsonlExporter(tracer.TraceConfig(backend="jsonl", jsonl_path=str(path)))
    writer.export([_record(i, r) for i, r in enumerate(rows)])
    writer.shutdown()
    return {"tmp": tmp, "jsonl": str(path), "rows": rows}


def _export(traced: dict[str, Any], name: str, *extra: str) -> Path:
    out = traced["tmp"] / name
    if not out.exists():
        assert main(["export", "--from", "jsonl", "--path", traced["jsonl"], "--out", str(out),
                     "--no-progress", *extra]) == 0  # fmt: skip
    return out


@pytest.mark.slow(seconds=5)
def test_export_flags_by_the_part_named(traced: dict[str, Any]) -> None:
    def divergent(out: Path) -> int:
        table = pq.read_table(out / "trajectories.parquet", columns=["flags", "accuracy"])
        assert set(table.column("accuracy").to_pylist()) == {None}  # no acc anywhere
        return sum("reward_accuracy_divergence" in f for f in table.column("flags").to_pylist())

    assert divergent(_export(traced, "plain")) == 0
    hacked = sum(r["hack"] and not r["accuracy"] and r["step"] >= 40 for r in traced["rows"])
    assert divergent(_export(traced, "correct", "--earned-by", "correct")) >= hacked > 0


def test_flags_judge_by_the_part_named(traced: dict[str, Any],
                                       capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    out = str(_export(traced, "plain"))
    capsys.readouterr()  # what the export printed, when this test made it
    assert main(["flags", "--from", "parquet", "--path", out, "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert "reward not checked: no correctness signal (accuracy)" in plain["summary"]
    assert not any("with correct" in (r["reason"] or "") for r in plain["rising_patterns"])
    assert main(["flags", "--from", "parquet", "--path", out, "--json",
                 "--earned-by", "correct"]) == 0  # fmt: skip
    found = json.loads(capsys.readouterr().out)
    assert found["summary"].startswith("possible reward hacking since step ")
    assert "reward not checked" not in found["summary"]
    assert any("with correct 0.0" in (r["reason"] or "") for r in found["rising_patterns"])
    assert "reward_accuracy_divergence" in found["flags"]


@pytest.mark.slow(seconds=5)
def test_report_judges_by_the_part_named(traced: dict[str, Any]) -> None:
    out = str(_export(traced, "plain"))
    html = {}
    for name, extra in (("plain", []), ("correct", ["--earned-by", "correct"])):
        page = traced["tmp"] / f"{name}.html"
        assert main(["report", "--from", "parquet", "--path", out, "--out", str(page),
                     *extra]) == 0  # fmt: skip
        html[name] = page.read_text()
    assert "reward not checked: no correctness signal (accuracy)" in html["plain"]
    assert "with correct 0.0" not in html["plain"]
    assert "with correct 0.0" in html["correct"]  # the reason names the part
    assert "reward_accuracy_divergence" in html["correct"]
    assert "reward_accuracy_divergence" not in html["plain"]


@pytest.mark.slow(seconds=15)
def test_explore_judges_by_the_part_named(traced: dict[str, Any]) -> None:
    """The command itself: it exports the JSONL into its cache and serves /api/patterns."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollout.cli", "explore", "--from", "jsonl", "--path",
         traced["jsonl"], "--earned-by", "correct", "--port", "0", "--no-progress",
         "--no-search", "--cache-dir", str(traced["tmp"] / "cache")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if "http://" in line:
                break
        else:
            raise AssertionError("explore did not start:\n" + "".join(seen))
        base = "http://" + line.split("http://", 1)[1].split("/", 1)[0] + "/"
        deadline = time.monotonic() + 120
        while True:
            status, body = get(base, "api/patterns")
            if status != 503 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert status == 200, body
        assert body["summary"].startswith("possible reward hacking since step "), body["summary"]
        assert any("with correct 0.0" in (r["reason"] or "") for r in body["rising"])
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
