"""What the OTLP backend's semantic-convention attributes cost per trajectory.

The same trajectories as benchmarks/cpu.py (8 spans: the root, 3 generate calls with 300
prompt ids, 100 response ids and 4 messages, 3 tool calls, a reward) are turned into OTLP
protobuf bytes, the OTLP backend's whole CPU work short of the HTTP POST:

- ``ours, genai + openinference`` (the default), ``ours, genai only``, ``ours, neither`` (MLflow's
  attributes alone): ``to_otel_spans`` with those ``otlp_conventions``, then the SDK's OTLP
  encoder (``encode_spans(...).SerializeToString()``);
- ``OTel SDK span``: the plain OpenTelemetry SDK making the same 8 spans live (a tracer, spans
  with ``gen_ai.operation.name`` and inputs/outputs as JSON ``input.value``/``output.value``),
  collected by a processor and encoded the same way.

CPU time (``time.process_time``) per trajectory, the median of the repeats; attributes and
OTLP bytes per trajectory.

    python -m benchmarks.otlp_attrs [--quick] [--markdown]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from benchmarks.cpu import _workload, otel_ops, ours_ops

VARIANTS = {
    "ours_both": ("ours, genai + openinference (default)", ["genai", "openinference"]),
    "ours_genai": ("ours, genai only", ["genai"]),
    "ours_none": ("ours, MLflow's attributes only", []),
}


def records(n: int) -> list[Any]:
    import tracer
    from tracer.testing import InMemoryExporter

    tracer.init(backend="memory", spool=False)

    generate, tool, reward = ours_ops()
    _workload(n, generate, tool, reward,
              lambda i: tracer.trace_attr(step=0, sample_index=i, rollout_n=0))  # fmt: skip
    assert tracer.flush(600)
    out = list(InMemoryExporter.latest().records)
    tracer.shutdown()
    assert len(out) == n
    return out


def ours(recs: list[Any], conventions: list[str]) -> tuple[float, int, int]:
    """CPU seconds for all ``recs``, attributes and OTLP bytes of one trajectory."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.resources import Resource

    from tracer.backends.otlp_backend import to_otel_spans

    resource = Resource.create({"service.name": "bench"})
    t0 = time.process_time()
    for r in recs:
        data = encode_spans(to_otel_spans(r, resource, conventions)).SerializeToString()
    cpu = time.process_time() - t0
    spans = to_otel_spans(recs[0], resource, conventions)
    return cpu, sum(len(s.attributes) for s in spans), len(data)


def otel(n: int) -> tuple[float, int, int]:
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider

    class Collect(SpanProcessor):
        def __init__(self) -> None:
            self.spans: list[ReadableSpan] = []

        def on_end(self, span: ReadableSpan) -> None:
            self.spans.append(span)

    collect = Collect()
    provider = TracerProvider(resource=Resource.create({"service.name": "bench"}))
    provider.add_span_processor(collect)
    t = provider.get_tracer("bench")

    generate, tool, reward, trajectory = otel_ops(t)

    t0 = time.process_time()
    _workload(n, generate, tool, reward, trajectory)
    spans = collect.spans
    per = len(spans) // n
    for i in range(0, len(spans), per):
        data = encode_spans(spans[i : i + per]).SerializeToString()
    cpu = time.process_time() - t0
    provider.shutdown()
    return cpu, sum(len(s.attributes or {}) for s in spans[:per]), len(data)


def run(quick: bool) -> dict[str, Any]:
    n, reps = (50, 3) if quick else (1000, 7)
    recs = records(n)
    out: dict[str, Any] = {"n": n, "reps": reps, "variants": {}}
    for key, (label, conventions) in VARIANTS.items():
        runs = [ours(recs, conventions) for _ in range(reps)]
        out["variants"][key] = {
            "label": label,
            "us_per_trajectory": statistics.median(r[0] for r in runs) / n * 1e6,
            "attributes": runs[0][1],
            "otlp_bytes": runs[0][2],
        }
    runs = [otel(n) for _ in range(reps)]
    out["variants"]["otel"] = {
        "label": "OTel SDK span (live spans, gen_ai.operation.name + JSON input/output)",
        "us_per_trajectory": statistics.median(r[0] for r in runs) / n * 1e6,
        "attributes": runs[0][1],
        "otlp_bytes": runs[0][2],
    }
    return out


def markdown(result: dict[str, Any]) -> str:
    base = result["variants"]["otel"]["us_per_trajectory"]
    lines = [
        "| variant | CPU µs / trajectory | ÷ OTel SDK | attributes | OTLP bytes |",
        "|---|---:|---:|---:|---:|",
    ]
    for v in result["variants"].values():
        us = v["us_per_trajectory"]
        lines.append(
            f"| {v['label']} | {us:,.0f} | {us / base:.2f}x | {v['attributes']} "
            f"| {v['otlp_bytes']:,} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.otlp_attrs", description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", help="write the raw result here")
    a = p.parse_args()
    result = run(a.quick)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    print(f"{result['n']} trajectories, median of {result['reps']} repeats")
    print(markdown(result))


if __name__ == "__main__":
    main()
