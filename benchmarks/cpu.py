"""Whole-process CPU per durable trajectory: ours against the OpenTelemetry SDK, same payload.

Each mode runs in its own interpreter. It times the process's CPU (``time.process_time``: every
thread, so the background's work counts) from the first op until the data is durable in a
local file (``flush``/``force_flush`` returned), minus the same loop untraced, per trajectory.

The workload, per trajectory (7 ops): 3 generate calls, each with 300 prompt ids, 100 response
ids and 4 messages; 3 tool calls; a reward.

- ``ours``: the default config into JSONL (redaction on, spool on).
- ``otel``: a ``BatchSpanProcessor`` and an exporter writing each span's ``to_json()`` line to
  a file, inputs and outputs as JSON attributes, the way GenAI instrumentations record them;
  its queue holds every span (the default drops spans at this rate) and the run checks that
  every span reached the file, as ``ours`` checks every trajectory.
- ``ours_stages``: our background stages alone over the same trajectories, timed one by one
  (where the CPU goes).

    python -m benchmarks.cpu --json out.json [--quick]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks.common import QUIET_ENV, ROOT, section_main

SYSTEM = {"role": "system", "content": "You are a careful math tutor. Use the calculator. " * 4}


def _messages(i: int, turn: int) -> list[dict[str, str]]:
    return [
        SYSTEM,
        {"role": "user", "content": f"Problem {i}: a train leaves at {i % 12} o'clock. " * 3},
        {"role": "assistant", "content": f"Turn {turn}: let me compute 6*7 first. " * 4},
        {"role": "tool", "content": "42"},
    ]


PROMPT_IDS = list(range(5000, 5300))
SPANS_PER_TRAJECTORY = 8  # the trajectory's root and its 7 ops
RESPONSE_IDS = list(range(9000, 9100))


def _workload(n: int, generate: Any, tool: Any, reward: Any, trajectory: Any) -> None:
    for i in range(n):
        with trajectory(i):
            text = ""
            for turn in range(3):
                out = generate(_messages(i, turn), PROMPT_IDS)
                text = out["text"]
                tool("calculator", {"expression": f"6*{turn + 7}"})
            reward(text)


def _generate_result() -> dict[str, Any]:
    return {"text": "Let me compute. <tool_call>{\"expression\": \"6*7\"}</tool_call>",
            "response_ids": RESPONSE_IDS, "finish_reason": "stop"}  # fmt: skip


def mode_untraced(n: int, tmp: str) -> None:
    import contextlib

    def generate(messages: Any, prompt_ids: Any) -> dict[str, Any]:
        return _generate_result()

    def tool(name: str, args: Any) -> dict[str, Any]:
        return {"result": "42"}

    def reward(text: str) -> float:
        return 1.0

    _workload(n, generate, tool, reward, lambda i: contextlib.nullcontext())


def mode_ours(n: int, tmp: str) -> None:
    import tracer

    tracer.init(backend="jsonl", jsonl_path=f"{tmp}/ours.jsonl", spool_dir=f"{tmp}/spool")

    generate, tool, reward = ours_ops()
    _workload(n, generate, tool, reward,
              lambda i: tracer.trace_attr(step=0, sample_index=i, rollout_n=0))  # fmt: skip
    assert tracer.flush(600)
    with open(f"{tmp}/ours.jsonl", "rb") as f:
        lines = sum(1 for _ in f)
    assert lines == n, (lines, n)


def mode_otel(n: int, tmp: str) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class FileExporter(SpanExporter):
        def __init__(self, path: str) -> None:
            self.f = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed at shutdown)

        def export(self, spans: Any) -> SpanExportResult:
            self.f.write("".join(s.to_json(indent=None) + "\n" for s in spans))
            self.f.flush()
            os.fsync(self.f.fileno())
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            self.f.close()

    provider = TracerProvider()
    # A queue that holds every span: with the default (2,048 spans) the processor dropped 22 %
    # of them here ("Queue full, dropping Span"), which is less work than the job, not a cost
    processor = BatchSpanProcessor(FileExporter(f"{tmp}/otel.jsonl"),
                                   max_queue_size=max(2048, SPANS_PER_TRAJECTORY * n))
    provider.add_span_processor(processor)

    _workload(n, *otel_ops(provider.get_tracer("bench")))
    assert provider.force_flush(600_000)
    provider.shutdown()
    with open(f"{tmp}/otel.jsonl", "rb") as f:
        lines = sum(1 for _ in f)
    assert lines == SPANS_PER_TRAJECTORY * n, (lines, n)  # every span durable, as ours


def stages(n: int, tmp: str) -> dict[str, float]:
    """Our background's stages over ``n`` trajectories, each timed apart (µs per trajectory)."""
    import tracer
    from tracer.encode import encode_record
    from tracer.record_builder import build_record

    tracer.init(backend="jsonl", jsonl_path=f"{tmp}/st.jsonl", spool_dir=f"{tmp}/spool-st",
                flush_interval_s=3600.0, export_batch_size=10**7,
                max_buffer_trajectories=10**7, max_buffer_bytes=2**40)  # fmt: skip

    generate, tool, reward = ours_ops()
    t0 = time.process_time()
    _workload(n, generate, tool, reward,
              lambda i: tracer.trace_attr(step=0, sample_index=i, rollout_n=0))  # fmt: skip
    hot = time.process_time() - t0
    pipeline = tracer.get_tracer().pipeline
    assert pipeline is not None
    trajs = [traj for _seq, traj in pipeline.buffer]
    pipeline.buffer.clear()
    config = tracer.get_tracer().config
    redactor = pipeline.redactor
    assert redactor is not None
    build = encode = 0.0
    records, lines = [], []
    for traj in trajs:  # one at a time, as the pipeline does
        t0 = time.process_time()
        records.append(build_record(traj, config, None))
        t1 = time.process_time()
        lines.append(encode_record(records[-1]))
        build += t1 - t0
        encode += time.process_time() - t1
    t0 = time.process_time()
    hits = sum(redactor.needs(line) for line in lines)
    gate = time.process_time() - t0
    t0 = time.process_time()
    for r in records:
        redactor.record(r)
    full = time.process_time() - t0
    worker = pipeline.workers[0]
    assert worker.spool is not None
    spool = export = 0.0
    size = config.export_batch_size if config.export_batch_size < n else 256
    for i in range(0, n, size):  # as the worker does: each batch spooled, exported, deleted
        batch, batch_lines = records[i : i + size], lines[i : i + size]
        t0 = time.process_time()
        # JSONL writes ahead (its appends are its log): the spool takes only what it refuses
        path = None if worker.writes_ahead else worker.spool.write(batch_lines)
        t1 = time.process_time()
        worker.exporter.export_encoded(batch, batch_lines)
        t2 = time.process_time()
        if path is not None:
            worker.spool.delete(path)
        spool += t1 - t0 + time.process_time() - t2
        export += t2 - t1
    tracer.reset()
    us = 1e6 / n
    return {"hot_path": hot * us, "build_record": build * us, "serialize": encode * us,
            "redaction_check": gate * us, "redaction_full_pass_if_needed": full * us,
            "spool_write": spool * us, "jsonl_write": export * us,
            "records_needing_redaction": hits}  # fmt: skip


def ours_ops() -> tuple[Any, Any, Any]:
    """The workload's generate, tool and reward functions, decorated with ours."""
    import tracer

    @tracer.trace_op(kind="generate")
    def generate(messages: Any, prompt_ids: Any) -> dict[str, Any]:
        return _generate_result()

    @tracer.trace_op(kind="tool")
    def tool(name: str, args: Any) -> dict[str, Any]:
        return {"result": "42"}

    @tracer.trace_op(kind="reward")
    def reward(text: str) -> float:
        return 1.0

    return generate, tool, reward


def otel_ops(t: Any) -> tuple[Any, Any, Any, Any]:
    """The workload's functions and trajectory context as OpenTelemetry SDK spans the way GenAI
    instrumentations record them (inputs and outputs as JSON attributes), for tracer ``t``."""

    def op(name: str, kind: str, fn: Any) -> Any:
        def wrapper(*args: Any) -> Any:
            with t.start_as_current_span(name) as span:
                span.set_attribute("gen_ai.operation.name", kind)
                span.set_attribute("input.value", json.dumps(args))
                result = fn(*args)
                span.set_attribute("output.value", json.dumps(result))
                return result

        return wrapper

    def trajectory(i: int) -> Any:
        return t.start_as_current_span("trajectory", attributes={
            "step": 0, "sample_index": i, "rollout_n": 0})  # fmt: skip

    return (op("generate", "chat", lambda m, p: _generate_result()),
            op("tool", "execute_tool", lambda name, a: {"result": "42"}),
            op("reward", "reward", lambda text: 1.0), trajectory)  # fmt: skip


MODES = {"untraced": mode_untraced, "ours": mode_ours, "otel": mode_otel}


def time_gc() -> Any:
    """Start timing the cyclic garbage collector in this (benchmark) process; returns a
    function that says the CPU seconds it spent so far."""
    import gc

    spent = [0.0]
    started = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.thread_time()
        else:
            spent[0] += time.thread_time() - started[0]

    gc.callbacks.append(on_gc)
    return lambda: spent[0]


def _child(mode: str, n: int) -> tuple[float, float]:
    """CPU seconds of ``mode`` over ``n`` trajectories in a fresh interpreter, its imports
    and init included (``run`` subtracts a 1-trajectory run of the same mode), and the CPU
    seconds of those spent in the cyclic garbage collector (counted on the thread it ran on;
    it holds the GIL meanwhile)."""
    code = (
        "import sys, time, tempfile, json; from benchmarks import cpu; "
        "tmp = tempfile.mkdtemp(); "
        "gc_seconds = cpu.time_gc(); "
        "t0 = time.process_time(); "
        f"cpu.MODES[{mode!r}]({n}, tmp); "
        "print(json.dumps([time.process_time() - t0, gc_seconds()]))"
    )
    env = {**os.environ, **QUIET_ENV, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=900, check=True)  # fmt: skip
    cpu_s, gc_s = json.loads(out.stdout.strip().splitlines()[-1])
    return float(cpu_s), float(gc_s)


def run(quick: bool) -> dict[str, Any]:
    n = 300 if quick else 1500
    repeats = 2 if quick else 5
    per: dict[str, list[float]] = {m: [] for m in MODES}
    gc_per: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(repeats):  # interleaved: drift on a shared machine hits every mode alike
        for mode in MODES:
            (cpu_s, gc_s), (base_cpu, base_gc) = _child(mode, n), _child(mode, 1)
            per[mode].append(cpu_s - base_cpu)
            gc_per[mode].append(gc_s - base_gc)
    med = {m: statistics.median(v) for m, v in per.items()}
    cost = {m: (med[m] - med["untraced"]) / n * 1e6 for m in ("ours", "otel")}
    gc_us = {m: statistics.median(gc_per[m]) / n * 1e6 for m in ("ours", "otel")}
    with tempfile.TemporaryDirectory() as tmp:
        stage_us = stages(n, tmp)
    return {
        "n": n,
        "repeats": repeats,
        "cpu_s": {m: [round(x, 3) for x in v] for m, v in per.items()},
        "us_per_durable_trajectory": {m: round(v, 1) for m, v in cost.items()},
        "ratio_ours_to_otel": round(cost["ours"] / cost["otel"], 3),
        # of each mode's cost, the cyclic garbage collector's share (µs per trajectory)
        "gc_us_per_trajectory": {m: round(v, 1) for m, v in gc_us.items()},
        "ours_stages_us": {k: round(v, 1) for k, v in stage_us.items()},
    }


if __name__ == "__main__":
    section_main(run)
