"""The benchmark suite's quick mode runs end to end and writes every section with numbers.

No timing assertions: the machine is shared; only the shape of the report is checked.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("mlflow")
pytest.importorskip("opentelemetry.sdk")

SECTIONS = (
    "## Machine",
    "## Targets",
    "## 1. Hot path",
    "## 2. End to end",
    "## 3. Rollout throughput",
    "## 4. Peak memory",
    "## 5. Export to Parquet",
    "## 9. Whole-process CPU per durable trajectory",
    "## 7. OTLP attributes per trajectory",
)


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    nxt = text.find("\n## ", start + len(heading))
    return text[start : nxt if nxt != -1 else len(text)]


@pytest.mark.slow
def test_quick_benchmarks_write_every_section(tmp_path: Path) -> None:
    out = tmp_path / "RESULTS.md"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--output", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    for heading in SECTIONS:
        assert heading in text, f"missing {heading!r}"
        body = _section(text, heading)
        assert "Section failed" not in body, body
        assert re.search(r"\d+\.\d+", body), f"no numbers in {heading!r}"
    hot = _section(text, "## 1. Hot path")
    for label in ("bare function call", "unsampled trajectory", "our op, sampled trajectory",
                  "OpenTelemetry SDK span", "mlflow.start_span", "verl-style"):  # fmt: skip
        rows = [line for line in hot.splitlines() if line.startswith("| ") and label in line]
        row = rows[0] if rows else None
        assert row is not None and re.search(r"\| \d+\.\d+ \|", row), f"no figure for {label!r}"
    e2e = _section(text, "## 2. End to end")
    ours = r"rollout-tracer \(mlflow backend, .+?\) \| [\d.]+ \| [\d.]+"
    assert re.search(ours + r" \| \d+/\d+", e2e)
    # the same two paths through a real tracking server, each with its ratio per durable trace
    server = e2e[e2e.index("through a real tracking server") :]
    assert re.search(ours + r" \| \d+/\d+", server), server
    assert re.search(r"Per durable trace: ours [\d.]+ ms, MLflow fluent [\d.]+ ms", server)
    assert re.search(r"MLflow fluent `start_span` \| [\d.]+ \| [\d.]+ \| \d+/\d+", e2e)
    tp = _section(text, "## 3. Rollout throughput")
    for mode in ("off", "on_100pct", "sampled_n4"):
        assert re.search(rf"\| {mode} \| [\d.]+ \| [\d.]+ \| [\d.]+ \|", tp), mode
    mem = _section(text, "## 4. Peak memory")
    assert re.search(r"peak RSS \| [\d.]+ MiB", mem)
    held = r"held \(memory \+ spool\) / of those in the spool / dropped \| \d+ / \d+ / \d+"
    assert re.search(held, mem)
    cpu = _section(text, "## 9. Whole-process CPU per durable trajectory")
    assert re.search(r"\| OpenTelemetry SDK .+ \| [\d.]+ \|", cpu), cpu
    assert re.search(r"\| serialize \| [\d.]+ \|", cpu), cpu
    export = _section(text, "## 5. Export to Parquet")
    assert re.search(r"\| jsonl \| 1000 \| \d+ \| [\d.]+ \|", export), export
    targets = _section(text, "## Targets")
    assert targets.count("| **") >= 5  # each target with a goal: met or MISSED
