"""Section 2: N trajectories of 5 spans (trajectory, generate, parse, tool, reward) into an
embedded MLflow sqlite store: time until durable, and how many MLflow holds when read back;
then the same on PostgreSQL-backed stores when a throwaway server can be started here, and
through a real tracking server (``mlflow server``, one worker, sqlite behind it).

* ours: ``tracer`` with the ``mlflow`` backend; durable when ``tracer.flush()`` returns.
* MLflow fluent API at its defaults (async trace logging): one root span with four child spans
  per trajectory, like an instrumented agent loop would open them inline; durable when
  ``mlflow.flush_trace_async_logging()`` returns. Run in its own (spawned) process so MLflow's
  global tracing state does not touch ours. Its reward is a span only, no ``reward``
  assessment (ours writes both, for the UI's reward column): the peer does less work.
"""

from __future__ import annotations

import multiprocessing
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import count_traces, mlflow_store, quiet_env, section_main

PROMPT_IDS = list(range(200))
EXPERIMENT = "bench-e2e"


def _messages(i: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": "You are a careful math assistant."},
        {"role": "user", "content": f"Problem {i}: what is 12 * (3 + {i % 10})?"},
    ]


def _ops() -> tuple[Any, Any, Any, Any]:
    import tracer

    @tracer.trace_op(kind="generate")
    def generate(prompt_ids: list[int], messages: list[dict[str, str]]) -> dict[str, Any]:
        return {"response_ids": prompt_ids[:40], "finish_reason": "stop"}

    @tracer.trace_op(kind="parse")
    def parse(text: str) -> dict[str, Any]:
        return {"content": text, "tool_calls": [{"name": "calculator"}]}

    @tracer.trace_op(kind="tool")
    def call_tool(name: str, arguments: dict[str, Any]) -> str:
        return "84"

    @tracer.trace_op(kind="reward")
    def reward(answer: str, ground_truth: str) -> dict[str, float]:
        return {"score": 1.0}

    return generate, parse, call_tool, reward


def _produce(n: int, first_step: int = 0) -> None:
    import tracer

    generate, parse, call_tool, reward = _ops()
    for i in range(n):
        with tracer.trace_attr(step=first_step + i // 100, sample_index=i % 100, rollout_n=0):
            generate(PROMPT_IDS, _messages(i))
            parse("<tool_call>calculator</tool_call>")
            call_tool("calculator", {"expression": "12 * 7"})
            reward("84", "84")


def _writer_log() -> list[str]:
    """Collects the MLflow backend's line saying it fell back from the bulk writer."""
    import logging

    lines: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "bulk writer" in record.getMessage():
                lines.append(record.getMessage()[:300])

    logging.getLogger("tracer").addHandler(Catch())
    return lines


def ours(n: int, uri: str, bulk: bool = True) -> dict[str, Any]:
    """Our MLflow backend; ``bulk=False`` makes it write through MLflow's own ``log_spans``
    (the path it falls back to on an MLflow version the bulk writer was not tested with). That
    run exports in this process: the export child would open its own bulk writer, and the row
    would time the bulk path under the fallback's name."""
    import tracer
    from tracer.backends import mlflow_backend

    fallback = _writer_log()
    real_open = mlflow_backend.open_bulk_writer
    if not bulk:
        mlflow_backend.open_bulk_writer = lambda *a, **k: None  # type: ignore[assignment]
    config = {"backend": "mlflow", "tracking_uri": uri, "project_name": EXPERIMENT,
              "token2text": False}  # fmt: skip
    if not bulk:
        config["export_in_subprocess"] = False
    tracer.init(config)
    t0 = time.perf_counter()
    _produce(n)
    produced = time.perf_counter() - t0
    flushed = tracer.flush(timeout_s=600)
    durable = time.perf_counter() - t0
    metrics = tracer.metrics()
    tracer.shutdown()
    mlflow_backend.open_bulk_writer = real_open  # type: ignore[assignment]
    return {
        "produce_s": round(produced, 3),
        "durable_s": round(durable, 3),
        "flush_ok": flushed,
        "writer": (
            "OTLP spans + REST rewards"
            if uri.startswith("http")
            else "mlflow log_spans (fallback)" if fallback or not bulk else "bulk"
        ),
        "fallback_reason": fallback[:1],
        "stored": count_traces(uri, EXPERIMENT),
        "dropped": metrics.get("tracer/dropped_buffer_full", 0)
        + metrics.get("tracer/mlflow/dropped", 0),
    }


def export_breakdown(n: int, uri: str) -> dict[str, Any]:
    """Where our MLflow export spends its time: cProfile of ``MlflowExporter.export`` on ``n``
    records, cumulative seconds per trajectory of the MLflow calls that dominate."""
    import cProfile
    import pstats

    import tracer
    from tracer.backends.mlflow_backend import MlflowExporter
    from tracer.config import TraceConfig
    from tracer.testing import InMemoryExporter

    tracer.init({"backend": "memory"})
    _produce(n, first_step=500)
    tracer.flush()
    records = list(InMemoryExporter.latest().records)
    tracer.reset()
    exporter = MlflowExporter(TraceConfig(backend=None, tracking_uri=uri, project_name="bd"))
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    exporter.export(records)
    prof.disable()
    total = time.perf_counter() - t0
    wanted = (
        "log_spans",
        "_log_rewards",
        "get_trace_info",
        "log_assessment",
        "write",  # the bulk writer: one transaction per batch
        "_trace",  # its rows of one trace (built before the transaction)
        "translate_span_when_storing",
    )
    out: dict[str, Any] = {
        "records": len(records),
        "writer": "bulk" if exporter.bulk is not None else "mlflow log_spans (fallback)",
        "export_ms_per_trajectory": 0.0,
    }
    out["export_ms_per_trajectory"] = round(total / max(1, len(records)) * 1e3, 2)
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    calls: dict[str, list[float]] = {}
    for (_file, _line, func), (_cc, ncalls, _tt, ct, _callers) in stats.items():
        if func in wanted or func.endswith("'commit' of 'sqlite3.Connection' objects>"):
            key = "sqlite3 commit" if "sqlite3" in func else func
            acc = calls.setdefault(key, [0, 0.0])
            acc[0] += ncalls
            acc[1] = max(acc[1], ct)
    out["calls"] = {
        k: {"calls": int(c), "ms_per_trajectory": round(t / max(1, len(records)) * 1e3, 2)}
        for k, (c, t) in sorted(calls.items())
    }
    return out


def mlflow_fluent(n: int, uri: str, experiment: str = EXPERIMENT) -> dict[str, Any]:
    quiet_env()
    import logging

    import mlflow
    from mlflow.entities import SpanType

    warnings: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage()[:200])

    logging.getLogger("mlflow").addHandler(Catch())
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment(experiment)
    t0 = time.perf_counter()
    for i in range(n):
        with mlflow.start_span("trajectory", span_type=SpanType.AGENT) as root:
            root.set_inputs({"step": i // 100, "sample_index": i % 100})
            mlflow.update_current_trace(tags={"step": str(i // 100)})
            with mlflow.start_span("generate", span_type=SpanType.CHAT_MODEL) as s:
                s.set_inputs({"prompt_ids": PROMPT_IDS, "messages": _messages(i)})
                s.set_outputs({"response_ids": PROMPT_IDS[:40], "finish_reason": "stop"})
            with mlflow.start_span("parse", span_type=SpanType.PARSER) as s:
                s.set_inputs({"text": "<tool_call>calculator</tool_call>"})
                s.set_outputs({"content": "", "tool_calls": [{"name": "calculator"}]})
            with mlflow.start_span("call_tool", span_type=SpanType.TOOL) as s:
                s.set_inputs({"name": "calculator", "arguments": {"expression": "12 * 7"}})
                s.set_outputs("84")
            with mlflow.start_span("reward", span_type=SpanType.EVALUATOR) as s:
                s.set_inputs({"answer": "84", "ground_truth": "84"})
                s.set_outputs({"score": 1.0})
    produced = time.perf_counter() - t0
    mlflow.flush_trace_async_logging(terminate=False)
    durable = time.perf_counter() - t0
    return {
        "produce_s": round(produced, 3),
        "durable_s": round(durable, 3),
        "stored": count_traces(uri, experiment),
        "warnings": sorted(set(warnings))[:3],
    }


def run(quick: bool) -> dict[str, Any]:
    n = 10 if quick else 1000  # quick: the report's shape, not a measurement
    out: dict[str, Any] = {"n": n}
    # one spawned process serves every MLflow fluent run (each imports MLflow once: ~4 s of CPU)
    with multiprocessing.get_context("spawn").Pool(1) as pool, \
            tempfile.TemporaryDirectory(prefix="bench-e2e-") as tmp:
        ours_uri = mlflow_store(tmp, "ours.db")
        fluent_uri = mlflow_store(tmp, "fluent.db")
        out["ours"] = ours(n, ours_uri)
        out["ours_export_breakdown"] = export_breakdown(min(n, 100), mlflow_store(tmp, "bd.db"))
        out["ours_log_spans"] = ours(n, mlflow_store(tmp, "ours-log-spans.db"), bulk=False)
        out["mlflow_fluent"] = pool.apply(mlflow_fluent, (n, fluent_uri))
        out["per_durable_trace"] = per_durable_trace(out["ours"], out["mlflow_fluent"])
        out["log_spans_per_durable_trace"] = per_durable_trace(out["ours_log_spans"],
                                                               out["mlflow_fluent"])
        # --quick checks the report's shape, on the embedded store and through a server; the
        # PostgreSQL leg starts a database server of its own, so only the full run measures it
        out["postgresql"] = ({"skipped": "not run with --quick (it starts PostgreSQL)"}
                             if quick else on_postgresql(n, pool))
        out["server"] = on_server(n, pool)
    return out


def on_server(n: int, pool: Any) -> dict[str, Any]:
    """The same two runs through one real tracking server (spans as OTLP batches, rewards as
    REST calls side by side); each run its own experiment. ``pool``: a spawned process for the
    MLflow fluent run."""
    from tests._servers import start_mlflow_server

    out: dict[str, Any] = {"n": n}
    with tempfile.TemporaryDirectory(prefix="bench-e2e-server-") as tmp:
        try:
            # a copy of the migrated template: the server skips the migrations (seconds)
            server = start_mlflow_server(Path(tmp), backend_store_uri=mlflow_store(tmp))
        except Exception as exc:  # no mlflow CLI here, port trouble, ...
            return {"skipped": f"mlflow server did not start: {exc}"[:300]}
        try:
            out["ours"] = ours(n, server.url)
            out["mlflow_fluent"] = pool.apply(mlflow_fluent, (n, server.url, "bench-e2e-fl"))
        finally:
            server.stop()
    out["per_durable_trace"] = per_durable_trace(out["ours"], out["mlflow_fluent"])
    return out


def on_postgresql(n: int, pool: Any) -> dict[str, Any]:
    """The same two runs on PostgreSQL-backed stores (a throwaway local server), when one can
    be started here."""
    from benchmarks.postgres import postgres_available, temporary_postgres

    if why := postgres_available():
        return {"skipped": why}
    out: dict[str, Any] = {"n": n}
    with temporary_postgres("ours", "fluent") as (ours_uri, fluent_uri):
        out["ours"] = ours(n, ours_uri)
        out["mlflow_fluent"] = pool.apply(mlflow_fluent, (n, fluent_uri))
    out["per_durable_trace"] = per_durable_trace(out["ours"], out["mlflow_fluent"])
    return out


def per_durable_trace(o: dict[str, Any], f: dict[str, Any]) -> dict[str, Any]:
    """ms until durable per trace MLflow holds afterwards (the fluent API's async queue may
    drop traces: those do not count as durable), and how many times faster ours is."""
    ours_ms = o["durable_s"] / max(1, o["stored"]) * 1e3
    fluent_ms = f["durable_s"] / max(1, f["stored"]) * 1e3
    return {
        "ours_ms": round(ours_ms, 3),
        "fluent_ms": round(fluent_ms, 3),
        "speedup": round(fluent_ms / ours_ms, 1) if ours_ms else None,
        # plain wall clock until durable, whatever each kept
        "wall_ratio": round(f["durable_s"] / o["durable_s"], 1) if o["durable_s"] else None,
    }


if __name__ == "__main__":
    section_main(run)
