"""Export: trajectories traced into a real MLflow store and a JSONL file come back as three
tables (Parquet, read with DuckDB and polars) that match what was traced, row by row."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import pytest

import tracer
from tests import export_agent
from tests.conftest import search_traces

pytest.importorskip("mlflow")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
duckdb = pytest.importorskip("duckdb")
pl = pytest.importorskip("polars")

from rollout.cli import main  # noqa: E402
from tracer.readers import TABLES, export, read_tables  # noqa: E402
from tracer.readers.schema import STEPS  # noqa: E402

PROJECT = "export-test"


@pytest.fixture
def traced(tmp_path: Path, mlflow_uri: str) -> dict[str, Any]:
    jsonl = export_agent.init(str(tmp_path), mlflow_uri, PROJECT)
    expected = export_agent.run([1, 2])
    expected_val = export_agent.run([2], validate=True)
    assert tracer.flush(timeout_s=60)
    return {"jsonl": jsonl, "expected": expected, "val": expected_val, "tmp": tmp_path}


def _export_cli(out: Path, *args: str) -> None:
    assert main(["export", "--out", str(out), "--no-progress", *args]) == 0


def _table(out: Path, name: str) -> list[dict[str, Any]]:
    rows = pq.read_table(out / f"{name}.parquet").to_pylist()
    return sorted(rows, key=lambda r: (r["trace_id"], r.get("turn_index"), r.get("call_index")))


def test_export_matches_what_was_traced(traced: dict[str, Any], mlflow_uri: str) -> None:
    tmp = traced["tmp"]
    _export_cli(tmp / "m", "--from", "mlflow", "--tracking-uri", mlflow_uri,
                "--experiment", PROJECT, "--no-validate")  # fmt: skip
    _export_cli(tmp / "j", "--from", "jsonl", "--path", traced["jsonl"], "--no-validate")

    # both sources give identical tables, row by row
    for name in TABLES:
        assert _table(tmp / "m", name) == _table(tmp / "j", name), name

    trajectories = _table(tmp / "m", "trajectories")
    turns = _table(tmp / "m", "turns")
    calls = _table(tmp / "m", "tool_calls")
    expected = traced["expected"]
    assert len(trajectories) == len(expected) == 12
    # trace ids are MLflow's own (read back through MLflow's client)
    mlflow_ids = {
        t.info.trace_id for t in search_traces(mlflow_uri, PROJECT, "tags.validate = 'false'")
    }
    assert {f"tr-{r['trace_id']}" for r in trajectories} == mlflow_ids
    for row in trajectories:
        want = expected[(row["step"], row["sample_index"], row["rollout_n"])]
        failed = want["error"] is not None
        assert row["reward"] == want["score"]
        assert row["prompt"] == want["prompt"]
        assert json.loads(row["messages"])[1]["content"] == want["prompt"]
        assert row["num_turns"] == 2
        assert row["num_tool_calls"] == 1
        assert row["num_tool_errors"] == int(failed)
        assert row["validate"] is False and row["experiment"] == PROJECT
        assert row["experiment_name"] == "grpo"
        assert row["finish_reason"] == "stop"
        n_prompt = 10 + row["sample_index"]
        assert row["prompt_tokens"] == n_prompt
        assert row["prompt_text"] == " ".join(f"w{i}" for i in range(n_prompt))
        second = want["second"]["response_ids"]
        assert row["response_text"] == " ".join(f"w{i}" for i in second)
        n_resp = len(want["first"]["response_ids"]) + len(second)
        assert row["response_tokens"] == n_resp
        assert row["latency_ms"] > 0 and row["status"] == "OK"
        # behaviour signature: the failed call marked, the answer's numbers masked
        assert row["signature_text"] == (f"tools: calculator{'!' if failed else ''} | finish: "
                                         "stop | answer: " + " ".join(["w<n>"] * len(second)))

        mine = [t for t in turns if t["trace_id"] == row["trace_id"]]
        assert [t["turn_index"] for t in mine] == [0, 1]
        for turn, out in zip(mine, (want["first"], want["second"]), strict=True):
            assert turn["response_text"] == " ".join(f"w{i}" for i in out["response_ids"])
            assert turn["response_tokens"] == len(out["response_ids"])
            assert turn["logprobs"] == out["logprobs"]
            assert turn["finish_reason"] == "stop"
        (call,) = [c for c in calls if c["trace_id"] == row["trace_id"]]
        assert call["name"] == "calculator" and call["turn_index"] == 0
        assert json.loads(call["arguments"]) == {"expression": want["expr"]}
        if failed:
            assert call["status"] == "ERROR" and call["error"] == want["error"]
            assert call["result"] is None
        else:
            assert call["error"] is None and call["result"] == str(eval(want["expr"]))
    keys = {(r["signature_text"], r["signature"]) for r in trajectories}
    assert len({k for _, k in keys}) == len({t for t, _ in keys}) == len(keys) > 1


def test_duckdb_and_polars_query_the_parquet(traced: dict[str, Any], mlflow_uri: str) -> None:
    out = traced["tmp"] / "all"
    _export_cli(out, "--from", "mlflow", "--tracking-uri", mlflow_uri, "--experiment", PROJECT)
    expected = traced["expected"]
    con = duckdb.connect()
    got = con.execute(
        f"SELECT step, avg(reward), sum(num_tool_errors) FROM '{out}/trajectories.parquet' "
        "WHERE NOT validate GROUP BY step ORDER BY step"
    ).fetchall()
    for step, mean, errors in got:
        rewards = [v["score"] for k, v in expected.items() if k[0] == step]
        assert mean == pytest.approx(sum(rewards) / len(rewards))
        assert errors == sum(v["error"] is not None for k, v in expected.items() if k[0] == step)
    joined = con.execute(
        f"SELECT count(*) FROM '{out}/turns.parquet' t JOIN '{out}/trajectories.parquet' j "
        "USING (trace_id) WHERE j.validate"
    ).fetchone()
    assert joined == (2 * len(traced["val"]),)
    df = pl.read_parquet(out / "tool_calls.parquet")
    assert df.height == len(expected) + len(traced["val"])
    failed = [v for v in (*expected.values(), *traced["val"].values()) if v["error"]]
    assert df.filter(pl.col("error").is_not_null()).height == len(failed) == 3


def test_step_and_validate_filters(traced: dict[str, Any], mlflow_uri: str) -> None:
    common = ["--from", "mlflow", "--tracking-uri", mlflow_uri, "--experiment", PROJECT]
    _export_cli(traced["tmp"] / "s2", *common, "--step", "2")
    rows = _table(traced["tmp"] / "s2", "trajectories")
    assert {r["step"] for r in rows} == {2} and len(rows) == 12  # train + validation
    _export_cli(traced["tmp"] / "v", *common, "--steps", "1:5", "--validate", "--format", "jsonl")
    lines = (traced["tmp"] / "v" / "trajectories.jsonl").read_text().splitlines()
    assert len(lines) == len(traced["val"])
    assert all(json.loads(line)["validate"] for line in lines)
    tables = read_tables("jsonl", path=traced["jsonl"], steps=[1])
    assert set(tables.trajectories["step"]) == {1}
    assert len(tables.turns) == 2 * len(tables.trajectories)


def test_bad_arguments_fail_clearly(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", "--from", "jsonl", "--out", "o", "--no-progress"]) == 2
    assert "--path" in capsys.readouterr().err


def _records(n: int, seed: int = 0) -> list[tracer.TrajectoryRecord]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        t0 = 1_700_000_000_000_000_000 + i * 1_000_000
        spans = [
            tracer.SpanRecord(f"{i:08x}00000001", None, "trajectory", "trajectory", t0, t0 + 900),
            tracer.SpanRecord(
                f"{i:08x}00000002",
                f"{i:08x}00000001",
                "generate",
                "generate",
                t0 + 1,
                t0 + 400,
                inputs={"prompt_ids": [1, 2, 3]},
                outputs={"response_ids": [4, 5], "finish_reason": "stop"},
                attributes={
                    "prompt_text": "a b c",
                    "response_text": f"answer {i}",
                    "prompt_tokens": 3,
                    "response_tokens": 2,
                    "finish_reason": "stop",
                },
            ),
            tracer.SpanRecord(
                f"{i:08x}00000003",
                f"{i:08x}00000001",
                "calc",
                "tool",
                t0 + 500,
                t0 + 600,
                inputs={"name": "calc", "arguments": {"x": i}},
                outputs={"content": str(i)},
                attributes={"tool_name": "calc"},
            ),
        ]
        out.append(
            tracer.TrajectoryRecord(
                trace_id=f"{i:032x}",
                name="trajectory",
                project_name="big",
                experiment_name="grpo",
                step=i // 1000,
                sample_index=i % 1000 // 4,
                rollout_n=i % 4,
                validate=False,
                worker_id="w0",
                start_ns=t0,
                end_ns=t0 + 900,
                reward=rng.random(),
                spans=spans,
            )
        )
    return out


def test_ten_thousand_trajectories_export_page_by_page(tmp_path: Path) -> None:
    from tracer.backends.jsonl_backend import JsonlExporter

    path = tmp_path / "big.jsonl"
    writer = JsonlExporter(tracer.TraceConfig(backend="jsonl", jsonl_path=str(path)))
    records = _records(10_000)
    for i in range(0, len(records), 2000):
        writer.export(records[i : i + 2000])
    pages: list[int] = []
    summary = export("jsonl", str(tmp_path / "out"), path=str(path), on_page=pages.append)
    assert pages == [500] * 20 and summary.pages == 20
    meta = pq.ParquetFile(tmp_path / "out" / "trajectories.parquet").metadata
    assert meta.num_rows == 10_000 and meta.num_row_groups == 20
    got = (
        duckdb.connect()
        .execute(
            f"SELECT count(*), sum(reward), count(DISTINCT step) FROM "
            f"'{tmp_path / 'out' / 'trajectories.parquet'}'"
        )
        .fetchone()
    )
    assert got is not None
    assert got[0] == 10_000 and got[2] == 10
    assert got[1] == pytest.approx(sum(r.reward or 0.0 for r in records))


def test_mlflow_export_pages_through_search_traces(tmp_path: Path, mlflow_uri: str) -> None:
    from mlflow.tracing.client import TracingClient
    from mlflow.tracking import MlflowClient

    from tracer.backends.mlflow_backend import mlflow_view, to_mlflow_spans

    exp_id = MlflowClient(mlflow_uri).create_experiment("big")
    records = _records(600, seed=1)
    spans = [s for r in records for s in to_mlflow_spans(mlflow_view(r))]
    TracingClient(mlflow_uri).log_spans(exp_id, spans)
    pages: list[int] = []
    summary = export("mlflow", str(tmp_path / "out"), experiment="big", tracking_uri=mlflow_uri,
                     page_size=250, on_page=pages.append)  # fmt: skip
    assert sorted(pages) == [100, 250, 250] and summary.rows["tool_calls"] == 600
    meta = pq.ParquetFile(tmp_path / "out" / "trajectories.parquet").metadata
    assert meta.num_row_groups == 3
    table = pq.read_table(tmp_path / "out" / "trajectories.parquet").to_pylist()
    by_id = {r.trace_id: r for r in records}
    for row in table:  # reward comes back from the trace tag (no assessment logged here)
        assert row["reward"] == pytest.approx(by_id[row["trace_id"]].reward)
        assert row["response_text"] == f"answer {int(row['trace_id'], 16)}"


def test_import_tracer_stays_light() -> None:
    import subprocess

    code = (
        "import sys, tracer, tracer.readers; "
        "print(sorted(m for m in ('pandas', 'pyarrow', 'mlflow', 'duckdb') if m in sys.modules))"
    )
    root = str(Path(__file__).resolve().parents[1])
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root
    )
    assert out.stdout.strip() == "[]"


def test_schema_doc_lists_every_column() -> None:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "export-schema.md").read_text()
    for name, columns in {**TABLES, "steps": STEPS}.items():
        section = doc.split(f"## `{name}`", 1)[1].split("\n## ", 1)[0]
        for column, kind, _ in columns:
            assert f"| `{column}` | {kind} |" in section, (name, column)
