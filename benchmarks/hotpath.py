"""Section 1: hot-path cost of one traced op, side by side, in one process.

Every variant wraps the same small tool-shaped function ``tool(name, arguments) -> str`` and is
called ``n`` times inside one open trajectory / root span per repeat; the figure is µs per call
(loop overhead included in every variant, so differences are what the tracer adds). Background
exporters are flushed between repeats, outside the timed window.
"""

from __future__ import annotations

import cProfile
import importlib
import inspect
import io
import json
import pstats
import re
import tempfile
import time
from typing import Any

import tracer
from benchmarks.common import ROOT, median, mlflow_store, per_call_us, section_main
from tracer.backends import register_backend
from tracer.backends.base import ExportResult
from tracer.sampling import sample_hash

ARGS = {"expression": "12 * (3 + 4)", "precision": 2}
PROMPT_IDS = list(range(1000))
MESSAGES = [{"role": "user" if i % 2 else "assistant", "content": "x" * 200} for i in range(6)]


def tool(name: str, arguments: dict[str, Any]) -> str:
    return name


class NullExporter:
    name = "bench-null"

    def __init__(self, config: Any = None) -> None:
        self.exported = 0

    def export(self, batch: Any) -> ExportResult:
        self.exported += len(batch)
        return ExportResult.SUCCESS

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        return True

    def shutdown(self, timeout_s: float = 30.0) -> None:
        return None


register_backend("bench-null", NullExporter)


def _loop(fn: Any, args: tuple[Any, ...]) -> Any:
    def run(n: int) -> None:
        for _ in range(n):
            fn(*args)

    return run


def _in_trajectory(fn: Any, args: tuple[Any, ...], **attr: Any) -> Any:
    def run(n: int) -> None:
        with tracer.trace_attr(**attr):
            for _ in range(n):
                fn(*args)

    return run


def losing_pair(seed: int, step: int) -> tuple[int, int]:
    """(winner, loser) sample indices of ``step``: with N=1 the loser is never sampled."""
    h0, h1 = sample_hash(seed, step, False, 0), sample_hash(seed, step, False, 1)
    return (0, 1) if h0 < h1 else (1, 0)


# The background processor waits for a whole batch or the flush interval: with both out of
# reach it runs only at flush(), between repeats, and the trace_attr rows time the rollout
# thread alone (on a 2-core machine its work would otherwise land inside the timed window).
HOLD = {"export_batch_size": 1_000_000, "flush_interval_s": 3600.0,
        "max_buffer_trajectories": 1_000_000}  # fmt: skip


def ours(n: int, reps: int) -> dict[str, list[float]]:
    res: dict[str, list[float]] = {}
    op = tracer.trace_op(kind="tool")(tool)
    gen_op = tracer.trace_op(kind="generate")(_generate)
    gen_lp_op = tracer.trace_op(kind="generate")(_generate_logprobs)
    args = ("calculator", ARGS)
    res["bare"] = per_call_us(_loop(tool, args), n, reps)

    tracer.reset()  # tracing off: no backend configured
    res["off"] = per_call_us(_in_trajectory(op, args, step=0, sample_index=0), n, reps)

    tracer.init({"backend": "bench-null", "max_samples_per_step_per_worker": 0})
    res["unsampled_n0"] = per_call_us(_in_trajectory(op, args, step=0, sample_index=0), n, reps)

    tracer.init({"backend": "bench-null", "max_samples_per_step_per_worker": 1})
    win, lose = losing_pair(0, 7)
    with tracer.trace_attr(step=7, sample_index=win):
        pass  # the winner takes the step's only slot
    unsampled = _in_trajectory(op, args, step=7, sample_index=lose)
    res["unsampled_n1"] = per_call_us(unsampled, n, reps, between=tracer.flush)
    res["trace_false"] = per_call_us(
        _in_trajectory(op, args, step=8, sample_index=0, trace=False), n, reps
    )

    # keep rules on (tracer/keep.py): the same losing sample is now a tail candidate, recorded
    # in full so that its end can decide; this is what keep rules cost on the hot path
    tracer.init({"backend": "bench-null", "max_samples_per_step_per_worker": 1,
                 "keep": ["errors", "extreme_rewards"], **HOLD})  # fmt: skip
    with tracer.trace_attr(step=7, sample_index=win):
        pass
    candidate = _in_trajectory(op, args, step=7, sample_index=lose)
    res["tail_candidate_n1"] = per_call_us(candidate, n, reps, between=tracer.flush)

    def losing_trajectories(k: int) -> None:
        for _ in range(k):
            with tracer.trace_attr(step=7, sample_index=lose):
                pass

    # trace_attr rows: the rollout thread's own cost. The background processor is held off
    # while they are timed (it runs at the flush between repeats); what it then costs per
    # trajectory is its own row, "trajectory_background_build", below.
    n_traj = max(50, n // 10)
    res["trajectory_open_close_tail_candidate"] = per_call_us(
        losing_trajectories, n_traj, reps, tracer.flush)
    tracer.init({"backend": "bench-null", "max_samples_per_step_per_worker": 1, **HOLD})
    with tracer.trace_attr(step=7, sample_index=win):
        pass
    res["trajectory_open_close_unsampled"] = per_call_us(
        losing_trajectories, n_traj, reps, tracer.flush)

    tracer.init({"backend": "bench-null", "max_samples_per_step_per_worker": None})
    res["outside_trajectory"] = per_call_us(_loop(op, args), n, reps)
    res["sampled"] = per_call_us(
        _in_trajectory(op, args, step=1, sample_index=0), n, reps, between=tracer.flush
    )
    res["sampled_generate_payload"] = per_call_us(
        _in_trajectory(gen_op, (PROMPT_IDS, MESSAGES), step=2, sample_index=0),
        max(50, n // 20),
        reps,
        between=tracer.flush,
    )

    # the engine's per-token log-probs ride along: the hot path copies the list (C speed);
    # encoding them (tracer/tokens.py) happens in the background
    res["sampled_generate_1000_logprobs"] = per_call_us(
        _in_trajectory(gen_lp_op, (PROMPT_IDS, MESSAGES), step=4, sample_index=0),
        max(50, n // 20),
        reps,
        between=tracer.flush,
    )

    def trajectories(k: int) -> None:
        for i in range(k):
            with tracer.trace_attr(step=3, sample_index=i):
                pass

    tracer.init({"backend": "bench-null", "max_samples_per_step_per_worker": None, **HOLD})
    res["trajectory_open_close"] = per_call_us(trajectories, n_traj, reps, tracer.flush)
    # the background's share: building the records of n_traj empty trajectories (one root span
    # each) and handing them to the no-op exporter, per trajectory, timed around flush()
    build: list[float] = []
    for _ in range(reps):
        trajectories(n_traj)
        t0 = time.perf_counter()
        tracer.flush()
        build.append((time.perf_counter() - t0) / n_traj * 1e6)
    res["trajectory_background_build"] = build
    tracer.reset()
    return res


def _generate(prompt_ids: list[int], messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"response_ids": prompt_ids[:50], "finish_reason": "stop"}


def otel(n: int, reps: int) -> list[float]:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class NullSpanExporter(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(NullSpanExporter()))
    otracer = provider.get_tracer("bench")

    def otel_tool(name: str, arguments: dict[str, Any]) -> str:
        attrs = {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": name}
        with otracer.start_as_current_span("tool", attributes=attrs) as span:
            span.set_attribute("gen_ai.tool.call.arguments", json.dumps(arguments))
            result = tool(name, arguments)
            span.set_attribute("gen_ai.tool.call.result", result)
            return result

    def run(k: int) -> None:
        with otracer.start_as_current_span("trajectory"):
            for _ in range(k):
                otel_tool("calculator", ARGS)

    out = per_call_us(run, n, reps, between=provider.force_flush)
    provider.shutdown()
    return out


def mlflow_variants(n: int, reps: int, tmp: str) -> dict[str, list[float]]:
    import mlflow
    from mlflow.entities import SpanType

    mlflow.set_tracking_uri(mlflow_store(tmp))
    mlflow.set_experiment("bench-hotpath")

    def mlflow_tool(name: str, arguments: dict[str, Any]) -> str:
        with mlflow.start_span("tool", span_type=SpanType.TOOL) as span:
            span.set_inputs({"name": name, "arguments": arguments})
            result = tool(name, arguments)
            span.set_outputs(result)
            return result

    def verl_style(func: Any) -> Any:
        # verl's rollout_trace_op (mlflow backend), re-described: per call it binds the
        # arguments with a fresh inspect.signature(func).bind(...) + apply_defaults, opens a
        # span inline with MLflow's fluent API named after the function, sets inputs/outputs.
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            bound = inspect.signature(func).bind(*args, **kwargs)
            bound.apply_defaults()
            inputs = dict(bound.arguments)
            with mlflow.start_span(name=func.__qualname__) as span:
                span.set_inputs(inputs)
                result = func(*args, **kwargs)
                span.set_outputs(result)
                return result

        return wrapper

    def in_root(fn: Any) -> Any:
        def run(k: int) -> None:
            with mlflow.start_span("trajectory", span_type=SpanType.AGENT):
                for _ in range(k):
                    fn("calculator", ARGS)

        return run

    flush = mlflow.flush_trace_async_logging
    in_root(mlflow_tool)(20)  # warm-up: MLflow's first span initializes its tracer provider
    flush()
    res = {
        "mlflow_start_span": per_call_us(in_root(mlflow_tool), n, reps, between=flush),
        "verl_style_mlflow": per_call_us(in_root(verl_style(tool)), n, reps, between=flush),
    }
    flush()
    return res


def find_weave_server() -> tuple[Any, str]:
    """The in-process weave trace server from tests/ (written by the backends engineer)."""
    for path in sorted((ROOT / "tests").glob("*.py")):
        text = path.read_text(errors="replace")
        if "def call_start" not in text or "def calls_query_stream" not in text:
            continue
        module = importlib.import_module(f"tests.{path.stem}")
        for name, obj in vars(module).items():
            if (
                inspect.isclass(obj)
                and obj.__module__ == module.__name__
                and hasattr(obj, "call_start")
                and hasattr(obj, "calls_query_stream")
            ):
                return obj(), f"tests/{path.name}:{name}"
    raise LookupError("no in-process weave trace server in tests/ yet")


def weave_op(n: int, reps: int) -> dict[str, Any]:
    try:
        import weave
        from weave.trace.context.weave_client_context import set_weave_client_global
        from weave.trace.weave_client import WeaveClient
    except Exception as exc:
        return {"skipped": f"weave not importable: {type(exc).__name__}: {exc}"}
    try:
        server, where = find_weave_server()
    except Exception as exc:
        return {"skipped": f"{type(exc).__name__}: {exc}"}
    client = WeaveClient("bench", "bench", server, ensure_project_exists=False)
    set_weave_client_global(client)
    op = weave.op(tool)

    def run(k: int) -> None:
        for _ in range(k):
            op("calculator", ARGS)

    try:
        run(5)
        client.flush()
        times = per_call_us(run, n, reps, between=client.flush)
    except Exception as exc:
        return {"skipped": f"weave.op failed over {where}: {type(exc).__name__}: {exc}"}
    finally:
        set_weave_client_global(None)
    return {"us": times, "server": where}


def profile_sampled(n: int) -> list[dict[str, Any]]:
    """cProfile of the sampled op: where the time goes, per call of the op."""
    tracer.init({"backend": "bench-null", "max_samples_per_step_per_worker": None})
    op = tracer.trace_op(kind="tool")(tool)
    prof = cProfile.Profile()
    with tracer.trace_attr(step=9, sample_index=0):
        prof.enable()
        for _ in range(n):
            op("calculator", ARGS)
        prof.disable()
    tracer.flush()
    tracer.reset()
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (file, line, func), (_cc, ncalls, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        short = re.sub(r".*/(tracer|benchmarks)/", r"\1/", file)
        rows.append(
            {
                "function": f"{short}:{line}({func})",
                "calls_per_op": round(ncalls / n, 2),
                "tottime_us_per_op": round(tt / n * 1e6, 3),
                "cumtime_us_per_op": round(ct / n * 1e6, 3),
            }
        )
    rows.sort(key=lambda r: -r["tottime_us_per_op"])
    return rows[:14]


_RESPONSE_1000 = list(range(1000))
_LOGPROBS_1000 = [-0.001 * (i % 997) for i in range(1000)]


def _generate_logprobs(prompt_ids: list[int], messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"response_ids": _RESPONSE_1000, "finish_reason": "stop", "logprobs": _LOGPROBS_1000}


def run(quick: bool) -> dict[str, Any]:
    n, reps = (2000, 5) if quick else (20000, 15)
    n_heavy, reps_heavy = (30, 3) if quick else (400, 9)
    results: dict[str, Any] = {"n": n, "repeats": reps, "n_heavy": n_heavy}
    samples = ours(n, reps)
    samples["otel_sdk_span"] = otel(n, reps)
    with tempfile.TemporaryDirectory(prefix="bench-mlflow-") as tmp:
        samples.update(mlflow_variants(n_heavy, reps_heavy, tmp))
    # --quick leaves weave out (importing and running it: ~2 CPU-s); the report says so
    weave_res = {"skipped": "not run with --quick"} if quick else weave_op(n_heavy, reps_heavy)
    if "us" in weave_res:
        samples["weave_op"] = weave_res["us"]
        results["weave_server"] = weave_res["server"]
    else:
        results["weave_skipped"] = weave_res["skipped"]
    results["samples_us"] = samples
    results["median_us"] = {k: round(median(v), 3) for k, v in samples.items()}
    results["profile_sampled"] = profile_sampled(n)
    return results


if __name__ == "__main__":
    section_main(run)
