"""Export from Weave: the same trajectories traced to Weave (the real WeaveClient writing to
the in-process trace server) and to JSONL at once come back as the same three tables.

Weave stores timestamps to the microsecond (the backend sends ``ns / 1e9`` as a datetime, which
rounds), while JSONL keeps nanoseconds and the tables floor to microseconds: ``start_time`` may
differ by 1 µs and ``latency_ms`` by 0.002 ms. Every other column, ids included, is equal.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tracer
from tests import export_agent
from tests._servers import InProcessWeaveServer

weave = pytest.importorskip("weave")
pq = pytest.importorskip("pyarrow.parquet")

from rollout.cli import main  # noqa: E402
from tracer.readers import TABLES, export, read_tables, weave_source  # noqa: E402

PROJECT = "export-weave"
ENTITY = "team"


@pytest.fixture
def server(weave_server: InProcessWeaveServer) -> InProcessWeaveServer:
    return weave_server


@pytest.fixture
def traced(tmp_path: Path, server: InProcessWeaveServer) -> dict[str, Any]:
    jsonl = str(tmp_path / "traces.jsonl")
    tracer.init(
        {
            "backend": ["weave", "jsonl"],
            "jsonl_path": jsonl,
            "project_name": PROJECT,
            "weave_entity": ENTITY,
            "experiment_name": "grpo",
            "token2text": True,
            "raise_internal_errors": True,
        }
    )
    tracer.register_tokenizer(export_agent.WordTokenizer())
    expected = export_agent.run([1, 2])
    expected_val = export_agent.run([2], validate=True)
    assert tracer.flush(timeout_s=60)
    assert tracer.metrics()["tracer/weave/exported"] == 18
    return {"jsonl": jsonl, "expected": expected, "val": expected_val, "tmp": tmp_path}


def _export_cli(out: Path, *args: str) -> None:
    assert main(["export", "--out", str(out), "--no-progress", *args]) == 0


def _table(out: Path, name: str) -> list[dict[str, Any]]:
    rows = pq.read_table(out / f"{name}.parquet").to_pylist()
    return sorted(rows, key=lambda r: (r["trace_id"], r.get("turn_index"), r.get("call_index")))


def _assert_same(weave_rows: list[dict[str, Any]], jsonl_rows: list[dict[str, Any]]) -> None:
    assert len(weave_rows) == len(jsonl_rows)
    for got, want in zip(weave_rows, jsonl_rows, strict=True):
        if "start_time" in want:  # the tokens table has no times
            assert abs(got.pop("start_time") - want.pop("start_time")) <= dt.timedelta(
                microseconds=1)
            assert got.pop("latency_ms") == pytest.approx(want.pop("latency_ms"), abs=0.002)
        # Weave keeps times to the microsecond: the time parts (readers/timing/breakdown.py) of
        # a trajectory's few spans agree to a few microseconds
        if "slow_span_ms" in want:  # two spans as long to the microsecond: either is the slow one
            slow = ("slow_span_id", "slow_span_kind", "slow_span_name", "slow_span_detail")
            if {c: got[c] for c in slow} != {c: want[c] for c in slow}:
                assert got["slow_span_ms"] == pytest.approx(want["slow_span_ms"], abs=0.005)
                for column in slow:
                    got.pop(column), want.pop(column)
        for column in ("generate_ms", "tool_ms", "reward_ms", "other_ms", "gap_ms",
                       "slow_span_ms"):  # fmt: skip
            if column in want:
                assert got.pop(column) == pytest.approx(want.pop(column), abs=0.005), column
        if "tool_ms_by_name" in want:
            by_name = json.loads(want.pop("tool_ms_by_name") or "{}")
            assert json.loads(got.pop("tool_ms_by_name") or "{}") == pytest.approx(by_name,
                                                                                    abs=0.005)
        assert got == want


def test_weave_export_equals_jsonl_export(
    traced: dict[str, Any], server: InProcessWeaveServer
) -> None:
    tmp = traced["tmp"]
    _export_cli(tmp / "w", "--from", "weave", "--entity", ENTITY, "--experiment", PROJECT)
    _export_cli(tmp / "j", "--from", "jsonl", "--path", traced["jsonl"])
    for name in TABLES:
        _assert_same(_table(tmp / "w", name), _table(tmp / "j", name))
    trajectories = _table(tmp / "w", "trajectories")
    assert len(trajectories) == 18 and {r["experiment"] for r in trajectories} == {PROJECT}
    assert sum(r["validate"] for r in trajectories) == 6
    assert sum(r["num_tool_errors"] for r in trajectories) == 3
    # trace ids are the Weave root call ids (UUIDs) as 32 hex chars
    roots = [c["id"] for c in server.calls() if c["parent_id"] is None]
    assert {r["trace_id"] for r in trajectories} == {c.replace("-", "") for c in roots}


def test_filters_and_paging(
    traced: dict[str, Any], server: InProcessWeaveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    requests: list[dict[str, Any]] = []
    query = server.calls_query_stream

    def spy(req: Any) -> Iterator[Any]:
        requests.append(dict(req))
        return query(req)

    monkeypatch.setattr(server, "calls_query_stream", spy)
    monkeypatch.setattr(weave_source, "WEAVE_CALLS_PER_REQUEST", 7)  # a trace's calls span chunks
    pages: list[int] = []
    # entity from WANDB_ENTITY; 5 trajectories a page: 12 train roots -> pages 5, 5, 2
    monkeypatch.setenv("WANDB_ENTITY", ENTITY)
    summary = export(
        "weave",
        str(traced["tmp"] / "p"),
        experiment=PROJECT,
        validate=False,
        page_size=5,
        on_page=pages.append,
    )
    assert pages == [5, 5, 2] and summary.rows["turns"] == 24
    roots = [r for r in requests if r["filter"] == {"trace_roots_only": True}]
    assert [(r["offset"], r["limit"]) for r in roots] == [(0, 5), (5, 5), (10, 5), (15, 5), (18, 5)]
    assert all(r["project_id"] == f"{ENTITY}/{PROJECT}" for r in requests)
    fetches = [r for r in requests if "trace_ids" in r["filter"] and r["offset"] == 0]
    assert [len(r["filter"]["trace_ids"]) for r in fetches] == pages
    assert {r["limit"] for r in requests if "trace_ids" in r["filter"]} == {7}

    selections: list[tuple[list[int] | None, bool | None]] = [
        ([2], None),
        ([1, 2], True),
        (None, False),
        ([3], None),  # nothing: empty tables
    ]
    for steps, validate in selections:
        w = read_tables("weave", experiment=f"{ENTITY}/{PROJECT}", steps=steps, validate=validate)
        j = read_tables("jsonl", path=traced["jsonl"], steps=steps, validate=validate)
        for name in TABLES:
            key = ["trace_id", *_order(name)]
            got, want = getattr(w, name).sort_values(key), getattr(j, name).sort_values(key)
            if name == "tokens":  # one row per response token: the same from both sources
                assert list(got["token_id"]) == list(want["token_id"]), steps
                continue
            assert len(got) == len(want) and (len(got) > 0) == (steps != [3]), (steps, name)
            assert list(got["trace_id"]) == list(want["trace_id"])
            if name != "trajectories":
                assert list(got["span_id"]) == list(want["span_id"])


def _order(name: str) -> list[str]:
    return {"trajectories": [], "turns": ["turn_index"], "tool_calls": ["call_index"],
            "tokens": ["position"]}[name]


def test_weave_errors_are_clear(
    server: InProcessWeaveServer,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("WANDB_ENTITY", raising=False)
    args = ["export", "--from", "weave", "--out", "o", "--no-progress"]
    assert main(args) == 2
    assert "--experiment" in capsys.readouterr().err
    assert main([*args, "--experiment", "nothing-here"]) == 2
    assert "no calls in Weave project rollout-tracer/nothing-here" in capsys.readouterr().err


def test_missing_credentials_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", "/nonexistent")
    monkeypatch.setenv("NETRC", "/nonexistent/netrc")
    monkeypatch.setenv("HOME", "/nonexistent")
    assert (
        main(["export", "--from", "weave", "--experiment", "x", "--out", "o", "--no-progress"]) == 2
    )
    assert "WANDB_API_KEY" in capsys.readouterr().err
